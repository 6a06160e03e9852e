"""Memory-bounded index selection and sparse attention of many query rows (a prefill pass's rows) against their
requests' histories: no intermediate grows as rows × history.

* `select_rows` — rows ``[R]`` (each of request ``req[r]`` at position ``pos[r]``) score their request's index
  keys in row tiles × key tiles with a running top-k (`v41cp.layers.topk_scan`), under the shared tie rule, so
  the selection equals `v41cp.layers.indexer.select_scored` over the whole ``[R, G]`` score matrix. The
  candidate source keeps running block maxima and selects its blocks from them; a layer using the candidates
  scores only the kept blocks' entries (tiles of whole kept blocks, ascending). Candidates travel as kept block
  ids ``[R, kb]`` (−1 padding), not as ``[R, G]`` masks.
* `attend_rows` — sink attention of the rows in row tiles, each tile gathering its own window keys and selected
  entries: temporaries of one tile, not ``[R, W + K, D]``.

Temporaries per tile: about `ROW_TILE_BYTES`. Tiles run in ``lax.fori_loop``s (one compiled body;
`v41cp.sharding.hlo_stats.program_cost` counts every iteration) whose output buffers are allocated with their
layer (`v41cp.layers.common.full_after`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v41cp.config import LayerRole, ModelConfig
from v41cp.kernels.indexer_topk.reference import index_scores
from v41cp.kernels.sparse_attention.reference import sink_attention
from v41cp.layers.common import stacked_loop
from v41cp.layers.topk_scan import scan_topk, tile_count
from v41cp.sharding.dist_topk import merge_blocks

__all__ = ["select_rows", "attend_rows", "ROW_TILE_BYTES", "ROWS_PER_TILE"]

ROW_TILE_BYTES = 512 << 20        # temporaries of one (row tile × key tile) step
ROWS_PER_TILE = 256               # query rows per selection tile (their running top-k and block maxima)


def _row_tiles(n: int, per_row_bytes: int, budget: int) -> tuple[int, int]:
    """(rows per tile, tiles) for ``n`` rows at ``per_row_bytes`` each within ``budget`` (balanced tiles)."""
    rows = max(1, min(n, budget // max(1, per_row_bytes)))
    tiles = -(-n // rows)
    return -(-n // tiles), tiles


def _pad_rows(a: jax.Array, total: int, value=0) -> jax.Array:
    return jnp.pad(a, ((0, total - a.shape[0]),) + ((0, 0),) * (a.ndim - 1), constant_values=value)


def select_rows(cfg: ModelConfig, role: LayerRole, q: jax.Array, weights: jax.Array, keys: jax.Array,
                req: jax.Array, pos: jax.Array, cand_blocks: jax.Array | None, budget: int = ROW_TILE_BYTES,
                rows_per_tile: int = ROWS_PER_TILE):
    """Index selection of query rows.

    Args:
      q ``[R, Hi, Di]`` / weights ``[R, Hi]``: the rows' index queries and weights (`index_query`).
      keys ``[B, G, Di]``: every request's index keys in entry order (entries past a row's history are masked).
      req / pos ``[R]``: each row's request and position (rows of a padding request: any value; their result is
        unused). cand_blocks ``[R, kb]``: the candidate source's kept blocks (uses_candidates layers) or None.
      budget: temporaries of one (row tile × key tile) step in bytes; rows_per_tile: query rows per tile.
    Returns ``(topk [R, min(index_topk, G)] int32 (−1 padding), kept blocks [R, kb] of the candidate source, or
    the input)`` — equal to `select_scored`'s selection (and its candidate mask as blocks).
    """
    r, hi, di = q.shape
    b, g = keys.shape[:2]
    k = min(cfg.index_topk, g)
    cbs = cfg.candidate_block_size
    nb = -(-g // cbs)
    shared = b == 1                                        # one request: its keys are read once per tile
    visible = (pos + 1) // role.ratio                                                    # [R]
    uses = role.uses_candidates and cand_blocks is not None
    kb = cand_blocks.shape[1] if uses else 0
    # per (row, key) pair: the key copy (per row unless shared) and the per-head FP32 terms of the score loops
    pair = 4 * (3 * hi + (0 if shared and not uses else di))
    rt = min(r, rows_per_tile)
    if role.candidate_source:              # running block maxima and their selection: ~24 B per (row, block)
        rt = min(rt, max(1, budget // (24 * nb)))
    row_tiles = -(-r // rt)
    rp = rt * row_tiles
    tiles_q = _pad_rows(q, rp).reshape(row_tiles, rt, hi, di)
    tiles_w = _pad_rows(weights, rp).reshape(row_tiles, rt, hi)
    tiles_req = _pad_rows(jnp.clip(req, 0, b - 1), rp).reshape(row_tiles, rt)
    tiles_vis = _pad_rows(visible, rp).reshape(row_tiles, rt)
    tiles_cand = _pad_rows(cand_blocks, rp, -1).reshape(row_tiles, rt, kb) if uses else None

    def history_tile(qt, wt, rq, vis):
        per, tiles = tile_count(g, 1, pair * rt, budget)

        def score_tile(j):
            ids = j * per + jnp.arange(per)                                             # [T]
            if shared:
                kt = jnp.take(keys[0], jnp.minimum(ids, g - 1), axis=0)                    # [T, Di]
                scores = index_scores(qt[None], wt[None], kt[None])[0]                 # [rt, T]
            else:
                kt = keys[rq[:, None], jnp.minimum(ids, g - 1)[None]]                  # [rt, T, Di]
                scores = index_scores(qt[:, None], wt[:, None], kt)[:, 0]
            ok = (ids[None] < vis[:, None]) & (ids[None] < g)
            return scores, jnp.where(ok, ids[None], -1)

        vals, gid, maxima = scan_topk(score_tile, tiles, rt, k, num_blocks=nb if role.candidate_source else None,
                                      block_size=cbs, carry_like=(qt, wt, rq, vis, keys))
        blocks = None
        if role.candidate_source:
            blocks = merge_blocks(maxima, jnp.broadcast_to(jnp.arange(nb), maxima.shape), vis,
                                  cfg.candidate_topk_blocks, cbs, nb)
        return gid, blocks

    def kept_tile(qt, wt, rq, vis, cand):
        # only the kept blocks' entries, in tiles of whole blocks in ascending order (the running top-k's order)
        kept = jnp.sort(jnp.where(cand >= 0, cand, jnp.iinfo(jnp.int32).max), axis=1)
        per, tiles = tile_count(kb * cbs, cbs, pair * rt, budget)
        kept = jnp.pad(kept, ((0, 0), (0, per * tiles - kb)), constant_values=jnp.iinfo(jnp.int32).max)

        def score_tile(j):
            blocks = jax.lax.dynamic_slice_in_dim(kept, j * per, per, axis=1)             # [rt, per]
            real = blocks < nb
            ids = (jnp.where(real, blocks, 0)[..., None] * cbs + jnp.arange(cbs)).reshape(rt, -1)
            ok = jnp.repeat(real, cbs, axis=1) & (ids < vis[:, None]) & (ids < g)
            kt = keys[rq[:, None], jnp.minimum(ids, g - 1)]                              # [rt, per·cbs, Di]
            return index_scores(qt[:, None], wt[:, None], kt)[:, 0], jnp.where(ok, ids, -1)

        vals, gid, _ = scan_topk(score_tile, tiles, rt, k, carry_like=(qt, wt, rq, vis, cand, keys))
        return gid

    if uses:
        topk = stacked_loop(lambda t: (kept_tile(*t),), row_tiles,
                            (tiles_q, tiles_w, tiles_req, tiles_vis, tiles_cand), (jnp.full((rt, k), -1, jnp.int32),),
                            like=(keys,))[0]
        return topk.reshape(rp, k)[:r], cand_blocks
    kb_src = min(cfg.candidate_topk_blocks, nb)
    outs = (jnp.full((rt, k), -1, jnp.int32),) + ((jnp.full((rt, kb_src), -1, jnp.int32),) if role.candidate_source
                                                  else ())
    got = stacked_loop(lambda t: tuple(x for x in history_tile(*t) if x is not None), row_tiles,
                       (tiles_q, tiles_w, tiles_req, tiles_vis), outs, like=(keys,))
    topk = got[0].reshape(rp, k)[:r]
    if role.candidate_source:
        return topk, got[1].reshape(rp, -1)[:r]
    return topk, cand_blocks


def attend_rows(q: jax.Array, window_keys, window_valid: jax.Array, ckv: jax.Array | None, req: jax.Array,
                topk: jax.Array | None, sink: jax.Array, budget: int = ROW_TILE_BYTES,
                window_operands: tuple = ()) -> jax.Array:
    """Sink attention of query rows ``q [R, H, D]`` in row tiles.

    ``window_keys(rows) → [T, W, D]``: the window keys of flat rows ``rows [T]`` (gathered per tile), from the arrays
    ``window_operands``;
    ``window_valid [R, W]``; ``ckv [B, G, D]`` every request's compressed entries, ``req [R]`` each row's request
    and ``topk [R, K]`` its selected entries (−1 padding), or None (no compressed entries). Returns ``[R, H, D]``.
    """
    r, h, d = q.shape
    w = window_valid.shape[1]
    kk = topk.shape[1] if topk is not None else 0
    per_row = 4 * ((w + kk) * (d + 2 * h) + h * d)
    rt, tiles = _row_tiles(r, per_row, budget)
    rp = rt * tiles
    qs = _pad_rows(q, rp).reshape(tiles, rt, h, d)

    def tile(i):
        rows = jnp.minimum(i * rt + jnp.arange(rt), r - 1)
        keys, valid = window_keys(rows), window_valid[rows]
        if kk:
            sel = topk[rows]
            picked = ckv[jnp.clip(req[rows], 0, ckv.shape[0] - 1)[:, None], jnp.maximum(sel, 0)]   # [rt, K, D]
            keys = jnp.concatenate([keys, picked.astype(keys.dtype)], axis=1)
            valid = jnp.concatenate([valid, sel >= 0], axis=1)
        return sink_attention(qs[i][None], keys[None], valid[None], sink)[0]

    out = stacked_loop(lambda t: (tile(t[0]),), tiles, (jnp.arange(tiles),), (jnp.zeros((rt, h, d), q.dtype),),
                       like=(qs, window_valid, req, sink) + tuple(window_operands) + ((ckv, topk) if kk else ()))[0]
    return out.reshape(rp, h, d)[:r]
