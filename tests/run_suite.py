"""The whole suite as CI runs it: the fast tier first (every room, a few minutes: a broken room fails early), then
the rest, nothing twice, both on two xdist workers with one JAX compilation cache for the two runs (the second
loads what the first compiled instead of compiling it again).

    python tests/run_suite.py [pytest arguments, e.g. -x]

The cache is a fresh temporary folder, removed at the end, unless ``$JAX_COMPILATION_CACHE_DIR`` names one (then
it is used as it is and kept: a developer's later runs load from it). Exits with the first failing run's code (a
tier with no test selected is not a failure); the rest does not start when the fast tier fails."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

NO_TESTS = 5                                        # pytest's exit code when nothing was collected
TIERS = (("fast tier", "fast"), ("the rest", "not fast"))


def main(argv: list[str]) -> int:
    env = dict(os.environ)
    own = None
    if not env.get("JAX_COMPILATION_CACHE_DIR"):
        own = tempfile.mkdtemp(prefix="v41cp-test-jax-cache-")
        env["JAX_COMPILATION_CACHE_DIR"] = own
    try:
        for title, marker in TIERS:
            print(f"== {title}: pytest -m {marker!r}", flush=True)
            cmd = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-m", marker, *argv]
            code = subprocess.call(cmd, env=env)
            if code not in (0, NO_TESTS):           # a selection with no test in one tier is not a failure
                return code
        return 0
    finally:
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
