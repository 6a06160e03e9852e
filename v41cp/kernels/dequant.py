"""In-kernel decoders of the cache record formats (`v41cp.serving.records`), written with integer and
bit operations only, so that they lower to Triton and give exactly `records.decode`'s values.

The FP4 formats pack channel ``2i`` in the low nibble and ``2i+1`` in the high nibble of byte ``i``.
Kernels therefore work in a **split channel layout**: even channels ``[..., C/2]`` and odd channels
``[..., C/2]`` (a dot product is the sum of both halves; an output is re-interleaved by the wrapper).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["pow2", "e8m0", "e4m3", "e2m1", "split_channels", "merge_channels", "load_rows_split"]


def pow2(k: jax.Array) -> jax.Array:
    """``2**k`` in FP32 for int32 ``k`` in the normal range, built from bits (exact)."""
    return jax.lax.bitcast_convert_type((k + 127) << 23, jnp.float32)


def e8m0(b: jax.Array) -> jax.Array:
    """ue8m0 scale bytes (int32 0..255) → FP32 ``2**(b−127)`` (byte 0 → 0, as `records.decode` reads it)."""
    return jax.lax.bitcast_convert_type(b << 23, jnp.float32)


def e4m3(b: jax.Array) -> jax.Array:
    """float8 e4m3fn bytes (int32 0..255) → FP32 (NaN codes are never written by the encoder)."""
    e = (b >> 3) & 15
    m = b & 7
    mag = jnp.where(e == 0, m, m + 8).astype(jnp.float32) * pow2(jnp.where(e == 0, 1, e) - 10)
    return jnp.where((b & 128) != 0, -mag, mag)


def e2m1(c: jax.Array) -> jax.Array:
    """e2m1 codes (int32 0..15) → FP32; code 8 (−0) reads as +0 like the release's decoder table."""
    m = c & 7
    e = m >> 1
    mant = m & 1
    twice = jnp.where(e == 0, mant, (2 + mant) << jnp.maximum(e - 1, 0)).astype(jnp.float32)
    mag = twice * 0.5
    return jnp.where(((c & 8) != 0) & (m != 0), -mag, mag)


def split_channels(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[..., C]`` → (even channels, odd channels), each ``[..., C/2]``."""
    return x[..., 0::2], x[..., 1::2]


def merge_channels(even: jax.Array, odd: jax.Array) -> jax.Array:
    """Inverse of `split_channels`."""
    return jnp.stack([even, odd], axis=-1).reshape(*even.shape[:-1], 2 * even.shape[-1])


def load_rows_split(refs, fmt: str | None, rows: jax.Array, channels: int) -> tuple[jax.Array, jax.Array]:
    """Gather rows ``rows [T]`` of a store and decode them → (even, odd) channels, FP32 ``[T, C/2]``.

    ``refs``: ``(values,)`` for an unquantized store ``[N, C]``, or ``(payload, scales)`` byte refs for a
    record store: ``fmt`` ``"fp8"`` (payload ``[N, C]``, ue8m0 per 32), ``"nvfp4"`` (``[N, C/2]``, e4m3 per 16)
    or ``"mxfp4"`` (``[N, C/2]``, ue8m0 per 32)."""
    half = jnp.arange(channels // 2)
    r = rows[:, None]
    if fmt is None:
        (values,) = refs
        return (values[r, (2 * half)[None, :]].astype(jnp.float32),
                values[r, (2 * half + 1)[None, :]].astype(jnp.float32))
    payload, scales = refs
    if fmt == "fp8":
        s = e8m0(scales[r, (half // 16)[None, :]].astype(jnp.int32))
        even = e4m3(payload[r, (2 * half)[None, :]].astype(jnp.int32))
        odd = e4m3(payload[r, (2 * half + 1)[None, :]].astype(jnp.int32))
        return even * s, odd * s
    byte = payload[r, half[None, :]].astype(jnp.int32)
    if fmt == "nvfp4":
        s = e4m3(scales[r, (half // 8)[None, :]].astype(jnp.int32))
    elif fmt == "mxfp4":
        s = e8m0(scales[r, (half // 16)[None, :]].astype(jnp.int32))
    else:
        raise ValueError(f"unknown record format {fmt!r}")
    return e2m1(byte & 15) * s, e2m1(byte >> 4) * s
