"""Logical → mesh axis rules, parameter shardings and activation constraints.

Every parameter dimension carries a logical name (declared in the layers). `AxisRules` maps
names to mesh axes; a dimension whose size the mesh axis does not divide stays replicated (so a
config with, say, 4 heads still runs on an 8-way TP mesh), and `logical_sharding` logs a warning when that happens to a large (≥ 16M element) array.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

log = logging.getLogger(__name__)

__all__ = ["AxisRules", "TP_RULES", "REPLICATED_Q_RULES", "INDEXER_QCP_RULES", "QCP_RULES", "mesh_axes_size",
           "ShardingContext", "logical_sharding", "param_shardings", "constrain"]


@dataclass(frozen=True)
class AxisRules:
    """Immutable mapping logical axis name → mesh axis name (or None = replicated)."""

    rules: tuple[tuple[str, str | tuple[str, ...] | None], ...]

    def mesh_axis(self, logical: str | None) -> str | tuple[str, ...] | None:
        return dict(self.rules).get(logical) if logical is not None else None


# Attention tensor parallelism: heads, the expert and shared-expert intermediate widths (tensor-parallel MoE:
# every rank holds every expert's slice), vocab and Engram rows over ("tp", "cp").
# (Attention TP is the mesh-axis pair ("tp", "cp"); see `v41cp.sharding.mesh`.)
# The q-LoRA down projection's output columns (``q_latent``) and the router's expert columns (``router_out``) —
# projections every token runs whatever its heads — are split too, so no rank computes them whole: the q norm
# reduces partial sums and ``wq_b`` sees the gathered latent ([rows, q_lora] per layer); the top-k sees the
# gathered logits ([rows, experts]). Not split (measured on the span-prefill program, TP 4, 22 rows): the window-KV
# projection (``kv_dim``) and Engram's key/value projection (``engram_out``) — the partitioner reshards their
# split outputs through the cache writes / the stream reshape with dozens of collectives per layer (3.5–4× the
# pass's bytes).
_AT = ("tp", "cp")
TP_RULES = AxisRules((
    ("batch", "dp"), ("heads", _AT), ("o_groups", _AT), ("index_heads", _AT), ("moe_mlp", _AT),
    ("mlp", _AT), ("vocab", _AT), ("engram_rows", _AT), ("q_latent", _AT),
    ("router_out", _AT), ("split_columns", _AT),
))
# DCP with replicated query projections: the query heads of attention and indexer are split over the
# outer ``tp`` part only, so every rank of a context-parallel group computes its group's query heads
# locally (more weight memory, no per-layer query all-gather).
REPLICATED_Q_RULES = AxisRules(tuple((k, "tp" if k in ("heads", "index_heads") else v) for k, v in TP_RULES.rules))
# Operator-local indexer QCP: every rank projects its own query rows with all index heads, so the indexer's
# query / weight projections are replicated (everything else as in TP_RULES).
INDEXER_QCP_RULES = AxisRules(tuple((k, None if k == "index_heads" else v) for k, v in TP_RULES.rules))
# Model-wide QCP: a rank attends its own rows with every head, so attention and indexer query / output
# projections (the q-LoRA down projection and the router too) are replicated; expert / MLP widths, vocab and Engram rows stay
# split over attention TP (MoE, embedding, head and Engram run as gather → local slice → reduce-scatter,
# `v41cp.serving.runner.span_prefill`).
QCP_RULES = AxisRules(tuple((k, None if k in ("heads", "o_groups", "index_heads", "q_latent", "router_out") else v)
                            for k, v in TP_RULES.rules))


@dataclass(frozen=True)
class ShardingContext:
    """Mesh + rules handed to modules that constrain activations (None = single device).

    ``indexer_query_parallel``: operator-local indexer QCP over attention TP (`v41cp.layers.indexer`) for
    forwards of at least ``indexer_query_min_tokens`` query rows (use with `INDEXER_QCP_RULES`);
    ``attention_query_parallel``: operator-local attention QCP (`v41cp.layers.attention`) from
    ``attention_query_min_tokens`` rows (global layers) / ``attention_query_swa_min_tokens`` (SWA-only)."""

    mesh: Mesh
    rules: AxisRules = TP_RULES
    indexer_query_parallel: bool = False
    indexer_query_min_tokens: int = 1024
    attention_query_parallel: bool = False
    attention_query_min_tokens: int = 1024
    attention_query_swa_min_tokens: int = 4096


def mesh_axes_size(mesh: Mesh, axes) -> int:
    """Number of devices along mesh axis / axes ``axes`` (absent axes count 1)."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return int(np.prod([mesh.shape.get(a, 1) for a in axes]))


def logical_sharding(shape: Sequence[int], axes: Sequence[str | None], mesh: Mesh,
                     rules: AxisRules) -> NamedSharding:
    """NamedSharding of an array ``shape`` with logical ``axes``; non-divisible dims stay replicated.
    A rule may name a tuple of mesh axes (split over their product); axes absent from the mesh or of size 1
    drop out."""
    spec, used = [], set()
    for dim, name in zip(shape, axes):
        m = rules.mesh_axis(name)
        # axes absent from the mesh or of size 1 drop out (plain TP specs read "tp", not ("tp", "cp"))
        ms = tuple(a for a in ((m,) if isinstance(m, str) else (m or ())) if mesh.shape.get(a, 1) > 1)
        size = mesh_axes_size(mesh, ms)
        if not ms or used & set(ms) or dim % size:
            if ms and dim % size and int(np.prod(shape)) >= 2**24:
                log.warning("logical axis %r (size %d) does not divide over mesh axes %r (%d): a %s array "
                            "stays replicated on every device", name, dim, ms, size, tuple(shape))
            spec.append(None)
        else:
            spec.append(ms[0] if len(ms) == 1 else ms)
            used |= set(ms)
    return NamedSharding(mesh, P(*spec))


def param_shardings(boxed_params: Any, mesh: Mesh, rules: AxisRules) -> Any:
    """Shardings for a (possibly abstract) parameter tree whose leaves are ``nn.Partitioned`` boxes."""
    def one(leaf):
        if isinstance(leaf, nn.Partitioned):
            return logical_sharding(leaf.value.shape, leaf.names, mesh, rules)
        return NamedSharding(mesh, P())
    return jax.tree.map(one, boxed_params, is_leaf=lambda x: isinstance(x, nn.Partitioned))


# `split_columns_einsum`: at most this many rows (batch × rows of a call) split their output columns
SPLIT_COLUMNS_MAX_ROWS = 1024


def split_columns_einsum(eq: str, x: jax.Array, w: jax.Array, ctx: ShardingContext | None,
                         out_axes: Sequence[str | None]) -> jax.Array:
    """``einsum(eq, x, w)`` for a projection whose weight is replicated (the window-KV and Engram key / value
    projections, whose split outputs the partitioner would reshard through the cache writes and the stream
    reshape): on calls of at most `SPLIT_COLUMNS_MAX_ROWS` rows (the decode and verification steps give a context:
    `PagedRows.columns`) each attention-TP rank
    computes ``w``'s own slice of output columns (its last axis, ``split_columns``) and the result is gathered to
    ``out_axes`` — one all-gather instead of every rank computing the whole projection; each column is the same dot
    over the whole contraction, so the values do not change. Larger calls, no context, or inside a map: the plain
    einsum."""
    rows = int(np.prod(x.shape[:-1]))
    if ctx is None or getattr(ctx, "in_map", False) or rows > SPLIT_COLUMNS_MAX_ROWS:
        return jnp.einsum(eq, x, w)
    split = logical_sharding(w.shape, (None,) * (w.ndim - 1) + ("split_columns",), ctx.mesh, ctx.rules)
    if all(a is None for a in split.spec):
        return jnp.einsum(eq, x, w)
    y = jnp.einsum(eq, x, jax.lax.with_sharding_constraint(w, split))
    # the output's columns split first (else the partitioner gathers the weight and computes it whole), then gathered
    y = jax.lax.with_sharding_constraint(y, logical_sharding(y.shape, (*out_axes[:-1], "split_columns"), ctx.mesh,
                                                             ctx.rules))
    return jax.lax.with_sharding_constraint(y, logical_sharding(y.shape, out_axes, ctx.mesh, ctx.rules))


def constrain(x: jax.Array, axes: Sequence[str | None], ctx: ShardingContext | None) -> jax.Array:
    """``with_sharding_constraint`` by logical axes; identity without a sharding context or inside a map
    (`v41cp.sharding.row_group.RowGroup`)."""
    if ctx is None or getattr(ctx, "in_map", False):
        return x
    return jax.lax.with_sharding_constraint(x, logical_sharding(x.shape, axes, ctx.mesh, ctx.rules))
