"""KV-source compressor: one routine for every mode and ratio.

Ratio ``r > 1``: each token row gets FP32 projections ``c = x·wkv`` and ``z = x·wgate``; entry ``j`` pools the
group of rows ``j·r … j·r + r − 1`` channel-wise, ``Σ_rows c · softmax_rows(z)`` (`pool_group`), then RMSNorm.
Ratio 1: an unpooled projection ``norm(x·wkv)`` per row. The output is the pre-RoPE latent.

The full-sequence forward pools whole groups of its rows (`Compressor.__call__`; a trailing incomplete group
contributes nothing); the cached modes pool each group's rows as they arrive — the group's earlier rows come
from the cache's open group or from earlier rows of the same step (`v41cp.serving.attention.paged_rows`) — through the
same `pool_group` and `Compressor.finish`. (V4's overlapping ratio 4 / ratio 128 groups fit the same routine:
a group is a row window of ``pool_group``.)
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from v41cp.config import ModelConfig
from v41cp.layers.common import RMSNorm, declare, dtype_of, weight_for

__all__ = ["Compressor", "pool_group"]


def pool_group(values: jax.Array, scores: jax.Array) -> jax.Array:
    """Channel-wise softmax-gated pooling of a group's rows: ``values / scores [..., r, D]`` (FP32) →
    ``[..., D]`` FP32."""
    return jnp.sum(values * jax.nn.softmax(scores, axis=-2), axis=-2)


class Compressor(nn.Module):
    """Parameters (FP32): ``wkv [H, head_dim]``, ``wgate [H, head_dim]`` (ratio > 1 only), ``norm [head_dim]``."""

    cfg: ModelConfig
    ratio: int

    def setup(self):
        cfg = self.cfg
        self.wkv = declare(self, "wkv", (cfg.hidden_size, cfg.head_dim), ("embed", None), jnp.float32)
        if self.ratio > 1:
            self.wgate = declare(self, "wgate", (cfg.hidden_size, cfg.head_dim), ("embed", None), jnp.float32)
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype_of(cfg.dtype))

    def unpooled(self, x: jax.Array) -> jax.Array:
        """Ratio 1: the latent of every row ``x [..., H]`` → ``[..., head_dim]``."""
        return self.norm(jnp.einsum("...h,hd->...d", x, weight_for(self.wkv, x)))

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Ratio > 1: the FP32 projections ``(c, z)`` ``[..., head_dim]`` of rows ``x [..., H]``."""
        xf = x.astype(jnp.float32)
        hi = jax.lax.Precision.HIGHEST
        return (jnp.einsum("...h,hd->...d", xf, weight_for(self.wkv, xf), precision=hi),
                jnp.einsum("...h,hd->...d", xf, weight_for(self.wgate, xf), precision=hi))

    def finish(self, pooled: jax.Array, dtype) -> jax.Array:
        """A pooled group (FP32, `pool_group`) → its latent in ``dtype``."""
        return self.norm(pooled.astype(dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        """Full sequence ``x [B,S,H]`` → latents of its complete groups ``[B, S // r, head_dim]``."""
        if self.ratio == 1:
            return self.unpooled(x)
        r = self.ratio
        length = x.shape[1] // r * r
        c, z = self.project(x[:, :length])
        group = lambda a: a.reshape(x.shape[0], length // r, r, a.shape[-1])
        return self.finish(pool_group(group(c), group(z)), x.dtype)
