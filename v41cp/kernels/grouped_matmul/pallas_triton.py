"""Grouped FP4 expert matmul as a Pallas kernel (Triton backend): tiles of rows sorted by expert, each tile
times its expert's weight read **as stored** (packed e2m1 + e8m0 block scales) and decoded in registers.

Grid ``(tiles, out / block_n)``: a program owns one tile (``G`` rows, ``G ≥ 16`` for the tensor cores) and
``block_n`` output columns. It reads its expert id from the tile list, walks the input channels in blocks of
``block_k``, loads the ``[block_n, block_k/2]`` weight bytes and ``[block_n, block_k/32]`` scale bytes of that
expert as contiguous rows (gathered by row number from ``[E·o, ·]`` views of the weights), decodes both nibbles
in the dot's dtype (exact: an e2m1 code times a power of two) and accumulates ``x_even · W_evenᵀ + x_odd ·
W_oddᵀ`` in FP32. A tile marked empty (``live = 0``) runs no loop iteration: its weights are never read and its
output is zero. Nothing is gathered or decoded outside the kernel, so the expert bytes cross HBM once per tile
that uses them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from v41cp.kernels import match_varying, out_struct
from v41cp.kernels.dequant import e2m1, spread

__all__ = ["grouped_fp4_matmul_pallas", "weight_scale"]


def weight_scale(b: jax.Array, dtype) -> jax.Array:
    """Weight e8m0 bytes (int32) → ``2**(b−127)`` in FP32 or BF16, built from bits; byte 0 is the subnormal
    ``2**−127`` (the checkpoint convention, `v41cp.kernels.stored_weights.e8m0_to_f32`), not the caches' zero."""
    if jnp.dtype(dtype) == jnp.bfloat16:
        return jax.lax.bitcast_convert_type(jnp.where(b == 0, 1 << 6, b << 7).astype(jnp.int16), jnp.bfloat16)
    return jax.lax.bitcast_convert_type(jnp.where(b == 0, 1 << 22, b << 23), jnp.float32)


def _kernel(tiles_ref, live_ref, x_e_ref, x_o_ref, packed_ref, scale_ref, o_ref, *, out_width, block_n, block_k,
            dot_dtype, precision):
    t, jn = pl.program_id(0), pl.program_id(1)
    expert = tiles_ref[t]
    rows = x_e_ref.shape[0]
    half = block_k // 2
    n_blocks = x_e_ref.shape[1] // half

    # the expert's weight rows, as row numbers of the [E·o, ·] views: a scalar expert index into the [E, o, ·]
    # arrays is offset in int32 elements by the Triton lowering, which wrapped past 2³¹ bytes on an H200
    # (experts ≥ 364 of 384 × [2304, 2560] read wrong weights, 2026-12-04); row gathers are not
    w_rows = (expert * out_width + jn * block_n + jnp.arange(block_n))[:, None]             # [BN, 1]

    def body(kb, acc):
        x_e = x_e_ref[:, pl.ds(kb * half, half)].astype(dot_dtype)                       # [G, BK/2]
        x_o = x_o_ref[:, pl.ds(kb * half, half)].astype(dot_dtype)
        wb = packed_ref[w_rows, (kb * half + jnp.arange(half))[None, :]].astype(jnp.int32)     # [BN, BK/2]
        sb = scale_ref[w_rows, (kb * (block_k // 32) + jnp.arange(block_k // 32))[None, :]]
        s = spread(weight_scale(sb.astype(jnp.int32), dot_dtype), 16)                   # [BN, BK/2]: per byte
        w_e = e2m1(wb & 15, dot_dtype) * s
        w_o = e2m1(wb >> 4, dot_dtype) * s
        return (acc + jnp.dot(x_e, w_e.T, precision=precision, preferred_element_type=jnp.float32)
                + jnp.dot(x_o, w_o.T, precision=precision, preferred_element_type=jnp.float32))

    acc = jax.lax.fori_loop(0, live_ref[t] * n_blocks, body, jnp.zeros((rows, block_n), jnp.float32))
    o_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "num_warps", "num_stages", "interpret"))
def grouped_fp4_matmul_pallas(x_e, x_o, tiles, live, packed, scale, *, block_n: int = 64, block_k: int = 128,
                              num_warps: int = 4, num_stages: int = 2, interpret: bool = False):
    """The kernel call on prepared operands (see `v41cp.kernels.grouped_matmul`).

    x_e / x_o ``[c, G, n/2]`` (even / odd input channels; ``G`` ≥ 16, a power of two), tiles / live ``[c]``
    int32, packed ``[E, o, n/2]`` uint8, scale ``[E, o, n/32]`` uint8 (``o`` a multiple of ``block_n``, ``n`` of
    ``block_k``, ``block_k`` of 32). Returns ``[c, G, o]`` FP32."""
    c, g, half_n = x_e.shape
    o = packed.shape[1]
    dot_dtype = jnp.float32 if x_e.dtype == jnp.float32 else jnp.bfloat16
    precision = jax.lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j, nd=a.ndim: (0,) * nd)
    x_spec = pl.BlockSpec((None, g, half_n), lambda i, j: (i, 0, 0))
    e = packed.shape[0]
    rows = (packed.reshape(e * o, half_n), scale.reshape(e * o, scale.shape[-1]))          # free reshapes
    operands, _ = match_varying([tiles, live, x_e, x_o, *rows])
    kernel = functools.partial(_kernel, out_width=o, block_n=block_n, block_k=block_k, dot_dtype=dot_dtype,
                               precision=precision)
    return pl.pallas_call(
        kernel, grid=(c, o // block_n),
        in_specs=[whole(tiles), whole(live), x_spec, x_spec, whole(operands[4]), whole(operands[5])],
        out_specs=pl.BlockSpec((None, g, block_n), lambda i, j: (i, 0, j)),
        out_shape=out_struct((c, g, o), jnp.float32, operands[2]),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="v41cp_grouped_fp4_matmul")(*operands)
