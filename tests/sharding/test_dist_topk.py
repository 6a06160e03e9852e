"""The distributed top-k and candidate-block selection equal the single-device selection exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from v41cp.layers.indexer import select_candidate_blocks, topk_select
from v41cp.sharding import make_mesh
from v41cp.sharding.dist_topk import candidate_mask, distributed_candidate_blocks, distributed_topk, merge_topk

pytestmark = pytest.mark.fast           # the developer tier (`pytest -m fast`)


def _split(n, epb, g, first_residue):
    """Entry ids ``[n, G/n]`` each rank owns under page-cyclic ownership (pages of ``epb`` entries), −1 padding."""
    pages = -(-g // epb)
    lt = -(-pages // n)
    out = np.full((n, lt * epb), -1, np.int32)
    for r in range(n):
        mine = [i for i in range(pages) if (i + first_residue) % n == r]
        ids = [i * epb + e for i in mine for e in range(epb) if i * epb + e < g]
        out[r, :len(ids)] = ids
    return out


def _run(n, scores, visible, k, kb, block_size, epb, first_residue=0):
    """Distributed selection on an n-rank cp mesh → (topk ids [B,k], kept blocks [B,kb])."""
    b, g = scores.shape
    ids = _split(n, epb, g, first_residue)                                    # [n, Gl]
    local_scores = np.where(ids[:, None, :] >= 0, scores[:, np.maximum(ids, 0)].transpose(1, 0, 2), -np.inf)
    mesh = make_mesh(tp=n, devices=jax.devices()[:n], cp=n)

    def body(sc, idl, vis):
        idl = jnp.broadcast_to(idl[0], (b, idl.shape[-1]))
        idl = jnp.where(idl < vis[:, None], idl, -1)
        blocks = distributed_candidate_blocks(sc[0], idl, vis, kb, block_size, g, "cp")
        top, _ = distributed_topk(sc[0], idl, k, "cp")
        return top, blocks

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("cp"), P("cp"), P()), out_specs=(P(), P())))
    return f(jnp.asarray(local_scores, jnp.float32), jnp.asarray(ids), jnp.asarray(visible))


def _reference(scores, visible, k, kb, block_size):
    g = scores.shape[1]
    allowed = np.arange(g)[None] < visible[:, None]
    s = jnp.where(allowed, scores, -jnp.inf)[:, None]
    mask = select_candidate_blocks(s, jnp.asarray(visible)[:, None, None], kb, block_size)[:, 0]
    top, _ = topk_select(s[:, 0], min(k, g))
    return np.asarray(top), np.asarray(mask) & allowed


CASES = [  # (n, G, epb, k, kb, block size): context < k, G not divisible by n, heavy ties
    (2, 96, 4, 8, 3, 2), (4, 37, 2, 8, 2, 2), (8, 61, 4, 16, 4, 4), (8, 5, 2, 8, 2, 2), (4, 64, 8, 4, 3, 16),
]


@pytest.mark.parametrize("n,g,epb,k,kb,bs", CASES)
@pytest.mark.parametrize("ties", ["none", "heavy", "all"])
def test_distributed_selection_equals_single_device(n, g, epb, k, kb, bs, ties):
    rng = np.random.default_rng(n * 1000 + g)
    b = 5
    scores = rng.normal(size=(b, g)).astype(np.float32)
    if ties == "heavy":        # ReLU-zero style ties: most scores exactly 0, the rest from 3 values
        scores = np.where(rng.random((b, g)) < 0.7, 0.0, rng.choice([-1.0, 0.5, 2.0], (b, g))).astype(np.float32)
    elif ties == "all":
        scores[:] = 1.0
    visible = np.array([0, 1, min(g, 3), g // 2 + 1, g])[:b].astype(np.int32)
    for first in range(min(n, 3)):
        top, blocks = _run(n, scores, visible, min(k, g), kb, bs, epb, first)
        want_top, want_mask = _reference(scores, visible, k, kb, bs)
        np.testing.assert_array_equal(np.asarray(top), want_top)
        got_mask = np.asarray(candidate_mask(blocks, jnp.broadcast_to(jnp.arange(g), (b, g)), bs, g))
        np.testing.assert_array_equal(got_mask & (np.arange(g)[None] < visible[:, None]), want_mask)


def test_merge_never_counts_padding_and_is_deterministic():
    """−1 padding (score −inf) is never selected — not even when it outnumbers real candidates — and the
    merge of one gathered buffer is identical over repeats; ties resolve to the lower logical id."""
    vals = jnp.asarray([[-jnp.inf, 1.0, -jnp.inf, 1.0, 0.5, -jnp.inf]])
    ids = jnp.asarray([[-1, 9, -1, 3, 7, -1]], jnp.int32)
    outs = [np.asarray(merge_topk(vals, ids, 5)[0]) for _ in range(5)]
    for o in outs:
        np.testing.assert_array_equal(o, [[3, 9, 7, -1, -1]])


@pytest.mark.parametrize("tile", [1, 3, 16])
def test_scan_topk_equals_topk_of_the_whole_row(tile):
    """The running top-k over tiles (ascending ids, ties everywhere, unlisted entries) equals `lax.top_k` of the
    whole row under the shared tie rule, and its block maxima equal the whole row's."""
    from v41cp.layers.topk_scan import scan_topk

    rng = np.random.default_rng(tile)
    rows, n, k, cbs = 5, 48, 7, 4
    scores = jnp.asarray(rng.integers(0, 4, (rows, n)).astype(np.float32))        # many exact ties
    ids = jnp.where(jnp.asarray(rng.random((rows, n)) < 0.2), -1, jnp.arange(n)[None])
    tiles = -(-n // tile)
    pad = tiles * tile - n
    sp = jnp.pad(scores, ((0, 0), (0, pad)))
    ip = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=-1)
    tile_of = lambda j: (jax.lax.dynamic_slice_in_dim(sp, j * tile, tile, 1), jax.lax.dynamic_slice_in_dim(ip, j * tile, tile, 1))
    vals, got, maxima = jax.jit(lambda: scan_topk(tile_of, tiles, rows, k, num_blocks=n // cbs, block_size=cbs))()
    masked = jnp.where(ids >= 0, scores, -jnp.inf)
    want_v, want_i = jax.lax.top_k(masked, k)
    want_i = jnp.where(want_v > -jnp.inf, want_i, -1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(want_v))
    np.testing.assert_array_equal(np.asarray(maxima), np.asarray(masked.reshape(rows, -1, cbs).max(-1)))


@pytest.mark.parametrize("static,more", [(0, 5), (2, 3), (16, 1)])
def test_scan_topk_continued_over_data_dependent_tiles_equals_topk_of_the_whole_row(static, more):
    """`scan_topk_more` continues a running top-k over a traced number of tiles (the Reindex scan's overflow): a
    static part then the rest in a loop equals `lax.top_k` of the whole row, ties included."""
    from v41cp.layers.topk_scan import scan_topk, scan_topk_more

    rng = np.random.default_rng(static + more)
    rows, n, k, tile = 5, 48, 7, 3
    scores = jnp.asarray(rng.integers(0, 4, (rows, n)).astype(np.float32))
    ids = jnp.where(jnp.asarray(rng.random((rows, n)) < 0.2), -1, jnp.arange(n)[None])
    head = min(static * tile, n)
    pad = head + -(-(n - head) // more) * more - n
    sp, ip = jnp.pad(scores, ((0, 0), (0, pad))), jnp.pad(ids, ((0, 0), (0, pad)), constant_values=-1)
    part = lambda start, size: (jax.lax.dynamic_slice_in_dim(sp, start, size, 1),
                                jax.lax.dynamic_slice_in_dim(ip, start, size, 1))

    def run(count):
        state = scan_topk(lambda j: part(j * tile, tile), head // tile, rows, k) if head else \
            (jnp.full((rows, k), -jnp.inf), jnp.full((rows, k), -1, jnp.int32), None)
        return scan_topk_more(lambda j: part(head + j * more, more), count, state, k)[:2]

    vals, got = jax.jit(run)(jnp.int32(-(-(n - head) // more)))
    masked = jnp.where(ids >= 0, scores, -jnp.inf)
    want_v, want_i = jax.lax.top_k(masked, k)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.where(want_v > -jnp.inf, want_i, -1)))
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(want_v))
