"""Presence, frequency and repetition penalties on the device, as the OpenAI API and vLLM define them.

`TokenCounts` holds, per batch slot, how often each vocabulary id occurs among the outputs of the slot's request
(``output [S, V]`` int32) and whether it occurs in its prompt (``prompt [S, V]`` bool), the vocabulary split over
attention TP like the logits (`vocab_sharding`). A penalized row of logits ``x`` becomes, in vLLM's order:

* repetition ``r`` (prompt and outputs): for every id seen, ``x / r`` where ``x > 0``, else ``x · r``;
* frequency ``f`` and presence ``p`` (outputs only): ``x − f · count − p · [count > 0]``

— after the logit bias and the held-back ids (`v41cp.serving.runner.sampling.adjusted_logits`), before temperature
and the top-k / top-p / min-p filters; log-probabilities stay those of the model's logits.

Cost: only penalized rows read the counts and only they are counted (`count_tokens`), each under one `lax.cond` on
"a row of the batch is penalized", so a batch without penalties pays the predicate alone. Exactness is kept by the
host (`v41cp.serving.runner.model_runner`): before a penalized request is first sampled in a slot — admission,
recompute after a preemption, adoption by a PD decode role — its row is rebuilt from its prompt and outputs
(`reset_slot`); every sampling step then counts the tokens it emits (a speculative round: the kept drafts and the
token after them; verification row ``j`` is penalized with drafts ``0 … j−1`` counted as well).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from v41cp.serving.runner.vocab_slices import add_at_ids, on_vocab_slices, vocab_axes

__all__ = ["TokenCounts", "vocab_sharding", "penalized", "apply_penalties", "count_tokens", "reset_slot"]


def vocab_sharding(mesh, vocab: int, default=None):
    """The counts' sharding: the vocabulary split over attention TP (`vocab_axes`) where it divides evenly, else
    replicated over ``mesh``; ``default`` without a mesh (e.g. the runner's device)."""
    if mesh is None:
        return default or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    axes = vocab_axes(mesh)
    split = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    return NamedSharding(mesh, PartitionSpec(None, axes) if axes and vocab % split == 0 else PartitionSpec())


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TokenCounts:
    """Per batch slot: ``output [S, V]`` int32 — occurrences of each id among the request's outputs; ``prompt [S, V]``
    bool — ids in its prompt (see the module docstring)."""

    output: jax.Array
    prompt: jax.Array

    @classmethod
    def zeros(cls, slots: int, vocab: int, mesh=None, default=None) -> "TokenCounts":
        """Zeroed counts of ``slots`` slots, committed to `vocab_sharding` (each device allocates its slice)."""
        sh = vocab_sharding(mesh, vocab, default)
        make = lambda: cls(jnp.zeros((slots, vocab), jnp.int32), jnp.zeros((slots, vocab), jnp.bool_))
        return jax.jit(make, out_shardings=cls(sh, sh))()

    @classmethod
    def abstract(cls, slots: int, vocab: int, mesh=None, default=None) -> "TokenCounts":
        """``jax.ShapeDtypeStruct`` leaves (lowering a step ahead of its state, `v41cp.plan`)."""
        sh = vocab_sharding(mesh, vocab, default)
        return cls(jax.ShapeDtypeStruct((slots, vocab), jnp.int32, sharding=sh),
                   jax.ShapeDtypeStruct((slots, vocab), jnp.bool_, sharding=sh))


def penalized(rows) -> jax.Array:
    """``[B]`` bool: the rows of `SamplingRows` ``rows`` with a penalty that changes something."""
    return (rows.presence != 0) | (rows.frequency != 0) | (rows.repetition != 1)


def apply_penalties(logits: jax.Array, rows, counts: TokenCounts, prior: jax.Array | None = None,
                    mesh=None) -> jax.Array:
    """``logits [N, V]`` FP32 with each penalized row's penalties applied (rows ``rows``, their slots' counts in
    ``counts``); ``prior [N, K]`` (−1: none): ids counted as outputs on top of the slot's (a verification row's
    earlier drafts). Unpenalized rows are returned as they are; a batch without penalties skips it all."""
    on = penalized(rows)

    def go(x, counts, prior):
        slot = jnp.clip(rows.slot, 0, counts.output.shape[0] - 1)
        out, seen = counts.output[slot], counts.prompt[slot]                       # [N, V], split like x
        if prior is not None:
            out = on_vocab_slices(add_at_ids, out, prior, jnp.ones_like(prior), mesh=mesh)
        seen = seen | (out > 0)
        r = rows.repetition[:, None]
        y = jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
        y = y - rows.frequency[:, None] * out.astype(jnp.float32) - rows.presence[:, None] * (out > 0)
        return jnp.where(on[:, None], y, x)

    return jax.lax.cond(on.any(), go, lambda x, counts, prior: x, logits, counts, prior)


def count_tokens(counts: TokenCounts, rows, ids: jax.Array, mesh=None) -> TokenCounts:
    """``counts`` with ``ids [B, K]`` (−1: none) added to the outputs of each penalized row's slot (the tokens a
    step emitted); nothing when no row is penalized."""
    on = penalized(rows) & (rows.slot >= 0)

    def local(part, offset, slot, ids, on):
        v = part.shape[-1]
        loc = ids - offset
        ok = on[:, None] & (ids >= 0) & (loc >= 0) & (loc < v)
        at = jnp.where(ok, slot[:, None], part.shape[0])                           # out of range: dropped
        return part.at[at, jnp.clip(loc, 0, v - 1)].add(1, mode="drop")

    def go(out):
        return on_vocab_slices(local, out, rows.slot, ids, on, mesh=mesh)

    out = jax.lax.cond(on.any(), go, lambda out: out, counts.output)
    return TokenCounts(out, counts.prompt)


@partial(jax.jit, static_argnames=("mesh",), donate_argnames=("counts",))
def reset_slot(counts: TokenCounts, slot: jax.Array, ids: jax.Array, n_prompt: jax.Array, mesh=None) -> TokenCounts:
    """``counts`` with slot ``slot``'s row rebuilt from a request's history ``ids [L]`` (−1: padding; one static
    ``L``, the engine's tokens per request): its first ``n_prompt`` ids are the prompt, the rest its outputs."""
    pos = jnp.arange(ids.shape[0])

    def row(part, offset, ids, keep):
        v = part.shape[-1]
        loc = ids - offset
        ok = keep & (ids >= 0) & (loc >= 0) & (loc < v)
        return jnp.zeros((1, v), part.dtype).at[0, jnp.where(ok, loc, v)].add(1, mode="drop").astype(part.dtype)

    out = on_vocab_slices(row, counts.output[:1], ids, pos >= n_prompt, mesh=mesh)
    prompt = on_vocab_slices(row, counts.prompt[:1].astype(jnp.int32), ids, pos < n_prompt, mesh=mesh) > 0
    return TokenCounts(counts.output.at[slot].set(out[0]), counts.prompt.at[slot].set(prompt[0]))
