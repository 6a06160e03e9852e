"""Log-probabilities of tokens, on the device: what a request that asks for ``logprobs`` gets back with its tokens.

* `token_logprobs(logits [..., V], tokens [...], wanted, n)` — the log-probability of each given token and the
  ``n`` most likely tokens with theirs (`TokenLogprobs`), computed inside the jitted step that produced the logits,
  so that only ``[..., 1 + 2n]`` numbers (not ``[..., V]``) come to the host — and only when some row asks
  (``wanted``: otherwise the step skips the work and returns zeros);
* `entries(lp, index, count)` — one token's entry on the host: ``(logprob, ((id, logprob), …))`` with the
  request's ``count ≤ n`` alternatives.

The distribution is the model's own: ``log_softmax`` of the FP32 logits, before temperature and the top-k / top-p /
min-p filters (vLLM's default, ``raw_logprobs``), so the numbers do not depend on how a token was drawn. The
alternatives are in `jax.lax.top_k` order (log-probability descending, then lower token id first).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["TokenLogprobs", "token_logprobs", "entries"]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TokenLogprobs:
    """``chosen [...]`` FP32: the log-probability of each token; ``top_ids [..., n]`` int32 and ``top [..., n]``
    FP32: the ``n`` most likely tokens and their log-probabilities."""

    chosen: jax.Array
    top_ids: jax.Array
    top: jax.Array


def token_logprobs(logits: jax.Array, tokens: jax.Array, wanted: jax.Array, n: int, whole=None) -> TokenLogprobs:
    """See the module docstring. ``logits [..., V]``, ``tokens [...]`` (negative: padding, log-probability 0),
    ``wanted`` a boolean scalar, ``n ≥ 1`` static; ``whole``: makes vocab-sharded logits whole before the top-n
    (`v41cp.serving.runner.sampling.ReplicateOn`)."""
    lead = tokens.shape

    def compute(logits, tokens):
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        chosen = jnp.take_along_axis(lp, jnp.maximum(tokens, 0)[..., None].astype(jnp.int32), axis=-1)[..., 0]
        top, ids = jax.lax.top_k((whole or (lambda x: x))(lp), n)
        return TokenLogprobs(jnp.where(tokens >= 0, chosen, 0.0), ids.astype(jnp.int32), top)

    def skip(logits, tokens):
        return TokenLogprobs(jnp.zeros(lead, jnp.float32), jnp.zeros((*lead, n), jnp.int32),
                             jnp.zeros((*lead, n), jnp.float32))

    return jax.lax.cond(wanted, compute, skip, logits, tokens)


def entries(lp: TokenLogprobs, index, count: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """Host arrays ``lp`` (fetched) at ``index``: ``(logprob of the token, its ``count`` alternatives as (id,
    logprob))``."""
    ids, top = np.asarray(lp.top_ids[index])[:count], np.asarray(lp.top[index])[:count]
    return float(lp.chosen[index]), tuple((int(i), float(v)) for i, v in zip(ids, top))
