"""Per-device work on arrays whose last (vocabulary) axis is split over attention TP — the steps' logits and the
sampler's per-slot token counts: each device changes its own slice, nothing moves.

* `vocab_axes(mesh)` — the mesh axes the vocabulary is split over (``("tp", "cp")``, those of size > 1);
* `on_vocab_slices(local, x, *args, mesh)` — ``local(part, offset, *args)`` on each device's slice ``part [..., v]``
  of ``x [..., V]`` (``offset``: the slice's first vocabulary id; ``args`` replicated), under `jax.shard_map`; on one
  device (or a vocabulary that does not split evenly: left to the partitioner) ``local(x, 0, *args)``;
* `add_at_ids` — such a ``local``: values added at given vocabulary ids of each row.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

__all__ = ["vocab_axes", "on_vocab_slices", "add_at_ids"]


def vocab_axes(mesh) -> tuple[str, ...]:
    """The mesh axes of size > 1 among ``("tp", "cp")`` (the vocabulary's split); ``()`` without a mesh."""
    return tuple(a for a in ("tp", "cp") if mesh is not None and mesh.shape.get(a, 1) > 1)


def on_vocab_slices(local: Callable, x: jax.Array, *args, mesh=None) -> jax.Array:
    """``local(part, offset, *args)`` over each device's vocabulary slice of ``x`` (see the module docstring): the
    result has ``x``'s shape and split."""
    axes = vocab_axes(mesh)
    if not axes or x.shape[-1] % int(np.prod([mesh.shape[a] for a in axes])):
        return local(x, 0, *args)
    lead = (None,) * (x.ndim - 1)

    def body(part, *args):
        return local(part, jax.lax.axis_index(axes) * part.shape[-1], *args)

    return jax.shard_map(body, mesh=mesh, in_specs=(PartitionSpec(*lead, axes),) + (PartitionSpec(),) * len(args),
                         out_specs=PartitionSpec(*lead, axes))(x, *args)


def add_at_ids(part: jax.Array, offset, ids: jax.Array, add: jax.Array) -> jax.Array:
    """``part [N, v]`` (vocabulary ids ``offset …``) plus ``add [N, K]`` at ``ids [N, K]`` (−1, or an id of another
    device's slice: nothing) — for `on_vocab_slices`."""
    v = part.shape[-1]
    loc = ids - offset
    ok = (ids >= 0) & (loc >= 0) & (loc < v)
    return part.at[jnp.arange(part.shape[0])[:, None], jnp.clip(loc, 0, v - 1)].add(
        jnp.where(ok, add, jnp.zeros((), add.dtype)).astype(part.dtype))
