"""Reference (the XLA path) of the grouped FP4 expert matmul: each tile's rows times its expert's weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v41cp.kernels.stored_weights import e8m0_to_f32, fp4_values

__all__ = ["grouped_fp4_matmul_reference", "stored_matmul", "FOLD_SCALE_BELOW"]

FOLD_SCALE_BELOW = 16           # tiles of fewer rows apply FP4 block scales after the block dot (see stored_matmul)


def stored_matmul(x: jax.Array, packed: jax.Array, scale: jax.Array) -> jax.Array:
    """``x [c, G, n]`` times the FP4 weights of each tile as stored (``packed [c, o, n/2]``, e8m0 ``scale [c, o,
    n/32]``: the release's ``[out, in]`` orientation) → ``[c, G, o]`` in ``x.dtype``.

    The code values are exact in ``x.dtype``. Tiles of at least `FOLD_SCALE_BELOW` rows multiply the block scales
    into the decoded weights (one multiply per weight, shared by ``G`` rows); smaller tiles (decode: ``G = 1``)
    apply them after the per-block dot in FP32 (``Σ_b s_ob · Σ_j x_bj q_objb``), which costs ``1/32`` of the dot
    instead of half of it."""
    c, g, n = x.shape
    s = e8m0_to_f32(scale)                                                    # [c, o, n/32]
    if g >= FOLD_SCALE_BELOW:
        q = fp4_values(packed, x.dtype)                                      # [c, o, n]
        w = (q.reshape(c, q.shape[1], n // 32, 32) * s[..., None].astype(x.dtype)).reshape(q.shape)
        return jnp.einsum("cgn,con->cgo", x, w)
    # few rows per weight: the codes are looked up directly in FP32 (exact), so no per-weight conversion is
    # paid on a backend without native low-precision dots; the dot accumulates in FP32 either way
    q = fp4_values(packed, jnp.float32)
    part = jnp.einsum("cgbj,cobj->cgob", x.astype(jnp.float32).reshape(c, g, n // 32, 32),
                      q.reshape(c, q.shape[1], n // 32, 32))
    return jnp.einsum("cgob,cob->cgo", part, s).astype(x.dtype)


def grouped_fp4_matmul_reference(x: jax.Array, tiles: jax.Array, packed: jax.Array, scale: jax.Array) -> jax.Array:
    """``x [c, G, n]`` (tile ``i``'s ``G`` rows) times expert ``tiles[i]``'s FP4 weight as stored (``packed
    [E, o, n/2]``, e8m0 ``scale [E, o, n/32]``, the release's ``[out, in]`` orientation) → ``[c, G, o]`` in
    ``x.dtype``. The weights of every tile are gathered and decoded (`stored_matmul`)."""
    return stored_matmul(x, packed[tiles], scale[tiles])
