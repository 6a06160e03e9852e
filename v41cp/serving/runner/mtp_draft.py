"""DeepSeek-V4 MTP speculative decoding over the cached steps: the draft step and the context write (`v41cp.mtp`).

The draft cache (`v41cp.serving.cache.device_cache.DraftCache`, replicated) holds per batch slot the MTP layer's
window keys by position mod ``W`` (``keys[0]``), the target's output streams at the last fed position (``last``)
and the position after it (``fed``). The key of position ``t`` needs the token at ``t + 1``, so at any time the
ring holds the keys of positions ``≤ fed − 2`` and ``last`` the streams at ``fed − 1``, whose token after it is
the anchor — not fed, not final until verified:

* **context write** (`write_mtp_context`, after a prefill pass or a verification's commit, from the kept rows'
  target streams and their tokens): the key of ``fed − 1`` from ``last`` and the first new row's token, the keys
  of the new rows but the last from each row's streams and the next row's token, then ``last`` / ``fed`` from the
  last new row;
* **draft** (`mtp_draft_step`): row 0 at ``q − 1`` (``q`` the anchor's position ``= fed``) from ``last`` and the
  anchor, row ``i`` at ``q − 1 + i`` from row ``i − 1``'s output streams and draft ``i``; each row attends the
  ring's keys in its window and the step's earlier rows, causally; drafts are greedy (the acceptance rule is
  lossless whatever the proposal, `v41cp.serving.runner.sampling.accept_rows`). Nothing is written: a rejected
  draft leaves no trace, and the verification's commit (`commit_rows`, which puts back the target's rings and
  entries) is followed by the context write of the kept rows only.

Static shapes: one draft program per (batch bucket, ``n``), one context write per (bucket, rows).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from v41cp.config import ModelConfig
from v41cp.mtp import MTP, call_mtp, mtp_logits
from v41cp.serving.cache.device_cache import DraftCache

__all__ = ["mtp_draft_step", "write_mtp_context"]


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("dcache",))
def write_mtp_context(params: dict, embed: jax.Array, cfg: ModelConfig, dcache: DraftCache, slots: jax.Array,
                      features: jax.Array, positions: jax.Array, keep: jax.Array, tokens: jax.Array) -> DraftCache:
    """Write the context of new fed rows: ``features [B, F, hc·H]`` (the target's output streams) of the rows at
    ``positions [B, F]`` with their own tokens ``tokens [B, F]``; ``keep [B, F]`` must mark one run of
    consecutive positions per request (at most ``W``; a request with none is left as it is: every caller's rows are
    `drafter_rows` masked by a prefix), in batch slots ``slots [B]`` (see the module docstring)."""
    w = cfg.sliding_window
    b, f = keep.shape
    n_slots = dcache.keys.shape[1]
    fed, last = dcache.fed[slots, 0], dcache.last[slots]                                       # [B], [B, hc·H]
    nxt = jnp.concatenate([keep[:, 1:], jnp.zeros((b, 1), bool)], axis=1)                    # the row after is kept
    first = jnp.argmax(keep, axis=1)                                                          # [B] first kept row
    start = positions[jnp.arange(b), first]
    # the rows whose next token is known: every kept row but the last, and the previous last row (fed − 1)
    prev = keep.any(axis=1) & (fed == start) & (start >= 1)
    feats = jnp.concatenate([last[:, None].astype(features.dtype), features], axis=1)         # [B, 1 + F, ·]
    pos = jnp.concatenate([(start - 1)[:, None], positions], axis=1)
    ok = jnp.concatenate([prev[:, None], keep & nxt], axis=1)
    after = jnp.concatenate([tokens[jnp.arange(b), first][:, None], tokens[:, 1:], tokens[:, -1:]], axis=1)
    x = call_mtp(params, cfg, MTP.inputs, jnp.take(embed, after, axis=0), feats)
    keys = call_mtp(params, cfg, MTP.keys, x, jnp.maximum(pos, 0))                           # [B, 1 + F, D]
    at = jnp.where(ok, slots[:, None], n_slots)                                               # dropped when not
    ring = dcache.keys.at[0, at, jnp.maximum(pos, 0) % w].set(keys.astype(dcache.keys.dtype), mode="drop")
    # the last kept row: the next draft's first
    end = f - 1 - jnp.argmax(keep[:, ::-1], axis=1)
    any_kept = keep.any(axis=1)
    to = jnp.where(any_kept, slots, n_slots)
    new_last = features[jnp.arange(b), end].astype(dcache.last.dtype)
    return dcache.replace(keys=ring, last=dcache.last.at[to].set(new_last, mode="drop"),
                          fed=dcache.fed.at[to, 0].set(positions[jnp.arange(b), end] + 1, mode="drop"))


@partial(jax.jit, static_argnames=("cfg", "n", "with_logits"))
def mtp_draft_step(params: dict, embed: jax.Array, head: jax.Array, cfg: ModelConfig, dcache: DraftCache,
                   slots: jax.Array, anchors: jax.Array, positions: jax.Array, n: int, with_logits: bool = False):
    """``n`` greedy drafts ``[B, n]`` int32 for anchors ``anchors [B]`` at ``positions [B]`` (each slot's ``fed``;
    batch slots ``slots [B]``); ``with_logits``: also every row's logits ``[B, n, vocab]`` FP32 (row 0: the MTP
    layer at the anchor's previous position, as the full-sequence `v41cp.mtp.mtp_reference` computes it)."""
    w = cfg.sliding_window
    ring = dcache.keys[0, slots]                                                              # [B, W, D]
    held = (positions - 2)[:, None] - ((positions - 2)[:, None] - jnp.arange(w)[None]) % w   # ring row → position
    streams = dcache.last[slots][:, None]                                                     # [B, 1, hc·H]
    tok, step_keys, drafts, all_logits = anchors, [], [], []
    for i in range(n):
        p = (positions - 1 + i)[:, None]                                                      # [B, 1]
        x = call_mtp(params, cfg, MTP.inputs, jnp.take(embed, tok, axis=0)[:, None], streams)  # [B, 1, hc, H]
        ring_ok = (held >= 0) & (held > p - w)                                                # [B, W]
        ctx = jnp.concatenate([ring, *step_keys], axis=1) if step_keys else ring
        valid = jnp.concatenate([ring_ok, jnp.ones((ring.shape[0], i), bool)], axis=1)[:, None]
        out = call_mtp(params, cfg, MTP.rows, x, p, ctx, valid)                               # [B, 1, hc, H]
        logits = mtp_logits(head, call_mtp(params, cfg, MTP.head_input, out))[:, 0]           # [B, vocab]
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        drafts.append(tok)
        all_logits.append(logits)
        if i + 1 < n:
            step_keys.append(call_mtp(params, cfg, MTP.keys, x, p).astype(ring.dtype))
            streams = out.reshape(*out.shape[:2], -1)
    drafts = jnp.stack(drafts, axis=1)
    return (drafts, jnp.stack(all_logits, axis=1)) if with_logits else drafts
