"""`RowsBackend`: what the one model's layers ask of a serving backend when their rows continue cached histories.

The model (`v41cp.model.Transformer`) runs the full sequence with ``rows=None`` (every key is one of the sequence's
own rows: the layers compute window, compressed entries and selection themselves). In a serving step its rows
continue requests whose keys live in a cache, and a backend moves those keys; it never reads a weight. Shapes:
``B`` batch rows of ``R`` rows each (packed layouts: ``B = 1`` and ``R`` the step's rows), ``W`` the window, ``D``
the head dim, ``Di`` / ``Hi`` the index head dim and heads, ``K`` the selected entries. ``cache`` is the backend's
own (a `v41cp.serving.cache.device_cache.PagedCache` for both implementations): the layers pass it through unread.

Implementations: `v41cp.serving.attention.paged_rows.PagedRows` (cached rows over the paged cache: decode,
verification, token-serial and packed span prefill; XLA, the Pallas kernels, KVP / DCP islands or plain TP's split
selection, chosen once when it is built) and `v41cp.serving.attention.qcp_rows.QCPRows` (model-wide QCP: each
attention-TP rank its share of a span prefill's rows).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

from v41cp.config import LayerRole
from v41cp.layers.attention import CSAState

__all__ = ["RowsBackend"]


@runtime_checkable
class RowsBackend(Protocol):
    """See the module docstring. ``pos [B,R]`` int32 (each row's position), ``valid [B,R]`` bool (fed rows),
    ``narrows``: whether the step narrows to its CED decoder rows at the CED boundary (`ced_split`)."""

    pos: jax.Array
    valid: jax.Array
    narrows: bool

    def ced_split(self) -> tuple["RowsBackend", "RowsBackend", object]:
        """CED narrowing at the boundary: ``(encoder rows' backend, decoder rows' backend, take)`` — ``take`` gathers
        a ``[B,R,…]`` row array to the decoder rows."""

    def sampled(self, h: jax.Array, at: jax.Array) -> jax.Array:
        """Row ``at [B]`` of each request of ``h [B,R,H]`` → ``[B,1,H]`` (−1: zeros): the rows that meet the head."""

    def last_rows(self, x: jax.Array, count: int):
        """Each request's last ``count`` rows of ``x [B,R,…]`` → ``(rows [B,count,…], positions, valid [B,count])``."""

    def window(self, cache: Any, layer: int, kv: jax.Array):
        """Window keys of every row and the ring write: ``kv [B,R,D]`` → ``(cache, keys [B,R,W,D], valid [B,R,W])``."""

    def group_first(self, cache: Any, src: str, c: jax.Array, z: jax.Array):
        """Ratio-2 pair partners of every row (``c / z [B,R,D]``) → ``(cache, c0, z0)``; the open pair is written."""

    def write_entries(self, cache: Any, role: LayerRole, ckv: jax.Array, ik: jax.Array, j: jax.Array,
                      emits: jax.Array) -> dict:
        """Write the compressed entries ``j [B,R]`` (``ckv [B,R,D]``, index keys ``ik [B,R,Di]``) where ``emits``."""

    def history(self, cache: Any, role: LayerRole) -> CSAState:
        """The gathered history of a KV source for the paths that need it (empty when they read pools in place)."""

    def select(self, cache: Any, role: LayerRole, q: jax.Array, weights: jax.Array, state: CSAState):
        """Index selection of every row: ``q [B,R,Hi,Di]`` / ``weights [B,R,Hi]`` → ``(topk [B,R,K], candidates)``."""

    def attend(self, cache: Any, role: LayerRole, q: jax.Array, keys, valid: jax.Array, state: CSAState,
               sink: jax.Array) -> jax.Array:
        """Sink attention of every row over its window keys and selected entries: ``q [B,R,H,D]`` → ``[B,R,H,D]``."""
