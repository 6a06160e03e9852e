"""Indexer scan as a Pallas kernel (Triton backend): ReLU-weighted multi-head scores of paged index keys,
reduced in-kernel to group maxima (``mode="max"``) or written for a short list of groups (``"scores"``).

Grid ``(R, splits)``: a program owns one row's queries — **all** its index heads, loaded once — and one
contiguous part of the row's tiles (``tile`` entries = ``tile / group`` consecutive groups of its local entry
list: all of them in ``"max"`` mode, the listed ones in ``"scores"`` mode), which it walks in a loop. Per
tile it resolves each entry's page through the row's page list, loads the keys' records as contiguous rows,
decodes them in registers in the dot's dtype (`v41cp.kernels.dequant`), and computes ``Σ_h ReLU(q_h · k)
w_h`` with two tensor-core dots (split channels). ``"max"`` mode writes only ``tile / group`` maxima per tile,
so the full logits row never reaches HBM. ``splits`` sets the programs per row: few rows (small batches) get
many splits, so the scan still fills the GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from v41cp.kernels import match_varying, out_struct
from v41cp.kernels.dequant import load_rows_split
from v41cp.kernels.indexer_topk.reference import score_rows

__all__ = ["index_scan_pallas"]


def _kernel(*refs, fmt, n_store, epb, group, tile, cbs, mode, chunks, per_split, has_groups, has_mask, dot_dtype,
            precision):
    it = iter(refs)
    q_e_ref, q_o_ref, w_ref, vis_ref, pages_ref, pids_ref = (next(it) for _ in range(6))
    store = tuple(next(it) for _ in range(n_store))
    groups_ref = next(it) if has_groups else None
    mask_ref = next(it) if has_mask else None
    out_refs = tuple(it)
    r, s = pl.program_id(0), pl.program_id(1)
    tpg = tile // group
    q_e = q_e_ref[...].astype(dot_dtype)                                   # [Hp, Di/2], every head of the row
    q_o = q_o_ref[...].astype(dot_dtype)
    w = w_ref[...].astype(jnp.float32)
    visible = vis_ref[r]
    n_pages = pages_ref.shape[0]
    j = jnp.arange(tile)
    first = s * per_split

    def one_tile(u, carry):
        c = first + u
        slot = c * tpg + j // group
        gl = groups_ref[slot] if has_groups else slot
        e = gl * group + j % group
        p = jnp.clip(e // epb, 0, n_pages - 1)
        off = e % epb
        page = pages_ref[p]
        lid = pids_ref[p] * epb + off
        ok = (gl >= 0) & (e // epb < n_pages) & (page >= 0) & (lid < visible)
        if has_mask:
            ok &= mask_ref[jnp.clip(lid // cbs, 0, mask_ref.shape[0] - 1)] != 0
        k_e, k_o = load_rows_split(store, fmt, jnp.where(ok, page * epb + off, 0), 2 * q_e.shape[-1], dot_dtype)
        sc = score_rows(q_e, q_o, w, k_e, k_o, ok, precision)
        if mode == "max":
            (o_ref,) = out_refs
            o_ref[pl.ds(u * tpg, tpg)] = jnp.max(sc.reshape(tpg, group), axis=1)
        else:
            s_ref, id_ref = out_refs
            s_ref[pl.ds(u * tile, tile)] = sc
            id_ref[pl.ds(u * tile, tile)] = jnp.where(ok, lid, -1)
        return carry

    jax.lax.fori_loop(0, jnp.clip(chunks - first, 0, per_split), one_tile, 0)


@functools.partial(jax.jit, static_argnames=("fmt", "epb", "group", "tile", "cbs", "mode", "splits", "num_warps",
                                             "num_stages", "interpret"))
def index_scan_pallas(q_e, q_o, w, store, fmt, visible, pages, page_ids, groups, block_mask, *, epb: int,
                      group: int, tile: int, cbs: int, mode: str, splits: int = 1, num_warps: int = 4,
                      num_stages: int = 2, interpret: bool = False):
    """The kernel call on prepared operands (see `v41cp.kernels.indexer_topk`).

    q_e / q_o ``[R, Hp, Di/2]`` (heads padded to ≥ 16 with zero weights), w ``[R, Hp]``; store: refs tuple;
    visible ``[R]``; pages / page_ids ``[R, P]``; groups ``[R, KG]`` local group ids (``"scores"`` mode, a
    multiple of ``tile / group``) or None (every group; ``P·epb`` a multiple of ``tile``); block_mask
    ``[R, NB]`` int32 or None; ``splits`` programs per row, each owning ``⌈tiles / splits⌉`` consecutive tiles.
    Returns maxima ``[R, NG]`` (``"max"``) or (scores, ids) ``[R, KG·group]``.
    """
    r, hp, half = q_e.shape
    dot_dtype = jnp.float32 if q_e.dtype == jnp.float32 else jnp.bfloat16
    precision = jax.lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None
    tpg = tile // group
    n_groups = groups.shape[1] if groups is not None else pages.shape[1] * epb // group
    chunks = n_groups // tpg
    if chunks == 0:                                           # nothing listed: empty outputs, no kernel
        empty = lambda dt: jnp.zeros((r, 0), dt)
        return empty(jnp.float32) if mode == "max" else (empty(jnp.float32), empty(jnp.int32))
    splits = max(1, min(splits, chunks))
    per_split = -(-chunks // splits)
    row = lambda n: pl.BlockSpec((None, n), lambda i, k: (i, 0))
    in_specs = [pl.BlockSpec((None, hp, half), lambda i, k: (i, 0, 0))] * 2 + [
        pl.BlockSpec((None, hp), lambda i, k: (i, 0)), pl.BlockSpec(visible.shape, lambda i, k: (0,)),
        row(pages.shape[1]), row(page_ids.shape[1])]
    operands = [q_e, q_o, w, visible, pages, page_ids]
    for a in store:
        in_specs.append(pl.BlockSpec(a.shape, lambda i, k, nd=a.ndim: (0,) * nd))
        operands.append(a)
    if groups is not None:
        in_specs.append(row(groups.shape[1]))
        operands.append(groups)
    if block_mask is not None:
        in_specs.append(row(block_mask.shape[1]))
        operands.append(block_mask)
    operands, _ = match_varying(operands)
    padded = splits * per_split                               # tiles with room in the outputs (the tail is cut)
    if mode == "max":
        out_shape = out_struct((r, padded * tpg), jnp.float32, operands[0])
        out_specs = pl.BlockSpec((None, per_split * tpg), lambda i, k: (i, k))
    else:
        out_shape = (out_struct((r, padded * tile), jnp.float32, operands[0]),
                     out_struct((r, padded * tile), jnp.int32, operands[0]))
        out_specs = (pl.BlockSpec((None, per_split * tile), lambda i, k: (i, k)),) * 2
    kernel = functools.partial(_kernel, fmt=fmt, n_store=len(store), epb=epb, group=group, tile=tile, cbs=cbs,
                               mode=mode, chunks=chunks, per_split=per_split, has_groups=groups is not None,
                               has_mask=block_mask is not None, dot_dtype=dot_dtype, precision=precision)
    out = pl.pallas_call(
        kernel, grid=(r, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=f"v41cp_index_scan_{mode}")(*operands)
    if mode == "max":
        return out[:, :n_groups]
    return tuple(o[:, :n_groups * group] for o in out)
