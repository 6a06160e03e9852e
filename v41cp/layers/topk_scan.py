"""Memory-bounded selection: score keys tile by tile with a running top-k (and running candidate-block maxima),
so no intermediate grows with the history — only with one tile.

`scan_topk(score_tile, tiles, k, ...)`: ``score_tile(j)`` scores the ``j``-th tile of every row's keys →
``(scores [R, T] FP32, logical ids [R, T] int32)`` (−1 = no entry; its score is ignored). The tiles must list
each row's entries in ascending logical id (tile ``j`` after tile ``j − 1``), as the pages of a block table and
a rank's owned pages do. Then one ``lax.top_k`` over ``[running k | tile]`` per tile keeps the shared tie rule
exactly: among equal scores the running entries (smaller ids, themselves in id order among ties) come first,
then the tile's in id order — the result equals ``lax.top_k`` over the whole row. With ``num_blocks`` it also keeps
the running maximum per candidate block (``id // block_size``), the candidate source's block scores.

Tiles run in a ``lax.fori_loop`` (one compiled body; `v41cp.sharding.hlo_stats.program_cost` counts it per
iteration) when there are several, straight-line when one. `tile_count` picks the tile from a byte budget.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v41cp.kernels import match_varying
from v41cp.layers.common import full_after
from v41cp.sharding.dist_topk import local_block_maxima

__all__ = ["scan_topk", "scan_topk_more", "scan_topk_rows", "tile_count", "SCAN_TILE_BYTES"]

SCAN_TILE_BYTES = 256 << 20          # temporaries of one tile (decoded keys + per-head scores), all rows


def tile_count(entries: int, unit: int, bytes_per_entry: int, budget: int | None = None) -> tuple[int, int]:
    """(units per tile, tiles) covering ``entries`` in whole ``unit``s (e.g. pages of ``unit`` entries) with at most
    ``budget`` bytes (default `SCAN_TILE_BYTES`) of temporaries per tile (``bytes_per_entry``: for all rows
    together); balanced tiles."""
    budget = SCAN_TILE_BYTES if budget is None else budget
    units = -(-entries // unit)
    per = max(1, budget // max(1, bytes_per_entry * unit))
    tiles = -(-units // per)
    return -(-units // tiles), tiles


def _merge(vals, gid, scores, ids, k):
    ids = ids.astype(jnp.int32)
    scores = jnp.where(ids >= 0, scores.astype(jnp.float32), -jnp.inf)
    both_v = jnp.concatenate([vals, scores], axis=-1)
    both_i = jnp.concatenate([gid, ids], axis=-1)
    top, idx = jax.lax.top_k(both_v, k)
    got = jnp.take_along_axis(both_i, idx, axis=-1)
    return top, jnp.where(top > -jnp.inf, got, -1)


def _absorb(state, scores, ids, k: int, block_size: int, num_blocks: int | None):
    """One tile into a running state ``(vals, ids, block maxima or None)`` (the step every scan here shares)."""
    vals, gid, maxima = state
    if maxima is not None:
        maxima = jnp.maximum(maxima, local_block_maxima(scores, ids, block_size, num_blocks))
    vals, gid = _merge(vals, gid, scores, ids, k)
    return vals, gid, maxima


def scan_topk(score_tile, tiles: int, rows: int, k: int, *, num_blocks: int | None = None, block_size: int = 1,
              carry_like=None):
    """Running top-``k`` over ``tiles`` tiles (see the module docstring) of ``rows`` rows → ``(vals [R, k] FP32
    (−inf padding), ids [R, k] int32 (−1 padding), block maxima [R, num_blocks] FP32 or None)``.
    ``carry_like``: an array (or a sequence: the union) whose mesh-axis variance the running state takes (inside
    ``jax.shard_map``: the tiles' operands, so the loop's carry type equals its body's)."""
    vals = jnp.full((rows, k), -jnp.inf, jnp.float32)
    gid = jnp.full((rows, k), -1, jnp.int32)
    maxima = None if num_blocks is None else jnp.full((rows, num_blocks), -jnp.inf, jnp.float32)
    state = (vals, gid, maxima)
    if carry_like is not None:
        leaves, tree = jax.tree.flatten(state)
        likes = list(carry_like) if isinstance(carry_like, (list, tuple)) else [carry_like]
        leaves = match_varying(leaves + likes)[0][:len(leaves)]
        state = jax.tree.unflatten(tree, leaves)

    def step(j, state):
        return _absorb(state, *score_tile(j), k, block_size, num_blocks)

    if tiles == 1:
        state = step(0, state)
    else:
        state = jax.lax.fori_loop(0, tiles, step, state)
    return state


def scan_topk_more(score_tile, tiles: jax.Array, state, k: int):
    """Continue a running top-``k`` state of `scan_topk` (``(vals, ids, None)``) over ``tiles`` more tiles, a
    data-dependent count (an int32 scalar; 0: the state unchanged) — a ``lax.while_loop``, whose body XLA's cost
    analysis (and `v41cp.sharding.hlo_stats.program_cost`) counts once. The tiles continue the ascending id order."""
    vals, gid, maxima = state
    if maxima is not None:
        raise ValueError("scan_topk_more: block maxima are not continued")
    j0, tiles = match_varying([jnp.int32(0), jnp.asarray(tiles, jnp.int32), vals])[0][:2]

    def body(c):
        j, vals, gid = c
        vals, gid, _ = _absorb((vals, gid, None), *score_tile(j), k, 1, None)
        return j + 1, vals, gid

    _, vals, gid = jax.lax.while_loop(lambda c: c[0] < tiles, body, (j0, vals, gid))
    return vals, gid, None


def scan_topk_rows(score_tile, need: jax.Array, max_need: int, steps: int, rows: int, k: int, finish, outs: tuple, *,
                   num_blocks: int | None = None, block_size: int = 1, carry_like=None) -> tuple:
    """Running top-``k`` of several row tiles, each over only the key tiles it needs: row tile ``i`` scans key
    tiles ``0 … need[i] − 1`` (``need [I]`` int32, each in ``1 … max_need``: a causal prefix of the history), as
    `scan_topk` would over those tiles. ``score_tile(i, j)`` → ``(scores [R, T], ids [R, T])`` of row tile ``i``'s
    key tile ``j``; ``finish(i, vals, ids, maxima)`` → row tile ``i``'s outputs (shaped as ``outs``, one tile's zero
    value each) → stacked ``[I, …]``.

    The (row tile, key tile) pairs run in one flat schedule of ``steps`` static iterations (a ``fori_loop``:
    `v41cp.sharding.hlo_stats.program_cost` counts every one) — the caller's bound on ``Σ need``; pairs past it
    (a history longer than the bound assumed) run in a ``while_loop`` of data-dependent length (counted once), so
    the result is exact for any ``need``. With ``steps ≥ I · max_need`` no continuation is compiled."""
    n_tiles = need.shape[0]
    steps = min(steps, n_tiles * max_need)
    vals0 = jnp.full((rows, k), -jnp.inf, jnp.float32)
    gid0 = jnp.full((rows, k), -1, jnp.int32)
    max0 = None if num_blocks is None else jnp.full((rows, num_blocks), -jnp.inf, jnp.float32)
    likes = list(carry_like) if isinstance(carry_like, (list, tuple)) else ([] if carry_like is None else
                                                                              [carry_like])
    dep = next((d for d in likes if jnp.issubdtype(d.dtype, jnp.floating)), need)
    # the stacked outputs are allocated with this layer's data (`full_after`: never hoisted to the program start)
    bufs = tuple(full_after((n_tiles, *o.shape), 0, o.dtype, dep) + o for o in outs)
    leaves, tree = jax.tree.flatten((jnp.int32(0), jnp.int32(0), vals0, gid0, max0, bufs))
    state = jax.tree.unflatten(tree, match_varying(leaves + likes + [need])[0][:len(leaves)])
    init = state[2:5]

    def step(c):
        i, j, vals, gid, maxima, bufs = c
        live = i < n_tiles
        ic = jnp.minimum(i, n_tiles - 1)
        scores, ids = score_tile(ic, j)
        vals, gid, maxima = _absorb((vals, gid, maxima), scores, jnp.where(live, ids, -1), k, block_size,
                                    num_blocks)
        done = live & (j + 1 >= need[ic])
        got = jax.lax.cond(done, lambda: tuple(finish(ic, vals, gid, maxima)),
                           lambda: tuple(jax.lax.dynamic_index_in_dim(b, ic, 0, keepdims=False) for b in bufs))
        bufs = tuple(jax.lax.dynamic_update_index_in_dim(b, g.astype(b.dtype), ic, 0) for b, g in zip(bufs, got))
        vals, gid, maxima = jax.tree.map(lambda a, a0: jnp.where(done, a0, a), (vals, gid, maxima), init)
        return i + done.astype(jnp.int32), jnp.where(done, 0, j + 1), vals, gid, maxima, bufs

    state = jax.lax.fori_loop(0, steps, lambda s, c: step(c), state)
    if steps < n_tiles * max_need:
        state = jax.lax.while_loop(lambda c: c[0] < n_tiles, step, state)
    return state[5]
