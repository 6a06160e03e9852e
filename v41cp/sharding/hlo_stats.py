"""Exact structure of a compiled program: its collectives and their bytes (from the optimized HLO text).

`collectives(text)` lists every collective op (all-gather, all-reduce, reduce-scatter, all-to-all,
collective-permute; async ``-start`` halves counted once) with its result bytes per device and replica-group
size; `collective_bytes` sums them. Byte counts are of each op's result on one device.
"""

from __future__ import annotations

import re

__all__ = ["collectives", "collective_bytes"]

_OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1, "f64": 8, "s64": 8,
                "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2}
_LINE = re.compile(r"=\s*(?P<shape>.+?)\s+(?P<op>" + "|".join(_OPS) + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"\b([a-z0-9]+)\[([0-9,]*)\]")


def _bytes(shape_text: str) -> list[int]:
    out = []
    for dtype, dims in _ARRAY.findall(shape_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append(n * _DTYPE_BYTES.get(dtype, 4))
    return out


def _group_size(line: str) -> int | None:
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    return None


def collectives(hlo_text: str) -> list[dict]:
    """Every collective of an optimized HLO module: ``{"op", "bytes", "group_size"}``."""
    found = []
    for line in hlo_text.splitlines():
        m = _LINE.search(line)
        if not m:
            continue
        sizes = _bytes(m.group("shape"))
        if m.group("start") and len(sizes) > 1:     # async start: (operands..., results...) → count results
            sizes = sizes[len(sizes) // 2:]
        found.append({"op": m.group("op"), "bytes": sum(sizes), "group_size": _group_size(line)})
    return found


def collective_bytes(hlo_text: str, group_size: int | None = None) -> int:
    """Total result bytes of the collectives (optionally only those over replica groups of ``group_size``)."""
    return sum(c["bytes"] for c in collectives(hlo_text) if group_size is None or c["group_size"] == group_size)
