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

__all__ = ["MoE", "route", "route_scores", "swiglu_clamped", "routed_output", "shared_output", "dense_route_weights",
           "expert_weights"]


def swiglu_clamped(gate: jax.Array, up: jax.Array, limit: float, dtype) -> jax.Array:
    """``silu(min(gate, limit)) · clip(up, ±limit)`` in FP32, cast to ``dtype`` (limit 0 = no clamp)."""
    g, u = gate.astype(jnp.float32), up.astype(jnp.float32)
    if limit > 0:
        g = jnp.minimum(g, limit)
        u = jnp.clip(u, -limit, limit)
    return (jax.nn.silu(g) * u).astype(dtype)


def route_scores(x: jax.Array, w_gate: jax.Array, bias: jax.Array, bias_vl: jax.Array,
                 image_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Router scores of ``x [T,H]``: ``(scores [T,E], selection scores [T,E])`` FP32 — sqrtsoftplus of the gate
    logits, and the same plus the noaux_tc selection bias (what the top-k ranks)."""
    logits = jnp.einsum("th,he->te", x.astype(jnp.float32), w_gate.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    scores = jnp.sqrt(jax.nn.softplus(logits))
    sel_bias = bias[None, :] if image_mask is None else jnp.where(image_mask[:, None], bias_vl, bias)
    return scores, scores + sel_bias


def route(cfg: ModelConfig, x: jax.Array, w_gate: jax.Array, bias: jax.Array, bias_vl: jax.Array,
          image_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Router for ``x [T,H]`` → (weights ``[T,k]`` FP32, expert ids ``[T,k]``)."""
    scores, ranked = route_scores(x, w_gate, bias, bias_vl, image_mask)
    _, idx = jax.lax.top_k(ranked, cfg.num_experts_per_tok)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, idx


def expert_weights(p: dict, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A MoE parameter dict's routed experts as ``w1, w3 [E', H, I]``, ``w2 [E', I, H]`` (``E'`` = the experts
    present, e.g. a TP rank's slice): the parameters, or decoded from their stored FP4 bytes (``keep_quantized``)."""
    if "experts_w1" in p:
        return p["experts_w1"], p["experts_w3"], p["experts_w2"]
    return tuple(jnp.swapaxes(decode_fp4(p[f"experts_{n}_fp4"], p[f"experts_{n}_scale"], dtype), 1, 2)
                 for n in ("w1", "w3", "w2"))


def dense_route_weights(cfg: ModelConfig, w: jax.Array, idx: jax.Array) -> jax.Array:
    """Router output (weights, ids ``[T,k]``) → dense per-expert weights ``[T, E]`` FP32 (0 = not selected)."""
    t = w.shape[0]
    return jnp.zeros((t, cfg.n_routed_experts), jnp.float32).at[jnp.arange(t)[:, None], idx].add(w)


def routed_output(cfg: ModelConfig, xt: jax.Array, dense_w: jax.Array, w1, w3, w2, shard=None) -> jax.Array:
    """Σ_e dense_w[t, e] · expert_e(x_t) over the experts given (``w1, w3 [E', H, I]``, ``w2 [E', I, H]``,
    ``dense_w [T, E']``) — every expert runs on every row (exact reference dispatch). FP32 ``[T, H]``."""
    gate = jnp.einsum("th,ehi->tei", xt, w1.astype(xt.dtype))
    up = jnp.einsum("th,ehi->tei", xt, w3.astype(xt.dtype))
    act = swiglu_clamped(gate, up, cfg.swiglu_limit, xt.dtype)
    act = constrain(act, (None, "experts", None), shard)
    out_e = jnp.einsum("tei,eih->teh", act, w2.astype(act.dtype))
    return jnp.einsum("teh,te->th", out_e.astype(jnp.float32), dense_w)


def shared_output(cfg: ModelConfig, xt: jax.Array, s1, s3, s2) -> jax.Array:
    """The shared expert on ``xt [T, H]`` (``s1, s3 [H, I']``, ``s2 [I', H]``; a TP slice of I gives a partial
    sum) → ``[T, H]`` in ``xt.dtype``."""
    shared = swiglu_clamped(xt @ s1.astype(xt.dtype), xt @ s3.astype(xt.dtype), cfg.swiglu_limit, xt.dtype)
    return shared @ s2.astype(shared.dtype)


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
        stored = {}
        for name, (o, n), axes in (("w1", (i, h), ("experts", "moe_mlp", None)), ("w3", (i, h), ("experts", "moe_mlp", None)),
                                   ("w2", (h, i), ("experts", "embed", None))):
            stored[f"experts_{name}_fp4"] = declare(self, f"experts_{name}_fp4", (e, o, n // 2), axes, jnp.uint8,
                                                    zeros_init)
            stored[f"experts_{name}_scale"] = declare(self, f"experts_{name}_scale", (e, o, n // 32), axes, jnp.uint8,
                                                      zeros_init)
        return expert_weights(stored, dt)

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
        if getattr(self.shard, "in_map", False):
            out = self._row_group(xt, mask, w_gate, bias, bias_vl, (w1, w3, w2), (s1, s3, s2))
            return out.astype(x.dtype).reshape(b, s, h)
        if self.is_mutable_collection("intermediates"):       # forward_debug: the routing boundary's scores
            self.sow("intermediates", "route_scores", route_scores(xt, w_gate, bias, bias_vl, mask)[1])
        w, idx = route(cfg, xt, w_gate, bias, bias_vl, mask)
        dense_w = constrain(dense_route_weights(cfg, w, idx), (None, "experts"), self.shard)
        routed = routed_output(cfg, xt, dense_w, w1, w3, w2, self.shard)
        shared = shared_output(cfg, xt, s1, s3, s2)
        return (routed + shared.astype(jnp.float32)).astype(x.dtype).reshape(b, s, h)

    def _row_group(self, xt, mask, w_gate, bias, bias_vl, experts, shared_w):
        """Model-wide QCP (``shard`` a `RowGroup`): with experts / shared width split over the group, every rank
        applies its slice to every row (gathered) and the partial outputs are reduce-scattered back to the local
        rows; a replicated part is counted on one rank. ``xt [C, H]`` → FP32 ``[C, H]``."""
        cfg, grp = self.cfg, self.shard
        w1, w3, w2 = experts
        e_split = w1.shape[0] < cfg.n_routed_experts
        m_split = shared_w[0].shape[1] < cfg.moe_intermediate_size
        gathered = e_split or m_split
        xa = grp.gather(xt) if gathered else xt
        ma = None if mask is None else (grp.gather(mask) if gathered else mask)
        w, idx = route(cfg, xa, w_gate, bias, bias_vl, ma)
        dense = dense_route_weights(cfg, w, idx)
        if e_split:
            dense = jax.lax.dynamic_slice_in_dim(dense, grp.rank() * w1.shape[0], w1.shape[0], axis=1)
        routed = routed_output(cfg, xa, dense, w1, w3, w2)
        shared = shared_output(cfg, xa, *shared_w).astype(jnp.float32)
        if not gathered:
            return routed + shared
        lead = grp.rank() == 0
        routed = routed if e_split else jnp.where(lead, routed, 0.0)
        shared = shared if m_split else jnp.where(lead, shared, 0.0)
        return grp.sum_scatter(routed + shared)
