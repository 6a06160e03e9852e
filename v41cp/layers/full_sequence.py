"""`FullSequence`: the rows backend of a whole-sequence forward (`v41cp.model.forward`, the reference every cached
path is compared with). The rows ``x [B,S,·]`` are positions ``0 … S−1`` of each sequence and every key is one of
the sequence's own rows; nothing persists past the call.

* `window` — each row's window positions ``[S, W]`` into the sequence's window KV ``[B,S,D]`` (in its cache format
  under fake-quant, `ModelConfig.cache_formats`);
* `groups` — the sequence's complete compression groups: ``S // r`` runs of ``r`` consecutive rows (an incomplete last
  group has no entry yet);
* `write_entries` / `history` — the sequence's entries of each KV source (V4.1 NVFP4 compressed KV, V4 its FP8 + BF16
  record, MXFP4 index keys under fake-quant), kept in this backend's cache: a dict by source layer, built during the forward;
* `select` — every row scores the entries complete at its position and selects: XLA (the scores materialized,
  which `v41cp.model.forward_debug` returns), the indexer kernels, or operator-local indexer QCP
  (`v41cp.layers.indexer.query_parallel_select`: each rank projects and scores its interleaved rows);
* `attend` — sink attention over the window and the selected entries: the sparse-attention kernel, operator-local
  attention QCP (`v41cp.layers.attention.query_parallel_attention`) or XLA (`rows_sink_attention`).

The paths are chosen by the config's backends and the shard's operator-QCP settings, as the layer sizes allow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v41cp.config import LayerRole, ModelConfig
from v41cp.layers.attention import (
    CSAState,
    kernel_sink_attention,
    query_parallel_attention,
    rows_sink_attention,
    window_indices,
)
from v41cp.layers.compressor import with_previous_window
from v41cp.layers.indexer import IndexQuery, every_visible_entry, query_parallel_select, select_scored
from v41cp.layers.rows_backend import RowsBackend
from v41cp.quant import quantize_as
from v41cp.sharding.operator_qcp import attention_query_parallel_applies, indexer_query_parallel_applies
from v41cp.sharding.rules import ShardingContext

__all__ = ["FullSequence"]


class FullSequence(RowsBackend):
    """See the module docstring: ``batch`` sequences of ``length`` rows; ``shard`` the modules' sharding context
    (operator-local QCP settings) or None."""

    def __init__(self, cfg: ModelConfig, shard: ShardingContext | None, batch: int, length: int):
        self.cfg, self.shard, self.batch, self.length = cfg, shard, batch, length
        self.pos = jnp.broadcast_to(jnp.arange(length), (batch, length))
        self.valid = jnp.ones((batch, length), bool)
        self.narrows = False
        self.columns = None                 # (no `split_columns_einsum`: the forward computes them as declared)

    def ced_split(self):
        raise ValueError("a full-sequence forward runs every row through every layer: it has no CED narrowing")

    def sampled(self, h: jax.Array, at: jax.Array) -> jax.Array:
        """Row ``at [B]`` of each sequence of ``h [B,S,H]`` → ``[B,1,H]`` (−1: zeros)."""
        row = jnp.take_along_axis(h, jnp.clip(at, 0, h.shape[1] - 1)[:, None, None], axis=1)
        return jnp.where((at >= 0)[:, None, None], row, jnp.zeros((), h.dtype))

    def last_rows(self, x: jax.Array, count: int):
        """The last ``count`` rows of each sequence: ``(x[:, S − count:], positions [B, count], valid [B, count])``
        (positions before 0 are invalid, their rows zeros)."""
        s = x.shape[1]
        pos = jnp.broadcast_to(s - count + jnp.arange(count), (x.shape[0], count))
        valid = pos >= 0
        rows = jnp.take(x, jnp.clip(pos[0], 0, s - 1), axis=1)
        rows = jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), rows, jnp.zeros((), x.dtype))
        return rows, pos, valid

    def window(self, cache, layer: int, kv: jax.Array):
        """``(cache, (window KV [B,S,D], positions [S,W]), valid [S,W])``."""
        cfg = self.cfg
        if cfg.fake_quant:
            kv = quantize_as(kv, cfg.cache_formats.window, cfg.qk_rope_head_dim)
        widx, wvalid = window_indices(self.length, cfg.sliding_window)
        return cache, (kv, widx), wvalid

    def groups(self, cache, role: LayerRole, c: jax.Array, z: jax.Array, part: str = "main"):
        """The ``G = S // r`` complete groups: ``c / z [B,G,r,C]`` (V4 CSA: ``[B,G,2r,C]``, each with the window before
        it), entries ``0 … G−1``, all written. ``part``: which compressor of the layer (no state here)."""
        r, b = role.ratio, self.batch
        g = self.length // r
        group = lambda a: a[:, :g * r].reshape(b, g, r, a.shape[-1])
        c, z = group(c), group(z)
        if role.overlapping:
            c, z = with_previous_window(c, z)
        return cache, c, z, jnp.broadcast_to(jnp.arange(g), (b, g)), jnp.ones((b, g), bool)

    def write_entries(self, cache, role: LayerRole, ckv: jax.Array, ik: jax.Array, j: jax.Array, emits: jax.Array):
        """The source's entries (every group complete, in order), in the cache formats' precision under fake-quant."""
        cfg = self.cfg
        if cfg.fake_quant:
            fmt = cfg.cache_formats
            ckv = quantize_as(ckv, fmt.entries, cfg.qk_rope_head_dim)
            ik = quantize_as(ik, fmt.index) if ik.shape[-1] else ik          # (V4 HCA: no index keys)
        entries = CSAState(ckv=ckv, ikeys=ik)
        return {**(cache or {}), str(role.index): entries}

    def history(self, cache, role: LayerRole) -> CSAState:
        return cache[str(role.kv_source)]

    def every_entry(self, cache, role: LayerRole, state: CSAState) -> jax.Array:
        """V4 HCA's selection: every entry complete at each row's position, in entry order ``[B,S,G]`` (−1 =
        not yet visible: entry ``j`` is visible to row ``t`` iff ``j < (t + 1) // r``)."""
        return every_visible_entry(self.pos, role.ratio, state.ckv.shape[1])

    @staticmethod
    def _published(role: LayerRole, state: CSAState) -> None:
        if state.ckv is None:
            raise ValueError(f"layer {role.index}: a {role.kind} layer needs compressed KV from a KV source before it")

    def select(self, cache, role: LayerRole, query: IndexQuery, state: CSAState):
        cfg, b, s = self.cfg, self.batch, self.length
        self._published(role, state)
        if state.ckv.shape[1] == 0:             # no complete compression group yet: nothing to score or select
            cand = jnp.zeros((b, s, 0), bool) if role.candidate_source else state.candidates
            return jnp.zeros((b, s, 0), jnp.int32), cand, None
        positions = jnp.arange(s)[None]
        if indexer_query_parallel_applies(self.shard, role, b * s):
            topk = query_parallel_select(self.shard, cfg, role, query.wq_b, query.w_proj, query.x, query.qr,
                                         query.angles, state.ikeys, positions)
            return topk, state.candidates, None
        q, weights = query()
        return select_scored(cfg, role, q, weights, state.ikeys, positions, state.candidates)

    def attend(self, cache, role: LayerRole, q: jax.Array, keys, valid: jax.Array, state: CSAState,
               sink: jax.Array) -> jax.Array:
        kv, widx = keys
        compressed = role.ratio > 0
        if compressed:
            self._published(role, state)
        sel = state.topk if compressed and state.ckv.shape[1] else None
        ckv = state.ckv if sel is not None else None
        if self.cfg.attention_backend == "pallas":
            return kernel_sink_attention(q, kv, widx, valid, state if compressed else None, sink)
        if attention_query_parallel_applies(self.shard, self.cfg, role, self.batch * self.length):
            return query_parallel_attention(self.shard, q, kv, widx, valid, ckv, sel, sink)
        return rows_sink_attention(q, kv, widx, valid, ckv, sel, sink)
