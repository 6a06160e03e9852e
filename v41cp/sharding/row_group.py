"""Model-wide QCP's row group: the collectives and parameter slices of the one model applied inside the
span prefill's ``jax.shard_map`` over attention TP, where each rank holds its rows of the zigzag plan
(`v41cp.sharding.query_shard`).

A `RowGroup` is handed to the model's modules as their ``shard`` (`v41cp.model.Transformer`). Under `QCP_RULES`
attention is replicated (a rank attends its own rows with every head); vocab, expert / MLP widths and Engram rows
stay split over the group, so:

* `local_shape` — the rank's slice of a parameter (`v41cp.layers.common.declare` declares that shape);
* `split_lookup` — a lookup in a row-split table (embedding, Engram): ids all-gathered, owned rows looked up,
  reduce-scattered back (exact: one non-zero term per row);
* `gather` / `sum_scatter` — the MoE's gather of every row and reduce-scatter of the partial outputs;
* `to_span` — local rows to span order (the window, compressor pairs and cache writes read the whole span).

Activation constraints (`v41cp.sharding.rules.constrain`) are identities inside the map; the operator-local QCP
islands are not used there (they belong to the cached-rows backend; the rows are already split).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from v41cp.sharding.rules import QCP_RULES, AxisRules, logical_sharding

__all__ = ["RowGroup"]


@dataclass(frozen=True)
class RowGroup:
    """Rows split over mesh axes ``axes`` (``n`` ranks) of ``mesh``; parameters laid out by ``rules``;
    ``chunk_bytes``: the buffers of every rank's rows gathered at once (the MoE gathers them in row chunks of at most
    this many bytes)."""

    mesh: Mesh
    axes: tuple[str, ...]
    rules: AxisRules = QCP_RULES
    chunk_bytes: int = 2 << 30
    in_map = True                          # inside the shard_map: constraints are identities

    @property
    def n(self) -> int:
        return int(np.prod([self.mesh.shape[a] for a in self.axes]))

    def local_shape(self, shape, logical_axes) -> tuple[int, ...]:
        """The rank's slice of a parameter of global ``shape`` with ``logical_axes``."""
        spec = logical_sharding(shape, logical_axes, self.mesh, self.rules).spec
        out = []
        for dim, m in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
            ms = () if m is None else ((m,) if isinstance(m, str) else tuple(m))
            out.append(dim // int(np.prod([self.mesh.shape[a] for a in ms])))
        return tuple(out)

    def rank(self):
        return jax.lax.axis_index(self.axes)

    def gather(self, x):
        """Local rows ``[C, ·]`` → every rank's rows ``[N·C, ·]`` (rank-major), identical on every rank."""
        return jax.lax.all_gather(x, self.axes, tiled=True, to="invarying")

    def sum_scatter(self, x):
        """Per-rank contributions for every row ``[N·C, ·]`` → their sum at the local rows ``[C, ·]``."""
        return jax.lax.psum_scatter(x, self.axes, scatter_dimension=0, tiled=True)

    def psum(self, x):
        return jax.lax.psum(x, self.axes)

    def to_span(self, local, index):
        """Local rows ``[C, ·]`` → span order ``[B, S, ·]`` through ``index [B, S]`` into the gathered rows
        (``N·C`` = absent: zeros)."""
        g = self.gather(local)
        return jnp.concatenate([g, jnp.zeros((1, *g.shape[1:]), g.dtype)])[index]

    def split_lookup(self, lookup, table_rows: int, total_rows: int, ids):
        """``lookup(ids)`` of local ids ``[C, …]`` in a table of ``total_rows`` whose rank slice holds
        ``table_rows`` (the whole table when equal: a plain lookup)."""
        if table_rows == total_rows:
            return lookup(ids)
        all_ids = self.gather(ids)
        local = all_ids - self.rank() * table_rows
        own = (local >= 0) & (local < table_rows)
        got = lookup(jnp.clip(local, 0, table_rows - 1))
        got = jnp.where(own.reshape(own.shape + (1,) * (got.ndim - own.ndim)), got, jnp.zeros((), got.dtype))
        return self.sum_scatter(got)
