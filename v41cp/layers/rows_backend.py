"""`RowsBackend`: what the one model's layers ask of the rows they run — where each row's keys come from.

The layers compute every projection from their own weights; a backend says where the rows sit and moves keys: the
window keys of each row, the rows that complete compressed entries (and with which partner rows), where the
entries and index keys go and come back from, the selection and the attention. Shapes: ``B`` batch rows of ``R``
rows each (packed layouts: ``B = 1`` and ``R`` the step's rows), ``W`` the window, ``D`` the head dim, ``Di`` /
``Hi`` the index head dim and heads, ``G`` a source's entries, ``K`` the selected entries, ``r`` the compression
ratio. ``cache`` is the backend's own (the layers pass it through unread) and so are the window ``keys`` it returns.

Implementations, each chosen once when it is built:

* `v41cp.layers.full_sequence.FullSequence` — the rows are whole sequences from position 0 (the reference
  forward): every key is one of the sequence's own rows; its "cache" is the sequence's compressed entries by
  source; XLA, the Pallas kernels or operator-local QCP islands;
* `v41cp.serving.attention.paged_rows.PagedRows` — cached rows over the paged cache (decode, verification,
  token-serial and packed span prefill; XLA, the Pallas kernels, KVP / DCP islands or plain TP's split selection);
* `v41cp.serving.attention.qcp_rows.QCPRows` — model-wide QCP: each attention-TP rank its share of a span
  prefill's rows.

The last two continue requests whose history lives in a cache and share `CachedRows` (each row's own entry, its
pair partner from the step or the cache).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from v41cp.config import LayerRole
from v41cp.layers.attention import CSAState
from v41cp.layers.indexer import IndexQuery

__all__ = ["RowsBackend", "CachedRows"]


@runtime_checkable
class RowsBackend(Protocol):
    """See the module docstring. ``pos [B,R]`` int32 (each row's position), ``valid [B,R]`` bool (fed rows),
    ``narrows``: whether the step narrows to its CED decoder rows at the CED boundary (`ced_split`)."""

    pos: jax.Array
    valid: jax.Array
    narrows: bool
    columns: Any            # ShardingContext of `split_columns_einsum` (the cached rows of a sharded step) or None

    def ced_split(self) -> tuple["RowsBackend", "RowsBackend", object]:
        """CED narrowing at the boundary: ``(encoder rows' backend, decoder rows' backend, take)`` — ``take`` gathers
        a ``[B,R,…]`` row array to the decoder rows."""

    def sampled(self, h: jax.Array, at: jax.Array) -> jax.Array:
        """Row ``at [B]`` of each request of ``h [B,R,H]`` → ``[B,1,H]`` (−1: zeros): the rows that meet the
        head."""

    def last_rows(self, x: jax.Array, count: int):
        """Each request's last ``count`` rows of ``x [B,R,…]`` → ``(rows [B,count,…], positions, valid
        [B,count])``."""

    def window(self, cache: Any, layer: int, kv: jax.Array):
        """Window keys of every row (and the cache's window write): ``kv [B,R,D]`` → ``(cache, keys, valid
        [B,R,W])``; ``keys`` is the backend's own form, read back only by its `attend`."""

    def groups(self, cache: Any, role: LayerRole, c: jax.Array, z: jax.Array, part: str = "main"):
        """The compression groups (ratio ``r = role.ratio`` > 1) of the rows' FP32 projections ``c / z [B,R,D]``:
        ``(cache, c [B,N,r,D], z [B,N,r,D], j [B,N], emits [B,N])`` — each group's rows in order, its entry index
        ``j`` and whether it is written (complete). Ratio 1 needs no groups: each row is its entry ``pos``. V4 CSA
        (``role.overlapping``): ``[B,N,2r,D]``, the window before each group's rows first. ``part``: the layer's
        compressor (``"main"``) or its indexer's (``"index"``, V4 CSA), each with its own state."""

    def every_entry(self, cache: Any, role: LayerRole, state: CSAState) -> jax.Array:
        """V4 HCA's selection: every entry complete at each row's position, in entry order (−1 = not visible), over
        the history ``state`` reads."""

    def write_entries(self, cache: Any, role: LayerRole, ckv: jax.Array, ik: jax.Array, j: jax.Array,
                      emits: jax.Array):
        """Write the compressed entries ``j [B,N]`` (``ckv [B,N,D]`` rotated, index keys ``ik [B,N,Di]``; before
        the cache format's quantization) where ``emits``; returns the cache."""

    def history(self, cache: Any, role: LayerRole) -> CSAState:
        """The entries of KV source ``role`` (after this step's writes) for the selection and attention."""

    def select(self, cache: Any, role: LayerRole, query: IndexQuery, state: CSAState):
        """Index selection of every row against ``state.ikeys``: ``(topk [B,R,K], candidates, scores [B,R,G] or
        None where they are never materialized)``; ``query`` (`IndexQuery`) is projected where the rows are."""

    def attend(self, cache: Any, role: LayerRole, q: jax.Array, keys, valid: jax.Array, state: CSAState,
               sink: jax.Array) -> jax.Array:
        """Sink attention of every row over its window keys and selected entries: ``q [B,R,H,D]`` → ``[B,R,H,D]``."""


class CachedRows(RowsBackend):
    """Rows that continue cached histories (`PagedRows`, `QCPRows`): every row is a group's last row — its pair
    partner is the request's previous row of the step or, at the step's first row, the cached open pair
    (`group_first`, ratio 2) — and the group is written when the row closes it; selection projects every row."""

    @abstractmethod
    def group_first(self, cache: Any, src: str, c: jax.Array, z: jax.Array):
        """Ratio-2 pair partners of every row (``c / z [B,R,D]``) → ``(cache, c0, z0)``; the open pair is written."""

    def compressor_windows(self, cache: Any, role: LayerRole, c: jax.Array, z: jax.Array, part: str):
        """V4's compression windows of cached rows (`groups`): a backend with V4 compressor state implements it."""
        raise ValueError(f"layer {role.index}: {type(self).__name__} does not run DeepSeek-V4 compressors yet")

    def every_entry(self, cache: Any, role: LayerRole, state: CSAState) -> jax.Array:
        raise ValueError(f"layer {role.index}: {type(self).__name__} does not run DeepSeek-V4 HCA layers yet")

    @abstractmethod
    def select_queries(self, cache: Any, role: LayerRole, q: jax.Array, weights: jax.Array, state: CSAState):
        """Index selection of projected rows ``q [B,R,Hi,Di]`` / ``weights [B,R,Hi]`` → ``(topk, candidates)``."""

    def groups(self, cache: Any, role: LayerRole, c: jax.Array, z: jax.Array, part: str = "main"):
        if self.cfg.is_v4:
            return self.compressor_windows(cache, role, c, z, part)
        r = role.ratio
        if r != 2:
            raise ValueError(f"layer {role.index}: cached rows pair compression groups of ratio 2, not {r}")
        cache, c0, z0 = self.group_first(cache, str(role.kv_source), c, z)
        emits = self.valid & (self.pos % r == r - 1)
        return cache, jnp.stack([c0, c], -2), jnp.stack([z0, z], -2), self.pos // r, emits

    def select(self, cache: Any, role: LayerRole, query: IndexQuery, state: CSAState):
        q, weights = query()
        topk, candidates = self.select_queries(cache, role, q, weights, state)
        return topk, candidates, None
