"""KV-source compressor (§2.4): ratio 2 = channel-wise softmax-gated pooling of token pairs,
ratio 1 = an unpooled projection. Output is the pre-RoPE latent ``[B, S // r, head_dim]``;
a trailing incomplete group contributes nothing in a full-sequence forward."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from v41cp.config import ModelConfig
from v41cp.layers.common import RMSNorm, declare, dtype_of

__all__ = ["Compressor"]


class Compressor(nn.Module):
    """Parameters (FP32): ``wkv [H, head_dim]``, ``wgate [H, head_dim]`` (ratio 2 only), ``norm [head_dim]``."""

    cfg: ModelConfig
    ratio: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        wkv = declare(self, "wkv", (cfg.hidden_size, cfg.head_dim), ("embed", None), jnp.float32)
        norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype_of(cfg.dtype), name="norm")
        if self.ratio == 1:
            return norm(jnp.einsum("bsh,hd->bsd", x, wkv.astype(x.dtype)))
        wgate = declare(self, "wgate", (cfg.hidden_size, cfg.head_dim), ("embed", None), jnp.float32)
        r = self.ratio
        length = x.shape[1] // r * r
        xf = x[:, :length].astype(jnp.float32)
        values = jnp.einsum("bsh,hd->bsd", xf, wkv, precision=jax.lax.Precision.HIGHEST)
        scores = jnp.einsum("bsh,hd->bsd", xf, wgate, precision=jax.lax.Precision.HIGHEST)
        values = values.reshape(x.shape[0], length // r, r, cfg.head_dim)
        scores = scores.reshape(x.shape[0], length // r, r, cfg.head_dim)
        pooled = jnp.sum(values * jax.nn.softmax(scores, axis=2), axis=2).astype(x.dtype)
        return norm(pooled)
