"""Reference (pure jnp) of the sparse attention op: the definition the Pallas kernel reproduces."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v41cp.kernels.dequant import load_rows_split, merge_channels, record_refs

__all__ = ["gather_keys", "sink_attention", "sparse_attention_reference"]


def gather_keys(store, fmt: str | None, indices: jax.Array, channels: int) -> jax.Array:
    """Rows ``indices [R, K]`` (−1 = padding, read as row 0) of a store, decoded → FP32 ``[R, K, C]``."""
    r, k = indices.shape
    refs = record_refs(store, fmt)
    even, odd = load_rows_split(refs, fmt, jnp.maximum(indices, 0).reshape(-1), channels)
    return merge_channels(even, odd).reshape(r, k, channels)


def sparse_attention_reference(q: jax.Array, stores, formats, indices, lengths) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of each query row over the union of its keys in several stores (K = V).

    Args:
      q: ``[R, H, D]`` queries (any float dtype).
      stores / formats: per store a ``[N, D]`` array (format None) or a record dict ``{"q", "s"}``
        (``"fp8"`` / ``"nvfp4"``; ``{"q", "s", "r"}``: ``"fp8_ds_mla"``), rows addressed by physical slot.
      indices: per store ``[R, K_i]`` int32 slots, −1 = padding.
      lengths: per store ``[R]`` int32 — only the first ``lengths`` slots of a row are read.
    Returns: ``(o [R, H, D] FP32, lse [R, H] FP32)`` — the normalized output **without** the sink and the
    natural-log LSE of the logits ``q·k / √D``; a row with no valid key gives ``o = 0``, ``lse = −inf``.
    """
    d = q.shape[-1]
    keys, valid = [], []
    for store, fmt, idx, n in zip(stores, formats, indices, lengths):
        keys.append(gather_keys(store, fmt, idx, d))
        valid.append((idx >= 0) & (jnp.arange(idx.shape[1])[None, :] < n[:, None]))
    keys, valid = jnp.concatenate(keys, axis=1), jnp.concatenate(valid, axis=1)
    logits = jnp.einsum("rhd,rkd->rhk", q.astype(jnp.float32), keys, precision=jax.lax.Precision.HIGHEST)
    logits = jnp.where(valid[:, None, :], logits * d ** -0.5, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m_safe)
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("rhk,rkd->rhd", p, keys, precision=jax.lax.Precision.HIGHEST)
    o = jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    lse = jnp.where(l > 0, m_safe[..., 0] + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return o, lse


def sink_attention(q: jax.Array, keys: jax.Array, valid: jax.Array, sink: jax.Array) -> jax.Array:
    """Softmax attention with an additive sink column (value 0), K = V.

    Args:
      q: ``[B,S,Hq,D]``; keys: ``[B,S,K,D]`` per-query gathered keys; valid: ``[B,S,K]`` bool;
      sink: ``[Hq]`` FP32 logits.
    Returns: ``[B,S,Hq,D]`` in ``q.dtype``; a row with no valid key returns 0.
    """
    d = q.shape[-1]
    kf = keys.astype(jnp.float32)
    logits = jnp.einsum("bshd,bskd->bshk", q.astype(jnp.float32), kf,
                        precision=jax.lax.Precision.HIGHEST) * d ** -0.5
    logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)
    sink_col = jnp.broadcast_to(sink.astype(jnp.float32)[None, None, :, None], (*logits.shape[:3], 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink_col], axis=-1), axis=-1)[..., :-1]
    out = jnp.einsum("bshk,bskd->bshd", probs, kf, precision=jax.lax.Precision.HIGHEST)
    return out.astype(q.dtype)
