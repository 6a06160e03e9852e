"""Reference (pure jnp) of the indexer scan: the definition the Pallas kernel reproduces bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v41cp.kernels.dequant import load_rows_split, record_refs, split_channels
from v41cp.quant import round_through

__all__ = ["entry_layout", "index_scores", "score_terms", "score_total", "score_rows", "index_scan_reference"]


def index_scores(q: jax.Array, weights: jax.Array, keys: jax.Array) -> jax.Array:
    """Unmasked scores ``[B,S,G]`` = Σ_heads ReLU(q · k) · weight (FP32), for queries ``[B,S,index_heads,Di]``,
    weights ``[B,S,index_heads]`` and keys ``[B,G,Di]``. The one selection numerics of every path.

    Both sums run as sequential loops of elementwise FP32 operations, so an entry's score depends only on its
    own key and the query — bit-identical whatever the number of entries or rows scored at once or their
    layout (the full sequence, a cached step, a rank's owned pages in the distributed top-k): every path
    selects exactly the same entries, ties and near-ties included. Exact zeros are returned as +0 (a
    ReLU-zero times a negative weight would be −0, which `lax.top_k` ranks below +0 and a max may or may not
    keep).

    Queries in a reduced dtype (BF16, the released model) round where the reference stores that dtype
    (`score_terms`): the per-head dot, the weighted ReLU and the head sum; FP32 queries round nowhere."""
    qf = jnp.moveaxis(q.astype(jnp.float32), -1, 0)                                  # [E,B,S,H]
    kf = jnp.moveaxis(keys.astype(jnp.float32), -1, 0)                               # [E,B,G]
    term = lambda qe, ke: qe[..., None] * ke[:, None, None, :]                      # [B,S,H,G]
    # the carries start from the first term (not from zeros) so that they keep the operands' sharding type
    raw, _ = jax.lax.scan(lambda acc, qk: (acc + term(*qk), None), term(qf[0], kf[0]), (qf[1:], kf[1:]))
    contrib = jnp.moveaxis(score_terms(raw, weights[..., None], q.dtype), 2, 0)      # [H,B,S,G]
    scores, _ = jax.lax.scan(lambda acc, c: (acc + c, None), contrib[0], contrib[1:])
    return score_total(scores, q.dtype)


def score_terms(raw: jax.Array, weights: jax.Array, dtype) -> jax.Array:
    """Per-head terms ``ReLU(raw) · weight`` in FP32 from FP32 dots ``raw``, rounded where the reference stores
    ``dtype`` (NeMo's V4.1 indexer, eager and TileLang alike: the dot → ``dtype``, ReLU, × the ``dtype`` weight →
    ``dtype``; `v41cp.quant.round_through`, the identity for FP32). ``weights`` broadcasts against ``raw``."""
    w = weights.astype(jnp.float32)
    return round_through(jax.nn.relu(round_through(raw, dtype)) * w, dtype)


def score_total(total: jax.Array, dtype) -> jax.Array:
    """The head sum (FP32) → the score: rounded to ``dtype`` as the reference stores it, exact zeros as +0."""
    total = round_through(total, dtype)
    return jnp.where(total == 0, 0.0, total)


def entry_layout(pages, page_ids, visible, block_mask, epb: int, cbs: int, entries: jax.Array):
    """Where local entries ``entries [R, T]`` of each row live → (physical rows, logical ids with −1, ok mask).

    Local entry ``e`` of a row is offset ``e % epb`` of the row's ``e // epb``-th listed page; its logical id is
    ``page_ids[e // epb] · epb + e % epb``. It is scored when its page exists (``pages ≥ 0``), the id is
    visible (``< visible``) and, with a ``block_mask [R, NB]``, its candidate block ``id // cbs`` is kept."""
    p = entries // epb
    off = entries % epb
    pc = jnp.clip(p, 0, pages.shape[1] - 1)
    page = jnp.where((entries >= 0) & (p < pages.shape[1]), jnp.take_along_axis(pages, pc, axis=1), -1)
    lid = jnp.take_along_axis(page_ids, pc, axis=1) * epb + off
    ok = (page >= 0) & (lid < visible[:, None])
    if block_mask is not None:
        blk = jnp.clip(lid // cbs, 0, block_mask.shape[1] - 1)
        ok &= jnp.take_along_axis(block_mask, blk, axis=1) != 0
    return jnp.where(ok, page * epb + off, 0), jnp.where(ok, lid, -1), ok


def score_rows(q_e, q_o, w, k_e, k_o, ok, precision):
    """Scores ``[T]`` of keys (split channels ``[T, Di/2]``) for one query (``q_e / q_o [Hi, Di/2]``, weights
    ``w [Hi]``): ``Σ_h ReLU(q_h · k) · w_h`` in FP32 (exact zeros as +0), −inf where not ``ok``. BF16 queries
    round where the reference does (`score_terms` / `score_total`)."""
    raw = (jnp.dot(q_e, k_e.T, precision=precision, preferred_element_type=jnp.float32)
           + jnp.dot(q_o, k_o.T, precision=precision, preferred_element_type=jnp.float32))
    s = jnp.sum(score_terms(raw, w[:, None], q_e.dtype), axis=0)
    return jnp.where(ok, score_total(s, q_e.dtype), -jnp.inf)


def index_scan_reference(q, w, store, fmt, pages, page_ids, visible, block_mask, epb: int, cbs: int):
    """Scores of every listed entry: ``(scores [R, P·epb] FP32, logical ids [R, P·epb] int32)``, −inf / −1 for
    entries not scored. ``q [R, Hi, Di]``, ``w [R, Hi]``; ``store`` an ``[N, Di]`` array or MXFP4 records
    ``{"q", "s"}`` (``fmt``); ``pages / page_ids [R, P]``; ``visible [R]``."""
    r, hi, di = q.shape
    e = jnp.broadcast_to(jnp.arange(pages.shape[1] * epb), (r, pages.shape[1] * epb))
    rows, ids, ok = entry_layout(pages, page_ids, visible, block_mask, epb, cbs, e)
    refs = record_refs(store, fmt)
    dot_dtype = jnp.float32 if q.dtype == jnp.float32 else jnp.bfloat16
    prec = jax.lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None
    q_e, q_o = (x.astype(dot_dtype) for x in split_channels(q))

    def one(q_e, q_o, w, rows, ok):
        k_e, k_o = load_rows_split(refs, fmt, rows, di)
        return score_rows(q_e, q_o, w.astype(jnp.float32), k_e.astype(dot_dtype), k_o.astype(dot_dtype), ok, prec)

    return jax.vmap(one)(q_e, q_o, w, rows, ok), ids
