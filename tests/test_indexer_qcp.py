"""Operator-local indexer QCP (query rows interleaved over attention TP, top-k ids gathered back) in the
full-sequence forward == the unsharded forward: logits and every layer's selection, above and below the
row threshold."""

import jax
import numpy as np

from helpers import TOKEN_MAP, perturbed, rel_err
from v41cp import model
from v41cp.config import preset
from v41cp.layers.indexer import query_parallel_applies
from v41cp.sharding import make_mesh
from v41cp.sharding.topology import ParallelConfig


def _intermediates(tree, name):
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat if name in jax.tree_util.keystr(k)}


def test_indexer_query_parallel_equals_unsharded_above_and_below_threshold():
    cfg = preset("tiny-tp8", engram_token_map=TOKEN_MAP)
    params = perturbed(model.init_params(cfg, jax.random.key(0)))
    tokens = np.random.default_rng(1).integers(3, cfg.vocab_size, (2, 37))      # 37 rows: not a multiple of N
    want, _, want_i = model.forward_debug(params, cfg, tokens)
    for n, min_tokens in ((8, 1), (2, 75)):                                       # 75 > 2·37 rows: below threshold
        par = ParallelConfig(tp_size=n, indexer_query_parallel_size=n, indexer_query_min_tokens=min_tokens)
        mesh = make_mesh(tp=n, devices=jax.devices()[:n])
        ctx = par.sharding_context(mesh)
        got, _, got_i = model.forward_debug(model.shard_params(params, cfg, mesh, par.rules()), cfg, tokens, shard=ctx)
        assert rel_err(got, want) <= 1e-5
        topk, want_topk = _intermediates(got_i, "topk"), _intermediates(want_i, "topk")
        assert topk.keys() == want_topk.keys()
        for k in topk:
            np.testing.assert_array_equal(topk[k], want_topk[k], err_msg=k)
        applied = [r.index for r in cfg.layer_roles if r.is_index_source and query_parallel_applies(ctx, r, 74)]
        assert applied == ([1, 3] if min_tokens == 1 else [])      # not the candidate source 4 / its Reindex 5
        # the QCP path never materializes a layer's full score matrix: only the other index layers sow scores
        scored = sorted(int(k.split("layers_")[1].split("'")[0]) for k in _intermediates(got_i, "index_scores"))
        assert scored == sorted({1, 3, 4, 5} - set(applied))
