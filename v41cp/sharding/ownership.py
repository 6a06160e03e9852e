"""Page-cyclic KVP ownership: the integer math shared by the allocator, cache writes, the
distributed indexer and the DCP attention (pure functions; NumPy and jnp alike).

A global cache page is a *virtual block id* ``v`` of the LCM logical block (every ratio-1 / ratio-2
group's main KV and index keys share it). With a KVP group of ``n`` ranks:

* ``owner(v) = v % n`` and ``local(v) = v // n`` (the row of rank ``owner(v)``'s pool);
* the allocator gives a request's ``i``-th block the residue ``(i + s) % n`` where ``s`` is the residue
  of its first block — its pages are cyclic over the ranks, so every rank holds ``⌈P/n⌉`` or ``⌊P/n⌋``
  of a request's ``P`` pages (`pages_owned`);
* rank ``r`` therefore owns the block-table positions ``i_t = ((r − s) mod n) + n·t`` (`owned_positions`),
  in ascending order, so its entries are in ascending logical position — local top-k ties break the
  same way as global ones.

Entry ``j`` of a ratio-``ρ`` group (``epb = block_tokens / ρ`` entries per page) lives in page
``j // epb`` at row ``j % epb``. SWA rings, compressor tails and Engram history are replicated.
Padding block ids are −1 and are never owned (no ``-1 % n == n − 1`` trap: every test is ``v >= 0``).
"""

from __future__ import annotations

__all__ = ["owner", "local_row", "owned_positions", "pages_owned", "is_owned"]


def owner(v, n: int):
    """Rank that owns virtual block ``v`` (−1 for padding)."""
    return (v >= 0) * (v % n) + (v < 0) * -1


def local_row(v, n: int):
    """Row of virtual block ``v`` in its owner's pool."""
    return v // n


def is_owned(v, n: int, rank):
    """Whether ``rank`` owns virtual block ``v`` (padding −1 is owned by nobody)."""
    return (v >= 0) & (v % n == rank)


def owned_positions(first_block, rank, n: int, max_blocks: int, xp=None):
    """Block-table positions ``[..., ⌈max_blocks / n⌉]`` that ``rank`` owns for rows whose first block is
    ``first_block [...]`` (ascending); positions ``≥ max_blocks`` are out of the table (mask them)."""
    import numpy as np

    xp = xp or np
    s = xp.where(first_block >= 0, first_block % n, 0)
    t = xp.arange(-(-max_blocks // n))
    return ((rank - s) % n)[..., None] + n * t


def pages_owned(num_pages: int, first_residue: int, rank: int, n: int) -> int:
    """How many of a request's ``num_pages`` pages ``rank`` owns (its pages start at residue ``first_residue``)."""
    start = (rank - first_residue) % n
    return 0 if start >= num_pages else (num_pages - 1 - start) // n + 1
