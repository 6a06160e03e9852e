"""Exact structure of a compiled program: its collectives and their bytes (from the optimized HLO text).

`collectives(text)` lists every collective op (all-gather, all-reduce, reduce-scatter, all-to-all,
collective-permute; async ``-start`` halves counted once) with its result bytes per device and its device
groups (explicit, iota and mesh-axes replica-group formats); `collective_bytes` sums them, optionally only
over given groups (`mesh_axis_groups`). Byte counts are of each op's result on one device; an op inside a
``while`` loop counts once per iteration (`loop_multipliers`).

`program_cost(compiled)`: XLA's cost analysis of a compiled program (``flops``, ``bytes accessed``) with every
``while`` loop counted ``known_trip_count`` times — XLA's own analysis counts a loop body once (measured on jax
0.10: a 10-step ``fori_loop`` of a matmul reports one matmul), so a body's cost is re-analysed on its own and
added for the remaining iterations. Where XLA already multiplies by the trip count (probed once per backend,
`_xla_counts_trips`) its figures are used as they are. A loop whose trip count depends on the data (no
``known_trip_count``: e.g. the Reindex scan's overflow tiles, `v41cp.serving.attention.dcp.select`) is counted
once, as XLA counts it; `data_dependent_loops` lists them.
"""

from __future__ import annotations

import functools
import re

import numpy as np

__all__ = ["collectives", "collective_bytes", "replica_groups", "mesh_axis_groups", "ALL_DEVICES", "program_cost",
           "loop_multipliers", "dot_flops_by_op", "flops_by_op", "data_dependent_loops"]

ALL_DEVICES = "all"        # replica_groups={}: one group of every device

_OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1, "f64": 8, "s64": 8,
                "u64": 8, "s16": 2, "u16": 2, "f8e4m3fn": 1, "f8e4m3": 1, "f8e5m2": 1, "f8e8m0fnu": 1,
                "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "s4": 0.5, "u4": 0.5, "f4e2m1fn": 0.5}
_LINE = re.compile(r"=\s*(?P<shape>.+?)\s+(?P<op>" + "|".join(_OPS) + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"\b([a-z0-9]+)\[([0-9,]*)\]")
_OP_NAME = re.compile(r'op_name="(?P<name>[^"]*)"')
_DEF = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<shape>\S+?)(?:\{[^}]*\})? (?P<op>[\w\-]+)\((?P<args>[^)]*)\)")


def _arrays(shape_text: str) -> list[tuple[int, int]]:
    """(bytes, rank) of every array in an HLO shape (a tuple lists several)."""
    out = []
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"hlo_stats: unknown element type {dtype!r} in {shape_text!r}")
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append((int(n * _DTYPE_BYTES[dtype]), len(list(filter(None, dims.split(","))))))
    return out


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    a = np.arange(int(np.prod(dims))).reshape(dims)
    return a.transpose(perm) if perm else a


def _parse_iota(text: str) -> np.ndarray:
    """``[d0,d1]T(1,0)`` / ``[8]`` → the device order it denotes (flat)."""
    m = re.match(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text)
    dims = [int(x) for x in m.group(1).split(",")]
    perm = [int(x) for x in m.group(2).split(",")] if m.group(2) else None
    return _iota(dims, perm).reshape(-1)


def replica_groups(line: str) -> frozenset[frozenset[int]] | None:
    """The replica / device groups of one collective (explicit, iota ``[G,S]<=[…]`` or mesh-axes format)."""
    if re.search(r"replica_groups=\{\}", line):
        return ALL_DEVICES
    m = re.search(r"replica_groups=\{(\{[0-9,{} ]*\})\}", line)
    if m:
        return frozenset(frozenset(int(x) for x in g.split(",") if x) for g in re.findall(r"\{([0-9,]*)\}", m.group(1)))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=(\[[0-9,]+\](?:T\([0-9,]+\))?)", line)
    if m:
        devs = _parse_iota(m.group(3)).reshape(int(m.group(1)), int(m.group(2)))
        return frozenset(frozenset(int(x) for x in row) for row in devs)
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]", line)
    if m:
        sizes = [(k, int(v)) for k, v in re.findall(r"'(\w+)'=(\d+)", m.group(1))]
        ids = re.search(r"device_ids=\((\[[0-9,]+\](?:T\([0-9,]+\))?)\)", line)
        total = int(np.prod([v for _, v in sizes]))
        devs = (_parse_iota(ids.group(1)) if ids else np.arange(total)).reshape([v for _, v in sizes])
        axes = re.search(r"\)?\s*\{([^}]*)\}", line[m.end():])
        names = re.findall(r"'(\w+)'", axes.group(1)) if axes else []
        idx = [i for i, (k, _) in enumerate(sizes) if k in names]
        rest = [i for i in range(len(sizes)) if i not in idx]
        devs = devs.transpose(rest + idx).reshape(-1, int(np.prod([sizes[i][1] for i in idx])) if idx else 1)
        return frozenset(frozenset(int(x) for x in row) for row in devs)
    return None


def mesh_axis_groups(mesh, axes) -> frozenset[frozenset[int]]:
    """Groups of device positions (in ``mesh.devices`` flat order) that vary only along ``axes``."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    names = list(mesh.axis_names)
    pos = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    idx = [names.index(a) for a in axes]
    rest = [i for i in range(len(names)) if i not in idx]
    rows = pos.transpose(rest + idx).reshape(-1, int(np.prod([mesh.devices.shape[i] for i in idx])))
    return frozenset(frozenset(int(x) for x in r) for r in rows)


_HEADER = re.compile(r"^(ENTRY )?%(?P<name>[\w.\-]+) \(")
_WHILE = re.compile(r"\swhile\(.*?condition=%(?P<cond>[\w.\-]+), body=%(?P<body>[\w.\-]+)")
_CALLEES = re.compile(r"(?:calls|to_apply|true_computation|false_computation)=%([\w.\-]+)|"
                      r"branch_computations=\{([^}]*)\}")


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """``{computation name: its instruction lines}`` and the entry computation's name."""
    comps, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        m = _HEADER.match(line)
        if m and line.rstrip().endswith("{"):
            current = m.group("name")
            comps[current] = []
            entry = current if m.group(1) else entry
        elif current is not None and line.startswith("  "):
            comps[current].append(line)
    return comps, entry


def _trip_count(line: str) -> int:
    """A while loop's ``known_trip_count``; 1 (counted once, as XLA does) where the count depends on the data."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
    return int(m.group(1)) if m else 1


def data_dependent_loops(hlo_text: str) -> list[str]:
    """The bodies of the while loops with no known trip count (each counted once), by their op names."""
    out = []
    for lines in _computations(hlo_text)[0].values():
        for line in lines:
            if _WHILE.search(line) and '"known_trip_count"' not in line:
                name = _OP_NAME.search(line)
                out.append(re.sub(r"layers_\d+", "layers_*", name.group("name")) if name else "(unnamed)")
    return out


def _reach(comps: dict, name: str) -> tuple[list[str], list[tuple[str, int]]]:
    """What computation ``name`` runs each time it runs: the computations it reaches other than through a loop
    (itself, fusions, calls, conditionals) and the ``(body, trip count)`` of the while loops among them."""
    reached, loops, todo = [], [], [name]
    while todo:
        c = todo.pop()
        if c in reached or c not in comps:
            continue
        reached.append(c)
        for line in comps[c]:
            w = _WHILE.search(line)
            if w:
                loops.append((w.group("body"), _trip_count(line)))
                continue
            for one, many in _CALLEES.findall(line):
                todo.extend([one] if one else re.findall(r"%([\w.\-]+)", many))
    return reached, loops


def loop_multipliers(hlo_text: str) -> dict[str, int]:
    """How many times each computation runs per program execution (while bodies: their trip counts, nested
    loops multiplied); computations not reached from the entry are absent."""
    comps, entry = _computations(hlo_text)
    mult = {}

    def visit(c, m):
        reached, loops = _reach(comps, c)
        for x in reached:
            mult[x] = mult.get(x, 0) + m
        for body, trips in loops:
            visit(body, m * trips)

    if entry is not None:
        visit(entry, 1)
    return mult


def _with_entry(hlo_text: str, name: str) -> str:
    """The module text with computation ``name`` as its entry (for analysing a loop body on its own)."""
    out = []
    for line in hlo_text.splitlines():
        if line.startswith("HloModule"):
            out.append("HloModule loop_body_probe")
            continue
        if line.startswith("ENTRY "):
            line = line[len("ENTRY "):]
        m = _HEADER.match(line)
        if m and m.group("name") == name and line.rstrip().endswith("{"):
            line = "ENTRY " + line
        out.append(line)
    return "\n".join(out)


def _xla_cost_of(hlo_text: str, client) -> dict:
    from jax._src.lib import _jax
    from jaxlib import _hlo  # private XLA API (the cost analysis of HLO text), read only here

    return _jax.hlo_module_cost_analysis(client, _hlo.hlo_module_from_text(hlo_text))


def _module_cost(module, client) -> dict:
    from jax._src.lib import _jax

    return _jax.hlo_module_cost_analysis(client, module)


@functools.lru_cache(maxsize=None)
def _xla_counts_trips(platform: str | None) -> bool:
    """Whether XLA's cost analysis already multiplies a loop body by its trip count (a probe program: a 4-step loop
    of one 32×32 matmul): the backend ``platform``'s own analysis, or (None) the module analysis through the CPU
    client that `program_cost` falls back to."""
    import jax
    import jax.numpy as jnp
    from jax._src import xla_bridge

    x = jax.ShapeDtypeStruct((32, 32), jnp.float32)
    probe = jax.jit(lambda x: jax.lax.fori_loop(0, 4, lambda i, a: a @ x, x)).lower(x).compile()
    if platform is None:
        cost = _module_cost(probe.runtime_executable().hlo_modules()[0], xla_bridge.get_backend("cpu"))
    else:
        cost = probe.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0)) >= 4 * 2 * 32 ** 3


def _whole_program_cost(compiled) -> tuple[dict, object, str | None]:
    """XLA's cost analysis of ``compiled`` with the client to analyse its loop bodies through and the platform whose
    analysis it is. A compile-only executable (compiled for a GPU target on a host without one:
    `v41cp.targets`) has none of its own (``cost_analysis()`` is None): XLA's module cost analysis of the optimized
    module through the CPU client stands in (platform None), as it reads the GPU module's fusions and shapes."""
    import jax
    from jax._src import xla_bridge

    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    if cost:
        client = jax.devices()[0].client
        return cost, client, client.platform
    cpu = xla_bridge.get_backend("cpu")
    return _module_cost(compiled.runtime_executable().hlo_modules()[0], cpu), cpu, None


def program_cost(compiled) -> dict:
    """``{"flops", "bytes accessed"}`` per device of a compiled program, every while loop counted as many times as
    it runs (see the module docstring)."""
    cost, client, platform = _whole_program_cost(compiled)
    keys = ("flops", "bytes accessed")
    total = {k: float(cost.get(k, 0.0)) for k in keys}
    text = compiled.as_text()
    comps, entry = _computations(text)
    if entry is None or not any(_WHILE.search(l) for lines in comps.values() for l in lines):
        return total
    if _xla_counts_trips(platform):
        return total
    memo = {}

    def xla(c):
        if c not in memo:
            got = _xla_cost_of(_with_entry(text, c), client)
            memo[c] = {k: float(got.get(k, 0.0)) for k in keys}
        return memo[c]

    def corrected(c):
        # XLA counted each loop body reached from c once; add the remaining iterations (nested: recursively)
        out = dict(xla(c)) if c != entry else dict(total)
        for body, trips in _reach(comps, c)[1]:
            inner, once = corrected(body), xla(body)
            for k in keys:
                out[k] += trips * inner[k] - once[k]
        return out

    return corrected(entry)


def collectives(hlo_text: str) -> list[dict]:
    """Every collective of an optimized HLO module: ``{"op", "bytes", "groups", "group_size", "name"}`` (``bytes``:
    per program execution, so an op inside a loop counts once per iteration; ``name``: the source operation's name
    stack, "" for one the partitioner inserted without one)."""
    found = []
    comps, _ = _computations(hlo_text)
    mult = loop_multipliers(hlo_text)
    for name, lines in comps.items():
        for line in lines:
            m = _LINE.search(line)
            if not m:
                continue
            _collective(found, line, m, mult.get(name, 1))
    if comps:
        return found
    for line in hlo_text.splitlines():
        m = _LINE.search(line)
        if m:
            _collective(found, line, m, 1)
    return found


def _collective(found: list, line: str, m, times: int) -> None:
    """Append the collective on ``line`` (``m``: its `_LINE` match), run ``times`` times per execution."""
    arrays = _arrays(m.group("shape"))
    if m.group("start") and m.group("op") != "all-reduce":
        # async start of a gather / permute / all-to-all / scatter: (operands, results[, u32[] contexts]);
        # an all-reduce-start lists only its results
        arrays = [a for a in arrays if a[1] > 0 or len(arrays) == 1]
        arrays = arrays[len(arrays) // 2:] if len(arrays) > 1 else arrays
    groups = replica_groups(line)
    name = _OP_NAME.search(line)
    found.append({"op": m.group("op"), "bytes": times * sum(b for b, _ in arrays), "groups": groups,
                  "group_size": len(next(iter(groups))) if groups and groups != ALL_DEVICES else None,
                  "name": name.group("name") if name else ""})


def collective_bytes(hlo_text: str, groups: frozenset | None = None, within: str | None = None) -> int:
    """Total result bytes of the collectives (optionally only those over exactly ``groups``, e.g.
    `mesh_axis_groups(mesh, "cp")`, and only those whose source name contains ``within``, e.g. ``"shard_map"``:
    the collectives written in a map, not the ones the partitioner inserts)."""
    def match(g):
        return g == groups or (g == ALL_DEVICES and groups is not None and len(groups) == 1)
    return sum(c["bytes"] for c in collectives(hlo_text) if (groups is None or match(c["groups"]))
               and (within is None or within in c["name"]))



def _dims(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


# what XLA's cost analysis counts as one FLOP per output element (transcendentals are counted apart, not as FLOPs)
_ELEMENTWISE = frozenset("""add subtract multiply divide maximum minimum abs negate compare select and or xor not
    shift-left shift-right-logical shift-right-arithmetic clamp convert remainder sign floor ceil round-nearest-even
    round-nearest-afz is-finite popcnt count-leading-zeros atan2""".split())


def _flops_by_op(hlo_text: str, depth: int, dots_only: bool) -> dict[str, float]:
    comps, _ = _computations(hlo_text)
    mult = loop_multipliers(hlo_text)
    caller = {}                                 # a fused computation's ops carry their fusion's name
    for lines in comps.values():
        for line in lines:
            name = _OP_NAME.search(line)
            for callee in re.findall(r"calls=%([\w.\-]+)", line):
                if name:
                    caller.setdefault(callee, name.group("name"))
    out: dict[str, float] = {}
    for comp, lines in comps.items():
        times = mult.get(comp, 0)
        if not times:
            continue
        shapes = {}
        for line in lines:
            m = _DEF.match(line)
            if m is None:
                continue
            shapes[m.group("name")] = m.group("shape")
            op = m.group("op")
            operands = re.findall(r"%([\w.\-]+)", m.group("args"))
            if op == "dot":
                contract = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line)
                lhs_dims = _dims(shapes.get(operands[0], ""))
                k = int(np.prod([lhs_dims[int(i)] for i in contract.group(1).split(",") if i])) if contract else 1
                flops = 2.0 * float(np.prod(_dims(m.group("shape")))) * k * times
            elif dots_only or m.group("shape").startswith("("):
                continue
            elif op in _ELEMENTWISE:
                flops = float(np.prod(_dims(m.group("shape")))) * times
            elif op == "reduce" and operands:
                flops = float(np.prod(_dims(shapes.get(operands[0], "")))) * times
            else:
                continue
            name = _OP_NAME.search(line)
            name = name.group("name") if name else caller.get(comp)
            if name is None:         # the CPU backend's library fusions carry no name: labelled by their shapes
                label = "(unnamed) " + " x ".join(shapes.get(o, "?") for o in operands[:2]) if op == "dot" else \
                    f"(unnamed) {op} {m.group('shape')}"
            else:
                parts = [p for p in re.sub(r"layers_\d+", "layers_*", name).split("/")
                         if not p.startswith(("jit(", "shard_map", "dot_general")) and p not in _PLUMBING]
                label = "/".join(parts[-depth:])
            out[label] = out.get(label, 0.0) + flops
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


_PLUMBING = frozenset(("while", "body", "cond", "closed_call", "checkpoint", "remat"))   # name-stack levels that say
# nothing of the operation


def dot_flops_by_op(hlo_text: str, depth: int = 3) -> dict[str, float]:
    """FLOPs of every ``dot`` of a compiled program (2 · result elements · contracted elements, each loop body
    counted once per iteration: `loop_multipliers`), summed by the source operation's name — the jit / shard_map
    name stack with ``layers_<i>`` as ``layers_*`` and its last ``depth`` components kept, so the same operation
    of every layer adds up. Sorted by FLOPs, largest first. (Dots only: elementwise work is in `flops_by_op`.)"""
    return _flops_by_op(hlo_text, depth, dots_only=True)


def flops_by_op(hlo_text: str, depth: int = 4) -> dict[str, float]:
    """Every FLOP of a compiled program by source operation, as `dot_flops_by_op` labels them: the dots, the
    elementwise operations (one per output element, as XLA's cost analysis counts them: arithmetic, compares,
    selects, converts, bit operations; transcendentals apart, not counted) and reductions (one per input element).
    Totals within a few per cent of `program_cost`'s (XLA's own per-op rules differ in details): where the FLOPs
    above a floor go."""
    return _flops_by_op(hlo_text, depth, dots_only=False)
