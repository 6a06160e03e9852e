"""A request's bounded state outside the pages — its batch slot's rows — taken out of and put into the caches.

The slot state of ``slot`` (the fields with a ``slots`` axis of `PagedCache` and `DraftCache`): the window ring of
every layer ``swa[:, slot]`` (``[L, W, ·]``, stored bytes as they are), the open ratio-2 pair ``open_kv[g][slot] /
open_score[g][slot]`` (``[D]`` FP32 each), and with a drafter its context window ``keys[:, slot]`` (``[stages, W,
D]``). Replicated on every rank under KVP (only pages are split), so a snapshot is too. What prefix caching stores
at a block boundary (`v41cp.serving.cache.prefix`) and what a prefill → decode transfer carries besides the pages.
"""

from __future__ import annotations

from functools import partial

import jax

from v41cp.serving.cache.device_cache import SLOT_FIELDS, DraftCache, PagedCache

__all__ = ["take_slot_state", "put_slot_state", "state_bytes", "slot_state_bytes"]

# each part's slot axis, from the two caches' declared logical axes (their slot fields' names do not collide)
_SLOT_AXIS = {f: c.axes_of(f).index("slots") for c in (PagedCache, DraftCache) for f in c.slot_fields()}


def _parts(cache: PagedCache, dcache: DraftCache | None) -> dict:
    return {**cache.per_slot(), **(dcache.per_slot() if dcache is not None else {})}


@jax.jit
def _take(parts: dict, slot: jax.Array) -> dict:
    return {k: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, slot, _SLOT_AXIS[k], keepdims=False), v)
            for k, v in parts.items()}


@partial(jax.jit, donate_argnames=("parts",))
def _put(parts: dict, slot: jax.Array, state: dict) -> dict:
    def put(k, a, s):
        idx = (slice(None),) * _SLOT_AXIS[k] + (slot,)
        return a.at[idx].set(s)

    return {k: jax.tree.map(lambda a, s: put(k, a, s), v, state[k]) for k, v in parts.items()}


def take_slot_state(cache: PagedCache, slot: int, dcache: DraftCache | None = None) -> dict:
    """A copy of slot ``slot``'s state (device arrays, replicated like the cache's per-request state)."""
    return _take(_parts(cache, dcache), jax.numpy.int32(slot))


def put_slot_state(cache: PagedCache, slot: int, state: dict,
                   dcache: DraftCache | None = None) -> tuple[PagedCache, DraftCache | None]:
    """``(cache, dcache)`` with slot ``slot``'s state replaced by ``state`` (from `take_slot_state` of a cache of
    the same layout; the cache buffers are donated)."""
    parts = _parts(cache, dcache)
    if set(parts) != set(state):
        raise ValueError(f"slot state of parts {sorted(state)} does not fit caches of slot parts {sorted(parts)} "
                         "(a drafter's context window on one side only?)")
    parts = _put(parts, jax.numpy.int32(slot), state)
    cache = cache.replace(**{k: parts[k] for k in SLOT_FIELDS})
    return cache, (None if dcache is None else dcache.replace(**{k: parts[k] for k in DraftCache.slot_fields()}))


def slot_state_bytes(cache: PagedCache, dcache: DraftCache | None = None) -> int:
    """Bytes of one slot's state in ``cache`` (what `take_slot_state` returns), from the layout alone."""
    return sum(a.dtype.itemsize * a.size // a.shape[_SLOT_AXIS[k]]
               for k, v in _parts(cache, dcache).items() for a in jax.tree.leaves(v))


def state_bytes(state: dict) -> int:
    """Bytes of one slot state (per device: it is replicated)."""
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state))
