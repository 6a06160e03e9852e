"""Reference (pure jnp) of the indexer scan: the definition the Pallas kernel reproduces bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v41cp.kernels.dequant import load_rows_split, split_channels
from v41cp.layers.indexer import score_terms, score_total

__all__ = ["entry_layout", "score_rows", "index_scan_reference"]


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
    round where the reference does (`v41cp.layers.indexer.score_terms` / `score_total`)."""
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
    refs = (store,) if fmt is None else (store["q"], store["s"])
    dot_dtype = jnp.float32 if q.dtype == jnp.float32 else jnp.bfloat16
    prec = jax.lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None
    q_e, q_o = (x.astype(dot_dtype) for x in split_channels(q))

    def one(q_e, q_o, w, rows, ok):
        k_e, k_o = load_rows_split(refs, fmt, rows, di)
        return score_rows(q_e, q_o, w.astype(jnp.float32), k_e.astype(dot_dtype), k_o.astype(dot_dtype), ok, prec)

    return jax.vmap(one)(q_e, q_o, w, rows, ok), ids
