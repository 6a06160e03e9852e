"""One model for every forward mode: no module outside the model's own layer modules (``v41cp/layers/``,
``v41cp/model.py``, the DSpark drafter's model ``v41cp/drafter.py``, DeepSeek-V4's
MTP layer ``v41cp/mtp.py``) and the checkpoint name mapping
(``v41cp/checkpoint/``) reads a layer weight.

A static scan of the package's source: any subscript or ``.get`` with a parameter leaf name of the model (stored
FP4 / FP8 variants included) or a ``layers_{i}`` key is a module re-coding a layer against the raw
parameter tree.
"""

import ast
from pathlib import Path

import jax
import pytest

from v41cp import model
from v41cp.config import preset

pytestmark = pytest.mark.fast           # the developer tier (`pytest -m fast`)

PACKAGE = Path(__file__).resolve().parents[1] / "v41cp"
OWNERS = ("layers/", "model.py", "drafter.py", "mtp.py", "checkpoint/")


def _leaf_names() -> set[str]:
    names = set()
    for cfg in (preset("tiny"), preset("tiny", keep_quantized=True)):      # the released model: the same modules
        for path, _ in jax.tree_util.tree_flatten_with_path(model.abstract_params(cfg))[0]:
            names.add([k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1])
    return names


def _weight_reads(tree: ast.AST, names: set[str]):
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript):
            key = node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args:
            key = node.args[0]
        if isinstance(key, ast.Constant) and key.value in names:
            yield node.lineno, key.value
        elif isinstance(key, ast.JoinedStr) and ast.unparse(key).startswith("f'layers_"):
            yield node.lineno, ast.unparse(key)


def test_the_scan_finds_a_layer_weight_read():
    names = _leaf_names()
    assert {"wq_a", "wk", "experts_w1", "head", "attn_sink"} <= names
    found = list(_weight_reads(ast.parse('q = p["wq_a"]\nk = p["indexer"].get("wk")\nl = params[f"layers_{i}"]'),
                               names))
    assert [n for _, n in found] == ["wq_a", "wk", "f'layers_{i}'"]


def test_no_module_outside_the_layers_reads_a_layer_weight():
    names = _leaf_names()
    bad = []
    for f in sorted(PACKAGE.rglob("*.py")):
        rel = f.relative_to(PACKAGE).as_posix()
        if rel.startswith(OWNERS):
            continue
        bad += [f"{rel}:{line} reads {key!r}" for line, key in _weight_reads(ast.parse(f.read_text()), names)]
    assert not bad, "\n".join(bad)
