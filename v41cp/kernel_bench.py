"""Kernel benchmark: the Pallas kernels vs their XLA reference paths vs the HBM roofline (prints JSON).

``python -m v41cp bench kernels [--shapes flash|tiny] [--contexts 8192,131072,1048576] [--batches 1,16,64]
[--expert-tokens 64,4096] [--kernels indexer,attention,experts] [--sweep]``

Shapes (``flash``, V4.1-Flash): the indexer scans the index keys of one ratio-2 index source (``context / 2``
entries per request, MXFP4 records of 68 B, 32 heads × 128, top-512, pages of 32 entries = 64 tokens); the
sparse decode attention reads a 128-row FP8 window (528 B rows) and 512 selected NVFP4 entries (288 B) of
a ``context / 2``-entry pool per request, 64 heads × 512; the grouped FP4 expert GEMM multiplies ``T`` tokens
routed to 6 of 384 experts by the gate projection ``[2304, 5120]`` of each (FP4 as released). ``tiny`` runs the same code at toy sizes (CPU,
interpret mode) so the CLI itself is testable.

Per case: median wall time of ``--reps`` calls after a warm-up, the compile time of the first call, the
bytes the kernel must move (each cache byte once, plus queries / outputs), achieved GB/s and TFLOP/s, the
roofline time ``bytes / hbm_bw`` and the fraction of it achieved, and the speed-up over the XLA path.
Times are absolute only on a GPU; on a CPU the kernels run in interpret mode and only the shapes and the
correctness checks mean anything.
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from v41cp.kernels import default_splits
from v41cp.kernels.grouped_matmul import grouped_fp4_matmul
from v41cp.kernels.indexer_topk import index_scan_pallas, indexer_topk, prepare_queries
from v41cp.kernels.sparse_attention import sparse_attention
from v41cp.layers.moe_dispatch import DispatchShape, dispatch
from v41cp.targets import TARGETS

__all__ = ["SHAPES", "run"]

HBM_BYTES_PER_S = TARGETS["h200"].hbm_bytes_per_s                     # the H200's published figures
BF16_TENSOR_FLOP_PER_S = TARGETS["h200"].peak_flops("bf16")

SHAPES = {
    "flash": dict(heads=64, head_dim=512, window=128, topk=512, index_heads=32, index_dim=128, epb=32,
                  ratio=2, dtype="bfloat16", hidden=5120, expert_width=2304, experts=384, experts_per_token=6),
    "tiny": dict(heads=16, head_dim=64, window=8, topk=16, index_heads=16, index_dim=32, epb=8, ratio=2,
                 dtype="float32", hidden=64, expert_width=32, experts=16, experts_per_token=6),
}


def _time(fn, *args, reps: int):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), compile_s


def _random_bytes(key, shape):
    """Random uint8 ``shape`` (last dim a multiple of 4) drawn as uint32 words: no 4×-sized intermediate."""
    words = jax.random.bits(key, (*shape[:-1], shape[-1] // 4), jnp.uint32)
    return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(shape)


def _mxfp4_pool(key, n_rows: int, di: int):
    """Random MXFP4 index-key records with scale bytes near 2^0 (finite, typical magnitudes)."""
    k1, k2 = jax.random.split(key)
    return {"q": _random_bytes(k1, (n_rows, di // 2)),
            "s": (120 + jax.random.randint(k2, (n_rows, di // 32), 0, 8)).astype(jnp.uint8)}


def _fp8_rows(key, n_rows: int, d: int):
    k1, k2 = jax.random.split(key)
    q = _random_bytes(k1, (n_rows, d)) & jnp.uint8(0xF7)        # no NaN code (exponent 15, mantissa 7)
    return {"q": q, "s": (120 + jax.random.randint(k2, (n_rows, d // 32), 0, 8)).astype(jnp.uint8)}


def _nvfp4_rows(key, n_rows: int, d: int):
    k1, k2 = jax.random.split(key)
    # e4m3 scale bytes 0x30-0x37: 2^-1 · (1 + m/8), finite and positive
    return {"q": _random_bytes(k1, (n_rows, d // 2)),
            "s": (0x30 + jax.random.randint(k2, (n_rows, d // 16), 0, 8)).astype(jnp.uint8)}


def _paged_tables(batch: int, pages: int, seed: int):
    """Each request's pages, a random permutation of its own page range (as an allocator hands them out)."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.stack([b * pages + rng.permutation(pages) for b in range(batch)]).astype(np.int32))


def _stats(t: float, nbytes: int, flops: int) -> dict:
    roof = nbytes / HBM_BYTES_PER_S
    return {"ms": round(t * 1e3, 4), "gb_per_s": round(nbytes / t / 1e9, 1), "tflop_per_s": round(flops / t / 1e12, 2),
            "roofline_ms": round(roof * 1e3, 4), "fraction_of_roofline": round(roof / t, 3)}


def bench_indexer(shape: dict, context: int, batch: int, reps: int, with_xla: bool, seed: int = 0,
                  sweep_configs=None) -> dict:
    hi, di, epb, k = shape["index_heads"], shape["index_dim"], shape["epb"], shape["topk"]
    dt = jnp.dtype(shape["dtype"])
    g = context // shape["ratio"]                          # entries per request
    pages = -(-g // epb)
    key = jax.random.key(seed)
    kq, kw, kp = jax.random.split(key, 3)
    store = _mxfp4_pool(kp, batch * pages * epb, di)
    tables = _paged_tables(batch, pages, seed)
    page_ids = jnp.broadcast_to(jnp.arange(pages, dtype=jnp.int32), (batch, pages))
    visible = jnp.full((batch,), g, jnp.int32)
    q = jax.random.normal(kq, (batch, hi, di), jnp.float32).astype(dt)
    w = jax.random.normal(kw, (batch, hi), jnp.float32)
    kk = min(k, g)

    topk = jax.jit(lambda q, w, s, t: indexer_topk(q, w, s, t, page_ids, visible, kk, epb=epb, backend="pallas"))

    q_e, q_o, wp = prepare_queries(q, w)
    scan = jax.jit(lambda q_e, q_o, wp, sq, ss, t: index_scan_pallas(
        q_e, q_o, wp, (sq, ss), "mxfp4", visible, t, page_ids, None, None, epb=epb, group=16, tile=64, cbs=1,
        mode="max", splits=default_splits(batch, pages * epb // 64), interpret=jax.default_backend() != "gpu"))
    key_bytes = batch * g * (di // 2 + di // 32)
    nbytes = key_bytes + batch * pages * 4 + q.size * q.dtype.itemsize + w.size * 4
    flops = 2 * batch * g * hi * di
    out = {"kernel": "indexer_topk", "context": context, "batch": batch, "entries_per_request": g, "k": kk,
           "bytes": nbytes}
    t_p, c = _time(topk, q, w, store, tables, reps=reps)
    out["pallas"] = {**_stats(t_p, nbytes, flops), "compile_s": round(c, 2)}
    t, c = _time(scan, q_e, q_o, wp, store["q"], store["s"], tables, reps=reps)
    out["pallas_scan_pass"] = {**_stats(t, nbytes, flops), "compile_s": round(c, 2)}
    if sweep_configs:
        out["sweep"] = []
        for cfg in sweep_configs:
            fn = jax.jit(lambda q, w, s, t, cfg=cfg: indexer_topk(q, w, s, t, page_ids, visible, kk, epb=epb,
                                                                   backend="pallas", **cfg))
            t_s, c = _time(fn, q, w, store, tables, reps=reps)
            out["sweep"].append({"config": cfg, "ms": round(t_s * 1e3, 4), "gb_per_s": round(nbytes / t_s / 1e9, 1),
                                 "compile_s": round(c, 2)})
    if with_xla:
        ref = jax.jit(lambda q, w, s, t: indexer_topk(q, w, s, t, page_ids, visible, kk, epb=epb, backend="xla"))
        try:
            t_x, c = _time(ref, q, w, store, tables, reps=reps)
            out["xla"] = {**_stats(t_x, nbytes, flops), "compile_s": round(c, 2)}
            out["speedup_vs_xla"] = round(t_x / t_p, 2)
            (a, sa), (b, sb) = topk(q, w, store, tables), ref(q, w, store, tables)
            out["ids_equal_xla"] = bool(jnp.all(a == b))
            out["rows_with_id_mismatch"] = int(jnp.sum(jnp.any(a != b, axis=1)))
            # the k scores (descending) side by side: equal lists with other ids are ties at the k-th score
            out["max_abs_topk_score_diff_vs_xla"] = float(jnp.max(jnp.abs(sa - sb)))
        except Exception as e:                              # e.g. the reference's decoded keys exceed memory
            out["xla"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return out


def bench_sparse_attention(shape: dict, context: int, batch: int, reps: int, with_xla: bool, seed: int = 0,
                           sweep_configs=None) -> dict:
    h, d, win, k = shape["heads"], shape["head_dim"], shape["window"], shape["topk"]
    dt = jnp.dtype(shape["dtype"])
    g = context // shape["ratio"]
    kk = min(k, g)
    key = jax.random.key(seed + 1)
    kq, kw, kc, ks = jax.random.split(key, 4)
    window = _fp8_rows(kw, batch * win, d)
    pool = _nvfp4_rows(kc, batch * g, d)
    rng = np.random.default_rng(seed)
    sel = np.stack([b * g + np.sort(rng.choice(g, kk, replace=False)) for b in range(batch)]).astype(np.int32)
    win_idx = jnp.asarray(np.arange(batch)[:, None] * win + np.arange(win), jnp.int32)
    sel = jnp.asarray(sel)
    q = jax.random.normal(kq, (batch, h, d), jnp.float32).astype(dt)
    sink = jnp.zeros((h,), jnp.float32)
    nbytes = batch * (win * (d + d // 32) + kk * (d // 2 + d // 16) + (win + kk) * 4) + 2 * q.size * q.dtype.itemsize \
        + batch * h * (d + 1) * 4
    flops = 4 * batch * h * (win + kk) * d
    out = {"kernel": "sparse_attention", "context": context, "batch": batch, "keys_per_row": win + kk,
           "bytes": nbytes}
    fn = {be: jax.jit(lambda q, a, b, c, e, i, j, be=be: sparse_attention(
        q, ({"q": a, "s": b}, {"q": c, "s": e}), (i, j), sink=sink, backend=be)) for be in ("pallas", "xla")}
    args = (q, window["q"], window["s"], pool["q"], pool["s"], win_idx, sel)
    t, c = _time(fn["pallas"], *args, reps=reps)
    out["pallas"] = {**_stats(t, nbytes, flops), "compile_s": round(c, 2)}
    if sweep_configs:
        out["sweep"] = []
        for cfg in sweep_configs:
            f = jax.jit(lambda q, a, b, c, e, i, j, cfg=cfg: sparse_attention(
                q, ({"q": a, "s": b}, {"q": c, "s": e}), (i, j), sink=sink, backend="pallas", **cfg))
            t_s, c = _time(f, *args, reps=reps)
            out["sweep"].append({"config": cfg, "ms": round(t_s * 1e3, 4), "gb_per_s": round(nbytes / t_s / 1e9, 1),
                                 "compile_s": round(c, 2)})
    if with_xla:
        t_x, c = _time(fn["xla"], *args, reps=reps)
        out["xla"] = {**_stats(t_x, nbytes, flops), "compile_s": round(c, 2)}
        out["speedup_vs_xla"] = round(t_x / t, 2)
        (o1, l1), (o2, l2) = fn["pallas"](*args), fn["xla"](*args)
        out["max_rel_err_vs_xla"] = float(jnp.max(jnp.abs(o1 - o2)) / jnp.maximum(jnp.max(jnp.abs(o2)), 1e-30))
        out["max_abs_lse_err_vs_xla"] = float(jnp.max(jnp.abs(l1 - l2)))
    return out


def bench_experts(shape: dict, tokens: int, reps: int, with_xla: bool, seed: int = 0, sweep_configs=None) -> dict:
    """The grouped FP4 expert GEMM of one MoE layer's gate projection (``w1``: ``[E, I, H/2]`` as stored) for
    ``tokens`` rows routed uniformly at random to ``k`` of ``E`` experts, dispatched into tiles of ≥ 16 rows.
    Bytes = the experts the routing uses, each read once, plus activations in / out; FLOPs = the useful
    ``2 · T · k · I · H`` (padded tile rows not counted)."""
    h, i, e, k = shape["hidden"], shape["expert_width"], shape["experts"], shape["experts_per_token"]
    dt = jnp.dtype(shape["dtype"])
    key = jax.random.key(seed + 2)
    kx, kp, ks = jax.random.split(key, 3)
    packed = _random_bytes(kp, (e, i, h // 2))
    scale = (120 + jax.random.randint(ks, (e, i, h // 32), 0, 8)).astype(jnp.uint8)
    rng = np.random.default_rng(seed)
    idx = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(tokens)]), jnp.int32)
    dshape = DispatchShape.build(tokens, k, e, 1, min_tile=16)
    tile_expert, slot_pair = dispatch(idx, dshape)
    live = jnp.any(slot_pair >= 0, axis=1).astype(jnp.int32)
    x = jax.random.normal(kx, (tokens + 1, h), jnp.float32).astype(dt).at[tokens].set(0)
    xs = x[jnp.where(slot_pair < 0, tokens, slot_pair // k)]                                   # [tiles, G, H]
    used = int(np.unique(np.asarray(idx)).size)
    weight_bytes = used * i * (h // 2 + h // 32)
    nbytes = weight_bytes + tokens * h * dt.itemsize + tokens * k * i * dt.itemsize
    flops = 2 * tokens * k * i * h
    out = {"kernel": "grouped_fp4_matmul", "tokens": tokens, "experts_used": used, "tiles": dshape.tiles,
           "live_tiles": int(live.sum()), "tile_rows": dshape.tile, "bytes": nbytes, "expert_bytes": weight_bytes,
           "flops": flops}
    fn = {be: jax.jit(lambda xs, t, lv, p, sc, be=be: grouped_fp4_matmul(xs, t, p, sc, live=lv, backend=be))
          for be in ("pallas", "xla")}
    args = (xs, tile_expert, live, packed, scale)
    t, c = _time(fn["pallas"], *args, reps=reps)
    out["pallas"] = {**_stats(t, nbytes, flops), "compile_s": round(c, 2),
                     "fraction_of_bf16_peak": round(flops / t / BF16_TENSOR_FLOP_PER_S, 3)}
    if sweep_configs:
        out["sweep"] = []
        for cfg in sweep_configs:
            f = jax.jit(lambda xs, t, lv, p, sc, cfg=cfg: grouped_fp4_matmul(xs, t, p, sc, live=lv, backend="pallas",
                                                                             **cfg))
            try:
                t_s, c = _time(f, *args, reps=reps)
            except ValueError as err:                      # blocks that do not divide these widths
                out["sweep"].append({"config": cfg, "error": str(err)})
                continue
            out["sweep"].append({"config": cfg, "ms": round(t_s * 1e3, 4), "gb_per_s": round(nbytes / t_s / 1e9, 1),
                                 "compile_s": round(c, 2)})
    if with_xla:
        try:
            t_x, c = _time(fn["xla"], *args, reps=reps)
            out["xla"] = {**_stats(t_x, nbytes, flops), "compile_s": round(c, 2)}
            out["speedup_vs_xla"] = round(t_x / t, 2)
            a, b = (fn[be](*args).astype(jnp.float32) for be in ("pallas", "xla"))
            b = jnp.where(live[:, None, None] > 0, b, 0.0)
            out["max_rel_err_vs_xla"] = float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))
            # which experts' tiles disagree (> 1 % of the output's scale): locates e.g. an offset overflow
            tile_err = np.asarray(jnp.max(jnp.abs(a - b), axis=(1, 2)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))
            bad = sorted({int(x) for x in np.asarray(tile_expert)[tile_err > 1e-2]})
            out["experts_wrong"] = {"count": len(bad), "first": bad[:8], "lowest_byte_offset":
                                    bad[0] * int(packed.shape[1]) * int(packed.shape[2]) if bad else None}
        except Exception as err:                          # the reference gathers every tile's weights
            out["xla"] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
    return out


# kernel parameters tried by ``--sweep`` (the defaults come first)
SWEEP = {
    "attention": [dict(), dict(block_k=64), dict(block_k=16), dict(num_warps=4), dict(block_h=32, num_warps=8),
                  dict(block_h=16, num_warps=8), dict(block_h=16, num_warps=4), dict(splits=1),
                  dict(block_k=64, num_warps=8, num_stages=3)],
    "indexer": [dict(), dict(tile=128), dict(tile=128, group=32, num_warps=8), dict(tile=256, group=32, num_warps=8),
                dict(splits=1), dict(num_stages=3)],
    "experts": [dict(), dict(block_n=128), dict(block_k=256), dict(block_n=128, block_k=256, num_warps=8),
                dict(num_stages=3)],
}


def run(shapes: str = "flash", contexts=(8192, 131072, 1048576), batches=(1, 16, 64),
        kernels=("indexer", "attention", "experts"), reps: int = 10, with_xla: bool = True, sweep: bool = False,
        progress: bool = False, expert_tokens=(64, 4096)) -> dict:
    """Every (kernel, context, batch) case, then every expert-GEMM token count → a JSON-ready dict. ``sweep``:
    also time the `SWEEP` kernel parameters of each case (Pallas path only), for choosing the defaults on a GPU.
    ``progress``: a progress bar over the cases on stderr."""
    shape = SHAPES[shapes]
    dev = jax.devices()[0]
    out = {"bench": "kernels", "shapes": shapes, "shape": shape, "device": getattr(dev, "device_kind", str(dev)),
           "platform": jax.default_backend(), "jax": jax.__version__, "interpret": jax.default_backend() != "gpu",
           "hbm_bytes_per_s": HBM_BYTES_PER_S, "bf16_tensor_flop_per_s": BF16_TENSOR_FLOP_PER_S, "cases": []}
    cases = [(c, b, k) for c in contexts for b in batches for k in ("indexer", "attention") if k in kernels]
    cases += [(None, t, "experts") for t in expert_tokens if "experts" in kernels]
    for context, batch, kernel in tqdm(cases, desc="bench kernels" + (" (sweep)" if sweep else ""), unit="case",
                                       disable=not progress, file=sys.stderr):
        configs = SWEEP[kernel] if sweep else None
        if kernel == "indexer":
            out["cases"].append(bench_indexer(shape, context, batch, reps, with_xla, sweep_configs=configs))
        elif kernel == "attention":
            out["cases"].append(bench_sparse_attention(shape, context, batch, reps, with_xla, sweep_configs=configs))
        else:
            out["cases"].append(bench_experts(shape, batch, reps, with_xla, sweep_configs=configs))
    return out
