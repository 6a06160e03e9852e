"""Exact distributed top-k over a context-parallel axis (the indexer under KVP).

Each rank scores only the index keys it owns and keeps a local top-k of ``(score, logical id)``; the
``N·k`` candidates are all-gathered (FP32 scores and int32 ids, a history-independent payload) and merged
into the global top-k, identically on every rank.

Exactness (shared tie rule: score descending, then logical id ascending — `jax.lax.top_k` order): a
rank's entries are laid out in ascending logical id (`v41cp.sharding.ownership`), so its local
`lax.top_k` ranks them by the same rule; an entry of the global top-k has fewer than ``k`` entries
ahead of it globally, hence locally, so it is in its owner's candidates. The merge sorts candidates by
logical id and applies `lax.top_k` again, so ties resolve as in the single-device reference. Padding is
id −1 with score −inf and never selected.

Candidate blocks (the Full candidate source's block maxima): each rank takes partial block maxima over
its owned entries, keeps its top ``kb`` blocks, and the ``N·kb`` candidates are merged by a per-block
maximum and a final top ``kb``. A block of the global top ``kb`` is in the candidates of the rank that
holds its maximum, with that maximum; every other candidate carries at most its true maximum — so the
merged selection equals the single-device one without gathering block maxima over the history.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["local_topk", "merge_topk", "distributed_topk", "gather_merge_topk", "local_block_maxima", "merge_blocks",
           "distributed_candidate_blocks", "distributed_candidate_blocks_from_maxima", "distributed_blocks",
           "candidate_mask", "entries_in_kept", "kept_block_mask"]


def local_topk(scores: jax.Array, ids: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Top-``k`` of ``scores [B, G]`` whose entries have logical ids ``ids [B, G]`` (ascending, −1 = none).
    Returns (scores ``[B, k]``, ids ``[B, k]``), padded with (−inf, −1) when fewer exist."""
    scores = jnp.where(ids >= 0, scores, -jnp.inf)
    kk = min(k, scores.shape[-1])
    vals, idx = jax.lax.top_k(scores, kk)
    gid = jnp.take_along_axis(ids, idx, axis=-1)
    gid = jnp.where(vals > -jnp.inf, gid, -1).astype(jnp.int32)
    vals = jnp.where(gid >= 0, vals, -jnp.inf)
    if kk < k:
        pad = ((0, 0), (0, k - kk))
        vals, gid = jnp.pad(vals, pad, constant_values=-jnp.inf), jnp.pad(gid, pad, constant_values=-1)
    return vals, gid


def merge_topk(vals: jax.Array, ids: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Candidates ``[B, C]`` (distinct non-negative ids, −1 padding) → global top-``k`` (ids ``[B, k]`` with
    −1 padding, scores) in `lax.top_k` order of the logical ids."""
    vals = jnp.where(ids >= 0, vals, -jnp.inf)
    ids_sorted, vals_sorted = jax.lax.sort((ids, vals), dimension=-1, num_keys=1)
    top, idx = jax.lax.top_k(vals_sorted, k)
    gid = jnp.take_along_axis(ids_sorted, idx, axis=-1)
    return jnp.where(top > -jnp.inf, gid, -1).astype(jnp.int32), top


def distributed_topk(scores: jax.Array, ids: jax.Array, k: int, axis: str) -> tuple[jax.Array, jax.Array]:
    """Inside shard_map over ``axis``: this rank's ``scores [B, Gl]`` / ``ids [B, Gl]`` → the exact global
    top-``k`` ids ``[B, k]`` (identical on every rank) and scores. Communicates ``N·B·k`` (score, id) pairs."""
    vals, gid = local_topk(scores, ids, k)
    return gather_merge_topk(vals, gid, k, axis)


def gather_merge_topk(vals: jax.Array, ids: jax.Array, k: int, axis: str) -> tuple[jax.Array, jax.Array]:
    """Inside shard_map over ``axis``: this rank's local top-``k`` candidates (``vals / ids [B, k]``, −inf / −1
    padding; e.g. from the indexer kernel) → the global top-``k`` ids and scores, identical on every rank."""
    vals_all = jax.lax.all_gather(vals, axis, axis=1, tiled=True, to="invarying")     # [B, N·k]
    ids_all = jax.lax.all_gather(ids, axis, axis=1, tiled=True, to="invarying")
    return merge_topk(vals_all, ids_all, k)


def local_block_maxima(scores: jax.Array, ids: jax.Array, block_size: int, num_blocks: int) -> jax.Array:
    """Partial block maxima ``[B, num_blocks]`` over the entries ``ids [B, G]`` (−1 = none) of this rank."""
    b = scores.shape[0]
    bid = jnp.where(ids >= 0, ids // block_size, num_blocks)
    out = jnp.full((b, num_blocks + 1), -jnp.inf, jnp.float32)
    out = out.at[jnp.arange(b)[:, None], bid].max(jnp.where(ids >= 0, scores, -jnp.inf).astype(jnp.float32))
    return out[:, :num_blocks]


def _pin(blocks: jax.Array, visible_len: jax.Array, block_size: int) -> jax.Array:
    last = jnp.floor_divide(visible_len - 1, block_size)[:, None]
    return jnp.where(jnp.arange(blocks.shape[-1]) == last, jnp.inf, blocks)


def merge_blocks(vals: jax.Array, ids: jax.Array, visible_len: jax.Array, topk_blocks: int, block_size: int,
                 num_blocks: int) -> jax.Array:
    """Block candidates (partial maxima ``vals [B, C]`` of block ``ids [B, C]``, −1 = none) → the kept
    block ids ``[B, min(topk_blocks, num_blocks)]`` (−1 padding), as `select_candidate_blocks` keeps them."""
    b = vals.shape[0]
    merged = jnp.full((b, num_blocks + 1), -jnp.inf, jnp.float32)
    merged = merged.at[jnp.arange(b)[:, None], jnp.where(ids >= 0, ids, num_blocks)].max(
        jnp.where(ids >= 0, vals, -jnp.inf))[:, :num_blocks]
    merged = _pin(merged, visible_len, block_size)
    top, idx = jax.lax.top_k(merged, min(topk_blocks, num_blocks))
    return jnp.where(top > -jnp.inf, idx, -1).astype(jnp.int32)


def distributed_candidate_blocks(scores: jax.Array, ids: jax.Array, visible_len: jax.Array, topk_blocks: int,
                                 block_size: int, num_entries: int, axis: str) -> jax.Array:
    """Inside shard_map over ``axis``: the candidate source's kept blocks ``[B, kb]`` (ids, −1 padding) from
    this rank's masked scores ``[B, Gl]`` of entries ``ids [B, Gl]``; ``num_entries`` = the history capacity
    in entries (the reference's ``G``). Communicates ``N·B·kb`` (block max, block id) pairs."""
    nb = -(-num_entries // block_size)
    return distributed_blocks(local_block_maxima(scores, ids, block_size, nb), visible_len, topk_blocks,
                              block_size, axis)


def distributed_candidate_blocks_from_maxima(maxima: jax.Array, block_ids: jax.Array, visible_len: jax.Array,
                                             topk_blocks: int, block_size: int, num_entries: int,
                                             axis: str) -> jax.Array:
    """As `distributed_candidate_blocks`, from this rank's partial block maxima ``maxima [B, C]`` of logical
    blocks ``block_ids [B, C]`` (−1 = none; e.g. the indexer kernel's block maxima)."""
    nb = -(-num_entries // block_size)
    return distributed_blocks(local_block_maxima(maxima, block_ids, 1, nb), visible_len, topk_blocks,
                              block_size, axis)


def distributed_blocks(local: jax.Array, visible_len: jax.Array, topk_blocks: int, block_size: int,
                       axis: str) -> jax.Array:
    """Inside shard_map over ``axis``: this rank's partial block maxima over every block ``local [B, nb]`` (−inf =
    none here) → the kept block ids ``[B, kb]``, as `distributed_candidate_blocks`."""
    nb = local.shape[1]
    kb = min(topk_blocks, nb)
    local = _pin(local, visible_len, block_size)
    top, idx = jax.lax.top_k(local, kb)
    idx = jnp.where(top > -jnp.inf, idx, -1).astype(jnp.int32)
    top_all = jax.lax.all_gather(top, axis, axis=1, tiled=True, to="invarying")
    idx_all = jax.lax.all_gather(idx, axis, axis=1, tiled=True, to="invarying")
    return merge_blocks(top_all, idx_all, visible_len, topk_blocks, block_size, nb)


def candidate_mask(blocks: jax.Array, ids: jax.Array, block_size: int, num_entries: int) -> jax.Array:
    """Whether entries ``ids [B, G]`` (−1 = none) lie in the kept ``blocks [B, kb]`` → bool ``[B, G]``."""
    return entries_in_kept(kept_block_mask(blocks, -(-num_entries // block_size)), ids, block_size)


def entries_in_kept(keep: jax.Array, ids: jax.Array, block_size: int) -> jax.Array:
    """Whether entries ``ids [B, G]`` (−1 = none: False) lie in a kept block of ``keep [B, nb]`` (`kept_block_mask`,
    built once when several id tiles are tested) → bool ``[B, G]``."""
    nb = keep.shape[1]
    keep = jnp.pad(keep, ((0, 0), (0, 1)))
    return jnp.take_along_axis(keep, jnp.where(ids >= 0, ids // block_size, nb), axis=-1)


def kept_block_mask(blocks: jax.Array, num_blocks: int) -> jax.Array:
    """Kept block ids ``[B, kb]`` (−1 padding) → bool mask ``[B, num_blocks]``."""
    b = blocks.shape[0]
    keep = jnp.zeros((b, num_blocks + 1), bool)
    keep = keep.at[jnp.arange(b)[:, None], jnp.where(blocks >= 0, blocks, num_blocks)].set(True)
    return keep[:, :num_blocks]
