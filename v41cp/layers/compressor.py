"""KV-source compressor: one routine for every mode and ratio.

Ratio ``r > 1``: each token row gets FP32 projections ``c = x·wkv`` and ``z = x·wgate``; entry ``j`` pools the
group of rows ``j·r … j·r + r − 1`` channel-wise, ``Σ_rows c · softmax_rows(z)`` (`pool_group`), then RMSNorm.
Ratio 1: an unpooled projection ``norm(x·wkv)`` per row. The output is the pre-RoPE latent.

The full-sequence forward pools whole groups of its rows (`Compressor.__call__`; a trailing incomplete group
contributes nothing); the cached modes pool each group's rows as they arrive — the group's earlier rows come
from the cache's open group or from earlier rows of the same step (`v41cp.serving.attention.paged_rows`) — through the
same `pool_group` and `Compressor.finish`.

DeepSeek-V4 (``v4=True``): the gate scores get a learned position bias ``ape [r, ·]`` (one row per position in the
window) before the softmax. HCA (any ratio but 4): projections to ``dim``, windows of ``r`` rows as above. CSA
(``overlap``, ratio 4): projections to ``2·dim``; entry ``j`` pools ``2r`` slots — the previous window's rows' low
halves ``[..., :dim]`` then its own rows' high halves ``[..., dim:]``; a rows backend hands each entry its ``2r``
rows (`with_previous_window` for a whole sequence); the first window's previous slots are empty (value 0, score
−inf: weight 0). The indexer of a CSA layer owns one of these at the index
head dim.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from v41cp.config import ModelConfig
from v41cp.layers.common import RMSNorm, declare, dtype_of, weight_for

__all__ = ["Compressor", "pool_group", "with_previous_window"]


def pool_group(values: jax.Array, scores: jax.Array) -> jax.Array:
    """Channel-wise softmax-gated pooling of a group's rows: ``values / scores [..., r, D]`` (FP32) →
    ``[..., D]`` FP32."""
    return jnp.sum(values * jax.nn.softmax(scores, axis=-2), axis=-2)


def with_previous_window(c: jax.Array, z: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Windows ``c / z [B, G, r, C]`` of a whole sequence → ``[B, G, 2r, C]``: window ``j − 1``'s rows, then window
    ``j``'s (V4 CSA's input to `Compressor.pool`); window 0's previous rows are empty (value 0, score −inf)."""
    prev = lambda a, fill: jnp.concatenate([jnp.full_like(a[:, :1], fill), a[:, :-1]], axis=1)
    return jnp.concatenate([prev(c, 0), c], axis=2), jnp.concatenate([prev(z, -jnp.inf), z], axis=2)


class Compressor(nn.Module):
    """Parameters (FP32): ``wkv [H, head_dim]``, ``wgate [H, head_dim]`` (ratio > 1 only), ``norm [head_dim]``.
    V4 (``v4``): ``wkv`` / ``wgate [H, m·dim]`` and ``ape [r, m·dim]`` (``m`` = 2 with ``overlap``), ``norm [dim]``;
    ``dim`` 0 = the head dim."""

    cfg: ModelConfig
    ratio: int
    v4: bool = False
    overlap: bool = False
    dim: int = 0

    @property
    def width(self) -> int:
        return self.dim or self.cfg.head_dim

    def setup(self):
        cfg = self.cfg
        out = self.width * (2 if self.overlap else 1)
        self.wkv = declare(self, "wkv", (cfg.hidden_size, out), ("embed", None), jnp.float32)
        if self.ratio > 1:
            self.wgate = declare(self, "wgate", (cfg.hidden_size, out), ("embed", None), jnp.float32)
        if self.v4:
            self.ape = declare(self, "ape", (self.ratio, out), (None, None), jnp.float32)
        self.norm = RMSNorm(self.width, cfg.rms_norm_eps, dtype_of(cfg.dtype))

    def pool(self, c: jax.Array, z: jax.Array) -> jax.Array:
        """Windows of rows ``c / z [..., r, ·]`` (FP32, `project`) → pooled ``[..., dim]`` FP32: `pool_group`. V4 adds
        the position bias (row ``i`` of a window: ``ape[i]``) to the scores; CSA (``overlap``) takes ``[..., 2r,
        2·dim]`` — the previous window's rows then the entry's own (rows before the sequence: value 0, score −inf)
        — and pools the previous rows' low halves with its own rows' high halves."""
        if not self.v4:
            return pool_group(c, z)
        r, d = self.ratio, self.width
        if not self.overlap:
            return pool_group(c, z + self.ape)
        z = z + jnp.concatenate([self.ape, self.ape])
        slots = lambda a: jnp.concatenate([a[..., :r, :d], a[..., r:, d:]], axis=-2)
        return pool_group(slots(c), slots(z))

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
        """Full sequence ``x [B,S,H]`` → latents of its complete groups ``[B, S // r, dim]``."""
        if self.ratio == 1:
            return self.unpooled(x)
        r = self.ratio
        length = x.shape[1] // r * r
        c, z = self.project(x[:, :length])
        group = lambda a: a.reshape(x.shape[0], length // r, r, a.shape[-1])
        c, z = group(c), group(z)
        if self.overlap:
            c, z = with_previous_window(c, z)
        return self.finish(self.pool(c, z), x.dtype)
