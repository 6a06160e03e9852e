"""Log-probabilities of tokens, on the device: what a request that asks for ``logprobs`` gets back with its tokens.

* `token_logprobs(logits [..., V], tokens [...], wanted, n)` — the log-probability of each given token and the
  ``n`` most likely tokens with theirs (`TokenLogprobs`), computed inside the jitted step that produced the logits,
  so that only ``[..., 1 + 2n]`` numbers (not ``[..., V]``) come to the host — and only when some row asks
  (``wanted``: otherwise the step skips the work and returns zeros);
* `row_logprobs(hidden, head, targets, n)` — the same for every row of a prefill pass (prompt log-probabilities:
  each row's next prompt token), from the rows' head inputs in tiles of `ROW_TILE` rows;
* `chunk_logprobs(logits, targets, n)` — the token-serial prefill's: a chunk's logits, each position's next token;
* `entries(lp, index, count)` — one token's entry on the host: ``(logprob, ((id, logprob), …))`` with the
  request's ``count ≤ n`` alternatives.

The distribution is the model's own: ``log_softmax`` of the FP32 logits, before temperature and the top-k / top-p /
min-p filters (vLLM's default, ``raw_logprobs``), so the numbers do not depend on how a token was drawn. The
alternatives are in `jax.lax.top_k` order (log-probability descending, then lower token id first).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from v41cp.serving.runner.vocab_slices import vocab_axes

__all__ = ["TokenLogprobs", "token_logprobs", "row_logprobs", "chunk_logprobs", "top_n", "entries", "ROW_TILE"]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TokenLogprobs:
    """``chosen [...]`` FP32: the log-probability of each token; ``top_ids [..., n]`` int32 and ``top [..., n]``
    FP32: the ``n`` most likely tokens and their log-probabilities."""

    chosen: jax.Array
    top_ids: jax.Array
    top: jax.Array


def top_n(x: jax.Array, n: int, mesh=None, axes: tuple[str, ...] = ()) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` of ``x [..., V]`` (values, ids). With ``x``'s vocabulary split over mesh ``axes``: in two
    stages — each device's top ``n`` of its slice (a `jax.shard_map`: nothing moves), then the top ``n`` of the
    ``devices · n`` candidates — the same result and order (slices in id order, each in `top_k` order, so equal
    values still come lower id first), moving ``devices · n`` values per row instead of the row."""
    chunks = int(np.prod([mesh.shape[a] for a in axes])) if mesh is not None else 1
    v = x.shape[-1]
    if chunks <= 1 or v % chunks or v // chunks < n:
        return jax.lax.top_k(x, n)
    lead = (None,) * (x.ndim - 1)

    def local(part):
        vals, ids = jax.lax.top_k(part, n)
        return vals[..., None, :], (ids + jax.lax.axis_index(axes) * part.shape[-1])[..., None, :]

    vals, ids = jax.shard_map(local, mesh=mesh, in_specs=PartitionSpec(*lead, axes),
                              out_specs=(PartitionSpec(*lead, axes, None),) * 2)(x)    # [..., chunks, n]
    vals, at = jax.lax.top_k(vals.reshape(*x.shape[:-1], chunks * n), n)
    return vals, jnp.take_along_axis(ids.reshape(*x.shape[:-1], chunks * n), at, axis=-1)


def token_logprobs(logits: jax.Array, tokens: jax.Array, wanted: jax.Array, n: int, whole=None) -> TokenLogprobs:
    """See the module docstring. ``logits [..., V]``, ``tokens [...]`` (negative: padding, log-probability 0),
    ``wanted`` a boolean scalar, ``n ≥ 1`` static; ``whole``: the sampler's gather of vocab-sharded logits
    (`v41cp.serving.runner.sampling.ReplicateOn`; None: one device) — here only its mesh is used, the top ``n`` taken
    per device slice first (`top_n`), so the step moves candidates, not rows."""
    lead = tokens.shape
    mesh = whole.mesh if whole is not None else None
    axes = vocab_axes(mesh)                                                                 # the vocabulary's split

    def compute(logits, tokens):
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        # a masked sum, not a gather: with the vocabulary sharded, each device adds its slice (one small reduce)
        hit = jax.lax.broadcasted_iota(jnp.int32, lp.shape, lp.ndim - 1) == tokens[..., None]
        chosen = jnp.sum(jnp.where(hit, lp, 0.0), axis=-1)
        top, ids = top_n(lp, n, mesh, axes)
        return TokenLogprobs(jnp.where(tokens >= 0, chosen, 0.0), ids.astype(jnp.int32), top)

    def skip(logits, tokens):
        return TokenLogprobs(jnp.zeros(lead, jnp.float32), jnp.zeros((*lead, n), jnp.int32),
                             jnp.zeros((*lead, n), jnp.float32))

    return jax.lax.cond(wanted, compute, skip, logits, tokens)


ROW_TILE = 256          # prompt rows per head tile: [256, vocab] FP32 logits live at once (132 MB at 129,280)


def row_logprobs(hidden: jax.Array, head: jax.Array, targets: jax.Array, n: int, whole=None,
                 tile: int = ROW_TILE) -> TokenLogprobs:
    """Prompt log-probabilities of a prefill pass: each row's head input ``hidden [..., H]`` times ``head [H, V]``
    (FP32, as the model's head) → the log-probability of ``targets [...]`` (the next prompt token; −1: none) and the
    top ``n`` (`TokenLogprobs` shaped like ``targets``). Computed in tiles of ``tile`` rows (so the pass never holds
    ``[rows, V]`` logits), and only when some target is set (a ``lax.cond``: zeros otherwise)."""
    shape, h = targets.shape, hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    rows = t.shape[0]
    tile = min(tile, rows)
    pad = -rows % tile

    def compute(h, t):
        hp = jnp.pad(h, ((0, pad), (0, 0))).reshape(-1, tile, h.shape[-1])
        tp = jnp.pad(t, (0, pad), constant_values=-1).reshape(-1, tile)

        def one(args):
            hh, tt = args
            logits = jnp.einsum("sh,hv->sv", hh.astype(jnp.float32), head, precision=jax.lax.Precision.HIGHEST)
            return token_logprobs(logits, tt, jnp.any(tt >= 0), n, whole)

        out = jax.lax.map(one, (hp, tp))
        return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:])[:rows], out)

    def skip(h, t):
        return TokenLogprobs(jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, n), jnp.int32),
                             jnp.zeros((rows, n), jnp.float32))

    out = jax.lax.cond(jnp.any(t >= 0), compute, skip, h, t)
    return jax.tree.map(lambda a: a.reshape(*shape, *a.shape[1:]), out)


@partial(jax.jit, static_argnames=("n", "whole"))
def chunk_logprobs(logits: jax.Array, targets: jax.Array, n: int, whole=None) -> TokenLogprobs:
    """The token-serial prefill's prompt log-probabilities: ``logits [C, V]`` of a chunk's positions and ``targets
    [C]`` (each position's next prompt token; −1: none) → `token_logprobs` ``[C]`` (computed when a target is
    set)."""
    return token_logprobs(logits, targets, jnp.any(targets >= 0), n, whole)


def entries(lp: TokenLogprobs, index, count: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """Host arrays ``lp`` (fetched) at ``index``: ``(logprob of the token, its ``count`` alternatives as (id,
    logprob))``."""
    ids, top = np.asarray(lp.top_ids[index])[:count], np.asarray(lp.top[index])[:count]
    return float(lp.chosen[index]), tuple((int(i), float(v)) for i, v in zip(ids, top))
