"""The Pallas kernels compiled for a GPU target at a model's shapes, one call each: their grids, shared memory,
registers and spills (``ptxas``), read from the compile (`v41cp.targets.gpu_program`) — on a host without a GPU.

`kernel_programs(shape, context, batch, tokens, device, configs, ops)` lowers each kernel op (backend ``"pallas"``;
``configs``: its kernel parameters by `v41cp.kernel_bench.SWEEP` key, e.g. ``{"attention": {"block_h": 16}}``) on abstract
operands at ``shape`` (`v41cp.kernel_bench.SHAPES`: ``flash`` is V4.1-Flash's heads, head dims, record formats and
expert widths): the indexer's top-k over ``context / ratio`` MXFP4 keys per request (both scan passes), the sparse
decode attention over a FP8 window and the selected NVFP4 entries, the grouped FP4 expert GEMM of ``tokens`` routed
rows. `kernel_resources(target, ...)` compiles them for ``target`` and returns one row per kernel; a kernel whose
shared memory exceeds the target's per-block limit fails here, at compile time, as on the GPU.
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp

from v41cp.kernel_bench import SHAPES
from v41cp.kernels.grouped_matmul import grouped_fp4_matmul
from v41cp.kernels.indexer_topk import indexer_topk
from v41cp.kernels.sparse_attention import sparse_attention
from v41cp.layers.moe_dispatch import DispatchShape
from v41cp.targets import compile_devices
from v41cp.targets.gpu_program import analyse, compile_with_dump, ptx_global_loads

__all__ = ["OPS", "kernel_programs", "kernel_resources"]


OPS = {"indexer_topk": "indexer", "sparse_attention": "attention", "grouped_fp4_matmul": "experts"}


def kernel_programs(shape: dict, context: int, batch: int, tokens: int, device, configs: dict | None = None,
                    ops=tuple(OPS)) -> dict:
    """``{op name: lowered program}`` of the Pallas kernel ops ``ops`` at ``shape`` on ``device`` (abstract
    operands), with the kernel parameters ``configs[SWEEP key]``."""
    kw = {key: dict((configs or {}).get(key, {})) for key in OPS.values()}
    one = jax.sharding.SingleDeviceSharding(device)
    arg = lambda s, dt: jax.ShapeDtypeStruct(tuple(s), jnp.dtype(dt), sharding=one)
    dt = jnp.dtype(shape["dtype"])
    hi, di, epb, k = shape["index_heads"], shape["index_dim"], shape["epb"], shape["topk"]
    entries = context // shape["ratio"]
    pages = -(-entries // epb)
    kk = min(k, entries)
    out = {}
    keys = {"q": arg((batch * pages * epb, di // 2), jnp.uint8), "s": arg((batch * pages * epb, di // 32), jnp.uint8)}
    out["indexer_topk"] = jax.jit(lambda q, w, store, tables, ids, visible: indexer_topk(
        q, w, store, tables, ids, visible, kk, epb=epb, backend="pallas", **kw["indexer"])).lower(
        arg((batch, hi, di), dt), arg((batch, hi), jnp.float32), keys, arg((batch, pages), jnp.int32),
        arg((batch, pages), jnp.int32), arg((batch,), jnp.int32))
    h, d, win = shape["heads"], shape["head_dim"], shape["window"]
    window = {"q": arg((batch * win, d), jnp.uint8), "s": arg((batch * win, d // 32), jnp.uint8)}
    pool = {"q": arg((batch * entries, d // 2), jnp.uint8), "s": arg((batch * entries, d // 16), jnp.uint8)}
    out["sparse_attention"] = jax.jit(lambda q, a, b, i, j, sink: sparse_attention(
        q, (a, b), (i, j), sink=sink, backend="pallas", **kw["attention"])).lower(
        arg((batch, h, d), dt), window, pool, arg((batch, win), jnp.int32), arg((batch, kk), jnp.int32),
        arg((h,), jnp.float32))
    hidden, width, experts = shape["hidden"], shape["expert_width"], shape["experts"]
    tiles = DispatchShape.build(tokens, shape["experts_per_token"], experts, 1, min_tile=16)
    out["grouped_fp4_matmul"] = jax.jit(lambda xs, t, live, p, sc: grouped_fp4_matmul(
        xs, t, p, sc, live=live, backend="pallas", **kw["experts"])).lower(
        arg((tiles.tiles, tiles.tile, hidden), dt), arg((tiles.tiles,), jnp.int32), arg((tiles.tiles,), jnp.int32),
        arg((experts, width, hidden // 2), jnp.uint8), arg((experts, width, hidden // 32), jnp.uint8))
    return {op: out[op] for op in ops}


def kernel_resources(target: str = "h200", shapes: str = "flash", context: int = 131072, batch: int = 8,
                     tokens: int = 512, configs: dict | None = None, ops=tuple(OPS)) -> list[dict]:
    """One row per Pallas kernel of the ops at ``shapes`` compiled for ``target``: ``op``, ``name``, ``launches``,
    ``grid``, ``threads``, ``shared_memory_bytes``, ``registers``, ``spill_bytes`` and the ``bytes`` / ``flops`` of
    one launch its op recorded (`v41cp.kernels.cost_scope`), ``global_loads_in_ptx`` (the PTX's global loads by
    width: static instruction counts)."""
    device = compile_devices(target, 1)[0]
    rows = []
    for op, lowered in kernel_programs(SHAPES[shapes], context, batch, tokens, device, configs, ops).items():
        compiled, dump = compile_with_dump(lowered)
        try:
            kernels = analyse(dump, compiled.as_text())
            cost = {k.name: (k.bytes, k.flops) for k in kernels.kernels}
            loads = ptx_global_loads(dump)
            for row in kernels.by_name("v41cp_"):
                rows.append({"op": op, **row, "bytes": cost[row["name"]][0], "flops": cost[row["name"]][1],
                             "global_loads_in_ptx": loads.get(row["name"], {})})
        finally:
            shutil.rmtree(dump, ignore_errors=True)
    return rows
