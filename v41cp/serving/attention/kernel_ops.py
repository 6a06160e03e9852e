"""Cached rows' attention and index selection through `v41cp.kernels` (``attention_backend`` /
``indexer_backend`` = ``"pallas"``), reading the paged caches in place (`v41cp.serving.attention.paged_rows`).

The XLA path gathers a request's whole compressed history (``[B, G, ·]``) and its index keys before scoring
and attending. These helpers hand the kernels the pools as stored instead
(records decoded in-kernel) with slot lists built from the block tables, so a step reads only the
window rows, the selected entries and — in the indexer scan — each index key once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v41cp.config import LayerRole, ModelConfig
from v41cp.kernels.sparse_attention import flatten_store, sparse_attention
from v41cp.layers.indexer import kernel_select_rows

__all__ = ["entry_slots", "window_slots", "attend", "select"]


def entry_slots(ids: jax.Array, tables: jax.Array, epb: int) -> jax.Array:
    """Logical entry ids ``[B, K]`` (−1 padding) → physical slots ``page · epb + offset`` of the flattened pool
    (−1 where the id is padding or its page is unallocated)."""
    mb = tables.shape[1]
    page = jnp.take_along_axis(tables, jnp.clip(ids // epb, 0, mb - 1), axis=1)
    ok = (ids >= 0) & (page >= 0)
    return jnp.where(ok, page * epb + ids % epb, -1).astype(jnp.int32)


def window_slots(layer: int, slots: jax.Array, ring_valid: jax.Array, n_slots: int) -> jax.Array:
    """Slots ``[B, W]`` of each row's window ring in the flattened ``swa`` store ``[L·n_slots·W, ·]``."""
    w = ring_valid.shape[1]
    base = (layer * n_slots + slots) * w
    return jnp.where(ring_valid, base[:, None] + jnp.arange(w), -1).astype(jnp.int32)


def attend(cfg: ModelConfig, q: jax.Array, swa, win_slots: jax.Array, pool, sel_slots, sink) -> jax.Array:
    """Sink-applied attention ``[B, H, D]`` (``q.dtype``) of ``q [B, H, D]`` over the window slots of the
    ``swa`` store and the selected slots of ``pool`` (None for SWA-only layers)."""
    stores, indices = [flatten_store(swa)], [win_slots]
    if pool is not None and sel_slots.shape[1]:
        stores.append(flatten_store(pool))
        indices.append(sel_slots)
    o, _ = sparse_attention(q, stores, indices, sink=sink, backend=cfg.attention_backend)
    return o.astype(q.dtype)


def select(cfg: ModelConfig, role: LayerRole, q: jax.Array, w: jax.Array, ikeys, tables: jax.Array,
           positions: jax.Array, candidates):
    """Index selection of one index source for query rows with their own block tables, on the paged index keys.

    q ``[B, Hi, Di]`` / w ``[B, Hi]``; ikeys the group's pool ``[NB, epb, ·]`` (values or MXFP4 records);
    tables ``[B, MB]``; positions ``[B]``; candidates ``[B, G]`` entry mask (uses_candidates) or None.
    Returns (``topk [B, min(index_topk, G)]``, candidates ``[B, G]`` or the input), as the XLA path does."""
    epb = (ikeys["q"] if isinstance(ikeys, dict) else ikeys).shape[1]
    b, mb = tables.shape
    page_ids = jnp.broadcast_to(jnp.arange(mb, dtype=jnp.int32), (b, mb))
    return kernel_select_rows(cfg, role, q, w, flatten_store(ikeys), tables, page_ids,
                              (positions + 1) // role.ratio, epb, mb * epb, candidates)
