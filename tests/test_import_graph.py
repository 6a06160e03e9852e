"""The package's layering, read from its import graph (every ``import`` statement of every module, at module level
or inside a function): no cycle anywhere in `v41cp`; the kernels and their references import neither the layers,
the model nor serving (the math they share with the layers lives in the kernels' references); no module imports
another `v41cp` module inside a function (third-party imports may, for an optional dependency, with a comment that
says so)."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast           # the developer tier (`pytest -m fast`)

PACKAGE = Path(__file__).resolve().parents[1] / "v41cp"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module an imported name lives in (``a.b.c`` → ``a.b`` when ``c`` is a name of module ``a.b``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str):
    """``(target module, line, inside a function, statement, source line)`` of every v41cp import of ``module``
    and ``(None, line, inside a function, statement, source line)`` of its other imports."""
    path = MODULES[module]
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name) if name.split(".")[0] == "v41cp" else None
            yield target, node.lineno, id(node) in local, name, lines[node.lineno - 1]


def _graph() -> dict[str, set[str]]:
    return {m: {t for t, *_ in _imports(m) if t is not None and t != m} for m in MODULES}


def test_the_graph_reads_every_module():
    assert {"v41cp.model", "v41cp.kernels.sparse_attention.reference", "v41cp.serving.engine"} <= set(MODULES)
    assert "v41cp.layers.attention" in _graph()["v41cp.model"]


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}                     # 1 = on the path, 2 = done
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                pytest.fail("import cycle: " + " → ".join(path[path.index(t):] + [t]))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


LOWER = ("v41cp.layers", "v41cp.model", "v41cp.serving", "v41cp.drafter", "v41cp.checkpoint", "v41cp.cli")


def test_kernels_import_no_layer_model_or_serving():
    bad = [(m, t) for m, ts in _graph().items() if m.startswith("v41cp.kernels") for t in ts
           if t.startswith(LOWER)]
    assert not bad, f"kernels importing layers / model / serving: {bad}"


def test_no_function_local_import_of_the_package():
    bad = [f"{m}:{line} {name}" for m in MODULES for t, line, local, name, _ in _imports(m) if local and t]
    assert not bad, f"function-local imports of v41cp modules: {bad}"


def test_optional_dependencies_imported_locally_say_so():
    """A third-party import inside a function is there for an optional dependency (or one that costs start-up
    time); the statement or the line above it says so in a comment."""
    bad = []
    for m, path in MODULES.items():
        lines = path.read_text().splitlines()
        for t, line, local, name, src in _imports(m):
            if local and t is None and name.split(".")[0] not in ("jax", "numpy", "np", "v41cp") \
                    and "#" not in src and not lines[line - 2].strip().startswith("#"):
                bad.append(f"{m}:{line} {name}")
    assert not bad, f"function-local third-party imports without a comment: {sorted(set(bad))}"
