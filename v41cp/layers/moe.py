"""MoE FFN (§3.5): sqrtsoftplus router with noaux_tc selection bias, renormalised top-k weights ×
routed_scaling_factor, clamped-SwiGLU experts and one shared expert.

Reference path: every expert runs on every token and unselected experts get weight 0. It shards
cleanly over experts (each TP rank computes its experts; XLA sums), and is exact; a grouped
(ragged) dispatch that skips unselected experts belongs to the kernels issue.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from v41cp.config import ModelConfig
from v41cp.layers.common import declare, dtype_of, zeros_init
from v41cp.layers.stored_weights import decode_fp4
from v41cp.sharding.rules import ShardingContext, constrain

__all__ = ["MoE", "route", "swiglu_clamped"]


def swiglu_clamped(gate: jax.Array, up: jax.Array, limit: float, dtype) -> jax.Array:
    """``silu(min(gate, limit)) · clip(up, ±limit)`` in FP32, cast to ``dtype`` (limit 0 = no clamp)."""
    g, u = gate.astype(jnp.float32), up.astype(jnp.float32)
    if limit > 0:
        g = jnp.minimum(g, limit)
        u = jnp.clip(u, -limit, limit)
    return (jax.nn.silu(g) * u).astype(dtype)


def route(cfg: ModelConfig, x: jax.Array, w_gate: jax.Array, bias: jax.Array, bias_vl: jax.Array,
          image_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Router for ``x [T,H]`` → (weights ``[T,k]`` FP32, expert ids ``[T,k]``)."""
    logits = jnp.einsum("th,he->te", x.astype(jnp.float32), w_gate.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    scores = jnp.sqrt(jax.nn.softplus(logits))
    sel_bias = bias[None, :] if image_mask is None else jnp.where(image_mask[:, None], bias_vl, bias)
    _, idx = jax.lax.top_k(scores + sel_bias, cfg.num_experts_per_tok)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, idx


class MoE(nn.Module):
    """Parameters: ``gate.weight [H, E]``, ``gate.bias``/``gate.bias_vl [E]`` (FP32),
    ``experts.w1/w3 [E, H, I]``, ``experts.w2 [E, I, H]`` (or their FP4 storage, see `_experts`),
    ``shared.w1/w3 [H, I]``, ``shared.w2 [I, H]``."""

    cfg: ModelConfig
    shard: ShardingContext | None = None

    def _experts(self, dt):
        """Routed expert weights as ``w1, w3 [E, H, I]`` and ``w2 [E, I, H]``: parameters, or (with
        ``keep_quantized``) decoded from the stored FP4 bytes ``experts_w*_fp4 [E, out, in/2]`` and e8m0
        ``experts_w*_scale [E, out, in/32]`` (the release's per-expert ``[out, in]`` orientation)."""
        cfg = self.cfg
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        if not cfg.keep_quantized:
            return (declare(self, "experts_w1", (e, h, i), ("experts", "embed", "moe_mlp"), dt),
                    declare(self, "experts_w3", (e, h, i), ("experts", "embed", "moe_mlp"), dt),
                    declare(self, "experts_w2", (e, i, h), ("experts", "moe_mlp", "embed"), dt))
        out = []
        for name, (o, n), axes in (("w1", (i, h), ("experts", "moe_mlp", None)), ("w3", (i, h), ("experts", "moe_mlp", None)),
                                   ("w2", (h, i), ("experts", "embed", None))):
            packed = declare(self, f"experts_{name}_fp4", (e, o, n // 2), axes, jnp.uint8, zeros_init)
            scale = declare(self, f"experts_{name}_scale", (e, o, n // 32), axes, jnp.uint8, zeros_init)
            out.append(jnp.swapaxes(decode_fp4(packed, scale, dt), 1, 2))
        return tuple(out)

    @nn.compact
    def __call__(self, x: jax.Array, image_mask: jax.Array | None = None) -> jax.Array:
        """``x [B,S,H]`` (ffn-normed) → ``[B,S,H]``."""
        cfg = self.cfg
        dt = dtype_of(cfg.dtype)
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        w_gate = declare(self, "gate_weight", (h, e), ("embed", None), dt)
        bias = declare(self, "gate_bias", (e,), (None,), jnp.float32, zeros_init)
        bias_vl = declare(self, "gate_bias_vl", (e,), (None,), jnp.float32, zeros_init)
        w1, w3, w2 = self._experts(dt)
        s1 = declare(self, "shared_w1", (h, i), ("embed", "mlp"), dt)
        s3 = declare(self, "shared_w3", (h, i), ("embed", "mlp"), dt)
        s2 = declare(self, "shared_w2", (i, h), ("mlp", "embed"), dt)

        b, s, _ = x.shape
        xt = x.reshape(b * s, h)
        mask = None if image_mask is None else image_mask.reshape(b * s)
        w, idx = route(cfg, xt, w_gate, bias, bias_vl, mask)
        dense_w = jnp.zeros((b * s, e), jnp.float32).at[jnp.arange(b * s)[:, None], idx].add(w)
        dense_w = constrain(dense_w, (None, "experts"), self.shard)
        gate = jnp.einsum("th,ehi->tei", xt, w1.astype(xt.dtype))
        up = jnp.einsum("th,ehi->tei", xt, w3.astype(xt.dtype))
        act = swiglu_clamped(gate, up, cfg.swiglu_limit, xt.dtype)
        act = constrain(act, (None, "experts", None), self.shard)
        out_e = jnp.einsum("tei,eih->teh", act, w2.astype(act.dtype))
        routed = jnp.einsum("teh,te->th", out_e.astype(jnp.float32), dense_w)
        shared = swiglu_clamped(xt @ s1.astype(xt.dtype), xt @ s3.astype(xt.dtype), cfg.swiglu_limit, xt.dtype)
        shared = shared @ s2.astype(shared.dtype)
        return (routed + shared.astype(jnp.float32)).astype(x.dtype).reshape(b, s, h)
