"""Execute the notebooks top to bottom and store their outputs (figures included) in place.

``python scripts/execute_notebooks.py [notebooks/03_qcp_zigzag_rows.ipynb ...]`` (default: every notebook in
``notebooks/``); ``--check`` executes without writing. Each notebook runs in a fresh kernel with ``notebooks/``
as its working directory, on CPU (JAX_PLATFORMS=cpu unless set). Needs the test extra (nbclient, ipykernel).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def execute(path: Path, timeout: int = 900):
    """The executed notebook (nbformat node); raises nbclient's CellExecutionError on the first failing cell."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def main(argv=None) -> int:
    import nbformat
    from tqdm import tqdm

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="*", type=Path)
    p.add_argument("--check", action="store_true", help="execute only; do not write the outputs")
    a = p.parse_args(argv)
    paths = a.paths or sorted(NOTEBOOKS.glob("*.ipynb"))
    for path in tqdm(paths, desc="notebooks", unit="notebook", file=sys.stderr):
        t0 = time.perf_counter()
        nb = execute(path)
        if not a.check:
            for cell in nb.cells:                 # keep stored notebooks small and stable: no execution timestamps
                cell.get("metadata", {}).pop("execution", None)
            nbformat.write(nb, path)
        print(f"{path.name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
