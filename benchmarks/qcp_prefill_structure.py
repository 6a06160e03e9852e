"""Model-wide QCP prefill, exact structure from the compiled programs (prints JSON; nothing is timed).

One long prompt (``--rows`` tokens) of a V4.1-like model at reduced width (tiny-tp8 widths, index top-512,
window 128, 16 heads) on ``--devices`` simulated CPU devices, attention TP = QCP = all of them:

* **parts** — the one model's layer modules over model-wide QCP's rows backend (`v41cp.serving.attention.qcp_rows`, the
  `v41cp.sharding.row_group.RowGroup` shard) compiled alone, unsharded (the same map over one device, every
  row) and under QCP (each rank its zigzag rows): *attention* = a Reuse layer's `Attention` (projections,
  window + selected-entry attention, ring writes), *indexer* = a Reindex layer minus that Reuse layer (the
  same attention plus the index projections, scores and top-k), *moe* = the `MoE` FFN (rows gathered, each rank
  its slice of every expert's and the shared expert's width, reduce-scatter);
* **whole** — the complete `prefill_span` program (every layer, caches, sampled-row head), over the ``n`` ranks
  and over one device (a one-rank group).

Per program: per-device FLOPs from XLA's cost analysis (loops per iteration: `program_cost`), the QCP / unsharded ratio, and the result bytes per
device of the collectives (`v41cp.sharding.hlo_stats`) per prefill token, in total and by collective kind.
``python benchmarks/qcp_prefill_structure.py --devices 8 --rows 4096``
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--skip-whole", action="store_true", help="only the per-part programs")
    a = p.parse_args()
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={a.devices}")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print(json.dumps(measure(a.devices, a.rows, whole=not a.skip_whole), indent=1))


def measure(devices: int, rows: int, parts=("reuse", "reindex", "moe"), whole: bool = True) -> dict:
    """The structure numbers above for one ``rows``-token prompt over ``devices`` ranks (jax must already see
    that many devices). ``parts``: which layer programs to compile ("reindex" needs "reuse")."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from v41cp import model
    from v41cp.config import preset
    from v41cp.layers.attention import Attention, CSAState
    from v41cp.layers.moe import MoE
    from v41cp.serving.attention.qcp_rows import QCPRows
    from v41cp.serving.runner.span_batch import build_span_batch
    from v41cp.serving.runner.span_prefill import SpanLayout, lower_prefill_span, qcp_batch_spec
    from v41cp.serving.runner.steps import init_cache
    from v41cp.sharding import make_mesh
    from v41cp.sharding.hlo_stats import collective_bytes, collectives, program_cost
    from v41cp.sharding.row_group import RowGroup
    from v41cp.sharding.rules import QCP_RULES, param_shardings
    from v41cp.sharding.topology import ParallelConfig

    n, t = devices, rows
    cfg = preset("tiny-tp8", index_topk=512, sliding_window=128, num_attention_heads=16, o_groups=8,
                 fake_quant=False, engram_token_map=tuple(min(i, 135) for i in range(256)))
    par = ParallelConfig(tp_size=n, query_context_parallel_size=n)
    mesh = par.make_mesh()
    layout = SpanLayout.from_parallel(par, mesh)
    axes = layout.axes
    params = model.init_params(cfg, jax.random.key(0))
    specs = lambda m: jax.tree.map(lambda s: s.spec, param_shardings(model.abstract_params(cfg), m, QCP_RULES),
                                   is_leaf=lambda x: isinstance(x, NamedSharding))
    one = make_mesh(tp=1, devices=jax.devices()[:1])
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, t).tolist()
    nb, bt = -(-t // 16), 16
    table = np.arange(nb, dtype=np.int32)[None]

    def stats(compiled, tokens: int) -> dict:
        cost = program_cost(compiled)                 # loop bodies counted per iteration
        text = compiled.as_text()
        b = collective_bytes(text)
        by_op: dict[str, int] = {}
        for c in collectives(text):
            by_op[c["op"]] = by_op.get(c["op"], 0) + c["bytes"]
        return {"flops_per_device": float(cost.get("flops", 0.0)), "collective_bytes_per_device": b,
                "collective_bytes_per_token": round(b / tokens, 2),
                "collective_bytes_per_token_by_op": {k: round(v / tokens, 2) for k, v in sorted(by_op.items())},
                "collectives": sorted(by_op)}

    roles = cfg.layer_roles
    reuse = next(r for r in roles if r.kind == "reuse")
    reindex = next(r for r in roles if r.kind == "reindex" and r.kv_source == reuse.kv_source
                   and not r.uses_candidates)
    g = t // reuse.ratio
    k = min(cfg.index_topk, g)
    rng = np.random.default_rng(1)

    def part(fn_name: str, qcp: bool):
        """One layer part of the one model (`Attention` / `MoE` over `QCPRows`) in the QCP map over ``n`` ranks,
        or the same map over one device (unsharded)."""
        ranks = n if qcp else 1
        pmesh, gaxes = (mesh, axes) if qcp else (one, ("tp",))
        meta = build_span_batch(cfg, [prompt], ranks, query_parallel=True, block_tables=table, span=t)
        c = meta.rows
        x = jnp.asarray(rng.normal(size=(ranks, c, cfg.hidden_size)), jnp.float32)
        state = CSAState(ckv=jnp.asarray(rng.normal(size=(1, g, cfg.head_dim)), jnp.float32),
                         ikeys=jnp.asarray(rng.normal(size=(1, g, cfg.index_head_dim)), jnp.float32),
                         topk=jnp.asarray(rng.integers(0, g, (ranks, c, k)), jnp.int32))
        cache = init_cache(cfg, nb, bt, 1, records=False)
        grp = RowGroup(pmesh, gaxes)
        i = reuse.index if fn_name != "reindex" else reindex.index

        def body(lp, x, meta, cache, state):
            if fn_name == "moe":
                return MoE(cfg, grp).apply({"params": lp["ffn"]}, x)
            role = reuse if fn_name == "reuse" else reindex
            y, _, _ = Attention(cfg, role, grp).apply({"params": lp["attn"]}, x, state, QCPRows(cfg, grp, meta, cache, 1),
                                                      cache)
            return y

        lp = params[f"layers_{i}"]
        rank = P(gaxes)
        mspec = qcp_batch_spec(meta, rank)
        sspec = CSAState(ckv=P(), ikeys=P(), topk=rank)
        f = jax.shard_map(body, mesh=pmesh, in_specs=(specs(pmesh)[f"layers_{i}"], rank, mspec,
                                                      jax.tree.map(lambda _: P(), cache), sspec), out_specs=rank)
        with jax.default_matmul_precision("highest"):
            return stats(jax.jit(f).trace(lp, x, meta, cache, state).lower().compile(), t)

    out = {"devices": n, "rows": t, "entries": g, "index_topk": k, "parts": {}}
    progs = {(name, q): part(name, q) for name in parts for q in (False, True)}
    ratio = lambda q, u: round(q / max(u, 1.0), 4)
    fl = lambda name, q: progs[name, q]["flops_per_device"]
    if "reuse" in parts:
        out["parts"]["attention"] = {"unsharded": progs["reuse", False], "qcp": progs["reuse", True],
                                     "flops_ratio_qcp_vs_unsharded": ratio(fl("reuse", True), fl("reuse", False))}
    if "reindex" in parts:
        out["parts"]["indexer"] = {
            "flops_unsharded": fl("reindex", False) - fl("reuse", False),
            "flops_qcp_per_device": fl("reindex", True) - fl("reuse", True),
            "flops_ratio_qcp_vs_unsharded": ratio(fl("reindex", True) - fl("reuse", True),
                                                  fl("reindex", False) - fl("reuse", False)),
            "collective_bytes_per_token": progs["reindex", True]["collective_bytes_per_token"]}
    if "moe" in parts:
        out["parts"]["moe"] = {"unsharded": progs["moe", False], "qcp": progs["moe", True],
                               "flops_ratio_qcp_vs_unsharded": ratio(fl("moe", True), fl("moe", False))}
    if whole:
        done = {}
        for q in (False, True):          # the QCP program over n ranks, and the same program over one device
            meta = build_span_batch(cfg, [prompt], n if q else 1, query_parallel=True, block_tables=table, span=t)
            m = mesh if q else one
            cache = init_cache(cfg, nb, bt, 1, NamedSharding(m, P()), records=False)
            prm = model.shard_params(params, cfg, m, par.rules())
            done[q] = stats(lower_prefill_span(prm, cache, meta, cfg, SpanLayout(m, query_parallel=True)).compile(), t)
        out["whole"] = {"unsharded": done[False], "qcp": done[True],
                        "flops_ratio_qcp_vs_unsharded": ratio(done[True]["flops_per_device"],
                                                              done[False]["flops_per_device"])}
    return out


if __name__ == "__main__":
    main()
