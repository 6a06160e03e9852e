"""CSA2 attention of one V4.1 layer: one module for every mode, its rows through a rows backend
(`v41cp.layers.rows_backend`: the full sequence, or cached rows — paged rows, DCP, model-wide QCP).

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
from v41cp.layers.compressor import Compressor
from v41cp.layers.indexer import Indexer
from v41cp.layers.rope import apply_rope, rope_angles
from v41cp.sharding.operator_qcp import rows_island
from v41cp.sharding.rules import ShardingContext, constrain, split_columns_einsum

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


def query_projection(w: dict, q_norm, x: jax.Array, angles: jax.Array,
                     head_norm_eps: float | None = None) -> tuple[jax.Array, jax.Array]:
    """The queries of rows ``x [B,S,H]``: ``(qr = q_norm(x · wq_a) [B,S,q_lora], q = RoPE(qr · wq_b) [B,S,heads,D])``
    (``qr`` also feeds the indexer's queries). ``head_norm_eps`` (V4): each head of ``qr · wq_b`` is RMS-normalized
    (no weight) before the rotation."""
    qr = q_norm(jnp.einsum("bsh,hr->bsr", x, weight_for(w["wq_a"], x)))
    q = jnp.einsum("bsr,rnd->bsnd", qr, weight_for(w["wq_b"], qr))
    if head_norm_eps is not None:
        qf = q.astype(jnp.float32)
        q = q * jax.lax.rsqrt(jnp.mean(qf * qf, axis=-1, keepdims=True) + head_norm_eps).astype(q.dtype)
    return qr, apply_rope(q, angles)


def window_kv(wkv: jax.Array, kv_norm, x: jax.Array, angles: jax.Array,
              columns: ShardingContext | None = None) -> jax.Array:
    """The window key (= value) of rows ``x [..., H]``: ``kv_norm(x · wkv)`` rotated at ``angles`` →
    ``[..., D]`` (before the cache's FP8 fake-quant). One KV head: with ``columns`` (the rows backend's) the
    projection's columns split over attention TP on few rows (`split_columns_einsum`), else every rank computes it
    whole."""
    kv = split_columns_einsum("...h,hd->...d", x, weight_for(wkv, x), columns, ("batch",) + (None,) * (x.ndim - 1))
    return apply_rope(kv_norm(kv), angles)


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

    The rows ``x [B,R,H]`` come with their rows backend (`v41cp.layers.rows_backend.RowsBackend`): a whole sequence
    (`v41cp.layers.full_sequence.FullSequence`) or rows continuing cached histories (paged rows, model-wide QCP).
    The projections, the compressor's groups pooled into entries, the index keys and queries and the output are
    this module's in every mode; the backend says where each row's window keys, compression partners, entries and
    selection come from, and attends."""

    cfg: ModelConfig
    role: LayerRole
    shard: ShardingContext | None = None

    @nn.compact
    def __call__(self, x: jax.Array, state: CSAState, rows, cache=None, cache_only: bool = False):
        """``x [B,R,H]`` (attention-normed) → ``([B,R,H], new state, cache)``. ``cache_only`` (the CED prepass):
        write this layer's caches and return ``(None, state, cache)``."""
        cfg, role = self.cfg, self.role
        dt = dtype_of(cfg.dtype)
        w = attention_weights(self, cfg)
        q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dt, name="q_norm")
        kv_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dt, name="kv_norm")

        compressed = role.ratio > 0
        angles = rope_angles(cfg, rows.pos, compressed)
        qr, q = query_projection(w, q_norm, x, angles, cfg.rms_norm_eps if cfg.is_v4 else None)
        q = constrain(q, ("batch", None, "heads", None), self.shard)
        kv = window_kv(w["wkv"], kv_norm, x, angles, rows.columns)
        compressor = Compressor(cfg, role.ratio, v4=cfg.is_v4, overlap=role.overlapping,
                                name="compressor") if role.is_kv_source else None
        indexer = Indexer(cfg, role, name="indexer") if role.is_index_source else None

        cache, keys, valid = rows.window(cache, role.index, kv)
        if compressed:
            cache, state = self._compressed(x, qr, angles, rows, cache, state, compressor, indexer, cache_only)
        if cache_only:
            return None, state, cache
        o = rows.attend(cache, role, q, keys, valid, state, w["attn_sink"])
        return output_projection(cfg, w, o, angles).astype(dt), state, cache

    def _compressed(self, x, qr, angles, rows, cache, state: CSAState, compressor, indexer, cache_only):
        """KV sources: the rows' compression groups pooled into entries (`RowsBackend.groups`; ratio 1: each row),
        rotated at their entries' positions, written with their index keys, then the source's entries read back;
        index sources: every row's selection."""
        cfg, role = self.cfg, self.role
        if role.is_kv_source:
            r = role.ratio
            if r == 1:
                latent, j, emits = compressor.unpooled(x), rows.pos // r, rows.valid
            else:
                cache, c, z, j, emits = rows.groups(cache, role, *compressor.project(x))
                latent = compressor.finish(compressor.pool(c, z), x.dtype)
            cang = rope_angles(cfg, j * r, True)
            ckv = apply_rope(latent, cang)
            if not cfg.is_v4:
                ik = indexer.index_keys(latent, cang, quantize=False)
            elif indexer is not None:                   # V4 CSA: the indexer's own compressor
                cache, ik = indexer.compressed_keys(rows, cache, x, cang)
            else:                                       # V4 HCA: no index keys
                ik = jnp.zeros(ckv.shape[:-1] + (0,), ckv.dtype)
            cache = rows.write_entries(cache, role, ckv, ik, j, emits)
            if cache_only:
                return cache, state
            state = rows.history(cache, role)
            if role.dense_history:                      # V4 HCA: every visible entry
                state = state._replace(topk=rows.every_entry(cache, role, state))
        if role.is_index_source:
            topk, cand, scores = rows.select(cache, role, indexer.query(x, qr, angles), state)
            if scores is not None:                      # the kernel, QCP and cached paths never materialize them
                self.sow("intermediates", "index_scores", scores)
            if role.candidate_source and topk.shape[-1]:
                self.sow("intermediates", "candidates", cand)
            state = state._replace(topk=topk, candidates=cand)
        if state.topk is None:
            raise ValueError(f"layer {role.index}: a reuse layer needs a selection from an index source before it")
        self.sow("intermediates", "topk", state.topk)
        return cache, state
