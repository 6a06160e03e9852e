"""The index-selection and attention paths of cached rows (`v41cp.serving.attention.paged_rows.PagedRows`), one class
each; `PagedRows` reads the backend settings once and builds one of each per step (`choose`).

Selection (the index top-k of every row):

* `GatheredSelection` — XLA over the gathered history (`PagedRows.history`): one score matrix for a decode / verify
  step, row tiles for a packed prefill pass (`v41cp.layers.tiled_select.select_rows`), operator-local indexer QCP
  when it applies;
* `KernelSelection` — the indexer kernel over the pools in place (`kernel_ops.select`);
* `OwnedPagesSelection` — each rank scores its own pages and the exact distributed top-k merges them
  (`v41cp.serving.attention.dcp.select`): KVP / DCP, or plain attention TP's split selection over replicated pages.

Attention (sink attention over each row's window keys and selected entries):

* `GatheredAttention` — XLA: the selected entries from the gathered history (under plain TP's split selection,
  decoded from the pool in place instead); row tiles for a packed pass; operator-local attention QCP when it applies;
* `KernelAttention` — the sparse-attention kernel (`kernel_ops.attend`);
* `OwnedPagesAttention` — DCP: each rank's partial attention over its owned entries, merged by LSE
  (`v41cp.serving.attention.dcp.attend`; V4 HCA over every visible entry it owns, `dcp.attend_visible`); window-only
  layers take the local path.

Every path takes the step's `PagedRows` (``rows``: positions, tables, the flat row layout) and reads no weight.
``reads_history``: whether the path reads the gathered history (`PagedRows.history` gathers it only then).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v41cp.config import LayerRole, ModelConfig
from v41cp.kernels.sparse_attention.reference import sink_attention
from v41cp.layers.attention import CSAState, query_parallel_rows
from v41cp.layers.indexer import query_parallel_select_rows, select_scored
from v41cp.layers.tiled_select import attend_rows, select_rows
from v41cp.serving.attention import dcp, kernel_ops
from v41cp.serving.cache import paged as pc
from v41cp.serving.cache.device_cache import PagedCache
from v41cp.sharding.operator_qcp import attention_query_parallel_applies, indexer_query_parallel_applies

__all__ = ["GatheredSelection", "KernelSelection", "OwnedPagesSelection", "GatheredAttention", "KernelAttention",
           "OwnedPagesAttention", "choose"]


class GatheredSelection:
    reads_history = True

    def select(self, rows, cache: PagedCache, role: LayerRole, q, weights, state: CSAState):
        cfg = rows.cfg
        if rows.op is not None and indexer_query_parallel_applies(rows.op, role, rows.n_rows):
            topk = query_parallel_select_rows(rows.op, cfg, role, rows.flat(q), rows.flat(weights), state.ikeys,
                                              rows.row_req, rows.flat(rows.pos))
            return rows.unflat(topk), state.candidates
        if rows.meta.packed:            # each row against its own request's keys, in tiles (candidates as blocks)
            topk, cand = select_rows(cfg, role, rows.flat(q), rows.flat(weights), state.ikeys, rows.row_req,
                                     rows.flat(rows.pos), state.candidates)
            return rows.unflat(topk), cand
        topk, cand, _ = select_scored(cfg, role, q, weights, state.ikeys, rows.pos, state.candidates)
        return topk, cand


class KernelSelection:
    reads_history = False

    def select(self, rows, cache: PagedCache, role: LayerRole, q, weights, state: CSAState):
        pool, cand = cache.ikey[str(role.kv_source)], state.candidates
        topk, cand = kernel_ops.select(rows.cfg, role, rows.flat(q), rows.flat(weights), pool, rows.row_tables,
                                       rows.flat(rows.pos), None if cand is None else rows.flat(cand))
        return rows.unflat(topk), None if cand is None else rows.unflat(cand)


class OwnedPagesSelection:
    reads_history = False

    def __init__(self, plan):
        self.plan = plan

    def select(self, rows, cache: PagedCache, role: LayerRole, q, weights, state: CSAState):
        read = lambda a, f: pc.read(a, rows.cfg.cache_formats.index, rows.dtype, f)
        topk, cand = dcp.select(self.plan, rows.cfg, role, read, cache.ikey[str(role.kv_source)], rows.flat(q),
                                rows.flat(weights), rows.row_tables, rows.flat(rows.pos), state.candidates)
        return rows.unflat(topk), cand


class GatheredAttention:
    """``from_pool``: the selected entries are decoded from the (replicated) pool in place, not from a gathered
    history (plain TP's split selection: no step gathers a history)."""

    def __init__(self, from_pool: bool = False):
        self.from_pool = from_pool
        self.reads_history = not from_pool

    def attend(self, rows, cache: PagedCache, role: LayerRole, q, keys, valid, state: CSAState, sink):
        cfg, compressed = rows.cfg, role.ratio > 0
        pool = cache.ckv[str(role.kv_source)] if compressed else None
        topk = state.topk if compressed else None
        qcp = rows.op is not None and attention_query_parallel_applies(rows.op, cfg, role, rows.n_rows)
        if rows.meta.packed and not qcp:
            # a prefill pass's rows in row tiles: each tile gathers its own window keys and selected entries
            sel = rows.flat(topk) if compressed and topk.shape[-1] else None
            o = attend_rows(rows.flat(q), lambda r: rows.flat(keys)[r], rows.flat(valid),
                            state.ckv if sel is not None else None, rows.row_req, sel, sink, window_operands=(keys,))
            return rows.unflat(o)
        if compressed and topk.shape[-1]:
            if self.from_pool:                  # only the selected entries, from the pool in place
                picked = rows.unflat(self._selected_entries(rows, pool, rows.flat(topk)))
            else:
                picked = state.ckv[rows.unflat(rows.row_req)[..., None], jnp.maximum(topk, 0)]    # [B,R,K,D]
            keys = jnp.concatenate([keys, picked], axis=2)
            valid = jnp.concatenate([valid, topk >= 0], axis=2)
        if qcp:
            return rows.unflat(query_parallel_rows(rows.op, rows.flat(q), rows.flat(keys), rows.flat(valid), sink))
        return sink_attention(q, keys, valid, sink)

    @staticmethod
    def _selected_entries(rows, pool, topk: jax.Array) -> jax.Array:
        """Records of the selected entries ``topk [N, K]`` (logical ids, −1 padding) of every flat row, decoded from
        the (replicated) pool through the rows' block tables → ``[N, K, D]``."""
        blk, row, _ = pc.entry_location(rows.row_tables, jnp.maximum(topk, 0), pc.entries_per_block(pool))
        page = jnp.where((topk >= 0) & (blk >= 0), blk, 0)
        return pc.read(pool, rows.cfg.cache_formats.entries, rows.dtype, lambda a: a[page, row])


class KernelAttention:
    """The sparse-attention kernel over the window and the selected page entries, in place. One row per request: the
    window is read from the ring (already written); several rows: from the gathered window keys."""

    reads_history = False

    def attend(self, rows, cache: PagedCache, role: LayerRole, q, keys, valid, state: CSAState, sink):
        compressed = role.ratio > 0
        pool = cache.ckv[str(role.kv_source)] if compressed else None
        topk = state.topk if compressed else None
        b, r = rows.pos.shape
        w = keys.shape[2]
        if r == 1 and not rows.meta.packed:
            store = cache.swa
            win = kernel_ops.window_slots(role.index, rows.slot_r, valid[:, 0], rows.n_slots)
        else:
            store = keys.reshape(b * r * w, -1)
            win = jnp.where(rows.flat(valid), jnp.arange(b * r)[:, None] * w + jnp.arange(w), -1)
        sel = None
        if pool is not None:
            sel = kernel_ops.entry_slots(rows.flat(topk), rows.row_tables, pc.entries_per_block(pool))
        return rows.unflat(kernel_ops.attend(rows.cfg, rows.flat(q), store, win, pool, sel, sink))


class OwnedPagesAttention:
    """DCP attention of compressed layers over each rank's owned entries; ``local`` serves window-only layers."""

    reads_history = False

    def __init__(self, plan, local):
        self.plan, self.local = plan, local

    def attend(self, rows, cache: PagedCache, role: LayerRole, q, keys, valid, state: CSAState, sink):
        if role.ratio == 0:
            return self.local.attend(rows, cache, role, q, keys, valid, state, sink)
        read = lambda a, f: pc.read(a, rows.cfg.cache_formats.entries, rows.dtype, f)
        if role.dense_history:          # V4 HCA: every visible entry each rank owns (its selection is implied)
            o = dcp.attend_visible(self.plan, read, rows.flat(q), rows.flat(keys), rows.flat(valid),
                                   cache.ckv[str(role.kv_source)], rows.row_tables, rows.flat(rows.pos), role.ratio,
                                   sink)
            return rows.unflat(o)
        o = dcp.attend(self.plan, read, rows.flat(q), rows.flat(keys), rows.flat(valid), rows.flat(state.topk),
                       cache.ckv[str(role.kv_source)], rows.row_tables, sink, rows.cfg.attention_backend)
        return rows.unflat(o)


def choose(cfg: ModelConfig, plan, split):
    """The step's (selection, attention) paths — the one place the backend settings are read: ``plan`` the KVP / DCP
    layout (pages split over ``cp``) or None; ``split`` plain attention TP's split selection (replicated pages, both
    backends XLA) or None; otherwise ``cfg.indexer_backend`` / ``cfg.attention_backend`` (``xla`` | ``pallas``)."""
    owned = plan if plan is not None else split
    if owned is not None:
        selection = OwnedPagesSelection(owned)
    else:
        selection = KernelSelection() if cfg.indexer_backend == "pallas" else GatheredSelection()
    local = KernelAttention() if cfg.attention_backend == "pallas" else GatheredAttention(from_pool=split is not None)
    attention = OwnedPagesAttention(plan, local) if plan is not None else local
    return selection, attention
