"""Sparse attention as a Pallas kernel (Triton backend), split over the key list.

Grid ``(R, H / block_h, splits)``: a program owns one query row, ``block_h`` heads (by default all of them:
MQA, so each selected entry is read and decoded once per row) and one **split** of the key list — tiles
``s, s + splits, s + 2·splits, …`` of ``block_k`` slots of every store (only the first ``lengths`` slots: padding
tiles are skipped). It gathers each tile's rows (V4.1's records and values with contiguous loads; DeepSeek-V4's
584 B records channel by channel), decodes them in registers in the dot's
dtype (`v41cp.kernels.dequant`) and keeps an online softmax (running max, sum, FP32 accumulator) over the
union of its stores. Each program writes a **partial** — output normalised over its own keys and its
natural-log LSE (−inf and zeros for a split with no key) — and the wrapper merges the splits exactly
(`v41cp.sharding.lse_merge.merge_partials`), the same merge DCP uses across ranks. Splitting the key list
gives small batches enough programs to fill the GPU. Everything runs in the split channel layout (even /
odd channels), which the packed FP4 records give for free; the wrapper splits the queries and re-interleaves
the output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from v41cp.kernels import match_varying, out_struct
from v41cp.kernels.dequant import load_rows_split

__all__ = ["sparse_attention_pallas"]


def _kernel(*refs, formats, n_refs, block_k, splits, scale, dot_dtype, precision):
    q_e_ref, q_o_ref, len_ref = refs[:3]
    o_e_ref, o_o_ref, lse_ref = refs[-3:]
    r, s = pl.program_id(0), pl.program_id(2)
    q_e = q_e_ref[...].astype(dot_dtype)                       # [BH, D/2]
    q_o = q_o_ref[...].astype(dot_dtype)
    bh, half = q_e.shape
    m = jnp.full((bh,), -jnp.inf, jnp.float32)
    l = jnp.zeros((bh,), jnp.float32)
    acc_e = jnp.zeros((bh, half), jnp.float32)
    acc_o = jnp.zeros((bh, half), jnp.float32)
    pos = 3
    for i, fmt in enumerate(formats):
        idx_ref = refs[pos]
        store = refs[pos + 1: pos + 1 + n_refs[i]]
        pos += 1 + n_refs[i]
        n = len_ref[r, i]
        n_tiles = (n + block_k - 1) // block_k
        mine = jnp.maximum(n_tiles - s + splits - 1, 0) // splits        # tiles s, s + splits, … below n_tiles

        def tile(u, carry, idx_ref=idx_ref, store=store, fmt=fmt, n=n):
            m, l, acc_e, acc_o = carry
            t = s + u * splits
            slot = t * block_k + jnp.arange(block_k)
            idx = idx_ref[pl.ds(t * block_k, block_k)]
            ok = (idx >= 0) & (slot < n)
            k_e, k_o = load_rows_split(store, fmt, jnp.where(ok, idx, 0), 2 * half, dot_dtype)
            sc = (jnp.dot(q_e, k_e.T, precision=precision, preferred_element_type=jnp.float32)
                  + jnp.dot(q_o, k_o.T, precision=precision, preferred_element_type=jnp.float32)) * scale
            sc = jnp.where(ok[None, :], sc, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(sc, axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(sc - m_safe[:, None])
            alpha = jnp.exp(m - m_safe)
            l = l * alpha + jnp.sum(p, axis=1)
            p = p.astype(dot_dtype)
            acc_e = acc_e * alpha[:, None] + jnp.dot(p, k_e, precision=precision, preferred_element_type=jnp.float32)
            acc_o = acc_o * alpha[:, None] + jnp.dot(p, k_o, precision=precision, preferred_element_type=jnp.float32)
            return m_new, l, acc_e, acc_o

        m, l, acc_e, acc_o = jax.lax.fori_loop(0, mine, tile, (m, l, acc_e, acc_o))
    has = l > 0
    inv = 1.0 / jnp.where(has, l, 1.0)
    o_e_ref[...] = jnp.where(has[:, None], acc_e * inv[:, None], 0.0)
    o_o_ref[...] = jnp.where(has[:, None], acc_o * inv[:, None], 0.0)
    lse_ref[...] = jnp.where(has, jnp.where(m == -jnp.inf, 0.0, m) + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("formats", "block_h", "block_k", "splits", "num_warps", "num_stages",
                                             "interpret"))
def sparse_attention_pallas(q_e, q_o, stores, formats, indices, lengths, *, block_h: int, block_k: int,
                            splits: int = 1, num_warps: int = 4, num_stages: int = 2, interpret: bool = False):
    """The kernel call on prepared operands (see `v41cp.kernels.sparse_attention.sparse_attention`).

    q_e / q_o ``[R, H, D/2]`` (H a multiple of ``block_h``); stores: per store a tuple of refs (values, payload +
    scales, or V4's payload + scales + RoPE words: `v41cp.kernels.dequant.record_refs`); indices: per store ``[R, K_i]`` with ``K_i`` a multiple of ``block_k``; lengths
    ``[R, n_stores]`` int32. Returns the per-split partials ``(o_e, o_o [R, splits, H, D/2] FP32, lse [R, splits,
    H] FP32)``, each normalised over its split's keys (a split with none: zeros and −inf).
    """
    r, h, half = q_e.shape
    dot_dtype = jnp.float32 if q_e.dtype == jnp.float32 else jnp.bfloat16
    precision = jax.lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, formats=formats, n_refs=tuple(len(s) for s in stores), block_k=block_k,
                               splits=splits, scale=(2 * half) ** -0.5, dot_dtype=dot_dtype, precision=precision)
    q_spec = pl.BlockSpec((None, block_h, half), lambda i, j, k: (i, j, 0))
    in_specs = [q_spec, q_spec, pl.BlockSpec(lengths.shape, lambda i, j, k: (0, 0))]
    operands = [q_e, q_o, lengths]
    for store, idx in zip(stores, indices):
        in_specs.append(pl.BlockSpec((None, idx.shape[1]), lambda i, j, k: (i, 0)))
        operands.append(idx)
        for a in store:
            in_specs.append(pl.BlockSpec(a.shape, lambda i, j, k, nd=a.ndim: (0,) * nd))
            operands.append(a)
    operands, _ = match_varying(operands)
    like = operands[0]
    out_shape = (out_struct((r, splits, h, half), jnp.float32, like),
                 out_struct((r, splits, h, half), jnp.float32, like),
                 out_struct((r, splits, h), jnp.float32, like))
    o_spec = pl.BlockSpec((None, None, block_h, half), lambda i, j, k: (i, k, j, 0))
    out_specs = (o_spec, o_spec, pl.BlockSpec((None, None, block_h), lambda i, j, k: (i, k, j)))
    return pl.pallas_call(
        kernel, grid=(r, h // block_h, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="v41cp_sparse_attention")(*operands)
