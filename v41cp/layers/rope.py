"""Interleaved-pair RoPE on the trailing channels, with the frequency-only YaRN of V4.1.

Two tables: ``main`` (θ = rope_theta, no scaling; ratio-0 layers) and ``compress``
(θ = compress_rope_theta + YaRN; every layer with ratio > 0, incl. its compressed entries,
which are rotated at the position of their first token ``j·r``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from v41cp.config import ModelConfig

__all__ = ["rope_frequencies", "rope_angles", "apply_rope"]


def rope_frequencies(cfg: ModelConfig, compressed: bool) -> np.ndarray:
    """FP32 inverse frequencies ``[qk_rope_head_dim // 2]`` of the main or compress table."""
    dim = cfg.qk_rope_head_dim
    theta = cfg.compress_rope_theta if compressed else cfg.rope_theta
    # θ^(2i/d) correctly rounded to FP32 (float64 pow, then one rounding), as torch's FP32 pow gives;
    # NumPy's FP32 pow is off by one ulp for some i at d = 64, which grows to 1e-2 rad at 1M positions.
    exponents = (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)).astype(np.float64)
    powers = (np.float64(np.float32(theta)) ** exponents).astype(np.float32)
    freqs = (np.float32(1.0) / powers).astype(np.float32)
    rs = cfg.rope_scaling_dict if compressed else {}
    length = int(rs.get("original_max_position_embeddings", 0)) if rs else 0
    if length > 0:
        factor = float(rs.get("factor", 1.0))
        beta_fast, beta_slow = float(rs.get("beta_fast", 32)), float(rs.get("beta_slow", 1))
        low = max(math.floor(dim * math.log(length / (beta_fast * 2 * math.pi)) / (2 * math.log(theta))), 0)
        high = min(math.ceil(dim * math.log(length / (beta_slow * 2 * math.pi)) / (2 * math.log(theta))), dim - 1)
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                       / np.float32(max(high - low, 1e-3)), 0, 1).astype(np.float32)
        freqs = (freqs / np.float32(factor) * ramp + freqs * (np.float32(1) - ramp)).astype(np.float32)
    return freqs


def rope_angles(cfg: ModelConfig, positions: jax.Array, compressed: bool) -> jax.Array:
    """FP32 angles ``[..., rope_dim // 2]`` for integer ``positions [...]``."""
    return positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_frequencies(cfg, compressed))


def apply_rope(x: jax.Array, angles: jax.Array, inverse: bool = False) -> jax.Array:
    """Rotate the last ``2·angles.shape[-1]`` channels of ``x`` in adjacent pairs (FP32 math).

    Args:
      x: ``[B, S, C]`` or ``[B, S, H, C]``.
      angles: ``[B, S, P]`` (broadcast over heads for 4-D ``x``).
      inverse: conjugate rotation (used on the attention output).
    Returns: same shape and dtype as ``x``.
    """
    rot = 2 * angles.shape[-1]
    if x.ndim == 4:
        angles = angles[:, :, None, :]
    pairs = x[..., -rot:].astype(jnp.float32).reshape(*x.shape[:-1], rot // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if inverse:
        sin = -sin
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    rotated = rotated.reshape(*x.shape[:-1], rot).astype(x.dtype)
    return jnp.concatenate([x[..., :-rot], rotated], axis=-1)
