"""mHC: manifold-constrained hyper-connections with the V4.1 single-pass hand-off (and V4's per-site form).

The residual is ``X [B, S, hc, H]``. Each site (attention, FFN) predicts FP32 coefficients
``pre [B,S,hc]``, ``post [B,S,hc]`` and a Sinkhorn-normalised ``comb [B,S,hc,hc]``
(input stream × output stream). V4.1: a site's input is collapsed with the *previous* site's ``pre``, and the last
``pre`` collapses the streams before the final norm. V4: each site collapses with its own ``pre``, and a head
mixer (`HyperHead`, ``hc_head_*``) collapses them at the end.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from v41cp.config import ModelConfig
from v41cp.layers.common import declare, ones_init, zeros_init

__all__ = ["HyperConnection", "HyperHead", "sinkhorn", "collapse", "expand", "mhc_layer", "mhc_layer_v4"]


def sinkhorn(logits: jax.Array, iters: int, eps: float) -> jax.Array:
    """Softmax over the last axis, then alternate column/row normalisation (``iters`` column passes).

    The ``iters − 1`` row-then-column passes are one loop on a CPU and unrolled elsewhere, the same arithmetic in the
    same order: XLA:CPU compiles the unrolled passes, which its fusion duplicates into long recomputed chains, in about
    twice the time of the loop (`docs/benchmarks.md`), while a GPU runs them as a few fused kernels where a loop would
    launch the body's kernels once per pass. The unrolled passes are a fully unrolled ``fori_loop``: the body is
    traced once and called per pass (XLA inlines the calls: the compiled program is the unrolled one), so tracing for
    a CPU, which traces both branches, does not trace the passes one by one."""
    x = jax.nn.softmax(logits, axis=-1) + eps
    x = x / (jnp.sum(x, axis=-2, keepdims=True) + eps)

    def row_then_column(_, x):
        x = x / (jnp.sum(x, axis=-1, keepdims=True) + eps)
        return x / (jnp.sum(x, axis=-2, keepdims=True) + eps)

    return jax.lax.platform_dependent(
        x, cpu=lambda x: jax.lax.fori_loop(0, iters - 1, row_then_column, x),
        default=lambda x: jax.lax.fori_loop(0, iters - 1, row_then_column, x, unroll=True))


def collapse(streams: jax.Array, pre: jax.Array) -> jax.Array:
    """``Σ_k pre_k X_k`` in FP32, cast to the streams' dtype: ``[B,S,hc,H] → [B,S,H]``."""
    return jnp.sum(pre[..., None] * streams.astype(jnp.float32), axis=2).astype(streams.dtype)


def expand(output: jax.Array, streams: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """``X'_k = post_k · F + Σ_j comb[j,k] · X_j`` → ``[B,S,hc,H]`` in ``output``'s dtype."""
    update = post[..., None] * output[..., None, :].astype(jnp.float32)
    mixed = jnp.einsum("bsjk,bsjh->bskh", comb, streams.astype(jnp.float32))
    return (update + mixed).astype(output.dtype)


def mhc_layer(streams: jax.Array, pre_prev: jax.Array, hc_attn, attn_norm, attend, hc_ffn, ffn_norm, ffn):
    """One layer's two mHC sites with the single-pass hand-off: the attention site's input is collapsed with the
    previous layer's FFN ``pre_prev``, the FFN site's with the attention site's ``pre``. ``hc_*``: the sites'
    `HyperConnection`; ``attend`` / ``ffn``: ``[B,S,H] → [B,S,H]`` (applied to the normed collapse).
    ``streams [B,S,hc,H]`` → ``(streams, the FFN site's pre [B,S,hc])``."""
    pre_a, post_a, comb_a = hc_attn(streams)
    streams = expand(attend(attn_norm(collapse(streams, pre_prev))), streams, post_a, comb_a)
    pre_f, post_f, comb_f = hc_ffn(streams)
    return expand(ffn(ffn_norm(collapse(streams, pre_a))), streams, post_f, comb_f), pre_f


def mhc_layer_v4(streams: jax.Array, hc_attn, attn_norm, attend, hc_ffn, ffn_norm, ffn) -> jax.Array:
    """V4's layer: each site collapses the streams with its own ``pre`` (arguments as `mhc_layer`).
    ``streams [B,S,hc,H]`` → ``[B,S,hc,H]``."""
    pre_a, post_a, comb_a = hc_attn(streams)
    streams = expand(attend(attn_norm(collapse(streams, pre_a))), streams, post_a, comb_a)
    pre_f, post_f, comb_f = hc_ffn(streams)
    return expand(ffn(ffn_norm(collapse(streams, pre_f))), streams, post_f, comb_f)


def _normalized_mix(cfg: ModelConfig, streams: jax.Array, fn: jax.Array) -> jax.Array:
    """``fn · flatten(X)`` scaled by ``rsqrt(mean(flatten(X)²) + eps)`` (FP32): ``[B,S,hc,H]`` → ``[B,S,m]``."""
    flat = streams.reshape(*streams.shape[:2], -1).astype(jnp.float32)
    mixes = jnp.einsum("bsi,mi->bsm", flat, fn, precision=jax.lax.Precision.HIGHEST)
    return mixes * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + cfg.rms_norm_eps)


class HyperHead(nn.Module):
    """V4's final collapse: ``pre = sigmoid(mix · scale + base) + eps`` from its own mixer; parameters ``fn [hc,
    hc·H]``, ``base [hc]``, ``scale [1]`` (FP32; the release's ``hc_head_fn / base / scale``). ``[B,S,hc,H] →
    [B,S,H]``."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, streams: jax.Array) -> jax.Array:
        cfg = self.cfg
        hc = cfg.hc_mult
        fn = declare(self, "fn", (hc, hc * cfg.hidden_size), (None, "hc_embed"), jnp.float32,
                     nn.initializers.normal(0.02))
        base = declare(self, "base", (hc,), (None,), jnp.float32, zeros_init)
        scale = declare(self, "scale", (1,), (None,), jnp.float32, ones_init)
        pre = jax.nn.sigmoid(_normalized_mix(cfg, streams, fn) * scale + base) + cfg.hc_eps
        return collapse(streams, pre)


class HyperConnection(nn.Module):
    """One mHC site's coefficient predictor; parameters ``fn [hc(hc+2), hc·H]``, ``base``, ``scale [3]`` (FP32)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, streams: jax.Array):
        cfg = self.cfg
        hc, width = cfg.hc_mult, cfg.hc_mix_width
        fn = declare(self, "fn", (width, hc * cfg.hidden_size), ("hc_mix", "hc_embed"), jnp.float32,
                     nn.initializers.normal(0.02))
        base = declare(self, "base", (width,), ("hc_mix",), jnp.float32, zeros_init)
        scale = declare(self, "scale", (3,), (None,), jnp.float32, ones_init)
        mixes = _normalized_mix(cfg, streams, fn)
        scales = jnp.concatenate([jnp.broadcast_to(scale[0], (hc,)), jnp.broadcast_to(scale[1], (hc,)),
                                  jnp.broadcast_to(scale[2], (hc * hc,))])
        logits = base + mixes * scales
        pre = jax.nn.sigmoid(logits[..., :hc]) + cfg.hc_eps
        post = 2 * jax.nn.sigmoid(logits[..., hc:2 * hc])
        comb = sinkhorn(logits[..., 2 * hc:].reshape(*logits.shape[:-1], hc, hc), cfg.hc_sinkhorn_iters, cfg.hc_eps)
        return pre, post, comb
