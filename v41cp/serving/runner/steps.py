"""The static-capacity cached steps over the paged V4.1 caches: decode, verification, token-serial prefill.

Every step is the one model (`v41cp.model.Transformer`) over cached rows (`v41cp.serving.attention.paged_rows`):

* `decode_step(params, cache, meta, cfg)` — one new token per active batch row (a `StepBatch` of one row each,
  `StepBatch.decode`);
* `decode_and_sample` / `verify_and_accept` — the same steps with the tokens sampled (`v41cp.serving.runner.sampling`)
  and the drafts accepted inside the program: the engine's steps, which bring back only token ids;
* `verify_step(params, cache, rows, cfg)` — ``k`` new rows per request in one step (a `StepBatch`, static
  ``rows = k``, ragged ``lengths ≤ k``): the logits of every row and the cache equal feeding the same tokens one
  at a time; `commit_rows` then keeps only the first ``a ≤ k`` rows of each request (the cache equals having
  fed ``a`` tokens) — the step speculative decoding verifies drafts with;
* `prefill_chunk(params, cache, metas, cfg)` — a chunk of tokens fed one at a time (a scan of decode steps);
  the engine's default prefill and the reference the row-parallel prefills are checked against.

Shapes depend only on capacity (``max_batch`` / ``max_blocks`` / ``rows`` static, the cache's ``num_blocks``),
never on current lengths, so each step compiles once per bucket; metadata is refreshed on the host every step.
Inactive rows write nothing (their scatter indices point out of bounds). ``plan`` (`v41cp.serving.attention.dcp.DCPPlan`)
runs KVP / DCP: owner-masked writes, the exact distributed top-k and the LSE-merged attention, per row; a
``DCPPlan.split_selection`` plan (plain attention TP, replicated pages) splits only the selection's scoring over
the TP ranks, so that no collective of the step grows with the history.

The cache is `v41cp.serving.cache.device_cache.PagedCache` (``init_cache`` re-exported here); a verification
step's undo record `v41cp.serving.cache.undo.VerifyUndo`. Engram hash ids of each row's
token are host metadata (`v41cp.serving.step_batch.engram_ids_for_last`).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from v41cp.ced import ced_boundary, ced_rows
from v41cp.config import ModelConfig
from v41cp.drafter import drafter_rows
from v41cp.model import Transformer
from v41cp.serving.attention.dcp import DCPPlan
from v41cp.serving.attention.paged_rows import PagedRows
from v41cp.serving.cache import paged as pc
from v41cp.serving.cache.device_cache import POOLS, PagedCache, init_cache
from v41cp.serving.cache.undo import VerifyUndo
from v41cp.serving.runner.logprobs import token_logprobs
from v41cp.serving.runner.penalties import TokenCounts, count_tokens
from v41cp.serving.runner.sampling import ReplicateOn, SamplingRows, accept_rows, sample_with_logprobs
from v41cp.serving.step_batch import StepBatch

__all__ = ["StepBatch", "init_cache", "decode_step", "decode_and_sample", "verify_step", "verify_and_accept",
           "commit_rows", "prefill_chunk", "ced_boundary", "ced_rows"]


def _forward_rows(params: dict, cache: PagedCache, meta: StepBatch, cfg: ModelConfig, plan: DCPPlan | None,
                  encoder_only: bool = False, undo: bool = False, logits_at=None, operator=None, features: int = 0,
                  hidden: bool = False):
    """The model over cached rows: ``(logits [B,R,vocab] FP32 — ``[B,1,vocab]`` at ``logits_at`` —, cache, undo
    record or None, features, hidden)``. ``operator``: operator-local QCP settings (`PagedRows`). ``features > 0``:
    the drafter's rows of each request's last ``features`` rows (`v41cp.drafter.drafter_rows`: ``(features [B, F,
    ·], positions [B, F], valid [B, F], tokens [B, F])``), else None. ``hidden``: every row's head input ``[B, R,
    hidden]`` (else None)."""
    with jax.default_matmul_precision("highest" if cfg.dtype == "float32" else "default"):
        rows = PagedRows(cfg, meta, cache, plan, undo, operator)
        call = partial(Transformer(cfg).apply, {"params": params}, meta.tokens, meta.engram_ids, rows=rows,
                       cache=cache, encoder_only=encoder_only, logits_at=logits_at)
        mutable = (["taps"] if features else []) + (["final"] if hidden else [])
        feats = final = None
        if mutable:
            (logits, _, cache), sown = call(mutable=mutable)
            if features:
                feats = drafter_rows(cfg, rows, sown["taps"], meta.tokens, features)
            if hidden:
                final = sown["final"]["hidden"][0]
        else:
            logits, _, cache = call()
        return logits, cache, rows.undo_record() if undo else None, feats, final


@partial(jax.jit, static_argnames=("cfg", "plan"), donate_argnames=("cache",))
def decode_step(params: dict, cache: PagedCache, meta: StepBatch, cfg: ModelConfig, plan: DCPPlan | None = None):
    """One token for every active row: ``(logits [max_batch, vocab] FP32, updated cache)``.
    ``plan``: KVP/DCP layout (`v41cp.serving.attention.dcp.DCPPlan`; the cache from ``init_cache(..., plan=plan)``)."""
    logits, cache, _, _, _ = _forward_rows(params, cache, meta, cfg, plan)
    return logits[:, 0], cache


def _whole(plan: DCPPlan | None):
    """The sampler's ``whole``: vocab-sharded logits replicated over the plan's mesh before a vocabulary sort."""
    return ReplicateOn(plan.mesh) if plan is not None else None


@partial(jax.jit, static_argnames=("cfg", "plan", "logprobs"), donate_argnames=("cache", "counts"))
def decode_and_sample(params: dict, cache: PagedCache, meta: StepBatch, sampling: SamplingRows, counts: TokenCounts,
                      cfg: ModelConfig, plan: DCPPlan | None = None, logprobs: int = 0):
    """`decode_step` with each row's token sampled in the same program (`sample_rows`, parameters ``sampling``,
    penalized rows against their slots' ``counts``): ``(tokens [max_batch] int32, log-probabilities, logits
    [max_batch, vocab] FP32, cache, counts)`` — the engine fetches the tokens, and the log-probabilities
    (`TokenLogprobs` ``[max_batch]`` with the top ``logprobs``, computed when a row asks; None for ``logprobs = 0``)
    only when a request asks; the penalized rows' tokens are counted."""
    logits, cache, _, _, _ = _forward_rows(params, cache, meta, cfg, plan)
    tokens, lp, counts = sample_with_logprobs(logits[:, 0], sampling, counts, _whole(plan), logprobs)
    return tokens, lp, logits[:, 0], cache, counts


@partial(jax.jit, static_argnames=("cfg", "plan", "features"), donate_argnames=("cache",))
def verify_step(params: dict, cache: PagedCache, rows: StepBatch, cfg: ModelConfig, plan: DCPPlan | None = None,
                features: bool = False):
    """``rows.rows = k`` new rows per request continuing from the cache, in one step: ``(logits [max_batch, k,
    vocab] FP32, cache, undo)``. Row ``i`` of request ``b`` is position ``starts[b] + i``; rows past
    ``lengths[b]`` are padding (their logits are meaningless, they write nothing). Logits and cache equal
    feeding the same tokens one at a time (`decode_step`), under DCP too. ``undo`` records what the step
    overwrote: pass it to `commit_rows` to keep only a prefix of each request's rows. Needs ``k ≤`` the
    sliding window (a rejected row must not have overwritten the ring row of an accepted one). ``features``: also
    return the drafter's target features of every row (`_forward_rows`; the commit keeps those of accepted rows)."""
    if rows.rows > cfg.sliding_window:
        raise ValueError(f"verify_step: rows={rows.rows} exceeds sliding_window={cfg.sliding_window}")
    logits, cache, undo, feats, _ = _forward_rows(params, cache, rows, cfg, plan, undo=True,
                                               features=rows.rows if features else 0)
    return (logits, cache, undo, feats) if features else (logits, cache, undo)


@partial(jax.jit, static_argnames=("cfg", "plan", "features", "logprobs"), donate_argnames=("cache", "counts"))
def verify_and_accept(params: dict, cache: PagedCache, rows: StepBatch, sampling: SamplingRows, counts: TokenCounts,
                      cfg: ModelConfig, plan: DCPPlan | None = None, features: bool = False, logprobs: int = 0):
    """`verify_step` of ``rows`` (each request's anchor then its drafts) with the speculative acceptance in the same
    program (`accept_rows`, parameters ``sampling``, penalized rows against ``counts``): ``(emitted [max_batch, k]
    int32, kept [max_batch] int32 drafts, log-probabilities of the emitted tokens (`TokenLogprobs` ``[max_batch,
    k]``, as in `decode_and_sample`; None for ``logprobs = 0``), logits [max_batch, k, vocab], cache, counts (the
    emitted tokens counted), undo[, features])`` — the engine fetches ``emitted`` and ``kept`` (the
    log-probabilities when a request asks) and passes ``kept + 1`` to `commit_rows` on the device."""
    if rows.rows > cfg.sliding_window:
        raise ValueError(f"verify_step: rows={rows.rows} exceeds sliding_window={cfg.sliding_window}")
    logits, cache, undo, feats, _ = _forward_rows(params, cache, rows, cfg, plan, undo=True,
                                               features=rows.rows if features else 0)
    emitted, kept = accept_rows(logits, rows.tokens[:, 1:], rows.lengths, sampling, _whole(plan), counts)
    lp = token_logprobs(logits, emitted, sampling.logprobs.any(), logprobs, _whole(plan)) if logprobs else None
    counts = count_tokens(counts, sampling, emitted, plan.mesh if plan is not None else None)
    return (emitted, kept, lp, logits, cache, counts, undo) + ((feats,) if features else ())


@partial(jax.jit, static_argnames=("cfg", "plan"), donate_argnames=("cache",))
def commit_rows(cache: PagedCache, undo: VerifyUndo, accepted: jax.Array, cfg: ModelConfig, plan: DCPPlan | None = None):
    """Keep the first ``accepted [max_batch]`` rows of each request of a `verify_step` (clipped to its
    ``lengths``): the cache afterwards equals having fed only those tokens — the window-ring rows, the open
    ratio-2 pair (DeepSeek-V4: the compressor rings), the compressed entries and index keys of the rejected rows are
    put back as they were."""
    n_slots = pc.cache_slots(cache)
    accepted = jnp.clip(accepted, 0, undo.lengths)
    layers = sorted(undo.swa)
    r = undo.rows
    i = jnp.arange(r)[None]
    reject = (i >= accepted[:, None]) & (i < undo.lengths[:, None])                       # [B,R]
    pos = undo.starts[:, None] + i
    if layers:
        w = cfg.sliding_window
        old = jax.tree.map(lambda *a: jnp.stack(a), *(undo.swa[l] for l in layers))       # [L,B,R,·]
        at = (jnp.asarray(layers)[:, None, None], jnp.where(reject, undo.slots[:, None], n_slots)[None],
              (pos % w)[None])
        cache = cache.replace(swa=pc.put_raw(cache.swa, at, old))
    b = accepted.shape[0]
    for src, o in undo.open.items():
        # the open pair after the accepted rows: the last accepted even position's row, if it is in the step
        last = undo.starts + accepted - 1
        even = 2 * (jnp.maximum(last, 0) // 2)
        in_step = (accepted > 0) & (even >= undo.starts)
        k = jnp.clip(even - undo.starts, 0, r - 1)
        pick = lambda new, kept: jnp.where(in_step[:, None], new[jnp.arange(b), k], kept)
        at = jnp.where(undo.lengths > 0, undo.slots, n_slots)
        cache = cache.replace(
            open_kv={**cache.open_kv, src: cache.open_kv[src].at[at].set(pick(o.c, o.kv), mode="drop")},
            open_score={**cache.open_score, src: cache.open_score[src].at[at].set(pick(o.z, o.score), mode="drop")})
    for key, g in undo.rings.items():
        # each rejected row's ring row (position mod n) holds the latest kept row of the step with the same residue,
        # or what it held before the step
        width = g.c.shape[-1]
        n = cache.open_kv[key].shape[1] // width
        back = i - n * ((i - accepted[:, None] + n) // n)                                    # [B,R] that kept row
        at = (jnp.where(reject, undo.slots[:, None], n_slots), pos % n)
        rows_b = jnp.arange(b)[:, None]
        kept_value = lambda new, before: jnp.where((back >= 0)[..., None], new[rows_b, jnp.maximum(back, 0)], before)
        cache = cache.replace(**{
            name: {**getattr(cache, name), key: getattr(cache, name)[key].reshape(n_slots, n, width).at[at].set(
                kept_value(new, before), mode="drop").reshape(n_slots, -1)}
            for name, new, before in (("open_kv", g.c, g.kv), ("open_score", g.z, g.score))})
    for src, e in undo.entries.items():
        back = e.emits & reject
        for name in POOLS:
            if src not in cache.pool(name):         # DeepSeek-V4 HCA: no index keys
                continue
            pool, old = cache.pool(name)[src], getattr(e, name)
            if plan is not None and not plan.replicated_pages:
                flat = lambda a: a.reshape(-1)
                pool = pc.restore_owned(plan, pool, flat(e.blk), flat(e.row), old, flat(back))
            else:
                pool = pc.put_raw(pool, (jnp.where(back, e.blk, pc.store_rows(pool)), e.row), old)
            cache = cache.with_pool(name, src, pool)
    return cache


@partial(jax.jit, static_argnames=("cfg", "encoder_only", "plan", "features"), donate_argnames=("cache",))
def prefill_chunk(params: dict, cache: PagedCache, metas: StepBatch, cfg: ModelConfig, encoder_only: bool = False,
                  plan: DCPPlan | None = None, features: bool = False):
    """Feed a chunk of tokens through the cached path in order: ``metas`` holds one one-row `StepBatch` per
    token along a leading chunk axis (padding tokens inactive). Returns (logits of every chunk position
    ``[chunk, max_batch, vocab]``, cache). Exact by construction (token-serial over the caches), so a chunk
    may split pages and compression groups anywhere.
    ``encoder_only`` (CED narrowing): run the layers before the CED boundary and the boundary layer's
    cache-only prepass (its global KV and index keys), skipping the decoder; logits are then zeros.
    ``features``: also return every chunk position's drafter target features ``[chunk, max_batch, ·]``
    (`v41cp.drafter.target_features`)."""
    def body(c, m):
        logits, c, _, feats, _ = _forward_rows(params, c, m, cfg, plan, encoder_only,
                                            features=1 if features else 0)
        return c, (logits[:, 0], feats[0][:, 0] if features else None)

    cache, (logits, feats) = jax.lax.scan(body, cache, metas)
    return (logits, cache, feats) if features else (logits, cache)
