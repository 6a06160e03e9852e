"""KVP cache ownership and DCP decode attention inside the jitted decode step (`jax.shard_map` over ``cp``).

The global cache pools (``ckv[g]``, ``ikey[g]``: ``[num_blocks, epb, ·]``) are split over the ``cp`` axis
on their block dimension: rank ``r`` holds rows ``[r·LB, (r+1)·LB)`` of the global array, which are the
virtual blocks ``l·N + r`` (`v41cp.sharding.ownership`). Everything else of the decode state (SWA rings,
compressor tails) is replicated. Three operations run per compressed layer and row, each a shard_map island in
the otherwise GSPMD-partitioned step:

* writes (`v41cp.serving.cache.paged.write_owned`) — the new compressed entry / index key is computed by
  every rank (replicated) and written only by the owner of its page, at the local row;
* `select` — index sources score their owned index keys in tiles of pages with a running local top-k and
  block maxima (`v41cp.layers.topk_scan`: temporaries of one tile, not of the history) and run the exact
  distributed top-k (`v41cp.sharding.dist_topk`); the candidate source also the distributed block selection.
  The result (logical entry ids, −1 padding) is identical on every rank;
* `attend` — query heads of the group (all-gathered over ``cp``, or computed locally with replicated
  query projections), each rank attends the selected entries it owns (+ the replicated SWA window on
  cp rank 0 only), returns (output, LSE) without the sink, merges exactly (``ag_rs`` or ``a2a``), restoring
  the TP head layout, and applies the sink once.

History is never gathered: the per-step collectives are the query gathers, ``N·B·k`` top-k candidates,
``N·B·kb`` block candidates and the merge payload (`collective_plan` counts them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from v41cp.config import LayerRole, ModelConfig
from v41cp.kernels import interpret_mode
from v41cp.kernels.indexer_topk import index_block_maxima, indexer_topk
from v41cp.kernels.indexer_topk.reference import index_scores
from v41cp.kernels.sparse_attention import flatten_store, sparse_attention
from v41cp.layers.topk_scan import SCAN_TILE_BYTES, scan_topk, scan_topk_more, tile_count
from v41cp.serving.cache.records import record_bytes
from v41cp.sharding.dist_topk import (
    distributed_blocks,
    distributed_candidate_blocks_from_maxima,
    entries_in_kept,
    gather_merge_topk,
    kept_block_mask,
)
from v41cp.sharding.lse_merge import apply_sink, merge_a2a, merge_ag_rs, partial_attention
from v41cp.sharding.mesh import ATTN_TP, CP
from v41cp.sharding.ownership import owned_positions
from v41cp.sharding.topology import ParallelConfig

__all__ = ["DCPPlan", "select", "attend", "attend_visible", "gather_history", "gather_owned_records", "collective_plan",
           "KEPT_SHARE"]

# A rank's static capacity for the kept candidate entries it owns (Reindex layers), × an even share: page-cyclic
# ownership spreads the contiguous runs the candidate blocks form evenly, so 1.5× leaves the data-dependent overflow
# loop to short histories and unusual score patterns
KEPT_SHARE = 1.5


@dataclass(frozen=True)
class DCPPlan:
    """Static DCP layout of one decode step (hashable: a jit static argument).

    mesh: the ``(dp, tp, cp)`` mesh; ``n`` = its ``cp`` size (KVP = DCP); merge: ``ag_rs`` | ``a2a`` (partials
    over owned entries, LSE merge) | ``heads`` (selected records gathered, each rank its own heads);
    q_mode: ``gather`` | ``replicate``; heads_sharded: whether the query heads are split over attention TP
    (else replicated: the merge all-reduces instead of reduce-scattering); scan_tile_bytes: the temporaries
    of one tile of the XLA selection's scan over owned pages (`v41cp.layers.topk_scan`); kept_share: the static
    capacity of a rank's scan of the kept candidate entries it owns (Reindex layers), as a multiple of an even
    share (``candidate_topk_blocks · candidate_block_size / n``) — a rank owning more scans the rest in a loop of
    data-dependent length, so the result never depends on it.
    """

    mesh: Mesh
    merge: str = "ag_rs"
    q_mode: str = "gather"
    heads_sharded: bool = True
    scan_tile_bytes: int = SCAN_TILE_BYTES
    kept_share: float = KEPT_SHARE
    axis: str | tuple[str, ...] = CP
    replicated_pages: bool = False

    @property
    def n(self) -> int:
        axes = (self.axis,) if isinstance(self.axis, str) else self.axis
        out = 1
        for a in axes:
            out *= self.mesh.shape[a]
        return out

    def rank(self) -> jax.Array:
        """This rank's index in the page split (inside an island of the plan)."""
        return jax.lax.axis_index(self.axis)

    @property
    def pool_spec(self) -> P:
        """The pools' block-dimension layout entering an island: split over ``cp`` (KVP), or replicated."""
        return P() if self.replicated_pages else P(CP)

    @property
    def tp(self) -> int:
        return self.mesh.shape["tp"] * self.mesh.shape[CP]

    @classmethod
    def build(cls, cfg: ModelConfig, parallel: ParallelConfig, mesh: Mesh) -> "DCPPlan":
        parallel.validate_model(cfg)
        if mesh.shape.get(CP, 1) != parallel.kv_parallel_size:
            raise ValueError(f"topology: the mesh's cp axis ({mesh.shape.get(CP, 1)}) differs from "
                             f"kv_parallel_size={parallel.kv_parallel_size}")
        tp = mesh.shape["tp"] * mesh.shape[CP]
        sharded = cfg.num_attention_heads % tp == 0
        return cls(mesh, parallel.dcp_merge_for(cfg), parallel.dcp_q, sharded)

    @classmethod
    def split_selection(cls, mesh: Mesh) -> "DCPPlan":
        """Plain attention TP (replicated pages, KVP 1): the index selection's scoring split over the attention-TP
        ranks — rank ``r`` scores the pages at block-table positions ``≡ r (mod TP)`` of the replicated pool with
        every index head, and the exact distributed top-k merges them. Its only collectives are the index queries'
        gather and ``TP·B·k`` candidates: none grows with the history (`select`)."""
        return cls(mesh, axis=ATTN_TP, replicated_pages=True)

    # ------------------------------------------------------------------ specs
    @property
    def q_spec(self) -> P:
        """Per-rank query-head layout entering `attend`."""
        if not self.heads_sharded:
            return P()
        return P(None, "tp", None) if self.q_mode == "replicate" else P(None, ATTN_TP, None)

    @property
    def out_spec(self) -> P:
        """TP head layout of the attention output (and of the sink)."""
        return P(None, ATTN_TP, None) if self.heads_sharded else P()

    def shard_map(self, f, in_specs, out_specs, backend: str = "xla"):
        """A ``cp`` island. ``check_vma`` stays on, except around a Pallas kernel in *interpret* mode (CPU):
        JAX's Pallas HLO interpreter re-evaluates the kernel body with the kernel's own index constants
        (invariant) gathering from varying refs, which its varying-axes check rejects (jax 0.10, "pass
        check_vma=False as a temporary workaround"); the compiled GPU kernel keeps the check."""
        check = not (backend == "pallas" and interpret_mode(self.mesh))
        return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)


def _local(pool):
    return pool["q"] if isinstance(pool, dict) else pool


def _owned_pages(plan: DCPPlan, tables: jax.Array):
    """This rank's owned table positions of ``tables [B, MB]`` → (positions ``[B, LT]``, owned mask, local rows).
    KVP: the pages ``v ≡ r (mod N)`` at local row ``v // N``; replicated pages: table positions ``≡ r (mod N)``."""
    n = plan.n
    r = plan.rank()
    mb = tables.shape[1]
    first = jnp.zeros_like(tables[:, 0]) if plan.replicated_pages else tables[:, 0]
    pos = owned_positions(first, r, n, mb, xp=jnp)                                  # [B, LT]
    v = jnp.take_along_axis(tables, jnp.minimum(pos, mb - 1), axis=1)
    if plan.replicated_pages:
        ok = (pos < mb) & (v >= 0)
        return pos, ok, jnp.where(ok, v, 0)
    ok = (pos < mb) & (v >= 0) & (v % n == r)
    return pos, ok, jnp.where(ok, v // n, 0)


def _entry_owners(plan: DCPPlan, tables: jax.Array, ids: jax.Array, epb: int):
    """Inside a ``cp`` island: where logical entries ``ids [B, X]`` (−1 = none) live → (``there``: the entry's page
    is allocated, ``own``: this rank owns it, its local block and offset — 0 where not owned)."""
    at = jnp.clip(ids // epb, 0, tables.shape[1] - 1)
    page = jnp.take_along_axis(tables, at, axis=1)
    there = (ids >= 0) & (page >= 0)
    if plan.replicated_pages:
        own = there & (at % plan.n == plan.rank())
        return there, own, jnp.where(own, page, 0), jnp.where(own, ids % epb, 0)
    own = there & (page % plan.n == plan.rank())
    return there, own, jnp.where(own, page // plan.n, 0), jnp.where(own, ids % epb, 0)


def _window_slots(valid: jax.Array) -> jax.Array:
    """Kernel slots of the window rows ``[B, W]`` in the flattened ring store (−1 where not ``valid``)."""
    b, w = valid.shape
    return jnp.where(valid, jnp.arange(b)[:, None] * w + jnp.arange(w), -1)


def _owned_rows(plan: DCPPlan, tables: jax.Array, epb: int):
    """This rank's owned table positions → (local block rows ``[B, LT]``, entry ids ``[B, LT·epb]`` with −1 for
    positions outside the table or unallocated)."""
    pos, ok, rows = _owned_pages(plan, tables)
    ids = pos[..., None] * epb + jnp.arange(epb)                                      # [B, LT, epb]
    ids = jnp.where(ok[..., None], ids, -1).reshape(tables.shape[0], -1)
    return rows, ids


def select(plan: DCPPlan, cfg: ModelConfig, role: LayerRole, read, ikey_pool, q: jax.Array, weights: jax.Array,
           tables: jax.Array, positions: jax.Array, cand_blocks):
    """Distributed selection of one index source for one query row per batch row.

    Under KVP each rank scores the index keys of its own pages; with replicated pages
    (`DCPPlan.split_selection`) the pages at its share of the block-table positions.
    q ``[B, index_heads, Di]`` / weights ``[B, index_heads]`` (replicated); ``read(pool, index)`` decodes
    records; tables ``[B, MB]``; positions ``[B]``; cand_blocks ``[B, kb]`` (uses_candidates layers) or None.
    Returns (``topk [B, min(index_topk, G)]`` logical entry ids, −1 padding; kept candidate blocks of the
    candidate source ``[B, kb]`` or the input ``cand_blocks``). ``G = MB · epb`` as in the reference.
    """
    epb = _local(ikey_pool).shape[1]
    g = tables.shape[1] * epb
    k = min(cfg.index_topk, g)

    def kernel_body(pool, q, weights, tables, positions, cand):
        pos, ok, rows = _owned_pages(plan, tables)
        pages, store = jnp.where(ok, rows, -1), flatten_store(pool)
        visible = (positions + 1) // role.ratio
        cbs, out_cand, mask = cfg.candidate_block_size, cand, None
        if role.candidate_source:
            maxima, blk = index_block_maxima(q, weights, store, pages, pos, visible, epb=epb, cbs=cbs,
                                             backend="pallas")
            out_cand = distributed_candidate_blocks_from_maxima(maxima, blk, visible, cfg.candidate_topk_blocks,
                                                                cbs, g, plan.axis)
        elif role.uses_candidates:
            mask = kept_block_mask(cand, -(-g // cbs))
        ids, vals = indexer_topk(q, weights, store, pages, pos, visible, k, epb=epb, block_mask=mask, cbs=cbs,
                                 backend="pallas")
        topk, _ = gather_merge_topk(vals, ids, k, plan.axis)
        return topk, out_cand

    def body(pool, q, weights, tables, positions, cand):
        # the owned pages in tiles with a running top-k (`v41cp.layers.topk_scan`): temporaries of one tile
        rows, ids = _owned_rows(plan, tables, epb)                                    # [B, LT], [B, LT·epb]
        b, lt = rows.shape
        visible = (positions + 1) // role.ratio
        ids = jnp.where(ids < visible[:, None], ids, -1)
        hi, di = q.shape[1], q.shape[2]
        per, tiles = tile_count(lt * epb, epb, b * 4 * (2 * di + 3 * hi), plan.scan_tile_bytes)
        pad = per * tiles - lt
        rows = jnp.pad(rows, ((0, 0), (0, pad)))
        ids = jnp.pad(ids, ((0, 0), (0, pad * epb)), constant_values=-1)
        cbs = cfg.candidate_block_size
        nb = -(-g // cbs)
        keep = kept_block_mask(cand, nb) if role.uses_candidates else None

        def score_tile(j):
            r = jax.lax.dynamic_slice_in_dim(rows, j * per, per, axis=1)
            i = jax.lax.dynamic_slice_in_dim(ids, j * per * epb, per * epb, axis=1)
            keys = read(pool, lambda a: a[r]).reshape(b, per * epb, -1)              # [B, tile, Di]
            scores = index_scores(q[:, None], weights[:, None], keys)[:, 0]
            if keep is not None:
                i = jnp.where(entries_in_kept(keep, i, cbs), i, -1)
            return scores, i

        vals, gid, maxima = scan_topk(score_tile, tiles, b, k, num_blocks=nb if role.candidate_source else None,
                                      block_size=cbs, carry_like=plan.rank())
        out_cand = cand
        if role.candidate_source:
            out_cand = distributed_blocks(maxima, visible, cfg.candidate_topk_blocks, cbs, plan.axis)
        topk, _ = gather_merge_topk(vals, gid, k, plan.axis)
        return topk, out_cand

    def kept_body(pool, q, weights, tables, positions, cand):
        # a Reindex layer inside the candidate blocks scores only the kept blocks' entries this rank owns — not its
        # whole history, nor the other ranks' kept entries: the kept entries (replicated) are cut down to this
        # rank's, in ascending id; a static share of them (`DCPPlan.kept_share` × an even share) runs in tiles of
        # the running top-k, the rest (a rank that owns more, e.g. a short history on one rank) in a loop of as
        # many more tiles as the rank's largest row needs
        b, kb = cand.shape
        cbs = cfg.candidate_block_size
        visible = (positions + 1) // role.ratio
        real = (cand >= 0) & (cand < -(-g // cbs))
        ids = (jnp.where(real, cand, 0)[..., None] * cbs + jnp.arange(cbs)).reshape(b, -1)   # [B, kb·cbs]
        ids = jnp.where(jnp.repeat(real, cbs, axis=1) & (ids < visible[:, None]) & (ids < g), ids, -1)
        own = _entry_owners(plan, tables, ids, epb)[1]
        total = kb * cbs
        hi, di = q.shape[1], q.shape[2]
        cap = min(total, -(-math.ceil(plan.kept_share * total / plan.n) // cbs) * cbs)
        per, tiles = tile_count(cap, cbs, b * 4 * (2 * di + 3 * hi), plan.scan_tile_bytes)
        cap = per * cbs * tiles
        more = max(cbs, -(-cap // (4 * cbs)) * cbs)        # the overflow loop's tile (a quarter of the share)
        rest = max(0, total - cap)
        width = cap + -(-rest // more) * more
        big = jnp.iinfo(jnp.int32).max
        mine = jnp.sort(jnp.where(own, ids, big), axis=1)                                # owned first, ascending
        mine = jnp.pad(mine, ((0, 0), (0, width - total)), constant_values=big)
        owned = jnp.max(jnp.sum(own, axis=1))                                             # this rank's largest row

        def score_at(start, size):
            i = jax.lax.dynamic_slice_in_dim(mine, start, size, axis=1)
            i = jnp.where(i == big, -1, i)
            _, ok, local, off = _entry_owners(plan, tables, i, epb)
            keys = read(pool, lambda a: a[local, off])                                  # [B, size, Di]
            return index_scores(q[:, None], weights[:, None], keys)[:, 0], jnp.where(ok, i, -1)

        state = scan_topk(lambda j: score_at(j * per * cbs, per * cbs), tiles, b, k, carry_like=plan.rank())
        if rest:
            extra = jnp.maximum(owned - cap, 0)
            state = scan_topk_more(lambda j: score_at(cap + j * more, more), -(-extra // more), state, k)
        topk, _ = gather_merge_topk(state[0], state[1], k, plan.axis)
        return topk, cand

    if cand_blocks is None:
        cand_blocks = jnp.zeros((tables.shape[0], 0), jnp.int32)
    spec = jax.tree.map(lambda _: plan.pool_spec, ikey_pool)
    if cfg.indexer_backend == "pallas":
        body = kernel_body
    elif role.uses_candidates:
        body = kept_body
    return plan.shard_map(body, (spec, P(), P(), P(), P(), P()), (P(), P()), cfg.indexer_backend)(
        ikey_pool, q, weights, tables, positions, cand_blocks)


def attend(plan: DCPPlan, read, q: jax.Array, ring: jax.Array, ring_valid: jax.Array, topk, ckv_pool,
           tables: jax.Array, sink: jax.Array, backend: str = "xla") -> jax.Array:
    """DCP attention of one compressed layer for one query row per batch row.

    q ``[B, H, D]`` (TP head layout, `DCPPlan.q_spec`); ring ``[B, W, D]`` / ring_valid ``[B, W]`` the
    replicated window keys; topk ``[B, K]`` selected entry ids (−1 padding, replicated); ckv_pool the
    cp-split compressed-KV pool; sink ``[H]``. Returns the sink-applied output ``[B, H, D]`` in the TP head
    layout (`DCPPlan.out_spec`). ``backend="pallas"``: each rank's partial (output, LSE) comes from the
    sparse-attention kernel, reading the window and its own pool shard in place (records decoded in-kernel)."""
    n = plan.n
    epb = _local(ckv_pool).shape[1]

    def heads_body(q, ring, ring_valid, topk, pool, tables, sink):
        # no partials: the selected entries' records come from their owners (one exact all-reduce of the stored
        # bytes, each entry non-zero on its owner only), and each rank attends its own query heads over the whole
        # window and every selected entry — attention work ÷ N, history-independent traffic
        if plan.q_mode == "replicate":                 # heads replicated over cp: this rank's slice
            hr = q.shape[1] // n
            q = jax.lax.dynamic_slice_in_dim(q, jax.lax.axis_index(CP) * hr, hr, axis=1)
        keys, valid = ring, ring_valid
        b, w = valid.shape
        if topk.shape[-1]:
            sel, own, local, off = _entry_owners(plan, tables, topk, epb)
            records = gather_owned_records(pool, own, local, off)                    # [B, K, ·] as stored
        if backend == "pallas":
            stores, indices = [ring.reshape(b * w, -1)], [_window_slots(valid)]
            if topk.shape[-1]:
                kk = topk.shape[-1]
                stores.append(flatten_store(records))
                indices.append(jnp.where(sel, jnp.arange(b)[:, None] * kk + jnp.arange(kk), -1))
            o, lse = sparse_attention(q, stores, indices, backend="pallas")
        else:
            if topk.shape[-1]:
                picked = read(records, lambda a: a)                                 # [B, K, D]
                keys = jnp.concatenate([ring, picked.astype(ring.dtype)], axis=1)
                valid = jnp.concatenate([valid, sel], axis=1)
            o, lse = partial_attention(q, keys, valid)
        return apply_sink(o, lse, sink).astype(q.dtype)

    def body(q, ring, ring_valid, topk, pool, tables, sink):
        if plan.heads_sharded and plan.q_mode == "gather":
            q = jax.lax.all_gather(q, CP, axis=1, tiled=True)                        # heads of the cp group
        keys = ring
        valid = ring_valid & (jax.lax.axis_index(CP) == 0)   # the replicated window counts on cp rank 0 only
        if topk.shape[-1]:                             # selected entries this rank owns: local block, offset
            _, own, local, off = _entry_owners(plan, tables, topk, epb)
        if backend == "pallas":
            b, w = valid.shape
            stores, indices = [ring.reshape(b * w, -1)], [_window_slots(valid)]
            if topk.shape[-1]:
                stores.append(flatten_store(pool))
                indices.append(jnp.where(own, local * epb + off, -1))
            o, lse = sparse_attention(q, stores, indices, backend="pallas")
        elif topk.shape[-1]:
            picked = read(pool, lambda a: a[local, off])                              # [B, K, D]
            keys = jnp.concatenate([ring, picked.astype(ring.dtype)], axis=1)
            valid = jnp.concatenate([valid, own], axis=1)
        if backend != "pallas":
            o, lse = partial_attention(q, keys, valid)
        return _merged(plan, o, lse, sink, q.dtype)

    sink_spec = P(*plan.out_spec[1:2])
    spec = jax.tree.map(lambda _: P(CP), ckv_pool)
    body = heads_body if plan.merge == "heads" else body
    return plan.shard_map(body, (plan.q_spec, P(), P(), P(), spec, P(), sink_spec), plan.out_spec, backend)(
        q, ring, ring_valid, topk, ckv_pool, tables, sink)


def _merged(plan: DCPPlan, o: jax.Array, lse: jax.Array, sink: jax.Array, dtype) -> jax.Array:
    """Inside a ``cp`` island: this rank's sink-free partial ``o [B, Hg, D]`` / ``lse [B, Hg]`` over the cp group's
    heads merged exactly (``a2a``, else ``ag_rs``: the ``heads`` mode's partial layers merge so), back in the TP head
    layout, the sink applied once."""
    if plan.merge == "a2a":
        o, lse = merge_a2a(o, lse, CP, plan.n)
    else:
        o, lse = merge_ag_rs(o, lse, CP, scatter=plan.heads_sharded)
    return apply_sink(o, lse, sink).astype(dtype)


def attend_visible(plan: DCPPlan, read, q: jax.Array, ring: jax.Array, ring_valid: jax.Array, ckv_pool,
                   tables: jax.Array, positions: jax.Array, ratio: int, sink: jax.Array) -> jax.Array:
    """DCP attention of a layer that attends every visible compressed entry (V4 HCA, `LayerRole.dense_history`) for
    one query row per batch row: each rank's partial attention over the entries of the pages it owns that are
    complete at the row's position (``j < (p + 1) // ratio``) — no selection, no record moves — plus the replicated
    window on cp rank 0 only, merged exactly by LSE (`_merged`; under the ``heads`` mode too: gathering every
    visible record would move the whole history), the sink once.

    q ``[B, H, D]`` (TP head layout, `DCPPlan.q_spec`); ring ``[B, W, D]`` / ring_valid ``[B, W]``; ckv_pool the
    cp-split pool; tables ``[B, MB]``; positions ``[B]``; sink ``[H]`` → ``[B, H, D]`` (`DCPPlan.out_spec`). A rank
    owning no visible entry (a short history) contributes an empty partial (LSE −inf)."""
    epb = _local(ckv_pool).shape[1]

    def body(q, ring, ring_valid, pool, tables, positions, sink):
        if plan.heads_sharded and plan.q_mode == "gather":
            q = jax.lax.all_gather(q, CP, axis=1, tiled=True)                        # heads of the cp group
        rows, ids = _owned_rows(plan, tables, epb)                                    # [B, LT], [B, LT·epb]
        b = rows.shape[0]
        owned = read(pool, lambda a: a[rows]).reshape(b, ids.shape[1], -1)           # [B, LT·epb, D]
        visible = (ids >= 0) & (ids < ((positions + 1) // ratio)[:, None])
        keys = jnp.concatenate([ring, owned.astype(ring.dtype)], axis=1)
        valid = jnp.concatenate([ring_valid & (jax.lax.axis_index(CP) == 0), visible], axis=1)
        o, lse = partial_attention(q, keys, valid)
        return _merged(plan, o, lse, sink, q.dtype)

    sink_spec = P(*plan.out_spec[1:2])
    spec = jax.tree.map(lambda _: P(CP), ckv_pool)
    return plan.shard_map(body, (plan.q_spec, P(), P(), spec, P(), P(), sink_spec), plan.out_spec)(
        q, ring, ring_valid, ckv_pool, tables, positions, sink)


def gather_owned_records(pool, own: jax.Array, local: jax.Array, off: jax.Array):
    """Inside a ``cp`` island: the stored leaves of selected entries ``[B, K, ·]`` on every rank, from their owners.

    ``own [B, K]`` marks the entries this rank owns (each selected entry on exactly one rank), at local block
    ``local`` / offset ``off``. Each rank contributes its own entries and zeros elsewhere; one all-reduce over
    ``cp`` sums them — exact, bytes as stored (value stores move as same-width unsigned words, so a −0 stays −0)."""

    def one(a):
        picked = jnp.where(own[..., None], a[local, off], jnp.zeros((), a.dtype))
        if jnp.issubdtype(a.dtype, jnp.floating):
            words = jnp.dtype(f"uint{8 * a.dtype.itemsize}")
            picked = jax.lax.bitcast_convert_type(picked, words)
            return jax.lax.bitcast_convert_type(jax.lax.psum(picked, CP), a.dtype)
        return jax.lax.psum(picked, CP)

    return jax.tree.map(one, pool)


def collective_plan(cfg: ModelConfig, plan: DCPPlan, max_batch: int, max_blocks: int, block_tokens: int) -> dict:
    """Analytical per-step bytes (result bytes on one device) of the collectives over the ``cp`` group that
    the DCP decode step issues: query-head gathers, top-k and block candidates, merge payload. (The index
    queries and weights, ``B·index_heads·(Di + 1)`` values per index source, are gathered over the whole
    attention-TP group when their heads are split; that gather is not over ``cp`` and not counted here.) None of them
    depends on the history capacity except through ``min(index_topk, G)`` / ``min(candidate_topk_blocks, nb)``
    (constant once the capacity exceeds ``index_topk`` entries)."""
    n, b, d = plan.n, max_batch, cfg.head_dim
    item = jnp.dtype(cfg.dtype).itemsize
    hg = cfg.num_attention_heads // plan.mesh.shape["tp"] if plan.heads_sharded else cfg.num_attention_heads
    out = {"q_gather": 0, "topk_candidates": 0, "block_candidates": 0, "merge": 0}
    record = record_bytes(cfg.cache_formats.entries, d, cfg.qk_rope_head_dim) if cfg.fake_quant else d * item
    for role in cfg.layer_roles:
        if role.ratio == 0:
            continue
        if plan.merge == "heads" and not role.dense_history:
            # the selected entries' records, all-reduced; no query gather, no merge (a V4 HCA layer attends every
            # visible entry: partials over owned entries, merged, in every mode — `attend_visible`)
            # a Reuse layer gathers exactly its source layer's records (same selection, same pool): XLA merges the
            # two identical all-reduces into one
            if role.kind != "reuse":
                out["merge"] += b * min(cfg.index_topk, max_blocks * block_tokens // role.ratio) * record
        else:
            if plan.heads_sharded and plan.q_mode == "gather":
                out["q_gather"] += b * hg * d * item
            if plan.merge == "a2a":
                out["merge"] += n * b * (hg // n) * (d + 1) * 4
            elif plan.heads_sharded:                # ag_rs (and the heads mode's partial layers)
                out["merge"] += n * b * hg * 4 + b * (hg // n) * d * 4
            else:
                out["merge"] += n * b * hg * 4 + b * hg * d * 4
        if role.is_index_source:
            g = max_blocks * block_tokens // role.ratio
            out["topk_candidates"] += 2 * b * n * min(cfg.index_topk, g) * 4
            if role.candidate_source:
                nb = -(-g // cfg.candidate_block_size)
                out["block_candidates"] += 2 * b * n * min(cfg.candidate_topk_blocks, nb) * 4
    out["total"] = sum(out.values())
    return out


def gather_history(plan: DCPPlan, pool, table: jax.Array):
    """Materialize one request's packed pages from their owners: ``table [MB]`` (virtual block ids, −1
    padding) → the pool's leaves as ``[MB, epb, ·]`` in table order on every rank (zeros for padding).

    Records are copied as stored (uint8 payload and scale bytes, no dequantize / requantize): each rank
    contributes its ``⌈MB/N⌉`` owned pages and one all-gather moves them. Position ``i`` is owned by rank
    ``(i + s) % N`` as its ``(i // N)``-th owned page (``s`` = the residue of the first block)."""
    n = plan.n
    mb = table.shape[0]

    def body(pool, table):
        _, ok, rows = (x[0] for x in _owned_pages(plan, table[None]))               # [LT]

        def one(a):
            mine = jnp.where(ok[:, None, None], a[rows], jnp.zeros((), a.dtype))       # [LT, epb, C]
            allp = jax.lax.all_gather(mine, CP, to="invarying")                      # [N, LT, epb, C]
            i = jnp.arange(mb)
            s = jnp.where(table[0] >= 0, table[0] % n, 0)
            got = allp[(i + s) % n, i // n]
            return jnp.where((table >= 0)[:, None, None], got, jnp.zeros((), a.dtype))

        return jax.tree.map(one, pool)

    spec = jax.tree.map(lambda _: P(CP), pool)
    return plan.shard_map(body, (spec, P()), jax.tree.map(lambda _: P(), pool))(pool, table)
