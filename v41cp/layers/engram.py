"""Engram: hashed n-gram memory added to every residual stream before a layer's mHC."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from v41cp.config import ModelConfig
from v41cp.kernels.stored_weights import decode_fp8_rows
from v41cp.layers.common import declare, dtype_of, ones_init, weight_for, zeros_init
from v41cp.sharding.rules import ShardingContext, split_columns_einsum

__all__ = ["Engram", "engram_lookup", "engram_mix"]


def engram_lookup(cfg: ModelConfig, table: dict, hash_ids: jax.Array, dtype) -> jax.Array:
    """Table rows of ``hash_ids [..., hash_heads]`` → ``[..., hash_heads, engram_head_dim]`` in ``dtype``.
    ``table``: ``{"embed"}`` or (``keep_quantized``) ``{"embed_fp8", "embed_scale"}`` (only gathered rows are
    decoded). Ids must index the given table (a rank's slice under TP: offset and mask them first)."""
    if "embed_fp8" in table:
        return decode_fp8_rows(jnp.take(table["embed_fp8"], hash_ids, axis=0),
                               jnp.take(table["embed_scale"], hash_ids, axis=0), dtype)
    return jnp.take(table["embed"], hash_ids, axis=0).astype(dtype)


def engram_mix(cfg: ModelConfig, streams: jax.Array, gathered: jax.Array, wkv: jax.Array, q_w: jax.Array,
               k_w: jax.Array, token_mask: jax.Array | None = None,
               columns: ShardingContext | None = None) -> jax.Array:
    """Fused key/value projection of the gathered rows ``[B,S,hash_heads,dim]`` and the signed-sqrt gate applied
    to ``streams [B,S,hc,H]`` → updated streams (the part of `Engram` after the table lookup). ``columns``: the
    rows backend's context for splitting the projection's columns over attention TP (`split_columns_einsum`)."""
    hc, h = cfg.hc_mult, cfg.hidden_size
    emb = gathered.reshape(*gathered.shape[:2], gathered.shape[2] * cfg.engram_head_dim).astype(streams.dtype)
    kv = split_columns_einsum("bsi,io->bso", emb, weight_for(wkv, emb), columns, ("batch", None, None))
    key = kv[..., :hc * h].astype(jnp.float32).reshape(*kv.shape[:2], hc, h)
    value = kv[..., hc * h:].astype(jnp.float32)
    x = streams.astype(jnp.float32)
    weights = q_w.astype(jnp.float32) * k_w.astype(jnp.float32)
    rstd = (jax.lax.rsqrt(jnp.mean(x * x, axis=-1) + cfg.rms_norm_eps)
            * jax.lax.rsqrt(jnp.mean(key * key, axis=-1) + cfg.rms_norm_eps))
    dot = jnp.sum(x * weights * key, axis=-1) * rstd * h ** -0.5
    gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)), dot))
    if token_mask is not None:
        gate = jnp.where(token_mask[..., None], gate, 0.0)
    return (x + gate[..., None] * value[:, :, None, :]).astype(streams.dtype)


class Engram(nn.Module):
    """Table lookup, fused key/value projection and signed-sqrt gate.

    Parameters: ``embed [rows, engram_head_dim]`` (or, with ``keep_quantized``, ``embed_fp8`` e4m3 bytes and
    ``embed_scale`` e8m0 bytes ``[rows, engram_head_dim / 32]``), ``wkv [hash_heads·head_dim, (hc+1)·H]``
    (keys for the hc streams first, then the value), ``q_weight``/``k_weight [hc, H]``.
    """

    cfg: ModelConfig
    slot: int
    shard: object = None            # a RowGroup inside model-wide QCP (the table rows split over it)

    @nn.compact
    def __call__(self, streams: jax.Array, hash_ids: jax.Array, token_mask: jax.Array | None = None,
                 columns: ShardingContext | None = None):
        """``streams [B,S,hc,H]``, ``hash_ids [B,S,hash_heads]`` int32 → updated streams (``columns``: as
        `engram_mix`)."""
        cfg = self.cfg
        dt = dtype_of(cfg.dtype)
        hc, h = cfg.hc_mult, cfg.hidden_size
        rows = cfg.engram_table_rows(self.slot)
        if cfg.keep_quantized:        # FP8 rows + e8m0 scales as released; only gathered rows are decoded
            table = {"embed_fp8": declare(self, "embed_fp8", (rows, cfg.engram_head_dim), ("engram_rows", None),
                                          jnp.uint8, zeros_init),
                     "embed_scale": declare(self, "embed_scale", (rows, cfg.engram_head_dim // 32),
                                            ("engram_rows", None), jnp.uint8, zeros_init)}
        else:
            table = {"embed": declare(self, "embed", (rows, cfg.engram_head_dim), ("engram_rows", None), dt)}
        wkv = declare(self, "wkv", (cfg.engram_hash_heads * cfg.engram_head_dim, (hc + 1) * h),
                      (None, "engram_out"), dt)
        q_w = declare(self, "q_weight", (hc, h), (None, None), dt, ones_init)
        k_w = declare(self, "k_weight", (hc, h), (None, None), dt, ones_init)
        lookup = lambda ids: engram_lookup(cfg, table, ids, dt)
        if getattr(self.shard, "in_map", False):      # model-wide QCP: table rows split over the row group
            b, s = hash_ids.shape[:2]
            local = next(iter(table.values())).shape[0]
            got = self.shard.split_lookup(lookup, local, rows, hash_ids.reshape(b * s, -1))
            gathered = got.reshape(b, s, *got.shape[1:])
        else:
            gathered = lookup(hash_ids)
        return engram_mix(cfg, streams, gathered, wkv, q_w, k_w, token_mask, columns)
