"""MoE FFN: sqrtsoftplus router with noaux_tc selection bias, renormalised top-k weights ×
routed_scaling_factor, clamped-SwiGLU experts and one shared expert.

Two dispatches of the routed experts (``cfg.moe_backend``), identical routing and results:

* ``"sparse"`` (default, `v41cp.layers.moe_dispatch`): each token runs only its ``k`` experts, dropless, static
  shapes; FP4 experts decoded per tile, only for the tiles computed;
* ``"dense"`` (the reference): every expert runs on every token and unselected experts get weight 0.

Partitioning (tensor-parallel MoE): every expert's intermediate width ``I`` is split over attention TP (logical
axis ``moe_mlp``), like the shared expert's (``mlp``). Each rank runs the same routing over its width slice and
the partial outputs are summed — one ``[T, H]`` FP32 all-reduce per layer in the GSPMD step (a ``jax.shard_map``
island, `MoE._tp_island`), a reduce-scatter under model-wide QCP (`MoE._row_group`). Every rank does the same
work whatever the routing (balanced; no token dropped, no dynamic counts).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from v41cp.config import ModelConfig
from v41cp.kernels.stored_weights import decode_fp4, e8m0_to_f32, fp4_values
from v41cp.layers.common import declare, dtype_of, stacked_loop, weight_for, zeros_init
from v41cp.layers.moe_dispatch import expert_width, row_bytes, sparse_routed_output
from v41cp.sharding.mesh import ATTN_TP
from v41cp.sharding.rules import ShardingContext, constrain, logical_sharding

__all__ = ["MoE", "route", "route_scores", "swiglu_clamped", "routed_output", "shared_output", "dense_route_weights",
           "expert_weights", "dispatch_weights", "moe_partial"]


def swiglu_clamped(gate: jax.Array, up: jax.Array, limit: float, dtype) -> jax.Array:
    """``silu(min(gate, limit)) · clip(up, ±limit)`` in FP32, cast to ``dtype`` (limit 0 = no clamp)."""
    g, u = gate.astype(jnp.float32), up.astype(jnp.float32)
    if limit > 0:
        g = jnp.minimum(g, limit)
        u = jnp.clip(u, -limit, limit)
    return (jax.nn.silu(g) * u).astype(dtype)


# the router's weight [H, E]: its expert columns are split over attention TP (``router_out``), so no rank computes
# every logit; the top-k sees them gathered
GATE_AXES = ("embed", "router_out")


def route_scores(x: jax.Array, w_gate: jax.Array, bias: jax.Array, bias_vl: jax.Array,
                 image_mask: jax.Array | None = None, gather=None) -> tuple[jax.Array, jax.Array]:
    """Router scores of ``x [T,H]``: ``(scores [T,E], selection scores [T,E])`` FP32 — sqrtsoftplus of the gate
    logits, and the same plus the noaux_tc selection bias (what the top-k ranks). ``gather``: inside a map whose
    ranks hold column slices of ``w_gate``, the function that assembles the ``[T, E]`` logits from the local
    ``[T, E / N]`` (each logit is computed whole on one rank: exact)."""
    logits = jnp.einsum("th,he->te", x.astype(jnp.float32), weight_for(w_gate, x, jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    if gather is not None:
        logits = gather(logits)
    scores = jnp.sqrt(jax.nn.softplus(logits))
    sel_bias = bias[None, :] if image_mask is None else jnp.where(image_mask[:, None], bias_vl, bias)
    return scores, scores + sel_bias


def route(cfg: ModelConfig, x: jax.Array, w_gate: jax.Array, bias: jax.Array, bias_vl: jax.Array,
          image_mask: jax.Array | None = None, gather=None, fixed: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array]:
    """Router for ``x [T,H]`` → (weights ``[T,k]`` FP32, expert ids ``[T,k]``); ``gather`` as `route_scores`.
    ``fixed [T,k]`` (V4's hash-routed layers: ``tid2eid`` of the rows' tokens): the experts, not the top-k; the
    weights are still the router's scores of those experts."""
    scores, ranked = route_scores(x, w_gate, bias, bias_vl, image_mask, gather)
    idx = jax.lax.top_k(ranked, cfg.num_experts_per_tok)[1] if fixed is None else fixed.astype(jnp.int32)
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


def dispatch_weights(p: dict, width: int, rank, dtype) -> dict:
    """A MoE parameter dict's routed experts (the rank's slice of ``width`` columns of the intermediate width
    when split) in `v41cp.layers.moe_dispatch`'s format: plain ``w1 / w3 [E, H, I']``, ``w2 [E, I', H]``, or the
    stored FP4 ``(packed, scale)`` pairs. When a rank's slice of ``w2`` is not whole 32-column scale blocks (toy
    widths: the scale stays replicated while the bytes are split), that slice is decoded once up front."""
    if "experts_w1" in p:
        return {n: p[f"experts_{n}"] for n in ("w1", "w3", "w2")}
    out = {n: (p[f"experts_{n}_fp4"], p[f"experts_{n}_scale"]) for n in ("w1", "w3", "w2")}
    packed, scale = out["w2"]
    local = 2 * packed.shape[-1]
    if 32 * scale.shape[-1] != local:                        # replicated scale blocks over split bytes
        cols = jnp.repeat(e8m0_to_f32(scale), 32, axis=-1)[..., :width]
        cols = jax.lax.dynamic_slice_in_dim(cols, rank * local, local, axis=-1)
        values = fp4_values(packed, jnp.float32)
        out["w2"] = jnp.swapaxes((values * cols).astype(dtype), 1, 2)
    return out


def moe_partial(cfg: ModelConfig, xt: jax.Array, routing: tuple, stored: dict, shared: tuple, rank, lead) -> jax.Array:
    """One rank's contribution to the MoE output of ``xt [T, H]`` (every row) routed by ``routing`` (`route`'s
    weights and ids ``[T, k]``): the routed experts over the rank's slice of their intermediate width, the shared
    expert over its slice; a part whose weights are not split (the width does not divide the group) counts on the
    ``lead`` rank only. FP32 ``[T, H]``; summed over the group it is the layer's output."""
    w, idx = routing
    dt = xt.dtype
    width = cfg.moe_intermediate_size
    experts = dispatch_weights(stored, width, rank, dt)
    local = expert_width(experts)[1]
    local_in = experts["w1"][0].shape[1] if isinstance(experts["w1"], tuple) else experts["w1"].shape[2]
    if local_in != local:
        raise ValueError(f"MoE: the expert width splits unevenly over the group (w1 slice {local_in}, w2 slice "
                         f"{local} of moe_intermediate_size={width}); use a TP size that divides "
                         f"moe_intermediate_size / 2")
    if cfg.moe_backend == "sparse":
        act = lambda g, u: swiglu_clamped(g, u, cfg.swiglu_limit, dt)
        routed = sparse_routed_output(xt, idx, w, experts, act, backend=cfg.expert_backend)
    else:
        plain = [v if not isinstance(v, tuple) else jnp.swapaxes(decode_fp4(*v, dt), 1, 2)
                 for v in (experts["w1"], experts["w3"], experts["w2"])]
        routed = routed_output(cfg, xt, dense_route_weights(cfg, w, idx), *plain)
    shared_out = shared_output(cfg, xt, *shared).astype(jnp.float32)
    if local == width and lead is not None:
        routed = jnp.where(lead, routed, 0.0)
    if shared[0].shape[1] == width and lead is not None:
        shared_out = jnp.where(lead, shared_out, 0.0)
    return routed + shared_out


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
    shared = swiglu_clamped(xt @ weight_for(s1, xt), xt @ weight_for(s3, xt), cfg.swiglu_limit, xt.dtype)
    return shared @ weight_for(s2, shared)


def _distinct_experts(experts: int):
    """The initializer of a random model's ``tid2eid [vocab, k]``: token ``v`` routes to experts ``v, v+1, … (mod
    E)`` (a checkpoint brings the release's table)."""
    def init(key, shape, dtype):
        return ((jnp.arange(shape[0])[:, None] + jnp.arange(shape[1])[None, :]) % experts).astype(dtype)
    return init


class MoE(nn.Module):
    """Parameters: ``gate.weight [H, E]``, ``gate.bias``/``gate.bias_vl [E]`` (FP32),
    ``experts.w1/w3 [E, H, I]``, ``experts.w2 [E, I, H]`` (or their FP4 storage, see `_experts`),
    ``shared.w1/w3 [H, I]``, ``shared.w2 [I, H]``. ``I`` (``moe_mlp`` / ``mlp``) is split over attention TP.
    V4: no ``gate.bias_vl``; a hash-routed layer (``hash_routed``) has ``gate.tid2eid [vocab, k]`` int32 (each
    token's experts) instead of ``gate.bias``."""

    cfg: ModelConfig
    shard: ShardingContext | None = None
    hash_routed: bool = False

    def _experts(self, dt) -> tuple[dict, dict]:
        """Routed expert parameters and their logical axes: ``experts_w1/w3 [E, H, I]``, ``experts_w2 [E, I,
        H]``, or (with ``keep_quantized``) the stored FP4 bytes ``experts_w*_fp4 [E, out, in/2]`` and e8m0
        ``experts_w*_scale [E, out, in/32]`` (the release's per-expert ``[out, in]`` orientation)."""
        cfg = self.cfg
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        if not cfg.keep_quantized:
            specs = {"experts_w1": ((e, h, i), ("experts", "embed", "moe_mlp"), dt),
                     "experts_w3": ((e, h, i), ("experts", "embed", "moe_mlp"), dt),
                     "experts_w2": ((e, i, h), ("experts", "moe_mlp", "embed"), dt)}
        else:
            specs = {}
            for name, (o, n), axes in (("w1", (i, h), ("experts", "moe_mlp", None)),
                                       ("w3", (i, h), ("experts", "moe_mlp", None)),
                                       ("w2", (h, i), ("experts", "embed", "moe_mlp"))):
                specs[f"experts_{name}_fp4"] = ((e, o, n // 2), axes, jnp.uint8)
                specs[f"experts_{name}_scale"] = ((e, o, n // 32), axes, jnp.uint8)
        init = {} if not cfg.keep_quantized else {"init": zeros_init}
        stored = {k: declare(self, k, shape, axes, d, **init) for k, (shape, axes, d) in specs.items()}
        return stored, {k: (shape, axes) for k, (shape, axes, _) in specs.items()}

    @nn.compact
    def __call__(self, x: jax.Array, image_mask: jax.Array | None = None, tokens: jax.Array | None = None
                 ) -> jax.Array:
        """``x [B,S,H]`` (ffn-normed) → ``[B,S,H]``; ``tokens [B,S]``: the rows' token ids (hash-routed layers)."""
        cfg = self.cfg
        dt = dtype_of(cfg.dtype)
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        w_gate = declare(self, "gate_weight", (h, e), GATE_AXES, dt)
        hash_idx = None
        if self.hash_routed:
            table = declare(self, "gate_tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), (None, None), jnp.int32,
                            _distinct_experts(e))
            if tokens is None:
                raise ValueError("a hash-routed MoE layer needs the rows' token ids")
            hash_idx = jnp.take(table, tokens.reshape(-1), axis=0)
            bias = jnp.zeros((e,), jnp.float32)
        else:
            bias = declare(self, "gate_bias", (e,), (None,), jnp.float32, zeros_init)
        bias_vl = bias if cfg.is_v4 else declare(self, "gate_bias_vl", (e,), (None,), jnp.float32, zeros_init)
        stored, expert_axes = self._experts(dt)
        shared_axes = {"shared_w1": ((h, i), ("embed", "mlp")), "shared_w3": ((h, i), ("embed", "mlp")),
                       "shared_w2": ((i, h), ("mlp", "embed"))}
        shared = tuple(declare(self, k, shape, axes, dt) for k, (shape, axes) in shared_axes.items())

        b, s, _ = x.shape
        xt = x.reshape(b * s, h)
        mask = None if image_mask is None else image_mask.reshape(b * s)
        gate = (w_gate, bias, bias_vl)
        if getattr(self.shard, "in_map", False):
            out = self._row_group(xt, mask, gate, stored, shared, hash_idx)
            return out.astype(x.dtype).reshape(b, s, h)
        if self.is_mutable_collection("intermediates"):       # forward_debug: the routing boundary's scores
            self.sow("intermediates", "route_scores", route_scores(xt, w_gate, bias, bias_vl, mask)[1])
        if cfg.moe_backend == "sparse" and self.shard is not None:
            out = self._tp_island(xt, mask, gate, stored, shared, {**expert_axes, **shared_axes}, hash_idx)
        elif cfg.moe_backend == "sparse":
            out = moe_partial(cfg, xt, route(cfg, xt, *gate, mask, fixed=hash_idx), stored, shared, 0, None)
        else:
            w, idx = route(cfg, xt, w_gate, bias, bias_vl, mask, fixed=hash_idx)
            dense_w = constrain(dense_route_weights(cfg, w, idx), (None, "experts"), self.shard)
            routed = routed_output(cfg, xt, dense_w, *expert_weights(stored, dt), self.shard)
            out = routed + shared_output(cfg, xt, *shared).astype(jnp.float32)
        return out.astype(x.dtype).reshape(b, s, h)

    def _tp_island(self, xt, mask, gate, stored, shared, axes, hash_idx=None):
        """The GSPMD step's MoE as a ``jax.shard_map`` island over attention TP: rows (split over ``dp`` when the
        batch is) replicated over the group, each rank's weight slices as laid out by the rules, partial outputs
        all-reduced. ``xt [T, H]`` → FP32 ``[T, H]``."""
        cfg, ctx = self.cfg, self.shard
        mesh = ctx.mesh
        group = tuple(a for a in ATTN_TP if mesh.shape.get(a, 1) > 1)
        dp = ctx.rules.mesh_axis("batch")
        dp = dp if isinstance(dp, str) and mesh.shape.get(dp, 1) > 1 and xt.shape[0] % mesh.shape[dp] == 0 else None
        spec = lambda name: logical_sharding(*axes[name], mesh, ctx.rules).spec
        rows = P(dp, None)
        names = sorted(stored)
        shared_names = ("shared_w1", "shared_w3", "shared_w2")
        gate_spec = logical_sharding(gate[0].shape, GATE_AXES, mesh, ctx.rules).spec
        split = gate_spec[1] is not None                         # the router's expert columns split over the group

        def body(xt, gate, expert_leaves, shared_leaves, extra):
            rank = jax.lax.axis_index(group) if group else 0
            lead = (rank == 0) if group else None
            gather = (lambda lg: jax.lax.all_gather(lg, gate_spec[1], axis=1, tiled=True)) if split else None
            routing = route(cfg, xt, *gate, extra.get("mask"), gather, extra.get("hash_idx"))   # every row
            part = moe_partial(cfg, xt, routing, dict(zip(names, expert_leaves)), tuple(shared_leaves), rank, lead)
            return jax.lax.psum(part, group) if group else part

        extra = {k: v for k, v in (("mask", mask), ("hash_idx", hash_idx)) if v is not None}
        extra_specs = {k: P(dp) if k == "mask" else rows for k in extra}
        args = (xt, gate, tuple(stored[n] for n in names), shared, extra)
        in_specs = (rows, (gate_spec, P(), P()), tuple(spec(n) for n in names), tuple(spec(n) for n in shared_names),
                    extra_specs)
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=rows)(*args)

    def _row_group(self, xt, mask, gate, stored, shared, hash_idx=None):
        """Model-wide QCP (``shard`` a `RowGroup`): with the expert / shared width split over the group, every rank
        applies its slices to every row (gathered) and the partial outputs are reduce-scattered back to the local
        rows; a replicated part is counted on one rank. Each rank routes its own rows and the routing (``[C, k]`` weights
        and ids) is gathered with them. ``xt [C, H]`` → FP32 ``[C, H]``."""
        cfg, grp = self.cfg, self.shard
        width = cfg.moe_intermediate_size
        w2 = stored.get("experts_w2", stored.get("experts_w2_fp4"))
        local_routed = w2.shape[1] if "experts_w2" in stored else 2 * w2.shape[-1]
        gathered = local_routed < width or shared[0].shape[1] < width
        routing = route(cfg, xt, *gate, mask, fixed=hash_idx)          # each rank routes its own rows
        if not gathered:
            return moe_partial(cfg, xt, routing, stored, shared, 0, None)
        rank = grp.rank()

        def rows(part, routing):                 # local rows [c, H] → their outputs, through every rank's slices
            xa, routing = grp.gather(part), tuple(grp.gather(r) for r in routing)
            return grp.sum_scatter(moe_partial(cfg, xa, routing, stored, shared, rank, rank == 0))

        # the gathered rows' buffers (the rows, their pairs' FP32 outputs, the result and the scattered output) grow
        # with N·C: in row chunks of at most `RowGroup.chunk_bytes` of them (each token's output is its own, so
        # chunking changes no value)
        c, h = xt.shape
        per_row = row_bytes(h, cfg.num_experts_per_tok, xt.dtype) + 8 * h
        chunks = min(c, max(1, -(-(grp.n * c * per_row) // grp.chunk_bytes)))
        while c % chunks:
            chunks += 1
        if chunks == 1:
            return rows(xt, routing)
        per = c // chunks
        split = lambda a: a.reshape(chunks, per, *a.shape[1:])
        out = stacked_loop(lambda t: (rows(t[0], t[1:]),), chunks, (split(xt), *(split(r) for r in routing)),
                           (jnp.zeros((per, h), jnp.float32),), like=(stored, shared))[0]
        return out.reshape(c, h)
