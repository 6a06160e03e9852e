"""The prefill rows' memory-bounded selection / attention (`v41cp.layers.tiled_select`) equal the whole-matrix
reference (`select_scored`, `sink_attention` over gathered keys) exactly: row and key tiles of every size down to
one row / one key, one request or several, candidate source and users, exact score ties, rows that see nothing."""

import jax.numpy as jnp
import numpy as np
import pytest

from v41cp.config import preset
from v41cp.kernels.sparse_attention.reference import sink_attention
from v41cp.layers.indexer import select_scored
from v41cp.layers.tiled_select import attend_rows, causal_steps, select_rows
from v41cp.sharding.dist_topk import candidate_mask

pytestmark = pytest.mark.fast           # the developer tier (`pytest -m fast`)

CFG = preset("tiny", index_topk=5, candidate_topk_blocks=3, candidate_block_size=2)
ROLES = {r.index: r for r in CFG.layer_roles}


def _inputs(rng, b, g, r, ties: bool):
    hi, di = CFG.index_n_heads, CFG.index_head_dim
    q = rng.standard_normal((r, hi, di)).astype(np.float32)
    w = rng.standard_normal((r, hi)).astype(np.float32)
    keys = rng.standard_normal((b, g, di)).astype(np.float32)
    if ties:                                  # repeated keys: exact score ties across tiles
        keys[:, g // 2:] = keys[:, : g - g // 2]
    req = rng.integers(0, b, r).astype(np.int32)
    pos = rng.integers(-1, 2 * g, r).astype(np.int32)          # −1: a row that sees nothing
    return q, w, keys, req, pos


@pytest.mark.parametrize("bound", ["none", "sum", "short"])
@pytest.mark.parametrize("b,budget,rows", [(1, 1 << 12, 7), (1, 1 << 30, 256), (3, 1 << 12, 1), (3, 1, 16)])
def test_select_rows_equals_whole_matrix_selection(b, budget, rows, bound):
    """``bound``: no causal schedule (every row tile × key tile); the rows' visible entries summed (the schedule's
    static steps cover every needed tile); a bound of 0 (the static steps run out: the continuation finishes)."""
    rng = np.random.default_rng(b + budget % 7)
    g, r = 24, 40
    q, w, keys, req, pos = _inputs(rng, b, g, r, ties=True)
    src, user, plain = ROLES[4], ROLES[5], ROLES[1]            # ratio 1 candidate source / user, ratio 2 source

    def reference(role, cand_mask):
        topk, cand, _ = select_scored(CFG, role, jnp.asarray(q)[:, None], jnp.asarray(w)[:, None],
                                      jnp.asarray(keys)[req], jnp.asarray(pos)[:, None], cand_mask)
        return np.asarray(topk[:, 0]), cand

    for role in (plain, src):
        want, want_cand = reference(role, None)
        total = {"none": None, "sum": int(np.sum(np.maximum(pos + 1, 0) // role.ratio)), "short": 0}[bound]
        got, blocks = select_rows(CFG, role, jnp.asarray(q), jnp.asarray(w), jnp.asarray(keys), jnp.asarray(req),
                                  jnp.asarray(pos), None, budget=budget, rows_per_tile=rows, visible_total=total)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=role.kind)
        if role.candidate_source:
            mask = candidate_mask(blocks, jnp.broadcast_to(jnp.arange(g), (r, g)), CFG.candidate_block_size, g)
            mask = mask & (jnp.arange(g)[None] < ((jnp.asarray(pos) + 1) // role.ratio)[:, None])   # as the reference
            np.testing.assert_array_equal(np.asarray(mask), np.asarray(want_cand[:, 0]))
            want_user, _ = reference(user, want_cand)
            got_user, same = select_rows(CFG, user, jnp.asarray(q), jnp.asarray(w), jnp.asarray(keys),
                                         jnp.asarray(req), jnp.asarray(pos), blocks, budget=budget,
                                         rows_per_tile=rows)
            np.testing.assert_array_equal(np.asarray(got_user), want_user)
            assert same is blocks


def test_causal_steps_cover_every_row_tiles_visible_key_tiles():
    """The causal schedule's static step count bounds what ascending row tiles need (random visibility patterns:
    uniform, a fresh pass's triangle, all rows at the end, padding rows seeing nothing)."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        g, r = int(rng.integers(1, 300)), int(rng.integers(1, 200))
        rt, per = int(rng.integers(1, r + 1)), int(rng.integers(1, g + 1))
        kind = rng.integers(0, 3)
        vis = {0: rng.integers(0, g + 1, r), 1: np.minimum(np.arange(r) * g // r + 1, g), 2: np.full(r, g)}[kind]
        vis = np.where(rng.random(r) < 0.1, 0, vis)
        row_tiles, tiles = -(-r // rt), -(-g // per)
        s = np.pad(np.sort(vis), (row_tiles * rt - r, 0)).reshape(row_tiles, rt)        # padding rows first
        need = np.clip(-(-s.max(axis=1) // per), 1, tiles)
        assert need.sum() <= causal_steps(int(vis.sum()), rt, per, tiles, row_tiles)


def test_attend_rows_equals_gathered_attention():
    rng = np.random.default_rng(3)
    b, g, r, h, d, wlen, k = 2, 10, 13, 4, 8, 3, 4
    q = jnp.asarray(rng.standard_normal((r, h, d)), jnp.float32)
    win = jnp.asarray(rng.standard_normal((r, wlen, d)), jnp.float32)
    valid = jnp.asarray(rng.random((r, wlen)) < 0.7)
    ckv = jnp.asarray(rng.standard_normal((b, g, d)), jnp.float32)
    req = jnp.asarray(rng.integers(0, b, r), jnp.int32)
    topk = jnp.asarray(np.where(rng.random((r, k)) < 0.8, rng.integers(0, g, (r, k)), -1), jnp.int32)
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    keys = jnp.concatenate([win, ckv[req[:, None], jnp.maximum(topk, 0)]], axis=1)
    want = sink_attention(q[None], keys[None], jnp.concatenate([valid, topk >= 0], axis=1)[None], sink)[0]
    for budget in (1, 4096, 1 << 30):                          # 1 row per tile, a few, all rows
        got = attend_rows(q, lambda rows: win[rows], valid, ckv, req, topk, sink, budget=budget)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)
