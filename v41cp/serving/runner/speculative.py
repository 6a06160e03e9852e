"""Speculative decoding over the cached steps — the settings (`Speculative`) and V4.1's DSpark drafter: draft,
verify, accept, commit (DeepSeek-V4's MTP drafter: `v41cp.serving.runner.mtp_draft`; the same verification,
acceptance and commit).

One engine step of a request at anchor position ``p`` (the last output token, not yet fed):

1. **draft** (`draft_step`): the drafter (`v41cp.drafter.Drafter`, replicated) proposes ``n`` tokens from the block
   ``[anchor, noise × (N − 1)]`` at ``p … p + N − 1`` and its context window — each stage's keys of the target
   features at ``[p − W, p)``, kept in the draft cache (`v41cp.serving.cache.device_cache.DraftCache`: a ring of
   ``W`` rows per batch slot and stage, by position mod ``W``); the Markov head makes it sequential: draft ``i`` is
   the argmax of the block's logits at slot ``i`` plus the Markov logits of draft ``i − 1`` (of the anchor for
   ``i = 0``);
2. **verify**: the anchor and its drafts as ``n + 1`` rows of one static-width `verify_step` of the target (under
   KVP / DCP each row gets its distributed top-k and LSE merge), which also returns every row's target features;
3. **accept** (`v41cp.serving.runner.sampling.accept_rows`, inside the verification program
   `v41cp.serving.runner.steps.verify_and_accept`): greedy — the longest prefix of drafts equal to the target's
   argmax, then the target's token after it; sampling — standard rejection sampling against the target's sampling
   distribution with the drafts as a point-mass proposal: draft ``d`` is kept with probability ``p(d)``, else a
   token is drawn from ``p`` without ``d`` (renormalised), and after ``m`` kept drafts the bonus token is drawn
   from the target at row ``m``. Every emitted token is then distributed exactly as the target's own sampling
   (lossless); draws use per-request keys (seed, output index, stream), identical on every process;
4. **commit**: `commit_rows` keeps the anchor and the ``m`` accepted rows (window ring, open pair — DeepSeek-V4:
   every compressor ring —, compressed entries, index keys of the rejected rows put back) and `write_draft_context`
   (MTP: `write_mtp_context`) writes the draft cache from the features of the kept rows only.

Static shapes: the draft step compiles once per batch bucket, the verification once per (bucket, ``n + 1``); the
accepted counts are data. ``Speculative.proposer`` replaces the drafter by a host function (proposals injected
by tests, or another drafter).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp

from v41cp.config import ModelConfig
from v41cp.drafter import Drafter, draft_logits
from v41cp.serving.cache.device_cache import DraftCache

__all__ = ["Speculative", "draft_step", "write_draft_context", "check_speculative", "speculative_algorithm",
           "resolved"]


@dataclass(frozen=True)
class Speculative:
    """Speculative decoding settings of an `v41cp.serving.engine.Engine`: the drafter's parameters ``params`` and
    its ``algorithm`` — ``"dspark"`` (V4.1's DSpark stages, `v41cp.drafter`: ``num_draft_tokens`` 1 … the block
    size, default the block size) or ``"mtp"`` (DeepSeek-V4's MTP layer, `v41cp.mtp`: 1 … ``sliding_window − 1``
    chained rows, default 1, the layer as trained); None: the model's own. ``proposer(rid, history, n) → n token
    ids``: proposals from the host instead of the drafter (1 … ``sliding_window − 1``; with ``params`` too, the
    drafter's context is still written)."""

    params: Any = None
    num_draft_tokens: int | None = None
    algorithm: str | None = None
    proposer: Callable[[Any, list, int], list] | None = None


def speculative_algorithm(cfg: ModelConfig, spec: Speculative) -> str:
    """The drafter ``spec`` runs: its ``algorithm``, or the model's own (``"mtp"`` for DeepSeek-V4, else
    ``"dspark"``)."""
    return spec.algorithm or ("mtp" if cfg.is_v4 else "dspark")


def resolved(cfg: ModelConfig, spec: Speculative) -> Speculative:
    """``spec`` checked (`check_speculative`) with its algorithm and draft count resolved for ``cfg``."""
    algorithm = speculative_algorithm(cfg, spec)
    n = spec.num_draft_tokens
    if n is None:
        n = 1 if algorithm == "mtp" else cfg.dspark_block_size
    spec = dataclasses.replace(spec, algorithm=algorithm, num_draft_tokens=n)
    check_speculative(cfg, spec)
    return spec


def check_speculative(cfg: ModelConfig, spec: Speculative) -> None:
    """Raise ValueError naming the offending setting of ``spec`` for ``cfg`` (its weights are not looked at)."""
    algorithm = speculative_algorithm(cfg, spec)
    if algorithm not in ("dspark", "mtp"):
        raise ValueError(f"speculative algorithm {algorithm!r} is not supported (choose 'dspark' or 'mtp')")
    own = "mtp" if cfg.is_v4 else "dspark"
    if algorithm != own:
        raise ValueError(f"speculative algorithm {algorithm!r} does not fit model_type={cfg.model_type!r}: its "
                         f"drafter is {own!r}")
    n = spec.num_draft_tokens
    has = cfg.has_mtp if algorithm == "mtp" else cfg.has_dspark
    if (spec.params is not None or spec.proposer is None) and not has:         # the drafter runs: it must exist
        what = "the MTP layer" if algorithm == "mtp" else "DSpark stages"
        raise ValueError(f"speculative algorithm {algorithm!r} needs {what}, but the checkpoint's config has "
                         f"num_nextn_predict_layers={cfg.num_nextn_predict_layers}, dspark_target_layer_ids="
                         f"{list(cfg.dspark_target_layer_ids)}")
    if (spec.proposer is not None and spec.params is None) or algorithm == "mtp":
        # proposals from the host (no drafter to check), or the MTP layer chained n times
        if type(n) is not int or not 1 <= n < cfg.sliding_window:
            raise ValueError(f"speculative num_draft_tokens must be an integer in [1, sliding_window - 1="
                             f"{cfg.sliding_window - 1}], got {n!r}")
        return
    if type(n) is not int or not 1 <= n <= cfg.dspark_block_size:
        raise ValueError(f"speculative num_draft_tokens must be an integer in [1, dspark_block_size="
                         f"{cfg.dspark_block_size}], got {n!r}")
    if n + 1 > cfg.sliding_window:
        raise ValueError(f"speculative num_draft_tokens={n}: n + 1 verification rows exceed sliding_window="
                         f"{cfg.sliding_window}")


def _call(params, cfg, method, *args):
    # the drafter is loaded dequantized (`v41cp.checkpoint.open_drafter`) whatever the target keeps
    return Drafter(cfg.replace(keep_quantized=False) if cfg.keep_quantized else cfg).apply(
        {"params": params}, *args, method=method)


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("dcache",))
def write_draft_context(params: dict, cfg: ModelConfig, dcache: DraftCache, slots: jax.Array, features: jax.Array,
                        positions: jax.Array, keep: jax.Array) -> DraftCache:
    """Write the context keys of target features ``features [B, F, n·H]`` at ``positions [B, F]`` (``keep [B,
    F]``: the rows to write; at most ``W`` consecutive positions per request) into batch slots ``slots [B]``."""
    main_x = _call(params, cfg, Drafter.main_x, features)
    keys = _call(params, cfg, Drafter.context_keys, main_x, jnp.maximum(positions, 0))       # [K, B, F, D]
    n_slots = dcache.keys.shape[1]
    at = jnp.where(keep, slots[:, None], n_slots)                                            # dropped when not kept
    ring = jnp.maximum(positions, 0) % cfg.sliding_window
    return dcache.replace(keys=dcache.keys.at[:, at, ring].set(keys.astype(dcache.keys.dtype), mode="drop"))


@partial(jax.jit, static_argnames=("cfg", "n"))
def draft_step(params: dict, embed: jax.Array, head: jax.Array, cfg: ModelConfig, dcache: DraftCache, slots: jax.Array,
               anchors: jax.Array, positions: jax.Array, n: int):
    """``n`` greedy drafts ``[B, n]`` int32 for anchors ``anchors [B]`` at ``positions [B]`` (batch slots
    ``slots [B]``), and their confidence logits ``[B, n]`` FP32 (see the module docstring; ``embed`` / ``head``:
    the target's)."""
    w, size = cfg.sliding_window, cfg.dspark_block_size
    b = anchors.shape[0]
    ctx_keys = dcache.keys[:, slots]                                                      # [K, B, W, D]
    held = positions[:, None] - w + (jnp.arange(w)[None] - positions[:, None]) % w           # ring row → position
    block_ids = jnp.full((b, size), cfg.dspark_noise_token_id, jnp.int32).at[:, 0].set(anchors)
    block_pos = positions[:, None] + jnp.arange(size, dtype=jnp.int32)[None]
    h, normed = _call(params, cfg, Drafter.block, jnp.take(embed, block_ids, axis=0), block_pos, ctx_keys, held >= 0)
    base = draft_logits(head, normed[:, :n], jnp.zeros((), jnp.float32))                     # [B, n, vocab]
    prev, drafts, confidence = anchors, [], []
    for i in range(n):                                        # the Markov head: each draft conditions the next
        markov, emb = _call(params, cfg, Drafter.markov, prev)
        prev = jnp.argmax(base[:, i] + markov, axis=-1).astype(jnp.int32)
        drafts.append(prev)
        confidence.append(_call(params, cfg, Drafter.confidence, h[:, i], normed[:, i], emb))
    return jnp.stack(drafts, axis=1), jnp.stack(confidence, axis=1)
