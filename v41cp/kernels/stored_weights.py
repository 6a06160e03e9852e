"""Decode weights kept in the release's storage formats, inside jitted code (``keep_quantized``).

Stored as raw bytes (uint8) so every checkpoint backend can hold them:

* routed experts: packed e2m1 ``[..., out, in/2]`` (even column in the low nibble) with e8m0
  exponent bytes ``[..., out, in/32]``;
* Engram tables: e4m3 bytes ``[rows, dim]`` with e8m0 exponent bytes ``[rows, dim/32]``, decoded only
  for the gathered rows.

Decoding is exact (code value × power of two) and matches `v41cp.checkpoint.formats` bit for bit,
except for results below FP32's normal range, which XLA flushes to zero (real weight scales are far
from it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from v41cp.quant import FP4_TABLE

__all__ = ["e8m0_to_f32", "decode_fp4", "decode_fp8_rows", "FP4_PAIR_TABLE", "fp4_values"]

# packed byte → its two e2m1 values (low nibble first): one lookup per byte, no bit arithmetic
FP4_PAIR_TABLE = np.stack([FP4_TABLE[np.arange(256) & 15], FP4_TABLE[np.arange(256) >> 4]], axis=-1)


def e8m0_to_f32(bits: jax.Array) -> jax.Array:
    """ue8m0 exponent bytes → FP32 powers of two ``2^(b−127)`` (exact; b = 0 is the subnormal 2⁻¹²⁷)."""
    b = bits.astype(jnp.int32)
    normal = jax.lax.bitcast_convert_type(b << 23, jnp.float32)
    return jnp.where(b == 0, jax.lax.bitcast_convert_type(jnp.int32(1 << 22), jnp.float32), normal)


def _expand_scale(scale: jax.Array, cols: int) -> jax.Array:
    return jnp.repeat(e8m0_to_f32(scale), 32, axis=-1)[..., :cols]


def fp4_values(packed: jax.Array, dtype) -> jax.Array:
    """Packed e2m1 bytes ``[..., n/2]`` → their code values ``[..., n]`` in ``dtype`` (exact in any float type):
    one gather per byte from `FP4_PAIR_TABLE`, indexed by the bytes themselves (every byte value is in range,
    so no index arithmetic or conversion is emitted)."""
    table = jnp.asarray(FP4_PAIR_TABLE, dtype)
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(packed.ndim,), collapsed_slice_dims=(0,), start_index_map=(0,))
    pairs = jax.lax.gather(table, packed[..., None], dims, slice_sizes=(1, 2),
                           mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def decode_fp4(packed: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """``[..., out, in/2]`` packed e2m1 bytes × ``[..., out, in/32]`` e8m0 bytes → ``[..., out, in]`` in ``dtype``."""
    values = fp4_values(packed, jnp.float32)
    return (values * _expand_scale(scale, values.shape[-1])).astype(dtype)


def decode_fp8_rows(rows: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """``[..., dim]`` e4m3 bytes × ``[..., dim/32]`` e8m0 bytes → ``[..., dim]`` in ``dtype``."""
    values = jax.lax.bitcast_convert_type(rows, jnp.float8_e4m3fn).astype(jnp.float32)
    return (values * _expand_scale(scale, rows.shape[-1])).astype(dtype)
