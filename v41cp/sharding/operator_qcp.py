"""Operator-local QCP: the two shard_map islands over attention TP and when they apply (one implementation for
every mode — the full-sequence forward's layers and the cached rows of `v41cp.serving.attention.paged_rows` use them
through thin operand adapters: `v41cp.layers.attention.query_parallel_attention / query_parallel_rows`,
`v41cp.layers.indexer.query_parallel_select / query_parallel_select_rows`).

* `rows_island` (attention): all-to-all of each rank's local heads of every row for all heads of a contiguous
  row block, attend the block, inverse all-to-all back to the head layout — per device ``2·⌈S/N⌉·Hq·D``
  elements and the ``Hq`` sink gather per layer;
* `interleaved_island` (indexer): rows interleaved over attention TP, each rank selects its rows, the top-k ids
  are all-gathered back to row order — ``⌈S/N⌉·N·K`` int32 per device per layer.

Settings come from a `v41cp.sharding.rules.ShardingContext` (``indexer_query_parallel`` /
``attention_query_parallel`` and their row thresholds).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from v41cp.config import LayerRole, ModelConfig
from v41cp.sharding.mesh import ATTN_TP

__all__ = ["attention_tp", "attention_query_parallel_applies", "indexer_query_parallel_applies", "rows_island",
           "interleaved_island"]


def attention_tp(shard) -> tuple[tuple[str, ...], int]:
    """(the attention-TP mesh axes of size > 1, their product) of ``shard``'s mesh."""
    axes = tuple(a for a in ATTN_TP if shard.mesh.shape.get(a, 1) > 1)
    return axes, int(np.prod([shard.mesh.shape[a] for a in axes]))


def attention_query_parallel_applies(shard, cfg: ModelConfig, role: LayerRole, rows: int) -> bool:
    """Operator-local attention QCP for this layer: enabled, the query heads split evenly over attention TP, and
    at least ``attention_query_min_tokens`` (global layers) / ``attention_query_swa_min_tokens`` (SWA-only
    layers) query rows."""
    if shard is None or not shard.attention_query_parallel:
        return False
    n = attention_tp(shard)[1]
    threshold = shard.attention_query_swa_min_tokens if role.ratio == 0 else shard.attention_query_min_tokens
    return n > 1 and cfg.num_attention_heads % n == 0 and rows >= threshold


def indexer_query_parallel_applies(shard, role: LayerRole, rows: int) -> bool:
    """Whether operator-local indexer QCP runs for this layer: enabled in ``shard``, at least
    ``indexer_query_min_tokens`` query rows, and an ordinary index layer (the candidate-producing Full source
    and the Reindex layers inside its candidates keep their existing path)."""
    return bool(shard is not None and shard.indexer_query_parallel and rows >= shard.indexer_query_min_tokens
                and not role.candidate_source and not role.uses_candidates)


def rows_island(shard, q: jax.Array, operands, attend_block) -> jax.Array:
    """The attention exchange: each rank trades its local heads of every row of ``q [B,S,Hq,D]`` (head-sharded
    over attention TP) for all heads of a contiguous block of ``⌈S/N⌉`` rows (all-to-all), attends that block,
    and the inverse all-to-all restores the TP head layout. ``operands`` (a pytree, replicated) and
    ``attend_block(q_rows [B,local,Hq,D], rows [local], operands, sink)`` say how a block's rows find their keys;
    ``operands["sink"] [Hq]`` is the head-sharded sink. Rows past ``S`` (padding) are the block function's to
    mask. Returns ``[B,S,Hq,D]`` head-sharded."""
    axes, n = attention_tp(shard)
    s = q.shape[1]
    local = -(-s // n)

    def body(q, operands):
        q = jnp.pad(q, ((0, 0), (0, local * n - s), (0, 0), (0, 0)))
        q_rows = jax.lax.all_to_all(q, axes, split_axis=1, concat_axis=2, tiled=True)     # [B, local, Hq, D]
        rows = jax.lax.axis_index(axes) * local + jnp.arange(local)
        sink = jax.lax.all_gather(operands["sink"], axes, tiled=True)
        o = attend_block(q_rows, rows, operands, sink)
        o = jax.lax.all_to_all(o, axes, split_axis=2, concat_axis=1, tiled=True)           # [B, local·N, Hq/N, D]
        return o[:, :s]

    heads = P(None, None, axes, None)
    specs = {k: (P(axes) if k == "sink" else P()) for k in operands}
    return jax.shard_map(body, mesh=shard.mesh, in_specs=(heads, specs), out_specs=heads)(q, operands)


def interleaved_island(shard, b: int, s: int, operands, select_rows):
    """The indexer exchange: query rows interleaved over attention TP (row ``i`` on rank ``i mod N``); each rank
    selects its rows — ``select_rows(rows [local], operands) → topk [b, local, K]`` with ``operands`` a replicated
    pytree — and the logical top-k ids are all-gathered back to the original row order. Every rank ends with the
    same ``[b, s, K]``."""
    axes = tuple(a for a in ATTN_TP if a in shard.mesh.shape)
    n = int(np.prod([shard.mesh.shape[a] for a in axes]))
    local = -(-s // n)

    def body(operands):
        rows = jax.lax.axis_index(axes) + n * jnp.arange(local)                   # this rank's rows
        topk = select_rows(jnp.minimum(rows, s - 1), operands)
        got = jax.lax.all_gather(topk, axes, to="invarying")                      # [N, b, local, K]
        return jnp.moveaxis(got, 0, 2).reshape(b, local * n, -1)[:, :s]

    return jax.shard_map(body, mesh=shard.mesh, in_specs=(jax.tree.map(lambda _: P(), operands),),
                         out_specs=P())(operands)
