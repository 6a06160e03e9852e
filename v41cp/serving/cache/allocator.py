"""Host-side page allocation: logical blocks shared by every global cache group, per-request block
tables, batch slots for the per-request bounded state (SWA rings, compressor state), admission
control by free blocks, and freeing on completion or cancellation.

All decisions are made on the host from integers (no device round trip). Every mutating call either
succeeds completely or raises without changing any state, so a rejected request never harms the
others.

Under KVP (``kv_parallel_size = N > 1``) block ids are virtual: block ``v`` lives on rank ``v % N`` at
local row ``v // N`` (`v41cp.sharding.ownership`). A request's ``i``-th block is taken from residue class
``(i + s) % N``, where ``s`` (its first block's residue) is chosen at admission as the feasible residue
with the most free blocks, so every request's pages are cyclic over the ranks and the ranks fill evenly.

Prefix caching (`v41cp.serving.cache.prefix`): a request may start with *shared* blocks it reads but never
writes or frees (``admit(..., prefix=...)``; its own blocks continue the prefix's residue class), and may hand
blocks it wrote to the cache (`give`); the cache returns blocks it evicts with `free`.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np

__all__ = ["AllocationError", "BlockAllocator", "content_residue"]


def content_residue(prompt, block_tokens: int, n: int) -> int:
    """The KVP residue class a request whose prompt starts with ``prompt``'s first block prefers: a hash of that
    block's tokens mod ``n``. Placement then depends on content only, so two runs of the same prompt put every page
    on the same rank (the DCP merge adds per-rank partials: another placement rounds differently), prompts sharing
    a prefix share their page cycle (prefix caching), and different prompts spread over the ranks."""
    if n == 1:
        return 0
    head = np.asarray(list(prompt[:block_tokens]), np.int64).tobytes()
    return zlib.crc32(head) % n


class AllocationError(ValueError):
    """A request cannot be admitted or extended (names the request and the numbers involved)."""


@dataclass
class _Request:
    slot: int
    tokens: int
    blocks: list[int] = field(default_factory=list)
    residue: int = 0                       # residue class of the first block (KVP)
    shared: int = 0                        # leading blocks borrowed from the prefix cache
    given: set = field(default_factory=set)  # positions of blocks handed to the prefix cache


class BlockAllocator:
    """``num_blocks`` physical logical-blocks of ``block_tokens`` tokens and ``max_batch`` request slots.

    ``max_blocks_per_request`` bounds one request's history (the decode step's static capacity).
    ``kv_parallel_size``: the KVP group size N (``num_blocks`` must be a multiple of it).
    Block ids are handed out lowest-first (per residue class), so allocation is deterministic.
    """

    def __init__(self, num_blocks: int, block_tokens: int, max_batch: int, max_blocks_per_request: int,
                 kv_parallel_size: int = 1):
        for name, v in (("num_blocks", num_blocks), ("block_tokens", block_tokens), ("max_batch", max_batch),
                        ("max_blocks_per_request", max_blocks_per_request), ("kv_parallel_size", kv_parallel_size)):
            if type(v) is not int or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if num_blocks % kv_parallel_size:
            raise ValueError(f"num_blocks={num_blocks} must be a multiple of kv_parallel_size={kv_parallel_size}")
        self.num_blocks, self.block_tokens = num_blocks, block_tokens
        self.max_batch, self.max_blocks_per_request = max_batch, max_blocks_per_request
        self.n = kv_parallel_size
        # one stack per residue class: pop() gives the lowest id
        self._free = [list(range(num_blocks - self.n + r, -1, -self.n)) for r in range(self.n)]
        self._free_slots = list(range(max_batch - 1, -1, -1))
        self._requests: dict[object, _Request] = {}

    # ------------------------------------------------------------------ queries
    @property
    def free_blocks(self) -> int:
        return sum(len(f) for f in self._free)

    @property
    def _free_blocks(self) -> list[int]:
        return [b for f in self._free for b in f]

    def _fits(self, first: int, count: int, residue: int, reclaim=()) -> bool:
        """Whether blocks ``first .. first + count − 1`` of a request starting at ``residue`` are free (counting
        the blocks ``reclaim`` as free too)."""
        need = [0] * self.n
        for i in range(first, first + count):
            need[(i + residue) % self.n] += 1
        for b in reclaim:
            need[b % self.n] -= 1
        return all(need[r] <= len(self._free[r]) for r in range(self.n))

    def _take(self, first: int, count: int, residue: int) -> list[int]:
        return [self._free[(i + residue) % self.n].pop() for i in range(first, first + count)]

    def _residue_for(self, count: int, first: int = 0, residue: int | None = None, reclaim=()) -> int | None:
        if residue is not None:
            return residue if self._fits(first, count - first, residue, reclaim) else None
        fits = [r for r in range(self.n) if self._fits(first, count - first, r, reclaim)]
        return max(fits, key=lambda r: (len(self._free[r]), -r)) if fits else None

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def capacity_tokens(self) -> int:
        """Longest history one request may hold."""
        return self.max_blocks_per_request * self.block_tokens

    def __contains__(self, rid) -> bool:
        return rid in self._requests

    def blocks(self, rid) -> list[int]:
        return list(self._req(rid).blocks)

    def slot(self, rid) -> int:
        return self._req(rid).slot

    def tokens(self, rid) -> int:
        return self._req(rid).tokens

    def blocks_needed(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def fits_when_empty(self, tokens: int) -> bool:
        """Whether a request of ``tokens`` could ever be admitted (every block and slot free): a request that
        cannot must be rejected at submit, not left waiting forever."""
        count = self.blocks_needed(tokens)
        return 0 < tokens <= self.capacity_tokens and -(-count // self.n) <= self.num_blocks // self.n

    def can_admit(self, tokens: int, prefix_blocks: int = 0, residue: int | None = None, reclaim=()) -> bool:
        """Whether a request of ``tokens`` tokens fits now, its first ``prefix_blocks`` blocks shared (then its
        own blocks are in the prefix's ``residue`` class); ``reclaim``: blocks not free now that would be freed
        first (the prefix cache's unreferenced blocks), counted as free."""
        return (0 < tokens <= self.capacity_tokens and self.free_slots > 0 and prefix_blocks <= self.blocks_needed(tokens)
                and self._residue_for(self.blocks_needed(tokens), prefix_blocks, residue, reclaim) is not None)

    def can_extend(self, rid, tokens: int) -> bool:
        """Whether request ``rid`` can grow to ``tokens`` tokens now (its next blocks are free in its page cycle)."""
        req = self._req(rid)
        if tokens > self.capacity_tokens:
            return False
        return self._fits(len(req.blocks), max(self.blocks_needed(tokens) - len(req.blocks), 0), req.residue)

    # ------------------------------------------------------------------ mutations
    def admit(self, rid, tokens: int, prefix=(), residue: int | None = None) -> list[int]:
        """Reserve a slot and the blocks for ``tokens`` tokens of new request ``rid``; returns its blocks.
        ``prefix``: block ids its history starts with, shared (read only; not freed by this request); under KVP
        they must be cyclic from ``residue`` (the residue class of the first block) and the new blocks follow."""
        if rid in self._requests:
            raise AllocationError(f"request id {rid!r} is already active")
        if type(tokens) is not int or tokens <= 0:
            raise AllocationError(f"request {rid!r}: token count must be a positive integer, got {tokens!r}")
        if tokens > self.capacity_tokens:
            raise AllocationError(f"request {rid!r}: {tokens} tokens exceed the per-request capacity of "
                                  f"{self.capacity_tokens} ({self.max_blocks_per_request} blocks x "
                                  f"{self.block_tokens} tokens)")
        if not self._free_slots:
            raise AllocationError(f"request {rid!r}: all {self.max_batch} batch slots are in use")
        need, first = self.blocks_needed(tokens), len(prefix)
        if first > need:
            raise AllocationError(f"request {rid!r}: {first} shared blocks exceed the {need} its {tokens} tokens need")
        if prefix:
            residue = prefix[0] % self.n if residue is None else residue
            bad = [b for i, b in enumerate(prefix) if b % self.n != (i + residue) % self.n]
            if bad:
                raise AllocationError(f"request {rid!r}: shared block {bad[0]} breaks the cyclic page order from "
                                      f"residue {residue}")
        got = self._residue_for(need, first, residue)
        if got is None:
            raise AllocationError(f"request {rid!r}: needs {need - first} blocks, {self.free_blocks} free"
                                  + (f" (per rank: {[len(f) for f in self._free]})" if self.n > 1 else ""))
        req = _Request(self._free_slots.pop(), tokens, list(prefix) + self._take(first, need - first, got), got,
                       shared=first)
        self._requests[rid] = req
        return list(req.blocks)

    def extend(self, rid, tokens: int) -> list[int]:
        """Grow request ``rid`` to ``tokens`` tokens in total; returns the newly allocated blocks."""
        req = self._req(rid)
        if type(tokens) is not int or tokens < req.tokens:
            raise AllocationError(f"request {rid!r}: cannot shrink from {req.tokens} to {tokens!r} tokens")
        if tokens > self.capacity_tokens:
            raise AllocationError(f"request {rid!r}: {tokens} tokens exceed the per-request capacity of "
                                  f"{self.capacity_tokens}")
        need = max(self.blocks_needed(tokens) - len(req.blocks), 0)
        if not self._fits(len(req.blocks), need, req.residue):
            raise AllocationError(f"request {rid!r}: needs {need} more blocks, {self.free_blocks} free"
                                  + (f" (per rank: {[len(f) for f in self._free]})" if self.n > 1 else ""))
        new = self._take(len(req.blocks), need, req.residue)
        req.blocks.extend(new)
        req.tokens = tokens
        return new

    def give(self, rid, positions) -> None:
        """Hand the blocks at ``positions`` of request ``rid``'s table to the prefix cache: the request keeps
        reading them, `release` no longer frees them."""
        req = self._req(rid)
        positions = [int(i) for i in positions]
        bad = [i for i in positions if not req.shared <= i < len(req.blocks)]
        if bad:
            raise AllocationError(f"request {rid!r}: block position {bad[0]} is not one of its own "
                                  f"({req.shared}..{len(req.blocks) - 1})")
        req.given.update(positions)

    def free(self, blocks) -> None:
        """Return blocks the prefix cache held (evicted) to the free lists."""
        blocks = list(blocks)
        free = {b for f in self._free for b in f}
        for b in blocks:
            if not 0 <= b < self.num_blocks or b in free:
                raise AllocationError(f"block {b!r} cannot be freed: out of range or already free")
            free.add(b)
        for b in blocks:
            self._free[b % self.n].append(b)
        for f in self._free:
            f.sort(reverse=True)

    def release(self, rid) -> None:
        """Free everything request ``rid`` owns (completion or cancellation): not its shared blocks, not the
        blocks it gave to the prefix cache."""
        req = self._req(rid)
        del self._requests[rid]
        self.free([b for i, b in enumerate(req.blocks) if i >= req.shared and i not in req.given])
        self._free_slots.append(req.slot)
        self._free_slots.sort(reverse=True)

    finish = release
    cancel = release

    # ------------------------------------------------------------------ checks
    def check(self, cached=()) -> None:
        """Raise AssertionError unless every block / slot is owned exactly once or free exactly once; ``cached``:
        the blocks the prefix cache holds (shared blocks of requests must be among them)."""
        cached = list(cached)
        owned = [b for r in self._requests.values() for i, b in enumerate(r.blocks)
                 if i >= r.shared and i not in r.given] + cached
        shared = {b for r in self._requests.values() for i, b in enumerate(r.blocks) if i < r.shared or i in r.given}
        assert shared <= set(cached), "a request shares a block the prefix cache does not hold"
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert not set(owned) & set(self._free_blocks), "a block is both owned and free"
        assert sorted(owned + self._free_blocks) == list(range(self.num_blocks)), "a block leaked"
        slots = [r.slot for r in self._requests.values()]
        assert sorted(slots + self._free_slots) == list(range(self.max_batch)), "a slot leaked or is shared"
        for rid, r in self._requests.items():
            assert len(r.blocks) == self.blocks_needed(r.tokens), f"request {rid!r} holds the wrong block count"
            assert all(b % self.n == (i + r.residue) % self.n for i, b in enumerate(r.blocks)), \
                f"request {rid!r}: pages are not cyclic over the KVP ranks"
        for res, f in enumerate(self._free):
            assert all(b % self.n == res for b in f), "a free block is in the wrong residue class"

    def _req(self, rid) -> _Request:
        if rid not in self._requests:
            raise AllocationError(f"unknown request id {rid!r}")
        return self._requests[rid]
