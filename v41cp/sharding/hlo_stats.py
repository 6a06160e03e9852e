"""Exact structure of a compiled program: its collectives and their bytes (from the optimized HLO text).

`collectives(text)` lists every collective op (all-gather, all-reduce, reduce-scatter, all-to-all,
collective-permute; async ``-start`` halves counted once) with its result bytes per device and its device
groups (explicit, iota and mesh-axes replica-group formats); `collective_bytes` sums them, optionally only
over given groups (`mesh_axis_groups`). Byte counts are of each op's result on one device.
"""

from __future__ import annotations

import re

import numpy as np

__all__ = ["collectives", "collective_bytes", "replica_groups", "mesh_axis_groups", "ALL_DEVICES"]

ALL_DEVICES = "all"        # replica_groups={}: one group of every device

_OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1, "f64": 8, "s64": 8,
                "u64": 8, "s16": 2, "u16": 2, "f8e4m3fn": 1, "f8e4m3": 1, "f8e5m2": 1, "f8e8m0fnu": 1,
                "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "s4": 0.5, "u4": 0.5, "f4e2m1fn": 0.5}
_LINE = re.compile(r"=\s*(?P<shape>.+?)\s+(?P<op>" + "|".join(_OPS) + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"\b([a-z0-9]+)\[([0-9,]*)\]")


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


def collectives(hlo_text: str) -> list[dict]:
    """Every collective of an optimized HLO module: ``{"op", "bytes", "group_size"}``."""
    found = []
    for line in hlo_text.splitlines():
        m = _LINE.search(line)
        if not m:
            continue
        arrays = _arrays(m.group("shape"))
        if m.group("start") and m.group("op") != "all-reduce":
            # async start of a gather / permute / all-to-all / scatter: (operands, results[, u32[] contexts]);
            # an all-reduce-start lists only its results
            arrays = [a for a in arrays if a[1] > 0 or len(arrays) == 1]
            arrays = arrays[len(arrays) // 2:] if len(arrays) > 1 else arrays
        groups = replica_groups(line)
        found.append({"op": m.group("op"), "bytes": sum(b for b, _ in arrays), "groups": groups,
                      "group_size": len(next(iter(groups))) if groups and groups != ALL_DEVICES else None})
    return found


def collective_bytes(hlo_text: str, groups: frozenset | None = None) -> int:
    """Total result bytes of the collectives (optionally only those over exactly ``groups``, e.g.
    `mesh_axis_groups(mesh, "cp")`)."""
    def match(g):
        return g == groups or (g == ALL_DEVICES and groups is not None and len(groups) == 1)
    return sum(c["bytes"] for c in collectives(hlo_text) if groups is None or match(c["groups"]))
