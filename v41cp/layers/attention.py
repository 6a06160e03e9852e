"""CSA2 attention of one V4.1 layer: one module for every mode — the full sequence, and cached rows through a rows
backend (`v41cp.serving.attention`: paged rows, DCP, model-wide QCP).

Keys of query ``t`` = its sliding window ``{kv_s : t−W < s ≤ t}`` (FP8 window KV, K = V) ∪ the
selected compressed entries ``{ckv_j : j ∈ topk(t)}``; one softmax over their union plus the
per-head sink logit (sink value 0, no scaling). Output: inverse RoPE, grouped low-rank ``wo_a``,
then ``wo_b``.

CSA2 state (`CSAState`) flows from layer to layer: Full layers publish compressed KV, index keys
and top-k; Reindex layers replace the top-k; Reuse layers read both unchanged.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from v41cp.config import LayerRole, ModelConfig
from v41cp.kernels.sparse_attention import sparse_attention
from v41cp.kernels.sparse_attention.reference import sink_attention
from v41cp.layers.common import RMSNorm, declare, dtype_of, weight_for, zeros_init
from v41cp.layers.compressor import Compressor, pool_group
from v41cp.layers.indexer import Indexer
from v41cp.layers.rope import apply_rope, rope_angles
from v41cp.quant import fp8_block32, nvfp4_block16
from v41cp.sharding.operator_qcp import attention_query_parallel_applies, rows_island
from v41cp.sharding.rules import ShardingContext, constrain

__all__ = ["CSAState", "Attention", "attention_weights", "query_projection", "window_kv", "output_projection"]


class CSAState(NamedTuple):
    """Shared state of one forward. ``ckv [B,G,D]`` (rotated, NVFP4), ``ikeys [B,G,Di]``,
    ``topk [B,S,K]`` int32 (−1 = none), ``candidates [B,S,G]`` bool; fields are None until published."""

    ckv: Optional[jax.Array] = None
    ikeys: Optional[jax.Array] = None
    topk: Optional[jax.Array] = None
    candidates: Optional[jax.Array] = None


def window_indices(seq_len: int, window: int) -> tuple[jax.Array, jax.Array]:
    """Key positions ``[S, W]`` of each query's window (oldest first) and their validity mask."""
    w = min(window, seq_len)
    idx = jnp.arange(seq_len)[:, None] - (w - 1) + jnp.arange(w)[None, :]
    return jnp.maximum(idx, 0), idx >= 0


def rows_sink_attention(q, kv, widx, wvalid, ckv, sel, sink, rows=None) -> jax.Array:
    """`sink_attention` of query rows ``q [B,R,Hq,D]`` = rows ``rows [R]`` of the sequence (default: all): keys
    are their windows in ``kv [B,S,D]`` (``widx / wvalid [S,W]``) and, with ``ckv [B,G,D]``, the selected entries
    ``sel [B,S,K]`` (−1 = none). Rows past the sequence (``rows ≥ S``, padding) attend nothing."""
    b, s = kv.shape[:2]
    rows = jnp.arange(s) if rows is None else rows
    r = jnp.minimum(rows, s - 1)
    keys = kv[:, widx[r]]                                                  # [B,R,W,D]
    valid = jnp.broadcast_to((wvalid[r] & (rows < s)[:, None])[None], (b, rows.shape[0], widx.shape[1]))
    if ckv is not None:
        picked = sel[:, r]
        keys = jnp.concatenate([keys, jax.vmap(lambda c, i: c[jnp.maximum(i, 0)])(ckv, picked)], axis=2)
        valid = jnp.concatenate([valid, (picked >= 0) & (rows < s)[None, :, None]], axis=2)
    return sink_attention(q, keys, valid, sink)


def query_parallel_attention(shard, q, kv, widx, wvalid, ckv, sel, sink) -> jax.Array:
    """Operator-local attention QCP of a full sequence (`rows_island`): a block's keys are gathered inside the
    island from the replicated window KV / compressed KV / selection. ``q [B,S,Hq,D]`` head-sharded over attention
    TP; kv / ckv / sel replicated; returns ``[B,S,Hq,D]`` head-sharded, equal to `rows_sink_attention`."""
    b, s = kv.shape[:2]
    has_c = ckv is not None
    ops = {"kv": kv, "ckv": ckv if has_c else jnp.zeros((b, 0, kv.shape[-1]), kv.dtype),
           "sel": sel if has_c else jnp.zeros((b, s, 0), jnp.int32), "sink": sink}
    block = lambda q_rows, rows, o, sink_all: rows_sink_attention(
        q_rows, o["kv"], widx, wvalid, o["ckv"] if has_c else None, o["sel"], sink_all, rows)
    return rows_island(shard, q, ops, block)


def query_parallel_rows(shard, q: jax.Array, keys: jax.Array, valid: jax.Array, sink: jax.Array) -> jax.Array:
    """Operator-local attention QCP of cached rows (`rows_island`): ``q [T,Hq,D]`` head-sharded, each row's own
    keys ``[T,K,D]`` / ``valid [T,K]`` replicated; returns ``[T,Hq,D]`` head-sharded, equal to `sink_attention`."""
    t = q.shape[0]

    def block(q_rows, rows, o, sink_all):
        r = jnp.minimum(rows, t - 1)
        ok = o["valid"][r] & (rows < t)[:, None]
        return sink_attention(q_rows, o["keys"][r][None], ok[None], sink_all)

    return rows_island(shard, q[None], {"keys": keys, "valid": valid, "sink": sink}, block)[0]


def kernel_sink_attention(q: jax.Array, kv: jax.Array, widx: jax.Array, wvalid: jax.Array, state: CSAState | None,
                          sink: jax.Array) -> jax.Array:
    """`sink_attention` over the window and the selected entries through the sparse-attention kernel
    (``attention_backend="pallas"``): every query row ``(b, s)`` is one kernel row; the window KV ``[B·S, D]``
    and the compressed KV ``[B·G, D]`` are its two stores, addressed by slot lists instead of gathered keys.
    Returns ``[B,S,Hq,D]`` in ``q.dtype``."""
    b, s, h, d = q.shape
    win = jnp.where(wvalid[None], jnp.arange(b)[:, None, None] * s + widx[None], -1).reshape(b * s, -1)
    stores, indices = [kv.reshape(b * s, d)], [win]
    if state is not None and state.ckv.shape[1]:
        g = state.ckv.shape[1]
        sel = jnp.where(state.topk >= 0, jnp.arange(b)[:, None, None] * g + state.topk, -1)
        stores.append(state.ckv.reshape(b * g, d))
        indices.append(sel.reshape(b * s, -1))
    o, _ = sparse_attention(q.reshape(b * s, h, d), stores, indices, sink=sink, backend="pallas")
    return o.reshape(b, s, h, d).astype(q.dtype)


def attention_weights(module: nn.Module, cfg: ModelConfig) -> dict:
    """Declare one attention's projections on ``module`` (every layer's and every DSpark stage's): ``wq_a [H,
    q_lora]``, ``wq_b [q_lora, heads, D]``, ``wkv [H, D]``, ``wo_a [o_groups, heads/o_groups·D, o_lora]``, ``wo_b
    [o_groups, o_lora, H]``, ``attn_sink [heads]`` (FP32)."""
    dt = dtype_of(cfg.dtype)
    nh, d = cfg.num_attention_heads, cfg.head_dim
    g_in = nh // cfg.o_groups * d
    return {"wq_a": declare(module, "wq_a", (cfg.hidden_size, cfg.q_lora_rank), ("embed", "q_latent"), dt),
            "wq_b": declare(module, "wq_b", (cfg.q_lora_rank, nh, d), ("q_lora", "heads", "head_dim"), dt),
            "wkv": declare(module, "wkv", (cfg.hidden_size, d), ("embed", "kv_dim"), dt),
            "wo_a": declare(module, "wo_a", (cfg.o_groups, g_in, cfg.o_lora_rank), ("o_groups", None, "o_lora"), dt),
            "wo_b": declare(module, "wo_b", (cfg.o_groups, cfg.o_lora_rank, cfg.hidden_size),
                            ("o_groups", "o_lora", "embed"), dt),
            "attn_sink": declare(module, "attn_sink", (nh,), ("heads",), jnp.float32, zeros_init)}


def query_projection(w: dict, q_norm, x: jax.Array, angles: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The queries of rows ``x [B,S,H]``: ``(qr = q_norm(x · wq_a) [B,S,q_lora], q = RoPE(qr · wq_b) [B,S,heads,D])``
    (``qr`` also feeds the indexer's queries)."""
    qr = q_norm(jnp.einsum("bsh,hr->bsr", x, weight_for(w["wq_a"], x)))
    return qr, apply_rope(jnp.einsum("bsr,rnd->bsnd", qr, weight_for(w["wq_b"], qr)), angles)


def window_kv(wkv: jax.Array, kv_norm, x: jax.Array, angles: jax.Array) -> jax.Array:
    """The window key (= value) of rows ``x [..., H]``: ``kv_norm(x · wkv)`` rotated at ``angles`` →
    ``[..., D]`` (before the cache's FP8 fake-quant)."""
    return apply_rope(kv_norm(jnp.einsum("...h,hd->...d", x, weight_for(wkv, x))), angles)


def output_projection(cfg: ModelConfig, w: dict, o: jax.Array, angles: jax.Array) -> jax.Array:
    """Attention output ``o [B,S,heads,D]`` → ``[B,S,H]``: inverse RoPE at ``angles``, then the grouped low-rank
    ``wo_a`` and ``wo_b``."""
    b, s = o.shape[:2]
    o = apply_rope(o, angles, inverse=True).reshape(b, s, cfg.o_groups, -1)
    y = jnp.einsum("bsgi,gio->bsgo", o, weight_for(w["wo_a"], o))
    return jnp.einsum("bsgo,goh->bsh", y, weight_for(w["wo_b"], y))


class Attention(nn.Module):
    """One layer's attention, for every forward mode. Parameters: ``wq_a [H, q_lora]``, ``q_norm``,
    ``wq_b [q_lora, heads, D]``, ``wkv [H, D]``, ``kv_norm``, ``wo_a [o_groups, heads/o_groups·D, o_lora]``,
    ``wo_b [o_groups, o_lora, H]``, ``attn_sink [heads]`` (FP32), plus ``compressor`` / ``indexer``.

    Modes differ only in where keys are read from: *full* (``rows`` None) — the rows are a whole sequence
    ``x [B,S,H]`` from position 0 and every key comes from them; *cached* (``rows`` a
    `v41cp.serving.attention.paged_rows.PagedRows`, ``x [B,R,H]`` rows continuing each request's history) — window
    keys, compressed entries and index keys come from the paged ``cache`` through that backend, which the layer
    updates and returns. The projections, the compressor, the index keys and queries and the output are this
    module's, in both modes."""

    cfg: ModelConfig
    role: LayerRole
    shard: ShardingContext | None = None

    @nn.compact
    def __call__(self, x: jax.Array, state: CSAState, rows=None, cache=None,
                 cache_only: bool = False):
        """``x [B,S,H]`` (attention-normed) → ``([B,S,H], new state, cache)``. ``cache_only`` (cached mode, the
        CED prepass): write this layer's caches and return ``(None, state, cache)``."""
        cfg, role = self.cfg, self.role
        dt = dtype_of(cfg.dtype)
        b, s, _ = x.shape
        w = attention_weights(self, cfg)
        q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dt, name="q_norm")
        kv_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dt, name="kv_norm")
        sink = w["attn_sink"]

        compressed = role.ratio > 0
        positions = jnp.broadcast_to(jnp.arange(s), (b, s)) if rows is None else rows.pos
        angles = rope_angles(cfg, positions, compressed)
        qr, q = query_projection(w, q_norm, x, angles)
        q = constrain(q, ("batch", None, "heads", None), self.shard)
        kv = window_kv(w["wkv"], kv_norm, x, angles)
        compressor = Compressor(cfg, role.ratio, name="compressor") if role.is_kv_source else None
        indexer = Indexer(cfg, role, self.shard, name="indexer") if role.is_index_source else None

        if rows is None:
            o, state = self._full(q, kv, x, qr, angles, state, compressor, indexer, sink)
        else:
            cache, keys, valid = rows.window(cache, role.index, kv)
            if compressed:
                cache, state = self._cached_update(x, qr, angles, rows, cache, state, compressor, indexer,
                                                   cache_only)
            if cache_only:
                return None, state, cache
            o = rows.attend(cache, role, q, keys, valid, state, sink)
        return output_projection(cfg, w, o, angles).astype(dt), state, cache

    # ---------------------------------------------------------------------------------------- full mode
    def _full(self, q, kv, x, qr, angles, state, compressor, indexer, sink):
        cfg, role = self.cfg, self.role
        b, s, _ = x.shape
        compressed = role.ratio > 0
        if cfg.fake_quant:
            kv = fp8_block32(kv)
        widx, wvalid = window_indices(s, cfg.sliding_window)
        if compressed:
            state = self._update_state(x, qr, angles, state, compressor, indexer)
        sel = state.topk if compressed and state.ckv.shape[1] else None
        if cfg.attention_backend == "pallas":
            o = kernel_sink_attention(q, kv, widx, wvalid, state if compressed else None, sink)
        elif attention_query_parallel_applies(self.shard, cfg, role, b * s):
            o = query_parallel_attention(self.shard, q, kv, widx, wvalid, state.ckv if sel is not None else None,
                                         sel, sink)
        else:
            o = rows_sink_attention(q, kv, widx, wvalid, state.ckv if sel is not None else None, sel, sink)
        return o, state

    def _update_state(self, x, qr, angles, state: CSAState, compressor, indexer) -> CSAState:
        cfg, role = self.cfg, self.role
        b, s, _ = x.shape
        latent = compressed_angles = None
        if role.is_kv_source:
            latent = compressor(x)                                            # [B,G,D]
            g = latent.shape[1]
            compressed_angles = rope_angles(cfg, jnp.broadcast_to(jnp.arange(g) * role.ratio, (b, g)), True)
            ckv = apply_rope(latent, compressed_angles)
            state = CSAState(ckv=nvfp4_block16(ckv) if cfg.fake_quant else ckv)
        if state.ckv is None:
            raise ValueError(f"layer {role.index}: a {role.kind} layer needs compressed KV from a KV source before it")
        g = state.ckv.shape[1]
        if role.is_index_source:
            if g == 0:
                # no complete compression group yet: nothing to score or select
                keys = state.ikeys if state.ikeys is not None else jnp.zeros((b, 0, cfg.index_head_dim), x.dtype)
                cand = jnp.zeros((b, s, 0), bool) if role.candidate_source else state.candidates
                state = state._replace(ikeys=keys, topk=jnp.zeros((b, s, 0), jnp.int32), candidates=cand)
                self.sow("intermediates", "topk", state.topk)
                return state
            keys, topk, cand, scores = indexer(x, qr, angles, latent, compressed_angles, state.ikeys,
                                               state.candidates)
            if scores is not None:                      # the kernel path never materializes scores
                self.sow("intermediates", "index_scores", scores)
            if role.candidate_source:
                self.sow("intermediates", "candidates", cand)
            state = state._replace(ikeys=keys, topk=topk, candidates=cand)
        if state.topk is None:
            raise ValueError(f"layer {role.index}: a reuse layer needs a selection from an index source before it")
        self.sow("intermediates", "topk", state.topk)
        return state

    # -------------------------------------------------------------------------------------- cached mode
    def _cached_update(self, x, qr, angles, rows, cache, state: CSAState, compressor, indexer, cache_only):
        """KV sources: this step's compressed entries and index keys (each row's group pooled with its partner
        from the cache or the step) written to the pages, then the source's history; index sources: every
        row's selection."""
        cfg, role = self.cfg, self.role
        if role.is_kv_source:
            r = role.ratio
            if r == 1:
                latent = compressor.unpooled(x)
                emits = rows.valid
            else:
                c, z = compressor.project(x)
                cache, c0, z0 = rows.group_first(cache, str(role.kv_source), c, z)
                latent = compressor.finish(pool_group(jnp.stack([c0, c], -2), jnp.stack([z0, z], -2)), x.dtype)
                emits = rows.valid & (rows.pos % r == r - 1)
            j = rows.pos // r                                                   # each row's entry
            cang = rope_angles(cfg, j * r, True)
            ckv = apply_rope(latent, cang)
            ik = indexer.index_keys(latent, cang, quantize=False)
            cache = rows.write_entries(cache, role, ckv, ik, j, emits)
            if cache_only:
                return cache, state
            state = rows.history(cache, role)
        if role.is_index_source:
            qi, wi = indexer.query(x, qr, angles)
            topk, cand = rows.select(cache, role, qi, wi, state)
            state = state._replace(topk=topk, candidates=cand)
        return cache, state
