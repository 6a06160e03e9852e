"""Span prefill: a batch of fresh prompts through the model in one pass (rows in parallel, not token-serial),
writing the paged decode caches and returning the logits of each prompt's last row; with model-wide QCP.

`prefill_span(params, cache, meta, cfg, layout)` — ``meta`` from `build_span_metadata`; ``layout``
(`SpanLayout`, static) says how the rows are partitioned:

* one device, or GSPMD over a plain-TP / KVP mesh (``query_parallel=False``): the one model over the pass's rows
  as cached rows (`v41cp.serving.paged_rows`: KVP through the DCP islands, operator-local QCP through the layers'
  islands, CED as an encoder-only pass over the rows before the retained decoder rows);
* **model-wide QCP** (``query_parallel=True``, N = attention TP): one ``jax.shard_map`` over attention TP.
  Each rank holds its rows of the per-request zigzag plan from the embedding to the final norm:

  - attention heads are replicated (`QCP_RULES`): a rank attends its own rows with every head against the
    complete history; no partial attention is merged;
  - cache production reads the complete span: each rank's window-KV rows and compressor projections are
    all-gathered and restored to span order (``span_index``) before pooling, pairing, windows and cache
    writes, so a rank boundary is never a compressor pairing or cache boundary; every rank then writes the
    same rows (owner-masked when KVP = QCP: a page is written by its owner only);
  - vocab, experts, MLP width and Engram rows stay split over attention TP: the embedding lookup, Engram
    table lookup (hash ids all-gathered) and MoE (rows all-gathered) compute their slice for every row and
    reduce-scatter the contributions back to the local rows; the head multiplies only the sampled rows
    (gathered by an all-reduce of B rows) and returns vocab-sharded logits;
  - ranks without rows still join every collective (their slots are padding);
  - CED narrowing: the boundary layer produces its global KV / index keys from every row; only the retained
    decoder rows continue, each on the rank that owned it (``dec_slots``), and their gathers restore
    canonical order through ``dec_span_index`` — no row is redistributed.

Caches (`v41cp.serving.decode.init_cache` layout) after the call equal those of the token-serial prefill of the
same prompts: SWA ring rows of the last ``W`` positions, every complete compressed entry and index key of
each KV source in the prompt's pages, and the open ratio-2 pair's projections.

A prompt may be prefilled in passes (``meta.starts``): a later pass (``meta.continued``) reads the cached
history — its window rows from the SWA ring (before writing it), the open ratio-2 pair when the pass starts at
an odd position, and the request's compressed entries / index keys from its pages; under KVP every rank
contributes the pages it owns and one all-reduce over the group gives every rank the same history.

Selection follows ``indexer_backend`` (`select_positions`, each query row scoring its prompt's keys); the
attention is the XLA path (``attention_backend`` is not used here).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from v41cp.config import LayerRole, ModelConfig
from v41cp.kernels import interpret_mode
from v41cp.layers.attention import sink_attention
from v41cp.layers.common import dtype_of, rms_norm
from v41cp.layers.engram import engram_lookup, engram_mix
from v41cp.layers.indexer import select_positions
from v41cp.layers.mhc import HyperConnection, collapse, expand
from v41cp.layers.moe import dense_route_weights, expert_weights, route, routed_output, shared_output
from v41cp.layers.rope import apply_rope, rope_angles
from v41cp.quant import fp8_block32, mxfp4_block32, nvfp4_block16
from v41cp.serving import paged_cache as pc
from v41cp.serving.paged_cache import cache_slots
from v41cp.serving.span_metadata import SpanMetadata
from v41cp.sharding.mesh import ATTN_TP, CP
from v41cp.sharding.rules import ShardingContext

__all__ = ["SpanLayout", "prefill_span"]


@dataclass(frozen=True)
class SpanLayout:
    """Static partitioning of a span prefill. ``mesh`` None = one device; ``query_parallel``: model-wide QCP
    over the mesh's attention-TP axes; ``kv_parallel``: the KVP group size (the mesh's ``cp`` axis) when the
    pages are split over it (`init_cache(..., plan=...)`), else 1 (replicated pages); ``operator``: the
    operator-local indexer / attention QCP settings (a `ShardingContext`; the cached-rows path). Build from a
    topology with `from_parallel`."""

    mesh: Mesh | None = None
    query_parallel: bool = False
    kv_parallel: int = 1
    operator: ShardingContext | None = None

    def __post_init__(self):
        if self.kv_parallel > 1 and (self.mesh is None or self.mesh.shape.get(CP, 1) != self.kv_parallel):
            raise ValueError(f"span prefill: kv_parallel={self.kv_parallel} needs a mesh whose cp axis has that size")

    @classmethod
    def from_parallel(cls, parallel, mesh: Mesh | None) -> "SpanLayout":
        """The layout of `v41cp.sharding.topology.ParallelConfig` ``parallel`` on ``mesh``."""
        if mesh is None:
            return cls()
        local = parallel.indexer_query_parallel_size > 1 or parallel.attention_query_parallel_size > 1
        return cls(mesh, parallel.query_context_parallel_size > 1, parallel.kv_parallel_size,
                   parallel.sharding_context(mesh) if local else None)

    @property
    def axes(self) -> tuple[str, ...]:
        if self.mesh is None:
            return ()
        return tuple(a for a in ATTN_TP if self.mesh.shape.get(a, 1) > 1)

    @property
    def n(self) -> int:
        """Ranks the rows are split over (1 without QCP)."""
        return int(np.prod([self.mesh.shape[a] for a in self.axes])) if self.query_parallel else 1


class _Group:
    """Collectives over the query group; identities when the rows are not split (n = 1)."""

    def __init__(self, axes: tuple[str, ...], n: int):
        self.axes, self.n = axes, n

    def rank(self):
        return jax.lax.axis_index(self.axes) if self.n > 1 else 0

    def gather(self, x):
        """Local rows ``[C, ·]`` → every rank's rows ``[N·C, ·]`` (rank-major), identical on every rank."""
        return jax.lax.all_gather(x, self.axes, tiled=True, to="invarying") if self.n > 1 else x

    def sum_scatter(self, x):
        """Per-rank contributions for every row ``[N·C, ·]`` → their sum at the local rows ``[C, ·]``."""
        return jax.lax.psum_scatter(x, self.axes, scatter_dimension=0, tiled=True) if self.n > 1 else x

    def psum(self, x):
        return jax.lax.psum(x, self.axes) if self.n > 1 else x

    def to_span(self, local, index):
        """Local rows ``[C, ·]`` → span order ``[B, S, ·]`` through ``index`` (absent rows: zeros)."""
        g = self.gather(local)
        return jnp.concatenate([g, jnp.zeros((1, *g.shape[1:]), g.dtype)])[index]

    def owned_slice(self, ids, local_rows: int, total_rows: int):
        """Row ids of a table split over the group → (local ids clipped into the slice, owned mask)."""
        if local_rows == total_rows:
            return ids, jnp.ones(ids.shape, bool)
        local = ids - self.rank() * local_rows
        own = (local >= 0) & (local < local_rows)
        return jnp.clip(local, 0, local_rows - 1), own


class _Rows(NamedTuple):
    """One row layout: ``pos / req [C]`` (req −1 = padding slot), ``index [B,S]`` (span → gathered position),
    ``present [B,S]`` (row computed in this layout)."""

    pos: jax.Array
    req: jax.Array
    index: jax.Array
    present: jax.Array


def _split_lookup(grp: _Group, lookup, table_rows: int, total_rows: int, ids, dtype_zero):
    """Lookup of ``ids [C, ...]`` in a table whose rows may be split over the group: gather the ids, look up
    the owned rows (others 0), reduce-scatter back (exact: one non-zero term per row)."""
    if table_rows == total_rows or grp.n == 1:
        return lookup(ids)
    all_ids = grp.gather(ids)
    local, own = grp.owned_slice(all_ids, table_rows, total_rows)
    got = lookup(local)
    got = jnp.where(own.reshape(own.shape + (1,) * (got.ndim - own.ndim)), got, dtype_zero)
    return grp.sum_scatter(got)


def _moe(cfg: ModelConfig, grp: _Group, p: dict, x: jax.Array) -> jax.Array:
    """MoE of the local rows ``x [C, H]``: with experts / shared width split over the group, the rows are
    gathered, each rank applies its slice to every row and the partial outputs are reduce-scattered."""
    dt = dtype_of(cfg.dtype)
    w1, w3, w2 = expert_weights(p, dt)
    e_split = w1.shape[0] < cfg.n_routed_experts
    m_split = p["shared_w1"].shape[1] < cfg.moe_intermediate_size
    gathered = grp.n > 1 and (e_split or m_split)
    xa = grp.gather(x) if gathered else x
    w, idx = route(cfg, xa, p["gate_weight"], p["gate_bias"], p["gate_bias_vl"])
    dense = dense_route_weights(cfg, w, idx)
    if e_split:
        dense = jax.lax.dynamic_slice_in_dim(dense, grp.rank() * w1.shape[0], w1.shape[0], axis=1)
    routed = routed_output(cfg, xa, dense, w1, w3, w2)
    shared = shared_output(cfg, xa, p["shared_w1"], p["shared_w3"], p["shared_w2"]).astype(jnp.float32)
    if gathered:
        lead = grp.rank() == 0                     # a replicated part is counted once
        routed = routed if e_split else jnp.where(lead, routed, 0.0)
        shared = shared if m_split else jnp.where(lead, shared, 0.0)
        return grp.sum_scatter(routed + shared).astype(x.dtype)
    return (routed + shared).astype(x.dtype)


def _engram(cfg: ModelConfig, grp: _Group, slot: int, p: dict, streams, ids):
    """Engram on local rows ``streams [1,C,hc,H]`` with hash ids ``ids [C, hash_heads]``."""
    dt = dtype_of(cfg.dtype)
    table = {k: v for k, v in p.items() if k.startswith("embed")}
    rows = next(iter(table.values())).shape[0]
    got = _split_lookup(grp, lambda i: engram_lookup(cfg, table, i, dt), rows, cfg.engram_table_rows(slot), ids,
                        jnp.zeros((), dt))
    return engram_mix(cfg, streams, got[None], p["wkv"], p["q_weight"], p["k_weight"])


class _Placement(NamedTuple):
    """Where page writes land: ``kvp`` ranks own pages cyclically; ``in_map`` = inside the QCP shard_map (the
    pools are the rank's local rows) else one device / GSPMD over the global pool (structure baselines)."""

    kvp: int
    in_map: bool


def _write_entries(cfg, place: _Placement, store, values, j, ok, block_tables, fmt: str):
    return pc.write_entries(cfg, place.kvp, place.in_map, store, values, j, ok, block_tables, fmt)


def _read_pages(cfg, place: _Placement, store, block_tables, fmt: str, dtype):
    return pc.read_pages(place.kvp, place.in_map, store, block_tables, fmt, dtype)


def _attention(cfg: ModelConfig, role: LayerRole, p: dict, grp: _Group, place: _Placement, xq, rq: _Rows, xkv,
               rkv: _Rows, meta: SpanMetadata, cache: dict, state: dict):
    """One layer's attention for query rows ``xq [Cq, H]`` (layout ``rq``); window KV and compressor inputs
    from rows ``xkv`` (layout ``rkv``: the same rows, or every row at the CED boundary). Writes this layer's
    caches; returns ``([Cq, H], cache, state)``."""
    dt = dtype_of(cfg.dtype)
    w = cfg.sliding_window
    compressed = role.ratio > 0
    b, s = meta.span_index.shape
    angles = rope_angles(cfg, rq.pos[:, None], compressed)                          # [Cq,1,P]
    qr = rms_norm(xq @ p["wq_a"].astype(xq.dtype), p["q_norm"]["weight"], cfg.rms_norm_eps)
    q = apply_rope(jnp.einsum("cr,rnd->cnd", qr, p["wq_b"].astype(qr.dtype))[:, None], angles)    # [Cq,1,nh,D]
    akv = angles if xkv is xq else rope_angles(cfg, rkv.pos[:, None], compressed)
    kv_loc = apply_rope(rms_norm(xkv @ p["wkv"].astype(xkv.dtype), p["kv_norm"]["weight"],
                                 cfg.rms_norm_eps)[:, None], akv)[:, 0]
    kv_raw = grp.to_span(kv_loc, rkv.index)                                          # [B,S,D] span order
    kv = fp8_block32(kv_raw) if cfg.fake_quant else kv_raw
    # the window rows before the chunk (positions start − W … start − 1): the SWA ring, read before it is written
    start = meta.starts
    hist_pos = start[:, None] - w + jnp.arange(w)[None]                             # [B,W]
    if meta.continued:
        slot_r = jnp.clip(meta.slots, 0, cache_slots(cache) - 1)
        ring = pc.read(cache["swa"], "fp8", kv.dtype, lambda a: a[role.index][slot_r])
        hist = jnp.take_along_axis(ring, (hist_pos % w)[..., None], axis=1)
    else:
        hist = jnp.zeros((b, w, kv.shape[-1]), kv.dtype)
    kv_ext = jnp.concatenate([hist, kv], axis=1)                 # [B, W+S, D]: column c = position start − W + c
    present_ext = jnp.concatenate([hist_pos >= 0, rkv.present], axis=1)
    # SWA ring: the last W positions of the chunk
    last = start[:, None] + meta.lengths[:, None] - w + jnp.arange(w)[None]          # [B,W] absolute
    at = jnp.where((last >= start[:, None]) & (last >= 0), meta.slots[:, None], cache_slots(cache))
    ring_vals = jnp.take_along_axis(kv_raw, jnp.clip(last - start[:, None], 0, s - 1)[..., None], axis=1)
    cache = {**cache, "swa": pc.write(cfg, cache["swa"], (role.index, at, jnp.maximum(last, 0) % w), ring_vals, "fp8")}
    if compressed:
        cache, state = _compressed(cfg, role, p, grp, place, xq, rq, angles, qr, xkv, rkv, meta, cache, state)
    # window keys of each query row (oldest first) + the selected compressed entries
    req = jnp.maximum(rq.req, 0)
    cols = (rq.pos - start[req])[:, None] + 1 + jnp.arange(w)[None]                  # positions pos − W + 1 … pos
    cols = jnp.clip(cols, 0, w + s - 1)
    keys = kv_ext[req[:, None], cols]                                                # [Cq,W,D]
    valid = present_ext[req[:, None], cols] & (rq.pos[:, None] - (w - 1) + jnp.arange(w)[None] >= 0)
    if compressed and state["topk"].shape[-1]:
        sel = state["topk"]                                                          # [Cq,K]
        keys = jnp.concatenate([keys, state["ckv"][req[:, None], jnp.maximum(sel, 0)]], axis=1)
        valid = jnp.concatenate([valid, sel >= 0], axis=1)
    o = sink_attention(q, keys[:, None], valid[:, None], p["attn_sink"])             # [Cq,1,nh,D]
    o = apply_rope(o, angles, inverse=True).reshape(o.shape[0], 1, cfg.o_groups, -1)
    y = jnp.einsum("bsgi,gio->bsgo", o, p["wo_a"].astype(o.dtype))
    out = jnp.einsum("bsgo,goh->bsh", y, p["wo_b"].astype(y.dtype))[:, 0]
    return out.astype(dt), cache, state


def _compressed(cfg, role, p, grp, place, xq, rq, angles, qr, xkv, rkv, meta, cache, state):
    """Compressed KV / index keys from the complete span (KV sources; written to the pages) and the selection
    of the query rows (index sources)."""
    dt = dtype_of(cfg.dtype)
    b, s = meta.span_index.shape
    src = str(role.kv_source)
    if role.is_kv_source:
        r, comp = role.ratio, p["compressor"]
        start, end = meta.starts, meta.starts + meta.lengths
        slot_r = jnp.clip(meta.slots, 0, cache_slots(cache) - 1)
        if r == 1:
            lat = rms_norm(xkv @ comp["wkv"].astype(xkv.dtype), comp["norm"]["weight"], cfg.rms_norm_eps)
            latent = grp.to_span(lat, rkv.index)                                     # [B,S,D] (chunk rows)
            j = start[:, None] + jnp.arange(s)[None]                                 # entry = position
        else:
            xf = xkv.astype(jnp.float32)
            c = grp.to_span(jnp.einsum("ch,hd->cd", xf, comp["wkv"], precision=jax.lax.Precision.HIGHEST), rkv.index)
            z = grp.to_span(jnp.einsum("ch,hd->cd", xf, comp["wgate"], precision=jax.lax.Precision.HIGHEST),
                            rkv.index)
            # entries j whose pair (2j, 2j+1) ends in this chunk; the pair's first row before the chunk (an odd
            # start) is the cached open pair
            j = start[:, None] // 2 + jnp.arange(s // 2)[None]                      # (no pass completes more)
            row = lambda a, i: jnp.take_along_axis(a, jnp.clip(i, 0, s - 1)[..., None], axis=1)
            p0 = 2 * j - start[:, None]
            opened = lambda name: cache[name][src][slot_r][:, None]
            c0 = jnp.where((p0 < 0)[..., None], opened("open_kv"), row(c, p0)) if meta.continued else row(c, p0)
            z0 = jnp.where((p0 < 0)[..., None], opened("open_score"), row(z, p0)) if meta.continued else row(z, p0)
            pair_c, pair_z = jnp.stack([c0, row(c, p0 + 1)], axis=2), jnp.stack([z0, row(z, p0 + 1)], axis=2)
            pooled = jnp.sum(pair_c * jax.nn.softmax(pair_z, axis=2), axis=2)
            latent = rms_norm(pooled.astype(dt), comp["norm"]["weight"], cfg.rms_norm_eps)
            # the open pair's first row, as the token-serial path leaves it: the chunk's last even position
            first = 2 * ((end - 1) // 2)
            at = jnp.where((meta.lengths > 0) & (first >= start), meta.slots, cache_slots(cache))
            pick = lambda a: row(a, (first - start)[:, None])[:, 0]
            cache = {**cache,
                     "open_kv": {**cache["open_kv"], src: cache["open_kv"][src].at[at].set(pick(c), mode="drop")},
                     "open_score": {**cache["open_score"],
                                    src: cache["open_score"][src].at[at].set(pick(z), mode="drop")}}
        complete = (j + 1) * r <= end[:, None]                                         # [B, Gn]
        cang = rope_angles(cfg, j * r, True)
        ckv_raw = apply_rope(latent, cang)
        ip = p["indexer"]
        ik_raw = apply_rope(rms_norm(jnp.einsum("bgd,de->bge", latent, ip["wk"].astype(latent.dtype)),
                                     ip["k_norm"]["weight"], cfg.rms_norm_eps), cang)
        new_ckv = nvfp4_block16(ckv_raw) if cfg.fake_quant else ckv_raw
        new_ik = mxfp4_block32(ik_raw) if cfg.fake_quant else ik_raw
        if meta.continued:         # every rank reads the same history: the request's pages (from their owners)
            hist_ckv = _read_pages(cfg, place, cache["ckv"][src], meta.block_tables, "nvfp4", dt)
            hist_ik = _read_pages(cfg, place, cache["ikey"][src], meta.block_tables, "mxfp4", dt)
            put = lambda hist, new: hist.at[jnp.arange(b)[:, None], jnp.where(complete, j, hist.shape[1])].set(
                new.astype(hist.dtype), mode="drop")
            state = {"ckv": put(hist_ckv, new_ckv), "ikey": put(hist_ik, new_ik)}
        else:
            state = {"ckv": new_ckv, "ikey": new_ik}
        cache = {**cache,
                 "ckv": {**cache["ckv"], src: _write_entries(cfg, place, cache["ckv"][src], ckv_raw, j, complete,
                                                             meta.block_tables, "nvfp4")},
                 "ikey": {**cache["ikey"], src: _write_entries(cfg, place, cache["ikey"][src], ik_raw, j, complete,
                                                               meta.block_tables, "mxfp4")}}
    if role.is_index_source:
        ip = p["indexer"]
        req = jnp.maximum(rq.req, 0)
        cand = state.get("candidates")
        topk, cand, _ = select_positions(cfg, role, ip["wq_b"], ip["weights_proj"], xq[:, None], qr[:, None],
                                         angles, state["ikey"][req], rq.pos[:, None],
                                         None if cand is None else cand[:, None])
        state = {**state, "topk": topk[:, 0], "candidates": None if cand is None else cand[:, 0]}
    return cache, state


def _narrow(a, slots, axis=0):
    return jnp.take(a, jnp.maximum(slots, 0), axis=axis)


def _body(params, cache, meta: SpanMetadata, cfg: ModelConfig, grp: _Group, place: _Placement):
    # the per-rank fields' leading axis: this rank's (inside the QCP map) or the only one
    tokens, pos, req, eng, dec = (a[0] for a in (meta.tokens, meta.positions, meta.requests, meta.engram_ids,
                                                      meta.dec_slots))
    c = tokens.shape[0]
    n_rows = grp.n * c
    rows = _Rows(pos, req, meta.span_index, meta.span_index < n_rows)
    embed = params["embed"]
    x = _split_lookup(grp, lambda i: jnp.take(embed, i, axis=0), embed.shape[0], cfg.vocab_size, tokens,
                      jnp.zeros((), embed.dtype))
    streams = jnp.broadcast_to(x[None, :, None, :], (1, c, cfg.hc_mult, cfg.hidden_size))
    pre = jnp.zeros((1, c, cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
    from v41cp.ced import ced_boundary

    boundary = ced_boundary(cfg) if meta.ced else None
    state: dict = {}
    norm = lambda a, w: rms_norm(a, w["weight"], cfg.rms_norm_eps)
    for i, role in enumerate(cfg.layer_roles):
        p = params[f"layers_{i}"]
        if role.engram_slot >= 0:
            streams = _engram(cfg, grp, role.engram_slot, p["engram"], streams, eng[:, role.engram_slot])
        xkv, rkv = None, rows
        if i == boundary:                # CED: the boundary's global KV from every row, then the decoder rows only
            xkv = norm(collapse(streams, pre), p["attn_norm"])[0]
            streams, pre, eng = _narrow(streams, dec, 1), _narrow(pre, dec, 1), _narrow(eng, dec)
            rows = _Rows(_narrow(pos, dec), jnp.where(dec >= 0, _narrow(req, dec), -1), meta.dec_span_index,
                         meta.dec_span_index < grp.n * dec.shape[0])
        pre_a, post_a, comb_a = HyperConnection(cfg).apply({"params": p["hc_attn"]}, streams)
        x = norm(collapse(streams, pre), p["attn_norm"])[0]
        if xkv is None:
            xkv, rkv = x, rows
        y, cache, state = _attention(cfg, role, p["attn"], grp, place, x, rows, xkv, rkv, meta, cache, state)
        streams = expand(y[None], streams, post_a, comb_a)
        pre_f, post_f, comb_f = HyperConnection(cfg).apply({"params": p["hc_ffn"]}, streams)
        z = _moe(cfg, grp, p["ffn"], norm(collapse(streams, pre_a), p["ffn_norm"])[0])
        streams, pre = expand(z[None], streams, post_f, comb_f), pre_f
    h = norm(collapse(streams, pre), params["norm"])[0]                                   # [Cd, H]
    cd = h.shape[0]
    mine = (meta.sampled >= 0) & (meta.sampled // cd == grp.rank())
    hs = jnp.where(mine[:, None], h[jnp.clip(meta.sampled % cd, 0, cd - 1)], jnp.zeros((), h.dtype))
    hs = grp.psum(hs)                                                                   # [B, H]
    logits = jnp.einsum("bh,hv->bv", hs.astype(jnp.float32), params["head"], precision=jax.lax.Precision.HIGHEST)
    return logits, cache


def _specs(cfg: ModelConfig, layout: SpanLayout, params, cache, meta):
    from v41cp.model import abstract_params
    from v41cp.sharding.rules import QCP_RULES, param_shardings

    shardings = param_shardings(abstract_params(cfg), layout.mesh, QCP_RULES)
    pspec = jax.tree.map(lambda s: s.spec, shardings, is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))
    pool = P(CP) if layout.kv_parallel > 1 else P()
    cspec = {k: jax.tree.map(lambda _: pool if k in ("ckv", "ikey") else P(), v) for k, v in cache.items()}
    rank = P(layout.axes)
    mspec = SpanMetadata(*(rank,) * 5, *(P(),) * 7, meta.n, meta.capacity, meta.dec_capacity, meta.span, meta.ced,
                         meta.continued)
    return pspec, cspec, mspec, pspec["head"]


def _run(params, cache, meta: SpanMetadata, cfg: ModelConfig, layout: SpanLayout):
    with jax.default_matmul_precision("highest" if cfg.dtype == "float32" else "default"):
        pspec, cspec, mspec, hspec = _specs(cfg, layout, params, cache, meta)
        body = partial(_body, cfg=cfg, grp=_Group(layout.axes, layout.n), place=_Placement(layout.kv_parallel, True))
        # as in the DCP islands: JAX's Pallas interpreter trips its own varying-axes check (CPU only)
        check = not (cfg.indexer_backend == "pallas" and interpret_mode())
        return jax.shard_map(body, mesh=layout.mesh, in_specs=(pspec, cspec, mspec),
                             out_specs=(P(None, *hspec[1:]), cspec), check_vma=check)(params, cache, meta)


@partial(jax.jit, static_argnames=("cfg", "layout"), donate_argnames=("cache",))
def _prefill_qcp(params, cache: dict, meta: SpanMetadata, cfg: ModelConfig, layout: SpanLayout):
    return _run(params, cache, meta, cfg, layout)


@partial(jax.jit, static_argnames=("cfg", "plan", "operator"), donate_argnames=("cache",))
def _prefill_rows(params, cache: dict, rows, cfg: ModelConfig, plan, operator):
    from v41cp.serving.decode import _forward_rows

    last = rows.lengths - 1 - (0 if rows.encoder_rows is None else rows.encoder_rows)    # in the decoder rows
    logits, cache, _ = _forward_rows(params, cache, rows, cfg, plan, logits_at=last, operator=operator)
    return logits[:, 0], cache


def _span_rows(cfg: ModelConfig, meta: SpanMetadata):
    """One-rank span metadata → the pass's `StepRows` (``rows`` = the span; under CED narrowed at the boundary to
    each request's retained decoder rows, at most ``min(span, ced_rows)``). Host NumPy."""
    from v41cp.ced import ced_rows
    from v41cp.serving.paged_rows import StepRows

    b, s = meta.span_index.shape
    pad = lambda a: np.concatenate([np.asarray(a[0]), np.zeros((1, *a.shape[2:]), a.dtype)])
    tokens, eng = pad(meta.tokens)[meta.span_index], pad(meta.engram_ids)[meta.span_index]
    enc, dec_rows = None, 0
    if meta.ced:                       # rows before the retained decoder rows run the encoder only
        fed = np.arange(s)[None] < np.asarray(meta.lengths)[:, None]
        enc = jnp.asarray((fed & (meta.dec_span_index >= meta.dec_capacity)).sum(axis=1), jnp.int32)
        dec_rows = min(s, ced_rows(cfg))
    return StepRows(jnp.asarray(tokens), jnp.asarray(meta.starts, jnp.int32), jnp.asarray(meta.lengths, jnp.int32),
                    jnp.asarray(meta.slots), jnp.asarray(meta.block_tables), jnp.asarray(eng), b,
                    meta.block_tables.shape[1], s, enc, dec_rows)


def _layout_plan(cfg: ModelConfig, layout: SpanLayout):
    """The DCP plan of a KVP layout (None: replicated pages)."""
    if layout.kv_parallel == 1:
        return None
    from v41cp.serving.dcp import DCPPlan

    tp = layout.mesh.shape["tp"] * layout.mesh.shape[CP]
    return DCPPlan(layout.mesh, heads_sharded=cfg.num_attention_heads % tp == 0)


def prefill_span(params, cache: dict, meta: SpanMetadata, cfg: ModelConfig, layout: SpanLayout = SpanLayout()):
    """Prefill the prompts of ``meta`` (`build_span_metadata`) in one pass: ``(logits [B, vocab] FP32 of each
    prompt's last row — zeros for an empty row or a pass without it —, updated cache)``. Model-wide QCP runs the
    rank-local rows program below; every other layout runs the one model over the pass's rows as cached rows
    (`v41cp.serving.paged_rows`; KVP through the DCP islands, operator-local QCP through the layers' islands,
    CED narrowing to the retained decoder rows at the boundary). One compiled program per bucket."""
    return _dispatch(params, cache, meta, cfg, layout, lower=False)


def lower_prefill_span(params, cache: dict, meta: SpanMetadata, cfg: ModelConfig, layout: SpanLayout = SpanLayout()):
    """The lowered program of one span-prefill pass (for structure measurements)."""
    return _dispatch(params, cache, meta, cfg, layout, lower=True)


def _dispatch(params, cache, meta, cfg, layout, lower: bool):
    if meta.n != layout.n:
        raise ValueError(f"span prefill: the metadata plans {meta.n} ranks but the layout splits rows over "
                         f"{layout.n} (query_context_parallel_size)")
    if layout.query_parallel and layout.n > 1:
        fn, args = _prefill_qcp, (params, cache, meta, cfg, layout)
    else:
        fn, args = _prefill_rows, (params, cache, _span_rows(cfg, meta), cfg, _layout_plan(cfg, layout),
                                   layout.operator)
    return fn.lower(*args) if lower else fn(*args)


def compile_count() -> int:
    """Compiled span-prefill programs so far (every bucket and layout)."""
    return _prefill_qcp._cache_size() + _prefill_rows._cache_size()
