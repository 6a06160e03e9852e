"""Shared building blocks: parameter declaration with logical axes, RMSNorm, dtype helpers."""

from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["declare", "rms_norm", "dtype_of", "normal_init", "ones_init", "zeros_init"]

normal_init = nn.initializers.normal(stddev=0.02)
ones_init = nn.initializers.ones
zeros_init = nn.initializers.zeros


def dtype_of(name: str):
    """``"float32" | "bfloat16"`` → jnp dtype."""
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def declare(module: nn.Module, name: str, shape: Sequence[int], axes: Sequence[str | None],
            dtype, init: Callable = normal_init) -> jax.Array:
    """Declare parameter ``name`` of ``shape`` whose dimensions carry logical axis names ``axes``.

    The logical names are mapped to mesh axes by `v41cp.sharding.rules.AxisRules`. Inside model-wide QCP's map
    (the module's ``shard`` a `v41cp.sharding.row_group.RowGroup`) the parameter is the rank's slice.
    """
    if len(axes) != len(shape):
        raise ValueError(f"{name}: {len(axes)} logical axes for shape {tuple(shape)}")
    shard = getattr(module, "shard", None)
    if getattr(shard, "in_map", False):
        shape = shard.local_shape(tuple(shape), tuple(axes))
    return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape), dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in FP32, weight multiplied before the cast back to ``x.dtype`` (§3.6)."""
    v = x.astype(jnp.float32)
    v = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * v).astype(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a learned weight ``[dim]`` (logical axis ``axis``)."""

    dim: int
    eps: float
    dtype: object = jnp.float32
    axis: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = declare(self, "weight", (self.dim,), (self.axis,), self.dtype, ones_init)
        return rms_norm(x, w, self.eps)
