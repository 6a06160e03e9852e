"""Logical → mesh axis rules, parameter shardings and activation constraints.

Every parameter dimension carries a logical name (declared in the layers). `AxisRules` maps
names to mesh axes; a dimension whose size the mesh axis does not divide stays replicated (so a
config with, say, 4 heads still runs on an 8-way TP mesh), and `logical_sharding` logs a warning when that happens to a large (≥ 16M element) array.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import logging

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

log = logging.getLogger(__name__)

__all__ = ["AxisRules", "TP_RULES", "REPLICATED_RULES", "ShardingContext", "logical_sharding",
           "param_shardings", "constrain"]


@dataclass(frozen=True)
class AxisRules:
    """Immutable mapping logical axis name → mesh axis name (or None = replicated)."""

    rules: tuple[tuple[str, str | None], ...]

    def mesh_axis(self, logical: str | None) -> str | None:
        return dict(self.rules).get(logical) if logical is not None else None


# Plain attention tensor parallelism: heads, experts, MLP width, vocab and Engram rows over `tp`.
TP_RULES = AxisRules((
    ("batch", "dp"), ("heads", "tp"), ("o_groups", "tp"), ("index_heads", "tp"), ("experts", "tp"),
    ("mlp", "tp"), ("vocab", "tp"), ("engram_rows", "tp"),
))
REPLICATED_RULES = AxisRules((("batch", "dp"),))


@dataclass(frozen=True)
class ShardingContext:
    """Mesh + rules handed to modules that constrain activations (None = single device)."""

    mesh: Mesh
    rules: AxisRules = TP_RULES


def logical_sharding(shape: Sequence[int], axes: Sequence[str | None], mesh: Mesh,
                     rules: AxisRules) -> NamedSharding:
    """NamedSharding of an array ``shape`` with logical ``axes``; non-divisible dims stay replicated."""
    spec, used = [], set()
    for dim, name in zip(shape, axes):
        m = rules.mesh_axis(name)
        if m is None or m in used or m not in mesh.shape or dim % mesh.shape[m]:
            if m is not None and m in mesh.shape and dim % mesh.shape[m] and int(np.prod(shape)) >= 2**24:
                log.warning("logical axis %r (size %d) does not divide over mesh axis %r (%d): a %s array "
                            "stays replicated on every device", name, dim, m, mesh.shape[m], tuple(shape))
            spec.append(None)
        else:
            spec.append(m)
            used.add(m)
    return NamedSharding(mesh, P(*spec))


def param_shardings(boxed_params: Any, mesh: Mesh, rules: AxisRules) -> Any:
    """Shardings for a (possibly abstract) parameter tree whose leaves are ``nn.Partitioned`` boxes."""
    def one(leaf):
        if isinstance(leaf, nn.Partitioned):
            return logical_sharding(leaf.value.shape, leaf.names, mesh, rules)
        return NamedSharding(mesh, P())
    return jax.tree.map(one, boxed_params, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def constrain(x: jax.Array, axes: Sequence[str | None], ctx: ShardingContext | None) -> jax.Array:
    """``with_sharding_constraint`` by logical axes; identity without a sharding context."""
    if ctx is None:
        return x
    return jax.lax.with_sharding_constraint(x, logical_sharding(x.shape, axes, ctx.mesh, ctx.rules))
