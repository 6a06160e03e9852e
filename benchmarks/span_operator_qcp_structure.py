"""Operator-local QCP in the span prefill: exact structure from the compiled programs (prints JSON; nothing is timed).

One span-prefill pass (`v41cp.serving.runner.span_prefill.lower_prefill_span`) of ``--rows`` rows (one prompt) of the
``tiny-tp8`` model over ``--devices`` simulated CPU devices (attention TP = all of them), compiled twice:

* ``tp`` — plain TP: every rank computes every row with its heads;
* ``operator_qcp`` — operator-local indexer and attention QCP on every layer they apply to (row thresholds 1).

Per program: the count and the per-device result bytes of every collective (`v41cp.sharding.hlo_stats`), and of
those written in the QCP islands (``island_*``: the partitioner's TP collectives left out). And the exchanges the
seed describes for operator-local QCP, computed from the shapes:

* attention QCP, per layer: two all-to-alls of the query rows and of the outputs, each
  ``⌈R/N⌉ · Hq · D · itemsize`` bytes per device (a rank's row block with every head), and the all-gather of the
  head-sharded sink ``Hq · 4``;
* indexer QCP, per ordinary index layer: the all-gather of the top-k ids back to row order,
  ``⌈R/N⌉ · N · K · 4`` bytes (``K = min(index_topk, entries of the history capacity)``).

``python benchmarks/span_operator_qcp_structure.py --devices 4 --rows 64``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--rows", type=int, default=64)
    a = p.parse_args()
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={max(a.devices, 8)}")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from v41cp import model
    from v41cp.config import preset
    from v41cp.serving.cache.device_cache import init_cache
    from v41cp.serving.cache.paged import entries_per_block
    from v41cp.serving.runner.span_batch import build_span_batch
    from v41cp.serving.runner.span_prefill import SpanLayout, lower_prefill_span
    from v41cp.sharding.hlo_stats import collectives
    from v41cp.sharding.operator_qcp import attention_query_parallel_applies, indexer_query_parallel_applies
    from v41cp.sharding.topology import ParallelConfig

    n, rows, block = a.devices, a.rows, 4
    cfg = preset("tiny-tp8", fake_quant=False, engram_token_map=tuple(min(i, 135) for i in range(256)))
    params = model.init_params(cfg, jax.random.key(0))
    blocks = -(-rows // block)
    tables = np.arange(blocks, dtype=np.int32)[None]
    meta = build_span_batch(cfg, [[3 + i % 200 for i in range(rows)]], 1, block_tables=tables, span=rows)
    out, layers = {}, {}
    for name, op in (("tp", 1), ("operator_qcp", n)):
        par = ParallelConfig(tp_size=n, indexer_query_parallel_size=op, attention_query_parallel_size=op,
                             indexer_query_min_tokens=1, attention_query_min_tokens=1,
                             attention_query_swa_min_tokens=1)
        mesh = par.make_mesh(jax.devices()[:n])
        cache = init_cache(cfg, blocks, block, 1, NamedSharding(mesh, P()))
        layout = SpanLayout.from_parallel(par, mesh)
        hlo = lower_prefill_span(model.shard_params(params, cfg, mesh, par.rules()), cache, meta, cfg,
                                 layout).compile().as_text()
        cs = collectives(hlo)
        ops = sorted({c["op"] for c in cs})
        isl = [c for c in cs if "shard_map" in c["name"]]          # written in the QCP islands
        out[name] = {"count": dict(Counter(c["op"] for c in cs)),
                     "bytes": {k: sum(c["bytes"] for c in cs if c["op"] == k) for k in ops},
                     "total_bytes": sum(c["bytes"] for c in cs),
                     "island_count": dict(Counter(c["op"] for c in isl)),
                     "island_bytes": {k: sum(c["bytes"] for c in isl if c["op"] == k) for k in sorted({c["op"] for c in isl})}}
        if layout.operator is not None:
            roles = cfg.layer_roles
            layers = {"attention": [r.index for r in roles
                                    if attention_query_parallel_applies(layout.operator, cfg, r, rows)],
                      "indexer": [r.index for r in roles
                                  if r.is_index_source and indexer_query_parallel_applies(layout.operator, r, rows)]}
            src = str(next(r for r in roles if r.is_kv_source and r.ratio > 0).index)
            entries = blocks * entries_per_block(cache.pool("ikey")[src])
    local = -(-rows // n)
    k = min(cfg.index_topk, entries)
    hq, d, item = cfg.num_attention_heads, cfg.head_dim, np.dtype(cfg.dtype).itemsize
    expected = {"all-to-all": len(layers["attention"]) * 2 * local * hq * d * item,
                "all-gather": len(layers["attention"]) * hq * 4 + len(layers["indexer"]) * local * n * k * 4}
    qcp = out["operator_qcp"]
    out.update({
        "devices": n, "rows": rows, "layers": layers, "expected_exchange_bytes": expected,
        "exchange_bytes_per_row": (qcp["island_bytes"].get("all-to-all", 0)
                                   + qcp["island_bytes"].get("all-gather", 0)) / rows,
        "extra_bytes_per_row_vs_tp": (qcp["total_bytes"] - out["tp"]["total_bytes"]) / rows,
    })
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
