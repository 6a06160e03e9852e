"""On-device sampling: the token of each batch row drawn from its FP32 logits inside the jitted steps, so that only
the sampled ids (``[B]`` int32) come back to the host — never the ``[B, vocab]`` logits.

* `SamplingRows` — the per-row sampling parameters of a step as device data (a registered dataclass, one entry per
  batch row; idle rows greedy);
* `adjusted_logits(logits [B, V], rows, counts)` — what rows sample from: the logit bias, the ids held back by
  ``min_tokens`` and the presence / frequency / repetition penalties (`v41cp.serving.runner.penalties`) applied;
* `sample_rows(logits [B, V], rows)` — greedy (temperature 0) or temperature sampling restricted to the top-k,
  top-p (nucleus) and min-p support, one token per row;
* `accept_rows(logits [B, R, V], drafts [B, R−1], lengths [B], rows)` — speculative acceptance against point-mass
  draft proposals (greedy: the longest prefix equal to the argmax; sampled: lossless rejection sampling with the
  residual distribution), the emitted tokens and the kept draft count per row;
* `token_distribution(logits [B, V], rows)` — the distribution `sample_rows` draws from (probabilities [B, V]).

Determinism: the draw of output token ``i`` of a request with seed ``s`` uses the threefry key of ``s`` (64 bits)
folded with ``i`` and a stream number (0 for the token, 1 for the acceptance test of a draft, 2 for a token drawn
after a draft), so a request's tokens depend only on its own logits and seed — the same across batch compositions,
batch rows, restarts and speculative rounds. The support: the top-k tokens, then of those the smallest most-likely
set holding ``top_p`` of their renormalised mass, then of those the tokens at least ``min_p`` times as likely as
the most likely one; ties keep the lower token id (`jax.lax.top_k` order). A batch whose rows all leave the three
filters off skips the vocabulary sort. Temperatures so small that ``logits / T`` overflows are the greedy limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from v41cp.serving.runner.logprobs import token_logprobs
from v41cp.serving.runner.penalties import TokenCounts, apply_penalties, count_tokens
from v41cp.serving.runner.vocab_slices import add_at_ids, on_vocab_slices
from v41cp.serving.scheduler.request import MAX_LOGIT_BIAS, MAX_STOP_IDS, SamplingParams

__all__ = ["SamplingRows", "sample_rows", "accept_rows", "token_distribution", "sample_tokens", "sample_with_logprobs",
           "ReplicateOn"]

TOKEN, ACCEPT, AFTER_DRAFT = 0, 1, 2        # the random streams of one output index


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingRows:
    """The sampling parameters of every batch row (data fields, shapes ``[B]``): ``temperature`` f32 (0: greedy),
    ``top_p`` f32 in (0, 1], ``top_k`` i32 (0: off), ``min_p`` f32 in [0, 1), ``seed`` uint32 ``[B, 2]`` (the 64-bit
    seed's high and low words), ``index`` i32 (the output index of the row's first sampled token), ``logprobs`` bool
    (the row's request asks for log-probabilities: `v41cp.serving.runner.logprobs`); ``bias_ids`` / ``bias``
    ``[B, MAX_LOGIT_BIAS]`` (−1: none) the logit bias; ``ban_ids [B, MAX_STOP_IDS + 1]`` (−1: none) the EOS and stop
    ids that output indices below ``min_tokens [B]`` may not sample; ``presence`` / ``frequency`` / ``repetition`` f32
    the penalties (0, 0, 1: off) and ``slot`` i32 the row's batch slot (its `TokenCounts` row; −1: none); ``mask
    [B, words]`` int32 the ids a row's grammar allows (bit ``i % 32`` of word ``i // 32``; all set: no grammar;
    ``words = 0``: a program without grammars, `v41cp.serving.runner.grammar`)."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    min_p: jax.Array
    seed: jax.Array
    index: jax.Array
    logprobs: jax.Array
    bias_ids: jax.Array
    bias: jax.Array
    ban_ids: jax.Array
    min_tokens: jax.Array
    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array
    slot: jax.Array
    mask: jax.Array

    @classmethod
    def build(cls, params: Sequence[SamplingParams], indices: Sequence[int], batch: int,
              rows: Sequence[int] | None = None, eos: int | None = None,
              slots: Sequence[int] | None = None, masks: np.ndarray | None = None) -> "SamplingRows":
        """Host arrays of ``batch`` rows: ``params[i]`` at output index ``indices[i]`` in row ``rows[i]`` (default
        ``i``) of batch slot ``slots[i]`` (needed by penalties); the other rows are idle (greedy). ``eos``: the
        model's EOS id (held back by ``min_tokens``); ``masks [batch, words]``: the grammar masks (None: none, zero
        words)."""
        at = np.arange(len(params)) if rows is None else np.asarray(rows, np.int64)
        bias_ids = np.full((batch, MAX_LOGIT_BIAS), -1, np.int32)
        bias = np.zeros((batch, MAX_LOGIT_BIAS), np.float32)
        ban_ids = np.full((batch, MAX_STOP_IDS + 1), -1, np.int32)
        for r, sp in zip(at, params):
            for k, (t, v) in enumerate(sp.logit_bias):
                bias_ids[r, k], bias[r, k] = t, v
            if sp.min_tokens:
                held = ((eos,) if eos is not None and sp.stop_on_eos else ()) + tuple(sp.stop_token_ids)
                ban_ids[r, :len(held)] = held

        def col(values, dtype, idle):
            out = np.full(batch, idle, dtype)
            out[at] = values
            return out

        seeds = np.zeros((batch, 2), np.uint32)
        seeds[at, 0] = [sp.seed >> 32 for sp in params]
        seeds[at, 1] = [sp.seed & 0xFFFFFFFF for sp in params]
        return cls(temperature=col([sp.temperature for sp in params], np.float32, 0.0),
                   top_p=col([sp.top_p for sp in params], np.float32, 1.0),
                   top_k=col([sp.top_k for sp in params], np.int32, 0),
                   min_p=col([sp.min_p for sp in params], np.float32, 0.0), seed=seeds,
                   index=col(list(indices), np.int32, 0),
                   logprobs=col([sp.logprobs is not None for sp in params], bool, False),
                   bias_ids=bias_ids, bias=bias, ban_ids=ban_ids,
                   min_tokens=col([sp.min_tokens for sp in params], np.int32, 0),
                   presence=col([sp.presence_penalty for sp in params], np.float32, 0.0),
                   frequency=col([sp.frequency_penalty for sp in params], np.float32, 0.0),
                   repetition=col([sp.repetition_penalty for sp in params], np.float32, 1.0),
                   slot=col([-1] * len(params) if slots is None else list(slots), np.int32, -1),
                   mask=np.zeros((batch, 0), np.int32) if masks is None else
                   masks if isinstance(masks, jax.Array) else np.asarray(masks, np.int32))

    @classmethod
    def abstract(cls, batch: int, sharding=None, words: int = 0, verify_rows: int = 0) -> "SamplingRows":
        """``jax.ShapeDtypeStruct`` leaves of ``batch`` rows with grammar masks of ``words`` words — one per
        verification row with ``verify_rows`` (a speculative round's) — (lowering a step ahead of traffic)."""
        s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        return cls(temperature=s((batch,), jnp.float32), top_p=s((batch,), jnp.float32), top_k=s((batch,), jnp.int32),
                   min_p=s((batch,), jnp.float32), seed=s((batch, 2), jnp.uint32), index=s((batch,), jnp.int32),
                   logprobs=s((batch,), jnp.bool_), bias_ids=s((batch, MAX_LOGIT_BIAS), jnp.int32),
                   bias=s((batch, MAX_LOGIT_BIAS), jnp.float32), ban_ids=s((batch, MAX_STOP_IDS + 1), jnp.int32),
                   min_tokens=s((batch,), jnp.int32), presence=s((batch,), jnp.float32),
                   frequency=s((batch,), jnp.float32), repetition=s((batch,), jnp.float32), slot=s((batch,), jnp.int32),
                   mask=s((batch, verify_rows, words) if verify_rows else (batch, words), jnp.int32))

    def take(self, rows: jax.Array) -> "SamplingRows":
        """The parameters of batch rows ``rows``."""
        return jax.tree.map(lambda a: a[rows], self)


def _keys(rows: SamplingRows, offset, stream: int):
    """One threefry key per row: its seed folded with output index ``rows.index + offset`` and ``stream``."""
    def one(seed, index):
        key = jax.random.wrap_key_data(seed, impl="threefry2x32")
        return jax.random.fold_in(jax.random.fold_in(key, index), stream)
    return jax.vmap(one)(rows.seed, rows.index + offset)


def adjusted_logits(logits: jax.Array, rows: SamplingRows, whole=None, counts: TokenCounts | None = None,
                    prior: jax.Array | None = None) -> jax.Array:
    """``logits [B, V]`` with the ids a row's grammar forbids at −inf (``rows.mask``), each row's logit bias added
    and its held-back ids (EOS and stop ids before ``min_tokens`` outputs) at −inf — unless its grammar allows no
    other id (the grammar is complete: it ends the output) —, then with ``counts`` its
    penalties applied (`apply_penalties`; ``prior [B, K]``:
    ids counted on top of the slot's) — what every row samples from (greedy included). A batch with none of them
    skips each (``lax.cond``); vocab-sharded logits (``whole``: its mesh) are changed where they lie, each device
    its slice."""
    mesh = whole.mesh if whole is not None else None
    logits = logits.astype(jnp.float32)
    if rows.mask.shape[-1]:                                               # grammar rows: disallowed ids at −inf
        logits = jax.lax.cond((rows.mask != -1).any(), lambda x, m: on_vocab_slices(_allowed, x, m, mesh=mesh),
                              lambda x, m: x, logits, rows.mask)
    add = partial(on_vocab_slices, add_at_ids, mesh=mesh)
    logits = jax.lax.cond((rows.bias_ids >= 0).any(), lambda x, i, a: add(x, i, a), lambda x, i, a: x, logits,
                          rows.bias_ids, jnp.where(rows.bias_ids >= 0, rows.bias, 0.0))
    ban = (rows.index < rows.min_tokens)[:, None] & (rows.ban_ids >= 0)

    def hold_back(x, ids):
        # a row whose grammar allows nothing but its held-back ids keeps them: the grammar ends it
        held = add(x, ids, jnp.where(ids >= 0, -jnp.inf, 0.0))
        return jnp.where(jnp.isfinite(held).any(-1, keepdims=True), held, x)

    logits = jax.lax.cond(ban.any(), hold_back, lambda x, ids: x, logits, jnp.where(ban, rows.ban_ids, -1))
    return logits if counts is None else apply_penalties(logits, rows, counts, prior, mesh)


def _allowed(part: jax.Array, offset, mask: jax.Array) -> jax.Array:
    """``part [N, v]`` (ids ``offset …``) with the ids whose bit is clear in ``mask [N, words]`` at −inf."""
    ids = offset + jnp.arange(part.shape[-1], dtype=jnp.int32)
    words = jnp.take(mask, ids // 32, axis=1, mode="clip")
    bits = jax.lax.shift_right_logical(words, jnp.broadcast_to(ids % 32, words.shape)) & 1
    return jnp.where(bits == 1, part, -jnp.inf)


def _support_logits(logits: jax.Array, rows: SamplingRows, whole=None):
    """``(z [B, V], greedy [B])``: the tempered logits with −inf outside each row's support, and which rows are
    greedy (temperature 0, or ``logits / T`` not finite). ``whole``: makes the vocabulary axis whole on every
    device before the filters sort it (vocab-sharded logits under attention TP: one all-gather, then a local sort;
    None: as it is)."""
    t = rows.temperature[:, None]
    z = logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)
    # overflowed logits / T: +inf or NaN somewhere, or nothing finite left (−inf alone: held back / filtered)
    greedy = (rows.temperature <= 0) | (jnp.isnan(z) | (z == jnp.inf)).any(-1) | ~jnp.isfinite(z).any(-1)
    filtered = (rows.top_k > 0).any() | (rows.top_p < 1).any() | (rows.min_p > 0).any()
    sort = partial(_filtered, whole=whole or (lambda x: x))
    return jax.lax.cond(filtered, sort, lambda z, rows: z, z, rows), greedy


def _filtered(z: jax.Array, rows: SamplingRows, whole) -> jax.Array:
    """Top-k, then top-p over the top-k mass, then min-p: entries outside the support set to −inf."""
    z = whole(z)
    v = z.shape[-1]
    order = jnp.argsort(-z, axis=-1, stable=True)                          # descending, lower id first on ties
    zs = jnp.take_along_axis(z, order, axis=-1)
    rank = jnp.arange(v)[None]
    k = jnp.where(rows.top_k > 0, jnp.minimum(rows.top_k, v), v)[:, None]
    keep = rank < k
    p = jax.nn.softmax(jnp.where(keep, zs, -jnp.inf), axis=-1)
    before = jnp.cumsum(p, axis=-1) - p                                   # mass of the more likely tokens
    keep &= (before < rows.top_p[:, None]) | (rows.top_p[:, None] >= 1) | (rank == 0)
    keep &= p >= rows.min_p[:, None] * p[:, :1]
    inverse = jnp.argsort(order, axis=-1)
    return jnp.where(jnp.take_along_axis(keep, inverse, axis=-1), z, -jnp.inf)


def token_distribution(logits: jax.Array, rows: SamplingRows, whole=None, counts: TokenCounts | None = None
                       ) -> jax.Array:
    """The probabilities [B, V] that `sample_rows` draws from (a one-hot of the argmax for greedy rows)."""
    logits = adjusted_logits(logits, rows, whole, counts)
    z, greedy = _support_logits(logits, rows, whole)
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(greedy[:, None], onehot, jax.nn.softmax(z, axis=-1))


def _draw(keys, z: jax.Array) -> jax.Array:
    return jax.vmap(jax.random.categorical)(keys, z).astype(jnp.int32)


def sample_rows(logits: jax.Array, rows: SamplingRows, whole=None, counts: TokenCounts | None = None) -> jax.Array:
    """One token per row of ``logits [B, V]`` (FP32): ``[B]`` int32 (see the module docstring; ``whole`` as in
    `_support_logits`; ``counts``: the slots' token counts, for penalized rows)."""
    logits = adjusted_logits(logits, rows, whole, counts)
    z, greedy = _support_logits(logits, rows, whole)
    drawn = _draw(_keys(rows, 0, TOKEN), z)
    return jnp.where(greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), drawn)


@dataclass(frozen=True)
class ReplicateOn:
    """A ``whole`` for logits sharded over ``mesh`` (vocab-sharded under attention TP): the array replicated, one
    all-gather (hashable: a static argument)."""

    mesh: Mesh

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec()))


def sample_with_logprobs(logits: jax.Array, rows: SamplingRows, counts: TokenCounts | None = None, whole=None,
                         logprobs: int = 0):
    """`sample_rows` and, with ``logprobs = n > 0``, the tokens' log-probabilities with the top ``n`` of each row
    (`token_logprobs`, of the model's logits; computed only when a row asks): ``(tokens [B], TokenLogprobs or None,
    counts with the tokens counted — or None without counts)``."""
    tokens = sample_rows(logits, rows, whole, counts)
    lp = token_logprobs(logits, tokens, rows.logprobs.any(), logprobs, whole) if logprobs else None
    mesh = whole.mesh if whole is not None else None
    return tokens, lp, (None if counts is None else count_tokens(counts, rows, tokens[:, None], mesh))


# the prefills' first tokens: a program on the pass's device logits (the counts donated)
sample_tokens = jax.jit(sample_with_logprobs, static_argnames=("whole", "logprobs"), donate_argnames=("counts",))


def accept_rows(logits: jax.Array, drafts: jax.Array, lengths: jax.Array, rows: SamplingRows, whole=None,
                counts: TokenCounts | None = None) -> tuple[jax.Array, jax.Array]:
    """Speculative acceptance of ``drafts [B, R−1]`` against the verification rows' ``logits [B, R, V]`` (row ``j``
    predicts the token after draft ``j``; only the first ``lengths [B] ≤ R`` rows of a request are real): ``(emitted
    [B, R] int32 — the kept drafts, then one token from the target, −1 after —, kept [B] int32 drafts)``.
    Greedy rows keep drafts while they equal the argmax; sampled rows keep draft ``d`` at row ``j`` when a uniform
    draw (stream 1 of output index ``index + j``) is below ``p_j(d)``, and the first rejected row draws from its
    distribution without ``d`` (stream 2) — exactly the target's distribution (lossless). After every real draft is
    kept, the last real row draws from its full distribution (stream 2). With ``counts``, row ``j`` is penalized
    with drafts ``0 … j−1`` counted as outputs (what plain decoding would have counted). ``rows.mask``: a grammar
    mask per request ``[B, words]`` or per verification row ``[B, R, words]`` (row ``j``: what the grammar allows
    after drafts ``0 … j−1``)."""
    b, r, v = logits.shape
    flat = {k: jnp.repeat(a, r, axis=0) for k, a in vars(rows).items() if k != "mask"}
    flat["index"] = flat["index"] + jnp.tile(jnp.arange(r, dtype=jnp.int32), b)
    m = rows.mask                                   # grammar masks: one per request, or per verification row
    flat = SamplingRows(**flat, mask=m.reshape(b * r, m.shape[-1]) if m.ndim == 3 else jnp.repeat(m, r, axis=0))
    earlier = jnp.where(jnp.arange(r - 1)[None] < jnp.arange(r)[:, None], drafts[:, None, :], -1)   # [B, R, R−1]
    logits = adjusted_logits(logits.reshape(b * r, v), flat, whole, counts, earlier.reshape(b * r, r - 1))
    z, greedy = _support_logits(logits, flat, whole)
    logits = logits.reshape(b, r, v)
    p = jnp.where(greedy[:, None], jax.nn.one_hot(jnp.argmax(logits.reshape(b * r, v), -1), v), jax.nn.softmax(z, -1))
    p = p.reshape(b, r, v)
    greedy = greedy.reshape(b, r)
    d = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], axis=1)                  # [B, R]
    p_d = jnp.take_along_axis(p, d[..., None], axis=-1)[..., 0]
    u = jax.vmap(jax.random.uniform)(_keys(flat, 0, ACCEPT)).reshape(b, r)
    ok = jnp.where(greedy, jnp.argmax(logits, -1) == d, u < p_d)
    real = jnp.arange(r)[None] < lengths[:, None] - 1                                         # rows holding a draft
    kept = jnp.cumprod(ok & real, axis=1).sum(1).astype(jnp.int32)                            # [B]
    last = jnp.take_along_axis(p, kept[:, None, None], axis=1)[:, 0]                          # [B, V]
    rejected = kept < lengths - 1
    dk = jnp.take_along_axis(d, kept[:, None], axis=1)[:, 0]
    last = jnp.where(rejected[:, None] & (jnp.arange(v)[None] == dk[:, None]), 0.0, last)
    keys = _keys(rows, kept, AFTER_DRAFT)
    g = jnp.take_along_axis(greedy, kept[:, None], axis=1)[:, 0]
    best = jnp.argmax(jnp.take_along_axis(logits, kept[:, None, None], axis=1)[:, 0], -1).astype(jnp.int32)
    tok = jnp.where(g, best, _draw(keys, jnp.log(last)))
    i = jnp.arange(r)[None]
    emitted = jnp.where(i < kept[:, None], d, jnp.where(i == kept[:, None], tok[:, None], -1))
    return emitted.astype(jnp.int32), kept
