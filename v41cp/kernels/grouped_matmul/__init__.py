"""Grouped FP4 expert matmul (the sparse MoE's expert GEMMs, `v41cp.layers.moe_dispatch`): the dispatch's
tiles — ``G`` rows routed to one expert each — times that expert's FP4 weight as released (W4A16: weights
decoded in the kernel, activations in BF16 or FP32, FP32 accumulation).

`grouped_fp4_matmul(x, tiles, packed, scale, live=None, backend=...)`:

* ``x [c, G, n]``: tile rows (a padding row is zero); ``tiles [c]`` int32 expert of each tile; ``live [c]``
  (optional) 0 for a tile with no routed row — the kernel skips it (output 0);
* ``packed [E, o, n/2]`` uint8 (channel ``2i`` in the low nibble of byte ``i``), ``scale [E, o, n/32]`` e8m0;
* returns ``[c, G, o]`` in ``x.dtype``.

Backends: ``"xla"`` (`grouped_fp4_matmul_reference`: gathers the tiles' weights, decodes them, one batched
dot) and ``"pallas"`` (`grouped_fp4_matmul_pallas`; interpret mode off the GPU). The kernel pads ``G`` to the
tensor-core minimum (16). Blocks: ``block_n`` output columns (a power of two ≥ 16) and ``block_k`` input
channels (a power of two ≥ 32, whole scale blocks) per step; by default the largest that divide the widths, up
to 64 and 128 (the TP-8 slice of V4.1-Flash's expert width, 288, takes 32 for both); a width no such block
divides is refused with an error that names it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v41cp.kernels import check_backend, cost_scope, nbytes, on_platform, pow2_at_least
from v41cp.kernels.dequant import split_channels
from v41cp.kernels.grouped_matmul.pallas_triton import grouped_fp4_matmul_pallas
from v41cp.kernels.grouped_matmul.reference import grouped_fp4_matmul_reference

__all__ = ["grouped_fp4_matmul", "grouped_fp4_matmul_reference", "grouped_fp4_matmul_pallas"]


def _block(name: str, size: int, block: int | None, cap: int, unit: int) -> int:
    """The given block, or the largest power of two in ``[unit, cap]`` dividing ``size``; checked."""
    if block is None:
        block = cap
        while block > unit and size % block:
            block //= 2
    if size % block or block % unit or block & (block - 1):
        raise ValueError(f"grouped_fp4_matmul: {name} {size} does not split into power-of-two blocks of {block} "
                         f"(a multiple of {unit})")
    return block


def grouped_fp4_matmul(x: jax.Array, tiles: jax.Array, packed: jax.Array, scale: jax.Array, live=None,
                       backend: str = "xla", block_n: int | None = None, block_k: int | None = None,
                       num_warps: int = 4, num_stages: int = 2, interpret: bool | None = None) -> jax.Array:
    """See the module docstring."""
    check_backend(backend, "expert_backend")
    if backend == "xla":
        return grouped_fp4_matmul_reference(x, tiles, packed, scale)
    c, g, n = x.shape
    o = packed.shape[1]
    block_n = _block("output width", o, block_n, 64, 16)
    block_k = _block("input width", n, block_k, 128, 32)
    gp = pow2_at_least(g)
    x_e, x_o = (jnp.pad(h, ((0, 0), (0, gp - g), (0, 0))) for h in split_channels(x))
    live = jnp.ones((c,), jnp.int32) if live is None else live.astype(jnp.int32)
    call = lambda x_e, x_o, tiles, live, packed, scale, interpret: grouped_fp4_matmul_pallas(
        x_e, x_o, tiles, live, packed, scale, block_n=block_n, block_k=block_k, num_warps=num_warps,
        num_stages=num_stages, interpret=interpret)
    # per call (grid: tiles × output blocks): each program loads its tile's tokens and its block of the tile's
    # expert's packed weights and scales (every tile live: an upper bound; tiles of one expert share them only
    # through the L2), and writes its FP32 block
    read = (o // block_n) * nbytes(x_e, x_o, tiles, live) + c * (nbytes(packed, scale) // packed.shape[0])
    with cost_scope(read, c * gp * o * 4, 2 * c * gp * n * o, x.dtype):
        y = on_platform(call, x_e, x_o, tiles.astype(jnp.int32), live, packed, scale, interpret=interpret)
    return y[:, :g].astype(x.dtype)
