"""Prefill → decode transfer of one request's cache: the page-owner transfer plan and its execution.

A prefill-role engine (KVP ``Np``) has written the request's entries into its pages (virtual blocks ``src[i]``:
rank ``src[i] mod Np``, row ``src[i] // Np``); a decode-role engine (KVP = DCP ``Nd``) has reserved blocks
``dst[i]`` for it. `plan_transfer` lists, per (source rank, destination rank) pair, the entries to copy:

* ``Np == Nd`` — **rank-matched**: the decode blocks continue the prefill's page cycle (same residue), so page ``i``
  moves from rank ``r`` to rank ``r`` only;
* ``Np == 1`` — **relayout**: every page comes from the one prefill rank; each decode rank receives exactly the
  pages it owns;
* anything else is refused (`check_sizes`).

Only complete entries move — ``tokens // ratio`` per group, so a partial last page ships no stale rows — as stored
(record bytes — every uint8 leaf, ``{"q", "s"}`` or V4's ``{"q", "s", "r"}`` — copied as they are: no dequantize / requantize). The replicated slot state (window
rings, open ratio-2 pairs; `v41cp.serving.cache.slot_state`) travels with it to every decode device. `execute` moves the
bytes device to device (one gather on the source device, one copy per receiving device, one scatter there) and
returns the bytes it moved, which equal `TransferPlan.bytes` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from v41cp.serving.cache.device_cache import POOLS, PagedCache
from v41cp.serving.cache.paged import entries_per_block, store_rows
from v41cp.serving.cache.slot_state import put_slot_state, state_bytes, take_slot_state

__all__ = ["TransferPlan", "check_sizes", "plan_transfer", "execute", "shard_rank"]


def check_sizes(prefill_kvp: int, decode_kvp: int) -> None:
    """Refuse the size pairs the page-owner plans do not cover, naming them."""
    if prefill_kvp not in (1, decode_kvp):
        raise ValueError(f"prefill KVP {prefill_kvp} cannot feed decode KVP = DCP {decode_kvp}: the prefill's KVP must "
                         f"be 1 (relayout to the decode owners) or equal to the decode's ({decode_kvp}, rank-matched)")


@dataclass(frozen=True)
class TransferPlan:
    """The entries of one request to copy. ``copies[group][(src_rank, dst_rank)]`` = ``(src_rows, dst_rows,
    in_page)`` int arrays: entry ``k`` goes from source pool row ``src_rows[k]`` (that rank's local row) to destination
    row ``dst_rows[k]``, both at in-page index ``in_page[k]``. ``tokens``: the positions the request's cache holds."""

    tokens: int
    prefill_kvp: int
    decode_kvp: int
    pages: int
    copies: dict

    @property
    def mode(self) -> str:
        return "rank-matched" if self.prefill_kvp == self.decode_kvp else "relayout"

    def entries(self, group: str) -> int:
        return sum(len(c[0]) for c in self.copies[group].values())

    def rank_pairs(self) -> set:
        return {pair for g in self.copies.values() for pair in g}

    def bytes(self, src_cache: PagedCache, dst_replicas: int, dst_devices: int, slot_bytes: int) -> int:
        """Bytes `execute` moves: every entry's stored record (main KV + index key) once per device holding its
        destination rank's pages (``dst_replicas``), plus the slot state once per decode device."""
        per_entry = {src: sum(a.dtype.itemsize * int(np.prod(a.shape[2:]))
                              for name in POOLS if src in src_cache.pool(name)      # V4 HCA: no index keys
                              for a in jax.tree.leaves(src_cache.pool(name)[src]))
                     for src in self.copies}
        return sum(self.entries(g) * per_entry[g] for g in self.copies) * dst_replicas + slot_bytes * dst_devices


def plan_transfer(src_blocks, dst_blocks, tokens: int, block_tokens: int, ratios: dict, prefill_kvp: int,
                  decode_kvp: int) -> TransferPlan:
    """The page-owner plan of a request holding ``tokens`` positions in prefill blocks ``src_blocks`` bound for decode
    blocks ``dst_blocks`` (``ratios``: compress ratio per KV source group)."""
    check_sizes(prefill_kvp, decode_kvp)
    pages = -(-tokens // block_tokens)
    if len(src_blocks) < pages or len(dst_blocks) < pages:
        raise ValueError(f"transfer of {tokens} tokens needs {pages} pages: the prefill holds {len(src_blocks)}, the "
                         f"decode reserved {len(dst_blocks)}")
    src, dst = np.asarray(src_blocks[:pages], np.int64), np.asarray(dst_blocks[:pages], np.int64)
    if prefill_kvp == decode_kvp and (src % decode_kvp != dst % decode_kvp).any():
        raise ValueError("rank-matched transfer: the decode blocks must continue the prefill's page cycle")
    copies = {}
    for group, ratio in ratios.items():
        epb = block_tokens // ratio
        j = np.arange(tokens // ratio)                      # complete entries only
        page, in_page = j // epb, j % epb
        s_rank, d_rank = src[page] % prefill_kvp, dst[page] % decode_kvp
        copies[group] = {}
        for pair in sorted(set(zip(s_rank.tolist(), d_rank.tolist()))):
            k = (s_rank == pair[0]) & (d_rank == pair[1])
            copies[group][pair] = (src[page[k]] // prefill_kvp, dst[page[k]] // decode_kvp, in_page[k])
    return TransferPlan(tokens, prefill_kvp, decode_kvp, pages, copies)


def shard_rank(shard, pool_rows: int, kvp: int) -> int:
    """The KVP rank whose pages a pool shard holds (pages split in ``kvp`` equal row ranges)."""
    start = shard.index[0].start or 0
    return start // (pool_rows // kvp) if kvp > 1 else 0


@jax.jit
def _gather_rows(pages: jax.Array, rows: jax.Array, in_page: jax.Array) -> jax.Array:
    """``pages [P, T, ...]`` at ``(rows[i], in_page[i])`` → ``[n, ...]`` (one program, not one per indexing op)."""
    return pages[rows, in_page]


@jax.jit
def _store_rows(pages: jax.Array, rows: jax.Array, in_page: jax.Array, values: jax.Array) -> jax.Array:
    """``pages`` with ``values [n, ...]`` stored at ``(rows[i], in_page[i])``."""
    return pages.at[rows, in_page].set(values)


def _move_pool(store: dict | jax.Array, dst: dict | jax.Array, pair_copies: dict, src_kvp: int, dst_kvp: int):
    """One pool's leaves: gather on the source rank's device, copy to each device of the destination rank, scatter."""
    moved = 0
    leaves_src = store if isinstance(store, dict) else {"v": store}
    leaves_dst = dst if isinstance(dst, dict) else {"v": dst}
    out = {}
    for key, a in leaves_src.items():
        b = leaves_dst[key]
        src_shards = {}
        for sh in a.addressable_shards:
            src_shards.setdefault(shard_rank(sh, store_rows(a), src_kvp), sh.data)
        new = {sh.device: sh.data for sh in b.addressable_shards}
        for sh in b.addressable_shards:
            r_dst = shard_rank(sh, store_rows(b), dst_kvp)
            for (r_src, r_d), (s_rows, d_rows, in_page) in pair_copies.items():
                if r_d != r_dst or not len(s_rows):
                    continue
                src = src_shards[r_src]
                payload = _gather_rows(src, *(jax.device_put(np.asarray(x, np.int32), src.device)
                                              for x in (s_rows, in_page)))                  # on the source device
                got = jax.device_put(payload, sh.device)
                moved += got.nbytes
                new[sh.device] = _store_rows(new[sh.device], *(jax.device_put(np.asarray(x, np.int32), sh.device)
                                                               for x in (d_rows, in_page)), got)
        out[key] = jax.make_array_from_single_device_arrays(
            b.shape, b.sharding, [new[sh.device] for sh in b.addressable_shards])
    return (out if isinstance(dst, dict) else out["v"]), moved


def execute(plan: TransferPlan, src_cache: PagedCache, dst_cache: PagedCache, src_slot: int, dst_slot: int,
            dst_sharding, src_dcache=None, dst_dcache=None):
    """Move the request's entries and slot state from ``src_cache`` (prefill) into ``dst_cache`` (decode; its
    replicated parts are placed with ``dst_sharding``); with DSpark on both roles the slot state includes the
    drafter's context window (``src_dcache`` → ``dst_dcache``). Returns ``(dst_cache, dst_dcache, bytes moved)``."""
    moved = 0
    for name in POOLS:
        for group, pair_copies in plan.copies.items():
            if group not in src_cache.pool(name):                    # V4 HCA: no index keys
                continue
            pool, m = _move_pool(src_cache.pool(name)[group], dst_cache.pool(name)[group], pair_copies,
                                 plan.prefill_kvp, plan.decode_kvp)
            dst_cache = dst_cache.with_pool(name, group, pool)
            moved += m
    state = take_slot_state(src_cache, src_slot, src_dcache)
    state = jax.device_put(state, dst_sharding)
    n_dst = len(dst_sharding.device_set)
    moved += state_bytes(state) * n_dst
    dst_cache, dst_dcache = put_slot_state(dst_cache, dst_slot, state, dst_dcache)
    return dst_cache, dst_dcache, moved


def ratios_of(cache: PagedCache, block_tokens: int) -> dict:
    """Compress ratio of every KV source group of a cache (from its pages' entries per block)."""
    return {g: block_tokens // entries_per_block(s) for g, s in cache.ckv.items()}
