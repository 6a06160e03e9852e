"""One-shot GPU check of the kernels (run on a GPU host; prints JSON lines, writes them to $OUT if set).

1. each kernel vs its reference on the GPU at V4.1-Flash head counts (ragged lengths, an all-padding row,
   a single-entry page), fp32 and bf16: max relative error, top-k ids identical;
   the grouped FP4 expert GEMM vs its reference at V4.1-Flash widths (tiles of 1 / 16 / 128 rows, a dead tile);
   each kernel's check guarded on its own, so one failure does not hide the others;
2. ``v41cp.kernel_bench`` at the requested contexts and batches, and the expert GEMM at ``--expert-tokens``
   (``--sweep``: alternative kernel parameters);
3. the tiny engine (CED off, FP4 experts kept as stored): greedy tokens of each ``--engine-backends`` variant
   (``xla``, ``pallas``, ``pallas-indexer-xla``: every kernel but the indexer's) equal to ``xla``'s — where not,
   the first differing token and both runs' top-1 − top-2 logit gap there (a near-tie or an error) — and the
   median decode-step time of each.

Usage: ``python scripts/gpu_kernel_check.py [--contexts 8192,131072,1048576] [--batches 1,16,64]
[--expert-tokens 64,4096] [--reps 5] [--sweep] [--skip kernels,bench,engine]
[--engine-backends xla,pallas]``
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np


def emit(obj, sink):
    line = json.dumps(obj)
    print(line, flush=True)
    sink.append(line)
    if os.environ.get("OUT"):                   # appended as it goes: a timeout keeps what was measured
        with open(os.path.join(os.environ["OUT"], "gpu_kernel_check.jsonl"), "a") as f:
            f.write(line + "\n")


def guarded(name, fn, sink):
    t0 = time.perf_counter()
    try:
        emit({"check": name, **fn(), "check_wall_s": round(time.perf_counter() - t0, 1)}, sink)
    except Exception as e:
        emit({"check": name, "error": f"{type(e).__name__}: {e}"[:2000]}, sink)


def check_kernels():
    from v41cp.kernels.indexer_topk import index_block_maxima, indexer_topk
    from v41cp.kernels.sparse_attention import sparse_attention
    from v41cp.quant import mxfp4_block32
    from v41cp.serving.cache.records import encode

    out = {}
    rng = np.random.default_rng(0)
    r, h, d, nw, nc = 5, 64, 512, 300, 2000

    def attention(dt, v4=False):
        # V4.1: FP8 window rows + NVFP4 entries; V4: both in DeepSeek-V4's 584 B record (fp8_ds_mla, RoPE 64)
        q = jax.random.normal(jax.random.key(0), (r, h, d)).astype(dt)
        fmts = (("fp8_ds_mla", 64), ("fp8_ds_mla", 64)) if v4 else (("fp8", 0), ("nvfp4", 0))
        stores = tuple(encode(jax.random.normal(jax.random.key(k), (n, d)), f, rope)
                       for k, n, (f, rope) in ((1, nw, fmts[0]), (2, nc, fmts[1])))
        iw = jnp.asarray(rng.integers(-1, nw, (r, 128)), jnp.int32).at[4].set(-1)
        ic = jnp.asarray(rng.integers(-1, nc, (r, 512)), jnp.int32).at[4].set(-1)
        lens = (jnp.array([128, 100, 1, 128, 0]), jnp.array([512, 77, 1, 0, 0]))
        t0 = time.perf_counter()
        o1, l1 = sparse_attention(q, stores, (iw, ic), lens, backend="pallas")
        jax.block_until_ready(o1)
        t1 = time.perf_counter() - t0
        o2, l2 = sparse_attention(q, stores, (iw, ic), lens, backend="xla")
        fin = jnp.isfinite(l2)
        return {
            "max_rel_err": float(jnp.max(jnp.abs(o1 - o2)) / jnp.max(jnp.abs(o2))),
            "max_lse_err": float(jnp.max(jnp.where(fin, jnp.abs(l1 - l2), 0.0))),
            "padding_row_lse_is_neg_inf": bool(jnp.all(l1[4] == -jnp.inf)), "first_call_s": round(t1, 2)}

    def indexer(dt):
        # indexer: 32 heads x 128, top-512, MXFP4 keys, pages of 32 entries, one single-valid-entry row
        hi, di, epb, npg = 32, 128, 32, 96
        store = encode(jax.random.normal(jax.random.key(3), (r * npg * epb, di)), "mxfp4")
        qi = mxfp4_block32(jax.random.normal(jax.random.key(4), (r, hi, di))).astype(dt)
        wi = jax.random.normal(jax.random.key(5), (r, hi))
        tables = jnp.asarray(np.stack([b * npg + rng.permutation(npg) for b in range(r)]), jnp.int32)
        tables = tables.at[1, 40:].set(-1)
        pids = jnp.broadcast_to(jnp.arange(npg, dtype=jnp.int32), (r, npg))
        vis = jnp.array([npg * epb, 1200, 1, 0, 2000])
        mask = jnp.asarray(rng.random((r, npg * epb // 8)) < 0.5)
        res = {}
        for name, kw in (("plain", {}), ("reindex_mask", {"block_mask": mask, "cbs": 8})):
            a = indexer_topk(qi, wi, store, tables, pids, vis, 512, epb=epb, backend="pallas", **kw)
            b = indexer_topk(qi, wi, store, tables, pids, vis, 512, epb=epb, backend="xla", **kw)
            fin = jnp.isfinite(b[1])
            res[name] = {"ids_identical": bool(jnp.all(a[0] == b[0])),
                         "rows_differing": int(jnp.sum(jnp.any(a[0] != b[0], axis=1))),
                         "max_rel_score_err": float(jnp.max(jnp.where(fin, jnp.abs(a[1] - b[1]), 0.0))
                                                    / jnp.max(jnp.where(fin, jnp.abs(b[1]), 0.0)))}
        m1 = index_block_maxima(qi, wi, store, tables, pids, vis, epb=epb, cbs=8, backend="pallas")
        m2 = index_block_maxima(qi, wi, store, tables, pids, vis, epb=epb, cbs=8, backend="xla")
        fin = jnp.isfinite(m2[0])
        res["block_maxima"] = {"ids_identical": bool(jnp.all(m1[1] == m2[1])),
                               "finite_pattern_identical": bool(jnp.all(jnp.isfinite(m1[0]) == fin)),
                               "max_rel_err": float(jnp.max(jnp.where(fin, jnp.abs(m1[0] - m2[0]), 0.0))
                                                    / jnp.max(jnp.where(fin, jnp.abs(m2[0]), 0.0)))}
        return res

    def experts(dt):
        # grouped FP4 expert GEMM: V4.1-Flash gate projection [2304, 5120] of 6 experts, tiles of 1 / 16 / 128 rows
        from v41cp.kernels.grouped_matmul import grouped_fp4_matmul

        packed = jnp.asarray(rng.integers(0, 256, (6, 2304, 2560)), jnp.uint8)
        scale = jnp.asarray(rng.integers(118, 130, (6, 2304, 160)), jnp.uint8)
        tiles = jnp.asarray([0, 5, 5, 2, 3, 1], jnp.int32)
        live = jnp.asarray([1, 1, 0, 1, 1, 1], jnp.int32)
        gm = {}
        for g in (1, 16, 128):
            x = jax.random.normal(jax.random.key(g), (6, g, 5120)).astype(dt)
            a = grouped_fp4_matmul(x, tiles, packed, scale, live=live, backend="pallas").astype(jnp.float32)
            b = grouped_fp4_matmul(x, tiles, packed, scale, backend="xla").astype(jnp.float32).at[2].set(0)
            gm[f"rows_{g}"] = {"max_rel_err": float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))),
                               "dead_tile_zero": bool(jnp.all(a[2] == 0))}
        return gm

    for dt in ("float32", "bfloat16"):
        for name, fn in (("sparse_attention", attention), ("sparse_attention_v4_records",
                                                            lambda dt: attention(dt, v4=True)),
                         ("indexer", indexer), ("grouped_fp4_matmul", experts)):
            try:
                out[f"{name}_{dt}"] = fn(dt)
            except Exception as e:                          # one kernel's failure must not hide the others
                out[f"{name}_{dt}"] = {"error": f"{type(e).__name__}: {e}"[:600]}
    return out


ENGINE_BACKENDS = {"xla": ("xla", "xla", "xla"), "pallas": ("pallas", "pallas", "pallas"),
                   "pallas-indexer-xla": ("pallas", "xla", "pallas")}      # attention, indexer, experts


def check_engine(variants=("xla", "pallas")):
    """The tiny engine with FP4 experts kept as stored: same greedy tokens with every kernel backend, and the
    median decode-step time of each (a tiny model: dispatch-bound, not a kernel measurement)."""
    import tempfile

    from v41cp.checkpoint import convert, default_released_checkpoint, load
    from v41cp.serving.engine import Capacity, Engine, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        convert(default_released_checkpoint(), tmp + "/kq", progress=False, keep_quantized=True)
        cfg, params = load(tmp + "/kq")
    cap = Capacity(max_batch=3, max_tokens=48, block_tokens=4, prefill_chunk=8)
    rng = np.random.default_rng(3)
    prompts = {f"p{n}": rng.integers(3, 256, n).tolist() for n in (5, 13, 21)}
    outs, times, steps, margins = {}, {}, {}, {}
    for be in variants:
        t0 = time.perf_counter()
        att, idx, exp = ENGINE_BACKENDS[be]
        eng = Engine(params, cfg.replace(attention_backend=att, indexer_backend=idx, expert_backend=exp), cap,
                     record_logits=True)
        for rnd in range(2):                                   # round 0 compiles; round 1 is timed
            for rid, p in prompts.items():
                eng.submit(f"{rid}-{rnd}", p, SamplingParams(max_new_tokens=12, stop_on_eos=False))
            durations, gaps = [], {r: [] for r in prompts}
            while eng.pending:
                t1 = time.perf_counter()
                eng.step()
                durations.append(time.perf_counter() - t1)
                for r in prompts:                              # untimed: each new token's top-1 − top-2 logit gap
                    req = eng.requests[f"{r}-{rnd}"]
                    if req.last_logits is not None and len(req.output) == len(gaps[r]) + 1:
                        top = np.sort(np.asarray(req.last_logits, np.float32))[-2:]
                        gaps[r].append(round(float(top[1] - top[0]), 5))
            outs[be] = {r: eng.release(f"{r}-{rnd}")["output_ids"] for r in prompts}
            margins[be] = gaps
        steps[be] = round(1e3 * sorted(durations)[len(durations) // 2], 3)
        times[be] = round(time.perf_counter() - t0, 1)
    base = variants[0]

    def divergence(be):            # per request: the first token that differs, and both runs' logit gap there
        out = {}
        for r in prompts:
            a, b = outs[base][r], outs[be][r]
            t = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if t is not None:
                gap = lambda v: margins[v][r][t] if t < len(margins[v][r]) else None
                out[r] = {"token": t, f"top2_gap_{base}": gap(base), f"top2_gap_{be}": gap(be)}
        return out

    return {"tokens_equal": {be: outs[be] == outs[base] for be in variants[1:]}, "tokens": outs,
            "first_divergence": {be: divergence(be) for be in variants[1:]}, "wall_s": times,
            "median_step_ms": steps,
            "step_ratio_over_" + base: {be: round(steps[be] / steps[base], 3) for be in variants[1:]}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", default="8192,131072,1048576")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--bench", default="indexer,attention,experts", help="which kernels to benchmark")
    p.add_argument("--expert-tokens", default="64,4096", help="token counts of the expert GEMM benchmark")
    p.add_argument("--sweep", action="store_true", help="also time the alternative kernel parameters")
    p.add_argument("--skip", default="", help="comma list of: kernels,engine,bench")
    p.add_argument("--engine-backends", default="xla,pallas", help=f"engine variants, the first the baseline: "
                   f"{','.join(ENGINE_BACKENDS)}")
    a = p.parse_args()
    lines = []
    skip = set(a.skip.split(","))
    emit({"devices": [str(d) for d in jax.devices()], "jax": jax.__version__}, lines)
    if "kernels" not in skip:
        guarded("kernels", check_kernels, lines)
    if "bench" not in skip:
        from v41cp.kernel_bench import SHAPES, SWEEP, bench_experts, bench_indexer, bench_sparse_attention

        if "experts" in a.bench:
            for t in (int(x) for x in a.expert_tokens.split(",")):
                try:
                    emit(bench_experts(SHAPES["flash"], t, a.reps, True,
                                       sweep_configs=SWEEP["experts"] if a.sweep else None), lines)
                except Exception as e:
                    emit({"kernel": "grouped_fp4_matmul", "tokens": t, "error": f"{type(e).__name__}: {e}"[:400]},
                         lines)

        for c in (int(x) for x in a.contexts.split(",")):
            for b in (int(x) for x in a.batches.split(",")):
                for fn in [f for n, f in (("indexer", bench_indexer), ("attention", bench_sparse_attention))
                           if n in a.bench]:
                    try:
                        kind = "indexer" if fn is bench_indexer else "attention"
                        emit(fn(SHAPES["flash"], c, b, a.reps, True, sweep_configs=SWEEP[kind] if a.sweep else None),
                             lines)
                    except Exception as e:
                        emit({"kernel": fn.__name__, "context": c, "batch": b, "error": f"{type(e).__name__}: {e}"[:400]},
                             lines)
    if "engine" not in skip:
        guarded("engine", lambda: check_engine(tuple(a.engine_backends.split(","))), lines)


if __name__ == "__main__":
    main()
