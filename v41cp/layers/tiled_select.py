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
from v41cp.layers.topk_scan import scan_topk, scan_topk_rows, tile_count
from v41cp.sharding.dist_topk import merge_blocks

__all__ = ["select_rows", "attend_rows", "causal_steps", "ROW_TILE_BYTES", "ROWS_PER_TILE"]

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
                rows_per_tile: int = ROWS_PER_TILE, visible_total: int | None = None):
    """Index selection of query rows.

    Args:
      q ``[R, Hi, Di]`` / weights ``[R, Hi]``: the rows' index queries and weights (`index_query`).
      keys ``[B, G, Di]``: every request's index keys in entry order (entries past a row's history are masked).
      req / pos ``[R]``: each row's request and position (rows of a padding request: any value; their result is
        unused). cand_blocks ``[R, kb]``: the candidate source's kept blocks (uses_candidates layers) or None.
      budget: temporaries of one (row tile × key tile) step in bytes; rows_per_tile: query rows per tile.
      visible_total: a static bound on the rows' visible entries summed (``Σ (pos + 1) // ratio``, e.g. a fresh
        pass's causal triangle) — the whole-history layers then run only the key tiles the rows can see, in a
        schedule of that many steps (exact beyond it: `scan_topk_rows`); None: every row tile × every key tile.
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
    if not uses:
        topk, blocks = _select_history(cfg, role, q, weights, keys, req, visible, k, nb, pair, rt, budget,
                                       visible_total)
        return topk, blocks if role.candidate_source else cand_blocks
    row_tiles = -(-r // rt)
    rp = rt * row_tiles
    tiles_q = _pad_rows(q, rp).reshape(row_tiles, rt, hi, di)
    tiles_w = _pad_rows(weights, rp).reshape(row_tiles, rt, hi)
    tiles_req = _pad_rows(jnp.clip(req, 0, b - 1), rp).reshape(row_tiles, rt)
    tiles_vis = _pad_rows(visible, rp).reshape(row_tiles, rt)
    tiles_cand = _pad_rows(cand_blocks, rp, -1).reshape(row_tiles, rt, kb)

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

    topk = stacked_loop(lambda t: (kept_tile(*t),), row_tiles,
                        (tiles_q, tiles_w, tiles_req, tiles_vis, tiles_cand), (jnp.full((rt, k), -1, jnp.int32),),
                        like=(keys,))[0]
    return topk.reshape(rp, k)[:r], cand_blocks


def causal_steps(visible_total: int, rt: int, per: int, tiles: int, row_tiles: int) -> int:
    """The static (row tile, key tile) steps that cover rows seeing ``visible_total`` entries in all, in ascending
    visible count, ``rt`` rows per tile, ``per`` keys per tile (``tiles`` of them): row tile ``i`` needs
    ``⌈max_vis_i / per⌉ ≤ max_vis_i / per + 1`` key tiles, and ascending rows make ``Σ_i max_vis_i ≤ Σ_i
    min_vis_{i+1} + g ≤ visible_total / rt + per · tiles``."""
    return min(row_tiles * tiles, -(-visible_total // (rt * per)) + tiles + row_tiles)


def _select_history(cfg: ModelConfig, role: LayerRole, q, weights, keys, req, visible, k: int, nb: int, pair: int,
                    rt: int, budget: int, visible_total: int | None):
    """`select_rows` of a layer scoring its whole visible history: rows in ascending visible count, in row tiles,
    each row tile over the key tiles up to its last visible key (`scan_topk_rows`)."""
    r = q.shape[0]
    b, g = keys.shape[:2]
    cbs = cfg.candidate_block_size
    shared = b == 1
    per, tiles = tile_count(g, 1, pair * rt, budget)
    row_tiles = -(-r // rt)
    rp = rt * row_tiles
    # rows in ascending visible count, the padding rows (−1) first: every tile's last row is its maximum
    order = jnp.argsort(_pad_rows(visible, rp, -1), stable=True)                    # [rp]
    tile_rows = lambda a, fill=0: _pad_rows(a, rp, fill)[order].reshape(row_tiles, rt, *a.shape[1:])
    tiles_q, tiles_w = tile_rows(q), tile_rows(weights)
    tiles_req, tiles_vis = tile_rows(jnp.clip(req, 0, b - 1)), tile_rows(visible, -1)
    need = jnp.clip(-(-jnp.max(tiles_vis, axis=1) // per), 1, tiles).astype(jnp.int32)          # [I]
    steps = row_tiles * tiles if visible_total is None else causal_steps(visible_total, rt, per, tiles, row_tiles)

    def score_tile(i, j):
        qt, wt, rq, vis = (jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)
                           for a in (tiles_q, tiles_w, tiles_req, tiles_vis))
        ids = j * per + jnp.arange(per)                                                 # [T]
        if shared:
            kt = jnp.take(keys[0], jnp.minimum(ids, g - 1), axis=0)                        # [T, Di]
            scores = index_scores(qt[None], wt[None], kt[None])[0]                     # [rt, T]
        else:
            kt = keys[rq[:, None], jnp.minimum(ids, g - 1)[None]]                      # [rt, T, Di]
            scores = index_scores(qt[:, None], wt[:, None], kt)[:, 0]
        ok = (ids[None] < vis[:, None]) & (ids[None] < g)
        return scores, jnp.where(ok, ids[None], -1)

    kb_src = min(cfg.candidate_topk_blocks, nb)

    def finish(i, vals, gid, maxima):
        if not role.candidate_source:
            return (gid,)
        vis = jax.lax.dynamic_index_in_dim(tiles_vis, i, 0, keepdims=False)
        return gid, merge_blocks(maxima, jnp.broadcast_to(jnp.arange(nb), maxima.shape), vis,
                                 cfg.candidate_topk_blocks, cbs, nb)

    outs = (jnp.full((rt, k), -1, jnp.int32),) + ((jnp.full((rt, kb_src), -1, jnp.int32),) if role.candidate_source
                                                  else ())
    got = scan_topk_rows(score_tile, need, tiles, steps, rt, k, finish, outs,
                         num_blocks=nb if role.candidate_source else None, block_size=cbs,
                         carry_like=(tiles_q, tiles_w, tiles_req, tiles_vis, keys))
    back = jnp.argsort(order)[:r]                                                      # sorted → caller's order
    topk = got[0].reshape(rp, k)[back]
    if role.candidate_source:
        return topk, got[1].reshape(rp, -1)[back]
    return topk, None


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
