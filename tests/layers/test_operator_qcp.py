"""Operator-local QCP in the full-sequence forward == the unsharded forward (logits, every block input and every
layer's selection), above and below the row thresholds:

* indexer QCP — query rows interleaved over attention TP, top-k ids gathered back in row order;
* attention QCP — local heads of every row traded (all-to-all) for all heads of a contiguous row block, and back.
"""

import jax
import numpy as np
from helpers import REPO, TOKEN_MAP, perturbed, rel_err

from v41cp import model
from v41cp.config import preset
from v41cp.sharding import make_mesh
from v41cp.sharding.operator_qcp import attention_query_parallel_applies, indexer_query_parallel_applies
from v41cp.sharding.topology import ParallelConfig


def _intermediates(tree, name):
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat if name in jax.tree_util.keystr(k)}


def test_operator_local_qcp_equals_unsharded_above_and_below_thresholds():
    cfg = preset("tiny-tp8", engram_token_map=TOKEN_MAP)
    params = perturbed(model.init_params(cfg, jax.random.key(0)))
    tokens = np.random.default_rng(1).integers(3, cfg.vocab_size, (2, 37))      # 74 rows: not a multiple of N
    want, want_h, want_i = model.forward_debug(params, cfg, tokens)
    for n, low in ((8, True), (2, False)):
        t = 1 if low else 75                                                    # 75 > 74 rows: below every threshold
        par = ParallelConfig(tp_size=n, indexer_query_parallel_size=n, attention_query_parallel_size=n,
                             indexer_query_min_tokens=t, attention_query_min_tokens=t,
                             attention_query_swa_min_tokens=1 if low else 10**6)
        mesh = make_mesh(tp=n, devices=jax.devices()[:n])
        ctx = par.sharding_context(mesh)
        sharded = model.shard_params(params, cfg, mesh, par.rules())
        got, got_h, got_i = model.forward_debug(sharded, cfg, tokens, shard=ctx)
        assert rel_err(got, want) <= 1e-5 and rel_err(got_h, want_h) <= 1e-5
        topk, want_topk = _intermediates(got_i, "topk"), _intermediates(want_i, "topk")
        assert topk.keys() == want_topk.keys()
        for k in topk:
            np.testing.assert_array_equal(topk[k], want_topk[k], err_msg=k)
        roles = cfg.layer_roles
        idx = [r.index for r in roles if r.is_index_source and indexer_query_parallel_applies(ctx, r, 74)]
        att = [r.index for r in roles if attention_query_parallel_applies(ctx, cfg, r, 74)]
        assert idx == ([1, 3] if low else [])       # never the candidate source (4) or its Reindex (5)
        assert att == (list(range(cfg.num_hidden_layers)) if low else [])
        # the indexer QCP path never materializes a layer's full score matrix
        scored = sorted(int(k.split("layers_")[1].split("'")[0]) for k in _intermediates(got_i, "index_scores"))
        assert scored == sorted({1, 3, 4, 5} - set(idx))
        if low:       # the exchange is in the program: two all-to-alls per layer
            text = model._apply.lower(sharded, np.asarray(tokens, np.int32), model.engram_inputs(cfg, tokens), cfg,
                                      ctx, "debug").as_text()
            assert text.count("all_to_all") == 2 * cfg.num_hidden_layers


def test_per_device_flops_fall_to_one_nth():
    """Compiled cost analysis of one long prefill (benchmarks/operator_qcp_structure.py): indexer QCP divides the
    per-device indexer FLOPs by N (the replicated baseline does not); attention QCP keeps head-sharded TP's 1/N
    with rows instead of heads; the id gather moves exactly K = min(index_topk, entries) int32 per row."""
    import json
    import subprocess
    import sys

    script = REPO / "benchmarks" / "operator_qcp_structure.py"
    res = subprocess.run([sys.executable, str(script), "--devices", "8", "--rows", "512"], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    parts = json.loads(res.stdout)["parts"]
    assert abs(parts["indexer"]["flops_ratio_qcp_vs_unsharded"] - 1 / 8) <= 0.01
    assert parts["indexer"]["flops_ratio_tp_baseline_vs_unsharded"] == 1.0
    assert abs(parts["attention"]["flops_ratio_qcp_vs_unsharded"] - 1 / 8) <= 0.01
    assert parts["indexer"]["qcp_collective_bytes_per_row"] == min(512, 512 // 2) * 4     # K = min(top-k, entries)


def test_span_prefill_operator_qcp_moves_only_the_seed_exchanges():
    """Operator-local QCP in the span prefill (benchmarks/span_operator_qcp_structure.py: TP 4, 22 rows — not a
    multiple of N): the compiled program's all-to-alls are exactly the two row-block exchanges of every layer, its
    islands' all-gathers exactly the sink and top-k id gathers, and it moves no more bytes than plain TP plus them."""
    import json
    import subprocess
    import sys

    script = REPO / "benchmarks" / "span_operator_qcp_structure.py"
    res = subprocess.run([sys.executable, str(script), "--devices", "4", "--rows", "22"], capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["layers"] == {"attention": [0, 1, 2, 3, 4, 5], "indexer": [1, 3]}
    qcp, tp, want = out["operator_qcp"], out["tp"], out["expected_exchange_bytes"]
    # the islands' own collectives (the partitioner's TP collectives, the same in both programs, are bounded below)
    assert qcp["island_count"] == {"all-to-all": 2 * 6, "all-gather": 6 + 2}
    assert qcp["island_bytes"]["all-to-all"] == want["all-to-all"]
    assert qcp["island_bytes"]["all-gather"] == want["all-gather"]
    assert qcp["count"]["all-to-all"] == 2 * 6
    assert qcp["total_bytes"] <= tp["total_bytes"] + sum(want.values())
