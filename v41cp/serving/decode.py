"""The static-capacity decode step over paged V4.1 caches (issue 4, reference path).

`decode_step(params, cache, meta, cfg)` advances every active batch row by one token. Shapes depend
only on capacity (`DecodeMetadata` static fields ``max_batch`` / ``max_blocks``, the cache's
``num_blocks``), never on current lengths, so the step compiles once per bucket; metadata is refreshed
on the host every step. Inactive rows write nothing (their scatter indices point out of bounds).

Cache (`init_cache`): either the release's byte records (FP8 window rows 528 B, NVFP4 compressed KV
288 B, MXFP4 index keys 68 B at the released dims; `v41cp.serving.records`) or plain values:

* ``swa [L, max_batch, W, ·]`` — ring row ``p % W`` holds window KV of position ``p``;
* ``ckv[g] [num_blocks, block_tokens / r, ·]`` and ``ikey[g] [num_blocks, block_tokens / r, ·]`` per
  KV source ``g`` — entry ``j`` lives in block ``block_table[j // epb]`` at ``j % epb``;
* ``open_kv[g] / open_score[g] [max_batch, D]`` FP32 — the open ratio-2 group's first row.

Engram hash ids of each row's new token are host metadata (`engram_ids_for_last`).

The MoE, mHC, Engram and norms are the full-sequence Flax modules applied to one token per row; the
attention is re-expressed over the caches with the same helpers (RoPE, quantizers, indexer scoring,
candidate blocks, sink attention) as the full-sequence path.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from v41cp.config import LayerRole, ModelConfig
from v41cp.engram_hash import engram_hash_ids
from v41cp.layers.attention import sink_attention
from v41cp.layers.common import RMSNorm, dtype_of, rms_norm
from v41cp.layers.engram import Engram
from v41cp.layers.indexer import index_query, select_positions
from v41cp.layers.mhc import HyperConnection, collapse, expand
from v41cp.layers.moe import MoE
from v41cp.layers.rope import apply_rope, rope_angles
from v41cp.quant import fp8_block32, mxfp4_block32, nvfp4_block16
from v41cp.serving import dcp, kernel_ops
from v41cp.serving.dcp import DCPPlan
from v41cp.serving.records import RECORD_FORMATS, decode, encode

__all__ = ["DecodeMetadata", "init_cache", "decode_step", "prefill_chunk", "engram_ids_for_last", "ced_boundary",
           "ced_rows"]


@partial(jax.tree_util.register_dataclass, data_fields=["tokens", "positions", "slots", "block_tables", "active",
                                                        "engram_ids"], meta_fields=["max_batch", "max_blocks"])
@dataclasses.dataclass(frozen=True)
class DecodeMetadata:
    """Host-built, padded per-step metadata. Rows ``≥`` the live batch have ``active = False``.

    tokens / positions / slots ``[max_batch]`` int32 (the new token, its position, the request's batch
    slot), block_tables ``[max_batch, max_blocks]`` int32, active ``[max_batch]`` bool, engram_ids
    ``[max_batch, n_engram, hash_heads]`` int32. ``max_batch`` / ``max_blocks`` are static (the bucket).
    """

    tokens: jax.Array
    positions: jax.Array
    slots: jax.Array
    block_tables: jax.Array
    active: jax.Array
    engram_ids: jax.Array
    max_batch: int
    max_blocks: int

    @classmethod
    def idle(cls, cfg: ModelConfig, max_batch: int, max_blocks: int) -> "DecodeMetadata":
        """Metadata of a bucket with no active row (for lowering / compiling the step ahead of traffic)."""
        n_eng = len(cfg.engram_layer_ids)
        return cls(jnp.zeros(max_batch, jnp.int32), jnp.zeros(max_batch, jnp.int32),
                   jnp.arange(max_batch, dtype=jnp.int32), jnp.full((max_batch, max_blocks), -1, jnp.int32),
                   jnp.zeros(max_batch, bool),
                   jnp.zeros((max_batch, n_eng, cfg.engram_hash_heads if n_eng else 0), jnp.int32),
                   max_batch, max_blocks)


def engram_ids_for_last(cfg: ModelConfig, history) -> np.ndarray:
    """Engram row ids ``[n_engram, hash_heads]`` of the last token of ``history`` (host side)."""
    if not cfg.engram_layer_ids:
        return np.zeros((0, 0), np.int32)
    tail = np.asarray(history[-cfg.engram_max_ngram_size:], np.int64)[None]
    # hashing only looks back max_ngram − 1 tokens; a tail shorter than that means the sequence start
    return engram_hash_ids(cfg, tail)[0, -1]


def _groups(cfg: ModelConfig) -> list[LayerRole]:
    return [r for r in cfg.layer_roles if r.is_kv_source]


def init_cache(cfg: ModelConfig, num_blocks: int, block_tokens: int, max_batch: int, sharding=None,
               records: bool | None = None, plan: DCPPlan | None = None) -> dict:
    """Zeroed decode cache for ``num_blocks`` logical blocks of ``block_tokens`` tokens and ``max_batch`` slots,
    committed to ``sharding`` (default: the first device) so that every step sees the same input types.

    ``records`` (default: ``cfg.fake_quant``) stores the release's byte records (`v41cp.serving.records`:
    FP8 window rows, NVFP4 compressed KV, MXFP4 index keys; each a ``{"q", "s"}`` pair of uint8 arrays);
    otherwise values are stored in the model dtype (fake-quantized when ``cfg.fake_quant``).

    ``plan`` (KVP): ``num_blocks`` counts virtual blocks (a multiple of the group size N); the global pools
    are split over the mesh's ``cp`` axis (each rank allocates ``num_blocks / N`` pages), everything else
    is replicated on the plan's mesh.
    """
    dt = dtype_of(cfg.dtype)
    records = cfg.fake_quant if records is None else records
    if records and not cfg.fake_quant:
        raise ValueError("byte records are the fake-quant formats: records=True needs cfg.fake_quant")
    d, di = cfg.head_dim, cfg.index_head_dim
    zeros = jax.ShapeDtypeStruct           # the layout first; the arrays are created already placed (below)

    def store(shape, fmt):
        if not records:
            return zeros((*shape, {"fp8": d, "nvfp4": d, "mxfp4": di}[fmt]), dt)
        c = {"fp8": d, "nvfp4": d, "mxfp4": di}[fmt]
        block = RECORD_FORMATS[fmt][0]
        return {"q": zeros((*shape, c if fmt == "fp8" else c // 2), jnp.uint8),
                "s": zeros((*shape, c // block), jnp.uint8)}

    cache = {"swa": store((cfg.num_hidden_layers, max_batch, cfg.sliding_window), "fp8"),
             "ckv": {}, "ikey": {}, "open_kv": {}, "open_score": {}}
    for g in _groups(cfg):
        if block_tokens % g.ratio:
            raise ValueError(f"block_tokens={block_tokens} is not a multiple of layer {g.index}'s ratio {g.ratio}")
        epb = block_tokens // g.ratio
        cache["ckv"][str(g.index)] = store((num_blocks, epb), "nvfp4")
        cache["ikey"][str(g.index)] = store((num_blocks, epb), "mxfp4")
        if g.ratio > 1:
            if g.ratio != 2:
                raise ValueError(f"the decode cache supports compress ratios 1 and 2, layer {g.index} has {g.ratio}")
            cache["open_kv"][str(g.index)] = zeros((max_batch, d), jnp.float32)
            cache["open_score"][str(g.index)] = zeros((max_batch, d), jnp.float32)
    if plan is None:
        one = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, cache)
    else:
        if num_blocks % plan.n:
            raise ValueError(f"num_blocks={num_blocks} must be a multiple of kv_parallel_size={plan.n}")
        rep, pool = NamedSharding(plan.mesh, PartitionSpec()), dcp.pool_sharding(plan.mesh)
        shardings = {k: jax.tree.map(lambda _: pool if k in ("ckv", "ikey") else rep, v) for k, v in cache.items()}
    # each device allocates only its own shard (no full-size staging copy on one device)
    return jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), cache), out_shardings=shardings)()


_FAKE_QUANT = {"fp8": fp8_block32, "nvfp4": nvfp4_block16, "mxfp4": mxfp4_block32}


def _write(cfg: ModelConfig, store, idx: tuple, values: jax.Array, fmt: str):
    """Scatter ``values`` (pre-quantization) into ``store`` at ``idx`` (out-of-bounds = dropped)."""
    if isinstance(store, dict):
        q, sc = encode(values, fmt)
        return {"q": store["q"].at[idx].set(q, mode="drop"), "s": store["s"].at[idx].set(sc, mode="drop")}
    if cfg.fake_quant:
        values = _FAKE_QUANT[fmt](values)
    return store.at[idx].set(values.astype(store.dtype), mode="drop")


def _read(store, fmt: str, dtype, select) -> jax.Array:
    """``select`` (an indexing function) applied to the store, decoded to values."""
    if isinstance(store, dict):
        return decode(select(store["q"]), select(store["s"]), fmt, dtype)
    return select(store)


def _store_rows(store) -> int:
    return (store["q"] if isinstance(store, dict) else store).shape[0]


def _dense(x, w):
    return jnp.einsum("...i,io->...o", x, w.astype(x.dtype))


class _Step:
    """One decode step's shared quantities (shapes: B = meta.max_batch rows; the cache has ``n_slots``)."""

    def __init__(self, cfg: ModelConfig, meta: DecodeMetadata, num_blocks: int, n_slots: int, block_tokens: int,
                 plan: DCPPlan | None = None):
        self.cfg, self.meta, self.num_blocks, self.n_slots, self.plan = cfg, meta, num_blocks, n_slots, plan
        self.block_tokens = block_tokens
        self.pos = meta.positions
        # out-of-bounds targets drop the writes of inactive rows
        self.slot_w = jnp.where(meta.active, meta.slots, n_slots)
        self.slot_r = jnp.clip(meta.slots, 0, n_slots - 1)


def _attention(cfg: ModelConfig, role: LayerRole, p: dict, x: jax.Array, cache: dict, st: _Step, state: dict,
               cache_only: bool = False):
    """Cached CSA2 attention of one layer for ``x [B, H]`` (attention-normed) → ``([B, H], cache, state)``.
    ``cache_only``: write this layer's caches (window KV, compressed KV, index keys) and stop (CED prepass)."""
    dt = dtype_of(cfg.dtype)
    meta, pos = st.meta, st.pos
    w = cfg.sliding_window
    compressed = role.ratio > 0
    angles = rope_angles(cfg, pos[:, None], compressed)                       # [B,1,P]
    qr = rms_norm(_dense(x, p["wq_a"]), p["q_norm"]["weight"], cfg.rms_norm_eps)
    q = apply_rope(jnp.einsum("br,rnd->bnd", qr, p["wq_b"].astype(qr.dtype))[:, None], angles)   # [B,1,H,D]
    kv = apply_rope(rms_norm(_dense(x, p["wkv"]), p["kv_norm"]["weight"], cfg.rms_norm_eps)[:, None], angles)
    swa = _write(cfg, cache["swa"], (role.index, st.slot_w, pos % w), kv[:, 0], "fp8")
    cache = {**cache, "swa": swa}
    if cache_only:
        if compressed:
            cache, state = _update_compressed(cfg, role, p, x, qr, angles, cache, st, state, keys_only=True)
        return None, cache, state
    k = jnp.arange(w)
    ring_pos = pos[:, None] - ((pos[:, None] - k[None, :]) % w)               # position held by ring row k
    if cfg.attention_backend == "pallas" and (st.plan is None or not compressed):
        return _kernel_attention(cfg, role, p, q[:, 0], x, qr, angles, cache, st, state, ring_pos >= 0, dt)
    ring = _read(swa, "fp8", kv.dtype, lambda a: a[role.index][st.slot_r])   # [B,W,D]
    keys, valid = ring[:, None], (ring_pos >= 0)[:, None]                      # [B,1,W,D], [B,1,W]
    if compressed and st.plan is not None:
        cache, state = _update_compressed(cfg, role, p, x, qr, angles, cache, st, state)
        pool = cache["ckv"][str(role.kv_source)]
        o = dcp.attend(st.plan, lambda a, f: _read(a, "nvfp4", kv.dtype, f), q[:, 0], ring, ring_pos >= 0,
                       state["topk"], pool, meta.block_tables, p["attn_sink"], cfg.attention_backend)[:, None]
        return _project_out(cfg, p, o, angles, dt), cache, state
    if compressed:
        cache, state = _update_compressed(cfg, role, p, x, qr, angles, cache, st, state)
        sel = state["topk"]                                                    # [B,1,K]
        if sel.shape[-1]:
            entries = state["ckv"]                                             # [B,G,D]
            picked = jax.vmap(lambda c, i: c[jnp.maximum(i, 0)])(entries, sel[:, 0])[:, None]
            keys = jnp.concatenate([keys, picked], axis=2)
            valid = jnp.concatenate([valid, sel >= 0], axis=2)
    o = sink_attention(q, keys, valid, p["attn_sink"])
    return _project_out(cfg, p, o, angles, dt), cache, state


def _kernel_attention(cfg: ModelConfig, role: LayerRole, p: dict, q: jax.Array, x, qr, angles, cache: dict,
                      st: _Step, state: dict, ring_valid: jax.Array, dt):
    """`_attention` through the sparse-attention kernel: the window rows and the selected entries are read
    from the stores in place (`v41cp.serving.kernel_ops`)."""
    pool = sel = None
    if role.ratio > 0:
        cache, state = _update_compressed(cfg, role, p, x, qr, angles, cache, st, state)
        pool = cache["ckv"][str(role.kv_source)]
        epb = (pool["q"] if isinstance(pool, dict) else pool).shape[1]
        sel = kernel_ops.entry_slots(state["topk"][:, 0], st.meta.block_tables, epb)
    win = kernel_ops.window_slots(role.index, st.slot_r, ring_valid, st.n_slots)
    o = kernel_ops.attend(cfg, q, cache["swa"], win, pool, sel, p["attn_sink"])
    return _project_out(cfg, p, o[:, None], angles, dt), cache, state


def _project_out(cfg: ModelConfig, p: dict, o: jax.Array, angles: jax.Array, dt) -> jax.Array:
    """Attention output ``[B,1,H,D]`` → inverse RoPE, grouped ``wo_a``, ``wo_b`` → ``[B, hidden]``."""
    b = o.shape[0]
    o = apply_rope(o, angles, inverse=True).reshape(b, 1, cfg.o_groups, -1)
    y = jnp.einsum("bsgi,gio->bsgo", o, p["wo_a"].astype(o.dtype))
    out = jnp.einsum("bsgo,goh->bsh", y, p["wo_b"].astype(y.dtype))[:, 0]
    return out.astype(dt)


def _gather_group(pages: jax.Array, tables: jax.Array) -> jax.Array:
    """``pages [NB, epb, C]`` gathered by ``tables [B, MB]`` → ``[B, MB·epb, C]`` (entry order)."""
    got = pages[jnp.maximum(tables, 0)]
    return got.reshape(tables.shape[0], -1, pages.shape[-1])


def _update_compressed(cfg, role, p, x, qr, angles, cache, st: _Step, state, keys_only: bool = False):
    meta, pos = st.meta, st.pos
    src = str(role.kv_source)
    if role.is_kv_source:
        r, comp = role.ratio, p["compressor"]
        j = pos // r                                                           # entry of this token's group
        if r == 1:
            latent = rms_norm(_dense(x, comp["wkv"]), comp["norm"]["weight"], cfg.rms_norm_eps)
            emits = meta.active
        else:
            xf = x.astype(jnp.float32)
            c = jnp.einsum("bh,hd->bd", xf, comp["wkv"], precision=jax.lax.Precision.HIGHEST)
            z = jnp.einsum("bh,hd->bd", xf, comp["wgate"], precision=jax.lax.Precision.HIGHEST)
            first = pos % r == 0
            slot_first = jnp.where(first, st.slot_w, st.n_slots)
            cache = {**cache,
                     "open_kv": {**cache["open_kv"], src: cache["open_kv"][src].at[slot_first].set(c, mode="drop")},
                     "open_score": {**cache["open_score"],
                                    src: cache["open_score"][src].at[slot_first].set(z, mode="drop")}}
            c0, z0 = cache["open_kv"][src][st.slot_r], cache["open_score"][src][st.slot_r]
            wts = jax.nn.softmax(jnp.stack([z0, z]), axis=0)
            pooled = (c0 * wts[0] + c * wts[1]).astype(x.dtype)
            latent = rms_norm(pooled, comp["norm"]["weight"], cfg.rms_norm_eps)
            emits = meta.active & (pos % r == r - 1)
        cang = rope_angles(cfg, (j * r)[:, None], True)                       # [B,1,P]
        ckv = apply_rope(latent[:, None], cang)
        ik = rms_norm(_dense(latent, p["indexer"]["wk"]), p["indexer"]["k_norm"]["weight"], cfg.rms_norm_eps)
        ik = apply_rope(ik[:, None], cang)
        epb = st.block_tokens // r
        blk = jnp.take_along_axis(meta.block_tables, (j // epb)[:, None], axis=1)[:, 0]
        if st.plan is not None:
            def owned(name, values, fmt):
                w = lambda a, idx, v: _write(cfg, a, idx, v, fmt)
                return dcp.write_owned(st.plan, w, cache[name][src], blk, j % epb, values, emits)
            cache = {**cache, "ckv": {**cache["ckv"], src: owned("ckv", ckv[:, 0], "nvfp4")},
                     "ikey": {**cache["ikey"], src: owned("ikey", ik[:, 0], "mxfp4")}}
            state = {}
            if keys_only:
                return cache, state
        blk = jnp.where(emits, blk, st.num_blocks)
    if role.is_kv_source and st.plan is None:
        cache = {**cache,
                 "ckv": {**cache["ckv"], src: _write(cfg, cache["ckv"][src], (blk, j % epb), ckv[:, 0], "nvfp4")},
                 "ikey": {**cache["ikey"], src: _write(cfg, cache["ikey"][src], (blk, j % epb), ik[:, 0], "mxfp4")}}
        gather = lambda a: _gather_group(a, meta.block_tables)
        if keys_only:
            return cache, state
        if cfg.attention_backend == "pallas" and cfg.indexer_backend == "pallas":
            state = {}                         # both kernels read the pools in place: no history gather
        else:
            state = {"ckv": _read(cache["ckv"][src], "nvfp4", x.dtype, gather),
                     "ikey": _read(cache["ikey"][src], "mxfp4", x.dtype, gather)}
    if role.is_index_source and st.plan is not None:
        ip = p["indexer"]
        qi, wi = index_query(cfg, ip["wq_b"], ip["weights_proj"], x[:, None], qr[:, None], angles)
        topk, cand = dcp.select(st.plan, cfg, role, lambda a, f: _read(a, "mxfp4", x.dtype, f),
                                cache["ikey"][src], qi[:, 0], wi[:, 0], meta.block_tables, pos,
                                state.get("candidates"))
        state = {**state, "topk": topk, "candidates": cand}
    elif role.is_index_source and cfg.indexer_backend == "pallas":
        ip = p["indexer"]
        qi, wi = index_query(cfg, ip["wq_b"], ip["weights_proj"], x[:, None], qr[:, None], angles)
        cand = state.get("candidates")
        topk, cand = kernel_ops.select(cfg, role, qi[:, 0], wi[:, 0], cache["ikey"][src], meta.block_tables, pos,
                                       None if cand is None else cand[:, 0])
        state = {**state, "topk": topk[:, None], "candidates": None if cand is None else cand[:, None]}
    elif role.is_index_source:
        ip = p["indexer"]
        topk, cand, _ = select_positions(cfg, role, ip["wq_b"], ip["weights_proj"], x[:, None], qr[:, None], angles,
                                         state["ikey"], pos[:, None], state.get("candidates"), stable=True)
        state = {**state, "topk": topk, "candidates": cand}
    return cache, state


def _block(cfg: ModelConfig, i: int, p: dict, streams, pre_prev, cache, st: _Step, state, engram_ids):
    role = cfg.layer_roles[i]
    dt = dtype_of(cfg.dtype)
    if role.engram_slot >= 0:
        streams = Engram(cfg, role.engram_slot).apply({"params": p["engram"]}, streams,
                                                       engram_ids[:, None, role.engram_slot])
    pre_a, post_a, comb_a = HyperConnection(cfg).apply({"params": p["hc_attn"]}, streams)
    x = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt).apply({"params": p["attn_norm"]}, collapse(streams, pre_prev))
    y, cache, state = _attention(cfg, role, p["attn"], x[:, 0], cache, st, state)
    streams = expand(y[:, None], streams, post_a, comb_a)
    pre_f, post_f, comb_f = HyperConnection(cfg).apply({"params": p["hc_ffn"]}, streams)
    z = MoE(cfg).apply({"params": p["ffn"]}, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt).apply(
        {"params": p["ffn_norm"]}, collapse(streams, pre_a)))
    return expand(z, streams, post_f, comb_f), pre_f, cache, state


def ced_boundary(cfg: ModelConfig) -> int | None:
    """The CED boundary layer: the ratio-1 KV source after which every layer is a ratio-1 consumer (its
    decoder depends on other tokens only through its window and that source's frozen global KV), or None."""
    roles = cfg.layer_roles
    for r in roles:
        if r.ratio == 1 and r.is_kv_source:
            rest = roles[r.index + 1:]
            if all(x.ratio == 1 and not x.is_kv_source for x in rest):
                return r.index
            return None
    return None


def ced_rows(cfg: ModelConfig) -> int:
    """Rows before the end of a prefill that must run the decoder layers (the dependency halo):
    ``W + (L − 1)(W − 1)`` with L = the decoder layers from the CED boundary on."""
    b = ced_boundary(cfg)
    layers = cfg.num_hidden_layers - b
    return cfg.sliding_window + (layers - 1) * (cfg.sliding_window - 1)


def _step_body(params: dict, cache: dict, meta: DecodeMetadata, cfg: ModelConfig, encoder_only: bool = False,
               plan: DCPPlan | None = None):
    with jax.default_matmul_precision("highest" if cfg.dtype == "float32" else "default"):
        groups = _groups(cfg)
        first = cache["ckv"][str(groups[0].index)] if groups else None
        num_blocks = _store_rows(first) if groups else 0
        epb = (first["s"] if isinstance(first, dict) else first).shape[1] if groups else 0
        swa = cache["swa"]["q"] if isinstance(cache["swa"], dict) else cache["swa"]
        st = _Step(cfg, meta, num_blocks, swa.shape[1], epb * groups[0].ratio if groups else 0, plan)
        b = meta.max_batch
        x = jnp.take(params["embed"], meta.tokens, axis=0)[:, None]            # [B,1,H]
        streams = jnp.broadcast_to(x[:, :, None, :], (b, 1, cfg.hc_mult, cfg.hidden_size))
        pre = jnp.zeros((b, 1, cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
        state: dict = {}
        last = ced_boundary(cfg) if encoder_only else cfg.num_hidden_layers
        for i in range(last):
            streams, pre, cache, state = _block(cfg, i, params[f"layers_{i}"], streams, pre, cache, st, state,
                                                meta.engram_ids)
        if encoder_only:                       # CED: the boundary layer's cache-only prepass, no decoder
            p = params[f"layers_{last}"]
            role = cfg.layer_roles[last]
            if role.engram_slot >= 0:
                streams = Engram(cfg, role.engram_slot).apply({"params": p["engram"]}, streams,
                                                               meta.engram_ids[:, None, role.engram_slot])
            x = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype_of(cfg.dtype)).apply(
                {"params": p["attn_norm"]}, collapse(streams, pre))
            _, cache, _ = _attention(cfg, role, p["attn"], x[:, 0], cache, st, state, cache_only=True)
            return jnp.zeros((b, cfg.vocab_size), jnp.float32), cache
        h = rms_norm(collapse(streams, pre), params["norm"]["weight"], cfg.rms_norm_eps)
        logits = jnp.einsum("bsh,hv->bsv", h.astype(jnp.float32), params["head"],
                            precision=jax.lax.Precision.HIGHEST)[:, 0]
        return logits, cache


@partial(jax.jit, static_argnames=("cfg", "plan"), donate_argnames=("cache",))
def decode_step(params: dict, cache: dict, meta: DecodeMetadata, cfg: ModelConfig, plan: DCPPlan | None = None):
    """One token for every active row: ``(logits [max_batch, vocab] FP32, updated cache)``.
    ``plan``: KVP/DCP layout (`v41cp.serving.dcp.DCPPlan`; the cache from ``init_cache(..., plan=plan)``)."""
    return _step_body(params, cache, meta, cfg, plan=plan)


@partial(jax.jit, static_argnames=("cfg", "encoder_only", "plan"), donate_argnames=("cache",))
def prefill_chunk(params: dict, cache: dict, metas: DecodeMetadata, cfg: ModelConfig, encoder_only: bool = False,
                  plan: DCPPlan | None = None):
    """Feed a chunk of tokens through the cached path in order: ``metas`` holds one `DecodeMetadata` per
    token along a leading chunk axis (padding tokens inactive). Returns (logits of every chunk position
    ``[chunk, max_batch, vocab]``, cache). Exact by construction (token-serial over the caches), so a chunk
    may split pages and compression groups anywhere; a chunk-parallel kernel path is future work.
    ``encoder_only`` (CED narrowing): run the layers before the CED boundary and the boundary layer's
    cache-only prepass (its global KV and index keys), skipping the decoder; logits are then zeros."""
    def body(c, m):
        logits, c = _step_body(params, c, m, cfg, encoder_only, plan)
        return c, logits

    cache, logits = jax.lax.scan(body, cache, metas)
    return logits, cache
