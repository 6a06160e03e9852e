"""A prefill → decode transfer between processes: each decode device's share of a `TransferPlan` as one byte vector.

PD across processes (`v41cp.serving.pd.processes`) puts the prefill role on process 0's ``L`` local devices and the
decode role on process 1's ``L``. Prefill device ``i`` (the ``i``-th local device by id) sends to decode device
``i``: every entry of the plan whose destination rank is the rank decode device ``i`` holds, then the request's
slot state (replicated: every decode device gets a copy). Rank-matched plans need prefill device ``i`` to hold the
same KVP rank as decode device ``i`` (the same topology on both sides gives that); relayout plans read from the
prefill's one rank, which every prefill device holds. `check_pairing` refuses anything else.

The bytes: every piece is the stored record as it is (`bitcast_convert_type` to uint8 — payload and scale bytes of
a packed record, BF16 / FP32 rows of the slot state: nothing is dequantized or requantized), concatenated in the
`WireLayout` order both processes compute from the plan and their caches' leaf shapes (equal: one config), padded to
a power-of-two bucket. One jitted `shard_map` over a mesh of all ``2L`` devices (the prefill devices first) moves them
with a `ppermute` ``i → L + i`` — on GPUs a NCCL send / receive between the hosts, on CPU processes gloo. Inside one
program (`DisaggregatedEngine(transport="collective")`) the same collective runs with both sides at hand. The bytes a
transfer moves (the unpadded vectors) equal `TransferPlan.bytes` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from v41cp.serving.cache.device_cache import POOLS, PagedCache
from v41cp.serving.cache.paged import store_rows
from v41cp.serving.cache.slot_state import put_slot_state
from v41cp.serving.pd.transfer import TransferPlan, _gather_rows, _store_rows, shard_rank

__all__ = ["WireLayout", "Wire", "check_pairing", "device_ranks"]



def _leaves(store) -> list[tuple[str, jax.Array]]:
    return sorted(store.items()) if isinstance(store, dict) else [("v", store)]


def _local_shards(a: jax.Array) -> dict:
    return {sh.device: sh for sh in a.addressable_shards}


def device_ranks(cache: PagedCache, devices: list, kvp: int) -> list[int]:
    """The KVP rank whose pages each of ``devices`` holds (all 0 without pools or KVP)."""
    groups = sorted(cache.ckv)
    if kvp == 1 or not groups:
        return [0] * len(devices)
    a = _leaves(cache.ckv[groups[0]])[0][1]
    shards = _local_shards(a)
    return [shard_rank(shards[d], store_rows(a), kvp) for d in devices]


def check_pairing(src_ranks: list[int], dst_ranks: list[int], prefill_kvp: int, decode_kvp: int) -> None:
    """Prefill device ``i`` must hold the pages decode device ``i`` receives (see the module docstring)."""
    if len(src_ranks) != len(dst_ranks):
        raise ValueError(f"PD across processes pairs prefill and decode devices one to one: {len(src_ranks)} prefill "
                         f"devices, {len(dst_ranks)} decode devices")
    if prefill_kvp == decode_kvp and src_ranks != dst_ranks:
        raise ValueError(f"rank-matched transfer across processes: prefill device ranks {src_ranks} and decode device "
                         f"ranks {dst_ranks} differ (the roles need the same topology)")


@dataclass(frozen=True)
class _Piece:
    pool: str            # "ckv" / "ikey" / "state"
    group: str
    key: str
    pair: tuple          # (source rank, destination rank); () for the slot state
    shape: tuple         # the piece's array shape
    dtype: object

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


class WireLayout:
    """The pieces each destination rank's byte vector holds, in order (both processes build it alike)."""

    def __init__(self, plan: TransferPlan, cache: PagedCache, state_shapes: dict):
        self.plan = plan
        self.state_tree = jax.tree.structure(state_shapes)
        self.state = [_Piece("state", "", str(i), (), tuple(s.shape), s.dtype)
                      for i, s in enumerate(jax.tree.leaves(state_shapes))]
        self.entries: dict[int, list[_Piece]] = {}
        for r_dst in range(plan.decode_kvp):
            pieces = []
            for pool in POOLS:
                for group in sorted(g for g in plan.copies if g in cache.pool(pool)):   # V4 HCA: no index keys
                    for key, a in _leaves(cache.pool(pool)[group]):
                        for pair, (s_rows, _, _) in sorted(plan.copies[group].items()):
                            if pair[1] == r_dst and len(s_rows):
                                pieces.append(_Piece(pool, group, key, pair, (len(s_rows), *a.shape[2:]), a.dtype))
            self.entries[r_dst] = pieces

    def pieces(self, r_dst: int) -> list[_Piece]:
        return self.entries[r_dst] + self.state

    def nbytes(self, r_dst: int) -> int:
        return sum(p.nbytes for p in self.pieces(r_dst))

    def bucket(self, dst_ranks: list[int]) -> int:
        """The padded vector length: a power of two covering the largest share (few compiled transfers)."""
        return max(1024, 1 << (max(self.nbytes(r) for r in dst_ranks) - 1).bit_length())


def _to_bytes(x: jax.Array) -> jax.Array:
    """The stored bytes of ``x``, flat (a wider dtype's bytes gain a trailing axis, then flatten)."""
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def _from_bytes(b: jax.Array, shape: tuple, dtype) -> jax.Array:
    size = np.dtype(dtype).itemsize
    if size == 1:
        return jax.lax.bitcast_convert_type(b.reshape(shape), dtype)
    return jax.lax.bitcast_convert_type(b.reshape(*shape, size), dtype)


@partial(jax.jit, static_argnames=("bucket",))
def _pack(sources: tuple, rows: tuple, in_pages: tuple, bucket: int) -> jax.Array:
    """One prefill device's vector ``[bucket]`` uint8, one program: each source's stored bytes in order — a pool
    shard ``[pages, page_tokens, ...]`` read at ``(rows[i], in_pages[i])``, or a slot-state leaf whole (its rows
    None) — concatenated and zero-padded."""
    parts = [_to_bytes(src if r is None else _gather_rows(src, r, p)) for src, r, p in zip(sources, rows, in_pages)]
    vec = jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.uint8)      # (≤ bucket: `Wire.send` checks)
    return jnp.pad(vec, (0, bucket - vec.shape[0]))


@partial(jax.jit, static_argnames=("pieces",))
def _unpack(vec: jax.Array, targets: tuple, rows: tuple, in_pages: tuple, pieces: tuple):
    """One decode device's received vector into its pool shards, one program. ``pieces``: per piece in the vector's
    order, ``(shape, dtype, target)`` — ``target`` the index in ``targets`` its rows are stored into at
    ``(rows[i], in_pages[i])``, or None for a slot-state leaf. Returns ``(targets updated, the state leaves)``."""
    targets, state, offset = list(targets), [], 0
    for (shape, dtype, target), r, p in zip(pieces, rows, in_pages):
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        values = _from_bytes(vec[offset:offset + nbytes], shape, dtype)
        offset += nbytes
        if target is None:
            state.append(values)
        else:
            targets[target] = _store_rows(targets[target], r, p, values)
    return tuple(targets), tuple(state)


class Wire:
    """The transfer program between ``prefill`` devices and ``decode`` devices (equal counts; device ``i`` of one
    sends to device ``i`` of the other) over a mesh of both: `send` on the prefill side, `receive` on the decode
    side — in two processes, each calls its side (the same collective); in one program, `transfer` does both."""

    def __init__(self, prefill: list, decode: list, src_ranks: list[int], dst_ranks: list[int]):
        if len(prefill) != len(decode):
            raise ValueError(f"the transfer pairs devices one to one: {len(prefill)} prefill, {len(decode)} decode")
        self.prefill, self.decode = list(prefill), list(decode)
        self.src_ranks, self.dst_ranks = src_ranks, dst_ranks
        self.half = len(prefill)
        self.mesh = jax.make_mesh((2 * self.half,), ("pd",), devices=self.prefill + self.decode,
                                  axis_types=(jax.sharding.AxisType.Explicit,))
        self.sharding = NamedSharding(self.mesh, P("pd"))
        perm = [(i, self.half + i) for i in range(self.half)]
        self._move = jax.jit(jax.shard_map(partial(jax.lax.ppermute, axis_name="pd", perm=perm), mesh=self.mesh,
                                           in_specs=P("pd"), out_specs=P("pd")))

    def _exchange(self, vectors: dict, bucket: int) -> dict:
        """Run the ppermute: ``vectors`` (prefill device → ``[bucket]`` uint8) for the prefill devices this process
        holds, zeros on the rest it holds; returns what each decode device this process holds received."""
        mine = [d for d in self.prefill + self.decode if d.process_index == jax.process_index()]
        shards = [(vectors[d] if d in vectors else jax.device_put(jnp.zeros((bucket,), jnp.uint8), d))
                  .reshape(1, bucket) for d in mine]
        out = _local_shards(self._move(jax.make_array_from_single_device_arrays((2 * self.half, bucket),
                                                                                self.sharding, shards)))
        return {d: out[d].data.reshape(-1) for d in self.decode if d in out}

    def send(self, layout: WireLayout, cache: PagedCache, state: dict, received: bool = False):
        """The prefill side: pack each prefill device's vector (from ``cache``'s pools and the slot ``state``) and
        send it. Returns the unpadded bytes sent (``received``: also what the decode devices got)."""
        plan, bucket = layout.plan, layout.bucket(self.dst_ranks)
        state_leaves = [_local_shards(a) for a in jax.tree.leaves(state)]
        vectors, sent = {}, 0
        for i, dev in enumerate(self.prefill):
            sources, rows, in_pages = [], [], []
            for piece in layout.pieces(self.dst_ranks[i]):
                if piece.pool == "state":
                    sources.append(state_leaves[int(piece.key)][dev].data)
                    rows.append(None)
                    in_pages.append(None)
                    continue
                if piece.pair[0] != self.src_ranks[i]:
                    raise AssertionError(f"prefill device {i} holds rank {self.src_ranks[i]}, not {piece.pair[0]}")
                shard = _local_shards(dict(_leaves(cache.pool(piece.pool)[piece.group]))[piece.key])[dev]
                s_rows, _, in_page = plan.copies[piece.group][piece.pair]
                sources.append(shard.data)
                rows.append(jax.device_put(np.asarray(s_rows, np.int32), dev))
                in_pages.append(jax.device_put(np.asarray(in_page, np.int32), dev))
            nbytes = sum((src.size if r is None else len(r) * int(np.prod(src.shape[2:]))) * src.dtype.itemsize
                         for src, r in zip(sources, rows))               # what the shards give, not the layout
            if nbytes > bucket:
                raise AssertionError(f"prefill device {i} packs {nbytes} bytes, over the {bucket}-byte vector")
            sent += nbytes
            vectors[dev] = _pack(tuple(sources), tuple(rows), tuple(in_pages), bucket)
        got = self._exchange(vectors, bucket)
        return (sent, got) if received else sent

    def receive(self, layout: WireLayout, cache: PagedCache, slot: int, got: dict | None = None, dcache=None):
        """The decode side: receive each decode device's vector (or take ``got``, what `send` delivered in this
        process) and scatter its pieces into ``cache``'s pools and slot ``slot`` (the slot state replicated over the
        decode devices, as the cache's window rings are; with DSpark the drafter's context window into ``dcache``).
        Returns ``(cache, dcache, unpadded bytes received)``."""
        plan = layout.plan
        if got is None:
            got = self._exchange({}, layout.bucket(self.dst_ranks))
        new = {pool: {g: {k: {sh.device: sh.data for sh in a.addressable_shards}
                          for k, a in _leaves(cache.pool(pool)[g])} for g in plan.copies if g in cache.pool(pool)}
               for pool in POOLS}
        state_parts = [dict() for _ in layout.state]
        received = 0
        for i, dev in enumerate(self.decode):
            names, targets, rows, in_pages, metas = {}, [], [], [], []
            for piece in layout.pieces(self.dst_ranks[i]):
                if piece.pool == "state":
                    metas.append((piece.shape, np.dtype(piece.dtype), None))
                    rows.append(None)
                    in_pages.append(None)
                    continue
                name = (piece.pool, piece.group, piece.key)
                if name not in names:
                    names[name] = len(targets)
                    targets.append(new[piece.pool][piece.group][piece.key][dev])
                if targets[names[name]].shape[2:] != piece.shape[1:]:
                    raise AssertionError(f"decode device {i}: {name} holds rows of {targets[names[name]].shape[2:]}, "
                                         f"the layout's piece {piece.shape[1:]}")
                _, d_rows, in_page = plan.copies[piece.group][piece.pair]
                metas.append((piece.shape, np.dtype(piece.dtype), names[name]))
                rows.append(jax.device_put(np.asarray(d_rows, np.int32), dev))
                in_pages.append(jax.device_put(np.asarray(in_page, np.int32), dev))
            stored, states = _unpack(got[dev], tuple(targets), tuple(rows), tuple(in_pages), tuple(metas))
            for (pool, group, key), t in names.items():
                new[pool][group][key][dev] = stored[t]
            for piece, values in zip(layout.state, states):
                state_parts[int(piece.key)][dev] = values
            received += layout.nbytes(self.dst_ranks[i])
        for pool in POOLS:
            for g in (g for g in plan.copies if g in cache.pool(pool)):
                store = cache.pool(pool)[g]
                out = {k: jax.make_array_from_single_device_arrays(
                    a.shape, a.sharding, [new[pool][g][k][sh.device] for sh in a.addressable_shards])
                    for k, a in _leaves(store)}
                cache = cache.with_pool(pool, g, out if isinstance(store, dict) else out["v"])
        ring = jax.tree.leaves(cache.swa)[0].sharding
        replicated = NamedSharding(ring.mesh, P())
        leaves = [jax.make_array_from_single_device_arrays(piece.shape, replicated, [parts[d] for d in self.decode])
                  for piece, parts in zip(layout.state, state_parts)]
        cache, dcache = put_slot_state(cache, slot, jax.tree.unflatten(layout.state_tree, leaves), dcache)
        return cache, dcache, received

    def transfer(self, layout: WireLayout, src_cache: PagedCache, state: dict, dst_cache: PagedCache,
                 slot: int, dst_dcache=None):
        """Both sides in one program (every device addressable): ``(dst_cache, dst_dcache, bytes moved)``."""
        sent, got = self.send(layout, src_cache, state, received=True)
        dst_cache, dst_dcache, received = self.receive(layout, dst_cache, slot, got, dst_dcache)
        if sent != received:
            raise AssertionError(f"transfer sent {sent} bytes but received {received}")
        return dst_cache, dst_dcache, received
