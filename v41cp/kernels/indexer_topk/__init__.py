"""Indexer scan + top-k over paged index keys (the DeepGEMM paged-MQA-logits + top-k contract,
exact under the shared tie rule (score desc, logical id asc).

Inputs shared by every op: ``q [R, Hi, Di]`` index queries, ``w [R, Hi]`` their head weights; ``store`` the
index-key pool as rows ``[N, Di]`` (values or MXFP4 records ``{"q", "s"}``); per row a **page list** ``pages
[R, P]`` (physical page, −1 = none) with its logical page numbers ``page_ids [R, P]`` in ascending order
(a request's block table with ``arange``; under KVP a rank's owned pages); ``epb`` entries per page;
``visible [R]`` (ids ``≥ visible`` are masked); optional ``block_mask [R, NB]`` (Reindex inside the
candidate blocks of ``cbs`` entries).

* `indexer_topk` → ``(ids [R, k], scores [R, k])`` — ``lax.top_k`` order, −1 / −inf padding. The Pallas
  path never writes the full logits row: pass 1 keeps the maximum of each group of ``group`` entries, the
  top ``k`` groups (ascending) are rescored (pass 2, ``k·group`` entries) and a ``lax.top_k`` over them gives
  the result. Exact: an entry outside the top-``k`` groups is dominated by the ``k`` group maxima (ties:
  lower groups first, i.e. lower logical ids), so it cannot be in the top ``k``.
* `index_block_maxima` → ``(maxima [R, P·epb/cbs], block ids [R, P·epb/cbs])`` — the candidate source's
  per-block maxima (partial over the listed pages), written directly by the kernel.

Backends ``"xla"`` (`index_scan_reference` + ``lax.top_k``) and ``"pallas"`` (`index_scan_pallas`; interpret
mode off the GPU) give identical ids.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from v41cp.kernels import check_backend, cost_scope, default_splits, nbytes, on_platform, pow2_at_least, row_bytes
from v41cp.kernels.dequant import record_refs, split_channels
from v41cp.kernels.indexer_topk.pallas_triton import index_scan_pallas
from v41cp.kernels.indexer_topk.reference import index_scan_reference

__all__ = ["indexer_topk", "index_block_maxima", "index_scan_reference", "index_scan_pallas", "key_format",
           "dense_pages", "prepare_queries"]

MIN_HEADS = 16          # tensor-core dot minimum; extra (padding) heads get zero weights


def key_format(store, channels: int) -> str | None:
    """None for an ``[N, Di]`` value store, ``"mxfp4"`` for records."""
    if not isinstance(store, dict):
        return None
    if store["q"].shape[-1] != channels // 2 or store["s"].shape[-1] != channels // 32:
        raise ValueError(f"index-key records must be MXFP4 ({channels // 2} + {channels // 32} bytes), got "
                         f"{store['q'].shape[-1]} + {store['s'].shape[-1]}")
    return "mxfp4"


def dense_pages(keys: jax.Array, page: int):
    """Per-request dense keys ``[B, G, Di]`` → (rows ``[B·Gp, Di]``, pages ``[B, Gp/page]``, page_ids) with
    ``Gp`` = ``G`` rounded up to ``page`` (the full-sequence path expressed as a paged store)."""
    b, g, di = keys.shape
    gp = -(-g // page) * page
    keys = jnp.pad(keys, ((0, 0), (0, gp - g), (0, 0)))
    n = gp // page
    pages = jnp.arange(b * n, dtype=jnp.int32).reshape(b, n)
    return keys.reshape(b * gp, di), pages, jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))


def prepare_queries(q, w):
    """Split channels and pad heads to the tensor-core minimum (zero weights) → (q_e, q_o, w)."""
    r, hi, _ = q.shape
    hp = pow2_at_least(hi, MIN_HEADS)                        # Triton blocks: a power of two, ≥ 16
    pad = ((0, 0), (0, hp - hi))
    q_e, q_o = (jnp.pad(x, pad + ((0, 0),)) for x in split_channels(q))
    return q_e, q_o, jnp.pad(w.astype(jnp.float32), pad)


def _pad_pages(pages, page_ids, epb: int, tile: int):
    per = math.lcm(epb, tile) // epb                # the listed entries fill whole tiles
    extra = -pages.shape[1] % per
    if extra:
        pages = jnp.pad(pages, ((0, 0), (0, extra)), constant_values=-1)
        page_ids = jnp.pad(page_ids, ((0, 0), (0, extra)), constant_values=0)
    return pages, page_ids


def _check_layout(group: int, tile: int):
    if tile % group or tile % 16:
        raise ValueError(f"tile={tile} must be a multiple of 16 and of group={group}")


def _scan(q, w, store, pages, page_ids, visible, block_mask, groups, *, epb, group, tile, cbs, mode, interpret,
          splits, num_warps, num_stages):
    fmt = key_format(store, q.shape[-1])
    q_e, q_o, wp = prepare_queries(q, w)
    mask = None if block_mask is None else block_mask.astype(jnp.int32)
    n_groups = groups.shape[1] if groups is not None else pages.shape[1] * epb // group
    splits = splits or default_splits(q.shape[0], n_groups * group // tile)
    call = lambda q_e, q_o, wp, refs, visible, pages, page_ids, groups, mask, interpret: index_scan_pallas(
        q_e, q_o, wp, refs, fmt, visible, pages, page_ids, groups, mask, epb=epb, group=group, tile=tile, cbs=cbs,
        mode=mode, splits=splits, num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    # per call (grid: rows × splits): each program loads its row's queries, weights, page lists and groups, and its
    # split of every listed key's record (all listed keys valid: an upper bound); the scores or group maxima
    # written; one product per key and index head
    refs = record_refs(store, fmt)
    keys = q.shape[0] * n_groups * group
    programs = max(1, min(splits, n_groups * group // tile))      # the kernel's own clamp: splits ≤ key chunks
    read = programs * nbytes(q_e, q_o, wp, pages, page_ids, groups, mask) + keys * row_bytes(refs)
    written = keys * 8 if mode == "scores" else keys // group * 4
    with cost_scope(read, written, 2 * keys * q_e.shape[1] * 2 * q_e.shape[2], q_e.dtype):
        return on_platform(call, q_e, q_o, wp, refs, visible.astype(jnp.int32), pages, page_ids, groups, mask,
                           interpret=interpret)


def indexer_topk(q, w, store, pages, page_ids, visible, k: int, *, epb: int, block_mask=None, cbs: int = 1,
                 backend: str = "xla", group: int = 16, tile: int = 64, splits: int | None = None, num_warps: int = 4,
                 num_stages: int = 2, interpret: bool | None = None):
    """Exact top-``k`` logical ids of every row (see the module docstring) → ``(ids [R, k], scores [R, k])``.
    Kernel parameters (``"pallas"``): ``group`` entries per group maximum, ``tile`` entries per loop step,
    ``splits`` programs per row (default `v41cp.kernels.default_splits`), ``num_warps``, ``num_stages``."""
    check_backend(backend, "indexer_backend")
    pages, page_ids = pages.astype(jnp.int32), page_ids.astype(jnp.int32)
    if backend == "xla":
        scores, ids = index_scan_reference(q, w, store, key_format(store, q.shape[-1]), pages, page_ids, visible,
                                           block_mask, epb, cbs)
    else:
        _check_layout(group, tile)
        pages, page_ids = _pad_pages(pages, page_ids, epb, tile)
        common = dict(epb=epb, group=group, tile=tile, cbs=cbs, interpret=interpret, splits=splits,
                      num_warps=num_warps, num_stages=num_stages)
        maxima = _scan(q, w, store, pages, page_ids, visible, block_mask, None, mode="max", **common)
        kt = min(k, maxima.shape[1])
        _, top_groups = jax.lax.top_k(maxima, kt)
        top_groups = jnp.sort(top_groups, axis=1).astype(jnp.int32)      # ascending = logical order
        extra = -kt % (tile // group)
        if extra:
            top_groups = jnp.pad(top_groups, ((0, 0), (0, extra)), constant_values=-1)
        scores, ids = _scan(q, w, store, pages, page_ids, visible, block_mask, top_groups, mode="scores", **common)
    kk = min(k, scores.shape[1])
    vals, pos = jax.lax.top_k(scores, kk)
    out = jnp.where(vals > -jnp.inf, jnp.take_along_axis(ids, pos, axis=1), -1).astype(jnp.int32)
    if kk < k:
        out = jnp.pad(out, ((0, 0), (0, k - kk)), constant_values=-1)
        vals = jnp.pad(vals, ((0, 0), (0, k - kk)), constant_values=-jnp.inf)
    return out, vals


def index_block_maxima(q, w, store, pages, page_ids, visible, *, epb: int, cbs: int, backend: str = "xla",
                       tile: int = 64, splits: int | None = None, num_warps: int = 4, num_stages: int = 2,
                       interpret: bool | None = None):
    """Per candidate block maxima of the listed entries → ``(maxima [R, P·epb/cbs], logical block ids)``
    (−inf / −1 where a block has no scored entry). ``cbs`` must divide ``epb``."""
    check_backend(backend, "indexer_backend")
    if epb % cbs:
        raise ValueError(f"candidate_block_size={cbs} must divide the entries per page ({epb})")
    pages, page_ids = pages.astype(jnp.int32), page_ids.astype(jnp.int32)
    n_blocks = pages.shape[1] * epb // cbs
    if backend == "xla":
        scores, _ = index_scan_reference(q, w, store, key_format(store, q.shape[-1]), pages, page_ids, visible,
                                         None, epb, cbs)
        maxima = jnp.max(scores.reshape(scores.shape[0], n_blocks, cbs), axis=-1)
    else:
        tile = max(tile, cbs)
        _check_layout(cbs, tile)
        pp, pids = _pad_pages(pages, page_ids, epb, tile)
        maxima = _scan(q, w, store, pp, pids, visible, None, None, epb=epb, group=cbs, tile=tile, cbs=cbs,
                       mode="max", interpret=interpret, splits=splits, num_warps=num_warps,
                       num_stages=num_stages)[:, :n_blocks]
    b = jnp.arange(n_blocks) * cbs                                        # local first entry of each block
    pid = jnp.take_along_axis(page_ids, jnp.broadcast_to(b // epb, (pages.shape[0], n_blocks)), axis=1)
    blk = (pid * epb + b % epb) // cbs
    has = maxima > -jnp.inf
    return maxima, jnp.where(has, blk, -1).astype(jnp.int32)
