"""Operator-local QCP, exact structure from the compiled programs (prints JSON; nothing is timed).

One long prefill (``--rows`` query rows, one request) of a V4.1-like layer at reduced width, on
``--devices`` simulated CPU devices (attention TP = all of them):

* **indexer**: the selection of an ordinary index layer (queries, weights, scores against the complete keys,
  top-k) — unsharded (one device), replicated TP baseline (every rank scores every row, with replicated index
  projections) and indexer QCP (rows interleaved, ids gathered back);
* **attention**: the selected prefill attention of a compressed layer (window + top-k entries) — unsharded,
  head-sharded TP (each rank: its heads, every row) and attention QCP (each rank: every head, its row block;
  two all-to-alls).

Per part: per-device FLOPs from XLA's cost analysis of each compiled program, their ratio to the unsharded
program, and the result bytes per device of every collective (`v41cp.sharding.hlo_stats`), also per
prefill row. ``python benchmarks/operator_qcp_structure.py --devices 8 --rows 4096``
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--rows", type=int, default=4096)
    a = p.parse_args()
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={a.devices}")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from v41cp.config import preset
    from v41cp.layers.attention import query_parallel_attention, rows_sink_attention, window_indices
    from v41cp.layers.indexer import query_parallel_select, select_positions
    from v41cp.sharding import make_mesh
    from v41cp.sharding.hlo_stats import collective_bytes, collectives
    from v41cp.sharding.topology import ParallelConfig

    n, s = a.devices, a.rows
    # tiny-tp8 widths with V4.1-Flash-like selection sizes (index top-512, window 128)
    cfg = preset("tiny-tp8", index_topk=512, sliding_window=128, num_attention_heads=16, o_groups=8)
    role = cfg.layer_roles[1]                                       # ratio-2 Full, an ordinary index source
    g = s // role.ratio
    mesh = make_mesh(tp=n)
    par = ParallelConfig(tp_size=n, indexer_query_parallel_size=n, attention_query_parallel_size=n,
                         indexer_query_min_tokens=1, attention_query_min_tokens=1)
    ctx = par.sharding_context(mesh)
    rep = NamedSharding(mesh, P())
    f32 = jnp.float32
    sds = lambda shape, sh=rep, dt=f32: jax.ShapeDtypeStruct(shape, dt, sharding=sh)

    def stats(fn, *avals):
        compiled = jax.jit(fn).trace(*avals).lower().compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        text = compiled.as_text()
        return {"flops_per_device": float(cost.get("flops", 0.0)),
                "collective_bytes_per_device": collective_bytes(text),
                "collectives": sorted({c["op"] for c in collectives(text)})}

    out = {"devices": n, "rows": s, "entries": g, "index_topk": cfg.index_topk, "parts": {}}
    # ---- indexer
    ih, di, ql, h = cfg.index_n_heads, cfg.index_head_dim, cfg.q_lora_rank, cfg.hidden_size
    ind_avals = (sds((ql, ih, di)), sds((h, ih)), sds((1, s, h)), sds((1, s, ql)),
                 sds((1, s, cfg.qk_rope_head_dim // 2)), sds((1, g, di)))
    pos = jnp.arange(s)[None]
    base = stats(lambda wq, wp, x, qr, ang, k: select_positions(cfg, role, wq, wp, x, qr, ang, k, pos, None)[0],
                 *ind_avals)
    qcp = stats(lambda wq, wp, x, qr, ang, k: query_parallel_select(ctx, cfg, role, wq, wp, x, qr, ang, k, pos),
                *ind_avals)
    # ---- attention (16 heads: split over TP for the baseline)
    hq, d = cfg.num_attention_heads, cfg.head_dim
    widx, wvalid = window_indices(s, cfg.sliding_window)
    heads = NamedSharding(mesh, P(None, None, ("tp",), None))
    att_avals = (sds((1, s, hq, d), heads), sds((1, s, d)), sds((1, g, d)), sds((1, s, cfg.index_topk), rep, jnp.int32),
                 sds((hq,), NamedSharding(mesh, P(("tp",)))))
    a_base = stats(lambda q, kv, ckv, sel, sink: rows_sink_attention(q, kv, widx, wvalid, ckv, sel, sink), *att_avals)
    a_qcp = stats(lambda q, kv, ckv, sel, sink: query_parallel_attention(ctx, q, kv, widx, wvalid, ckv, sel, sink),
                  *att_avals)
    one = lambda avals: [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in avals]     # unsharded: one device
    i_one = stats(lambda wq, wp, x, qr, ang, k: select_positions(cfg, role, wq, wp, x, qr, ang, k, pos, None)[0],
                  *one(ind_avals))
    a_one = stats(lambda q, kv, ckv, sel, sink: rows_sink_attention(q, kv, widx, wvalid, ckv, sel, sink),
                  *one(att_avals))
    for name, u, b, q in (("indexer", i_one, base, qcp), ("attention", a_one, a_base, a_qcp)):
        out["parts"][name] = {
            "unsharded": u, "tp_baseline": b, "qcp": q,
            "flops_ratio_qcp_vs_unsharded": round(q["flops_per_device"] / max(u["flops_per_device"], 1.0), 4),
            "flops_ratio_tp_baseline_vs_unsharded": round(b["flops_per_device"] / max(u["flops_per_device"], 1.0), 4),
            "qcp_collective_bytes_per_row": round(q["collective_bytes_per_device"] / s, 2)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
