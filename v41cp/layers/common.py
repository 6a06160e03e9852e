"""Shared building blocks: parameter declaration with logical axes, RMSNorm, dtype helpers."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import flax.linen as nn
from flax import errors as flax_errors
import jax
import jax.numpy as jnp
import numpy as np

from v41cp.kernels import match_varying

__all__ = ["declare", "abstract_tree_cache", "rms_norm", "dtype_of", "normal_init", "ones_init", "zeros_init",
           "full_after", "stacked_loop", "weight_for", "TIE_ROWS"]

normal_init = nn.initializers.normal(stddev=0.02)
ones_init = nn.initializers.ones
zeros_init = nn.initializers.zeros


def dtype_of(name: str):
    """``"float32" | "bfloat16"`` → jnp dtype."""
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def abstract_tree_cache(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Memoise ``fn(cfg)``, a config's abstract (boxed `ShapeDtypeStruct`) parameter tree: it depends on the
    hashable config alone, and tracing the model's ``init`` to get it costs about 1 s for the tiny model and 3 s at the
    released size, paid by every checkpoint load, placement and plan. Each call returns fresh containers over the
    shared, immutable leaves, so a caller that edits its tree edits its own copy."""
    cached = functools.lru_cache(maxsize=16)(fn)

    @functools.wraps(fn)
    def fresh(cfg):
        return jax.tree.map(lambda leaf: leaf, cached(cfg))

    fresh.cache_clear = cached.cache_clear
    return fresh


def declare(module: nn.Module, name: str, shape: Sequence[int], axes: Sequence[str | None],
            dtype, init: Callable = normal_init) -> jax.Array:
    """Declare parameter ``name`` of ``shape`` whose dimensions carry logical axis names ``axes``.

    The logical names are mapped to mesh axes by `v41cp.sharding.rules.AxisRules`. Inside model-wide QCP's map
    (the module's ``shard`` a `v41cp.sharding.row_group.RowGroup`) the parameter is the rank's slice.

    Applying the model (the parameter given): the value is read and its shape checked here, not through
    `nn.Module.param`, whose check traces the initializer under `jax.eval_shape` for every parameter at every trace
    (measured: 16 % of tracing an engine step of the tiny model).
    """
    if len(axes) != len(shape):
        raise ValueError(f"{name}: {len(axes)} logical axes for shape {tuple(shape)}")
    shard = getattr(module, "shard", None)
    if getattr(shard, "in_map", False):
        shape = shard.local_shape(tuple(shape), tuple(axes))
    if not module.is_initializing() and module.has_variable("params", name):
        value = nn.meta.unbox(module.get_variable("params", name))
        if np.shape(value) != tuple(shape):
            raise flax_errors.ScopeParamShapeError(name, module.scope.path_text, np.shape(value), tuple(shape))
        return value
    return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape), dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in FP32, weight multiplied before the cast back to ``x.dtype``."""
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


def _zero_from(dep: jax.Array, dtype) -> jax.Array:
    """A scalar zero of ``dtype`` computed from ``dep``'s first element: ``0·dep`` (not simplified for floating
    point), 0 where it is not finite; the zero's sign may follow ``dep``'s, which changes no sum or product."""
    z = dep.reshape(-1)[0].astype(jnp.float32) * 0
    return jnp.where(jnp.isfinite(z), z, 0).astype(dtype)


def full_after(shape, value, dtype, dep: jax.Array) -> jax.Array:
    """``jnp.full(shape, value, dtype)`` computed from ``dep`` (this layer's data), for a loop's initial buffer (an
    accumulator, a stacked output). A constant buffer depends on nothing, so XLA's scheduler may hoist its per-loop
    copy to the start of the program, and then every layer's copy is live at once (measured: the compiled
    V4.1-Flash prefill held all 43 layers' MoE accumulators and attention outputs together, 144 GB per device at
    131K tokens). An optimization barrier does not stop it (XLA removes barriers before scheduling); a value
    derived from ``dep`` does (`_zero_from`)."""
    return jnp.full(shape, value, dtype) + _zero_from(dep, dtype)


# forwards of at least this many rows take their weights through `weight_for`'s dependency (prefill passes);
# decode steps (a few rows) read them as they are
TIE_ROWS = 1024


def weight_for(w: jax.Array, x: jax.Array, dtype=None) -> jax.Array:
    """Weight ``w`` as the operand of a product with activations ``x [..., D]``: ``w`` cast to ``dtype`` (default
    ``x.dtype``). When ``x`` has at least `TIE_ROWS` rows the value is computed from ``x`` (``w + 0·x``, exact:
    `_zero_from`), so whatever copy the compiler makes of it — the cast, or the CPU backend's FP32 operand for a
    BF16 dot (it has no BF16 GEMM) — is made at the layer that uses it. A copy of a parameter alone depends on
    nothing, and XLA schedules such copies at the program start, where every layer's is live at once (measured:
    14.6 GB per device of FP32 weight copies in the compiled 131K V4.1-Flash prefill). One elementwise pass over
    the weight per prefill forward; decode steps are untouched."""
    dtype = dtype or x.dtype
    if x.ndim < 2 or x.size // x.shape[-1] < TIE_ROWS:
        return w.astype(dtype)
    return (w + _zero_from(x, w.dtype)).astype(dtype)


def stacked_loop(run, tiles: int, xs: tuple, outs: tuple, like: tuple = ()) -> tuple:
    """``run(x_i) → (out_i, …)`` for the ``tiles`` leading-axis slices of ``xs``, stacked into ``[tiles, *out.shape]``
    buffers (``outs``: one tile's zero value each); ``like``: the other operands ``run`` reads (closed over). A
    ``fori_loop`` writing in place; its output buffers are allocated with the operands
    (`v41cp.layers.common.full_after`), never hoisted to the program start where every layer's would be live at
    once, and vary over the mesh axes the operands vary over (inside ``jax.shard_map``)."""
    take = lambda i: tuple(jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False) for x in xs)
    if tiles == 1:
        return tuple(o[None] for o in run(take(0)))
    deps = jax.tree.leaves((xs, like))
    dep = next((d for d in deps if jnp.issubdtype(d.dtype, jnp.floating)), deps[0])
    init = tuple(full_after((tiles, *o.shape), 0, o.dtype, dep) + o for o in outs)
    leaves = match_varying(list(init) + deps)[0][:len(init)]

    def body(i, bufs):
        got = run(take(i))
        return tuple(jax.lax.dynamic_update_index_in_dim(b, g.astype(b.dtype), i, 0) for b, g in zip(bufs, got))

    return jax.lax.fori_loop(0, tiles, body, tuple(leaves))
