"""A request's whole decode state as host bytes: what a prefix hit must reproduce exactly, and what a transfer moves.

`request_state(cache, blocks, tokens, block_tokens, kvp)` → ``{"pages": {"ckv"|"ikey": {source: leaves}}, "slot": slot state}``:

* for every global group (KV source ``g``, ratio ``ρ``) the request's complete entries ``0 .. tokens // ρ − 1`` in
  history order, gathered from its blocks (block ``blocks[j // epb]`` row ``j % epb``) as *stored* (record bytes
  undecoded: the record's uint8 leaves ``{"q", "s"}`` — V4's ``{"q", "s", "r"}`` —, or values); under KVP ``kvp = N`` the pools are the global arrays whose rank-``r``
  rows are ``[r · LB, (r + 1) · LB)`` and block ``v`` lives at rank ``v mod N`` row ``v // N``;
* the slot state (`v41cp.serving.cache.slot_state`): window rings, open ratio-2 pairs (and the drafter's window).

Rows of a partial last page past ``tokens`` and ring rows of a slot's earlier occupant are not the request's and may
hold anything; compare window rings only on rows of positions ``max(0, tokens − W) .. tokens − 1`` (`window_rows`).
"""

from __future__ import annotations

import jax
import numpy as np

from v41cp.serving.cache.device_cache import POOLS, PagedCache
from v41cp.serving.cache.paged import entries_per_block, page_rows, store_rows

__all__ = ["request_state", "window_rows"]


def request_state(cache: PagedCache, blocks, tokens: int, block_tokens: int, kvp: int = 1,
                  slot_state: dict | None = None) -> dict:
    """See the module docstring (``tokens``: the positions the cache holds; ``slot_state``: already taken)."""
    pages = {}
    for name in POOLS:
        pages[name] = {}
        for src, store in cache.pool(name).items():
            count = tokens // (block_tokens // entries_per_block(store))          # complete entries
            rows = np.asarray(page_rows(kvp, False, np.asarray(blocks, np.int32), store_rows(store)))
            pages[name][src] = jax.tree.map(lambda a: np.asarray(a)[rows].reshape(-1, *a.shape[2:])[:count], store)
    out = {"pages": pages}
    if slot_state is not None:
        out["slot"] = jax.tree.map(np.asarray, slot_state)
    return out


def window_rows(tokens: int, window: int) -> np.ndarray:
    """Ring rows holding the request's last ``window`` positions (``p mod W`` for ``p`` in its window)."""
    return np.arange(max(0, tokens - window), tokens) % window
