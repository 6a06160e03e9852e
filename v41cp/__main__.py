"""``python -m v41cp``: the command line (`v41cp.cli`)."""

from v41cp.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
