"""Every notebook runs top to bottom on CPU (a fresh kernel each), and is stored with its outputs."""

import sys

import nbformat
import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
from execute_notebooks import execute  # noqa: E402

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def _images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_there_are_notebooks_to_explore():
    assert len(NOTEBOOKS) >= 4


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes_and_is_stored_with_outputs(path):
    stored = nbformat.read(path, as_version=4)
    code = [c for c in stored.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), f"{path.name}: a code cell is stored unexecuted " \
                                                         "(run scripts/execute_notebooks.py)"
    assert sum(bool(c.get("outputs")) for c in code) >= len(code) - 1, f"{path.name}: outputs missing"
    assert _images(stored) >= 1, f"{path.name}: no figure stored"
    ran = execute(path)                       # raises CellExecutionError naming the failing cell
    errors = [o for c in ran.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert _images(ran) == _images(stored)
