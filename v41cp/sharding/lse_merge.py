"""Exact partial-softmax (log-sum-exp) merge of context-parallel attention partials.

Conventions: LSE is natural-log FP32; partials are computed **without** the attention sink; the sink is
applied once, after the merge (`apply_sink`). A partial with no valid key has ``lse = −inf`` and a zero
output; a peer's NaN or +inf LSE is treated as −inf (that rank contributes exactly zero, never NaN).

`partial_attention` is the per-rank kernel reference; `merge_partials` the math on stacked partials;
`merge_ag_rs` / `merge_a2a` the two collective backends inside `jax.shard_map` over a context-parallel axis:

* ``ag_rs``: all-gather the LSE ``[N, B, Hg]`` (FP32), weight the own partial, reduce-scatter the
  outputs along heads in FP32 → ``[B, Hg/N, D]`` (with ``scatter=False``: all-reduce, heads replicated);
* ``a2a``: one all-to-all of ``[N, B, Hg/N, D + 1]`` FP32 (output and LSE packed on the channel axis),
  then a local merge → ``[B, Hg/N, D]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["partial_attention", "merge_partials", "apply_sink", "merge_ag_rs", "merge_a2a"]


def partial_attention(q: jax.Array, keys: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sink-free softmax attention over one rank's keys (K = V).

    q ``[B, H, D]``, keys ``[B, K, D]``, valid ``[B, K]`` bool → (``o [B, H, D]`` FP32, locally normalised;
    ``lse [B, H]`` FP32 natural log, −inf where no key is valid, and then ``o = 0``).
    """
    d = q.shape[-1]
    kf = jnp.where(valid[..., None], keys.astype(jnp.float32), 0.0)     # masked rows never reach the sums
    logits = jnp.einsum("bhd,bkd->bhk", q.astype(jnp.float32), kf, precision=jax.lax.Precision.HIGHEST) * d ** -0.5
    logits = jnp.where(valid[:, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(valid[:, None, :], jnp.exp(logits - m), 0.0)
    s = jnp.sum(p, axis=-1)
    o = jnp.einsum("bhk,bkd->bhd", p, kf, precision=jax.lax.Precision.HIGHEST) / jnp.where(s > 0, s, 1.0)[..., None]
    lse = jnp.where(s > 0, m[..., 0] + jnp.log(jnp.where(s > 0, s, 1.0)), -jnp.inf)
    return o, lse


def _sanitize(lse: jax.Array) -> jax.Array:
    lse = lse.astype(jnp.float32)
    return jnp.where(jnp.isnan(lse) | (lse == jnp.inf), -jnp.inf, lse)


def _weights(lse_all: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Merge weights ``[N, ...]`` (0 for −inf partials) and the merged LSE ``[...]`` of stacked LSEs."""
    lse_all = _sanitize(lse_all)
    g = jnp.max(lse_all, axis=0)
    g = jnp.where(jnp.isfinite(g), g, 0.0)
    e = jnp.exp(lse_all - g)                       # exp(−inf) = 0
    s = jnp.sum(e, axis=0)
    w = e / jnp.where(s > 0, s, 1.0)
    lse = jnp.where(s > 0, g + jnp.log(jnp.where(s > 0, s, 1.0)), -jnp.inf)
    return w, lse


def merge_partials(o_all: jax.Array, lse_all: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Stacked partials ``o [N, B, H, D]``, ``lse [N, B, H]`` → merged (``o [B, H, D]``, ``lse [B, H]``)."""
    w, lse = _weights(lse_all)
    o = jnp.sum(jnp.where(w[..., None] > 0, w[..., None] * o_all.astype(jnp.float32), 0.0), axis=0)
    return o, lse


def apply_sink(o: jax.Array, lse: jax.Array, sink: jax.Array) -> jax.Array:
    """Add the per-head sink logit ``sink [H]`` (value 0) to a merged partial: ``o · e^lse / (e^lse + e^σ)``."""
    sink = sink.astype(jnp.float32)
    scale = jnp.where(lse > -jnp.inf, jnp.exp(lse - jnp.logaddexp(lse, sink)), 0.0)
    return o * scale[..., None]


def merge_ag_rs(o: jax.Array, lse: jax.Array, axis: str, scatter: bool = True) -> tuple[jax.Array, jax.Array]:
    """Inside shard_map over ``axis`` (N ranks): own partial ``o [B, Hg, D]``, ``lse [B, Hg]`` →
    merged ``o [B, Hg/N, D]`` and ``lse [B, Hg/N]`` for this rank's head slice (``scatter``), or all
    ``Hg`` heads on every rank (``scatter=False``: the outputs are all-reduced)."""
    lse_all = jax.lax.all_gather(_sanitize(lse), axis, to="invarying")             # [N, B, Hg]
    w_all, lse_m = _weights(lse_all)
    w = w_all[jax.lax.axis_index(axis)]
    contrib = jnp.where(w[..., None] > 0, w[..., None] * o.astype(jnp.float32), 0.0)
    if not scatter:
        return jax.lax.psum(contrib, axis), lse_m
    n = lse_all.shape[0]
    hs = lse.shape[-1] // n
    out = jax.lax.psum_scatter(contrib, axis, scatter_dimension=1, tiled=True)     # [B, Hg/N, D]
    lse_own = jax.lax.dynamic_slice_in_dim(lse_m, jax.lax.axis_index(axis) * hs, hs, axis=1)
    return out, lse_own


def merge_a2a(o: jax.Array, lse: jax.Array, axis: str, n: int) -> tuple[jax.Array, jax.Array]:
    """Inside shard_map over ``axis`` (``n`` ranks): one all-to-all of the packed ``[n, B, Hg/n, D + 1]``
    FP32 payload (head slice ``k`` goes to rank ``k``), then a local merge → (``o [B, Hg/n, D]``, ``lse``)."""
    b, hg, d = o.shape
    packed = jnp.concatenate([o.astype(jnp.float32), _sanitize(lse)[..., None]], axis=-1)     # [B, Hg, D+1]
    packed = packed.reshape(b, n, hg // n, d + 1).transpose(1, 0, 2, 3)
    got = jax.lax.all_to_all(packed, axis, 0, 0, tiled=True)          # [n (source rank), B, Hg/n, D+1]
    return merge_partials(got[..., :d], got[..., d])
