"""Reference (the XLA path) of the grouped FP4 expert matmul: each tile's rows times its expert's weights."""

from __future__ import annotations

import jax

from v41cp.layers.moe_dispatch import stored_matmul

__all__ = ["grouped_fp4_matmul_reference"]


def grouped_fp4_matmul_reference(x: jax.Array, tiles: jax.Array, packed: jax.Array, scale: jax.Array) -> jax.Array:
    """``x [c, G, n]`` (tile ``i``'s ``G`` rows) times expert ``tiles[i]``'s FP4 weight as stored (``packed
    [E, o, n/2]``, e8m0 ``scale [E, o, n/32]``, the release's ``[out, in]`` orientation) → ``[c, G, o]`` in
    ``x.dtype``. The weights of every tile are gathered and decoded (`stored_matmul`)."""
    return stored_matmul(x, packed[tiles], scale[tiles])
