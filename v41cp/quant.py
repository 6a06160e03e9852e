"""The release's cache fake-quant formats (quantize → dequantize), bit-exact.

docs/architecture.md:

* ``fp8``   window KV, block 32: ``sc = pow2ceil(max(amax, 1e-4) · (1/448))``,
            ``q = e4m3(clip(x/sc, ±448))`` (round to nearest even).
* ``nvfp4`` compressed KV, block 16: ``sc = e4m3(max(amax, 6·2⁻⁹) / 6)``; e2m1 grid.
* ``mxfp4`` indexer Q/K, block 32: ``sc = pow2ceil(max(amax, 6·2⁻¹²⁶) · (1/6))``; e2m1 grid.
* ``fp8_ds_mla`` DeepSeek-V4's window rows and compressed entries (the 584 B record): the ``C − rope`` channels
  without RoPE FP8 as ``fp8`` but one scale per 64 channels, the ``rope`` RoPE channels rounded to BF16.

DeepSeek-V4's indexer rotates its queries and keys by a Hadamard transform before their MXFP4 fake-quant
(`hadamard_rotate`): an orthonormal map, so it leaves the unquantized scores unchanged and moves only where the
quantization error falls.

The e2m1 grid is {0, .5, 1, 1.5, 2, 3, 4, 6}; a value exactly between two grid points rounds
to the one with the even code (0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4).
A trailing partial block is zero-padded (the released kernels need complete blocks).
All functions take ``[..., channels]`` and return the same shape and dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg  # (a jax dependency, declared in pyproject.toml: its Sylvester Hadamard matrix)

__all__ = ["round_through", "pow2ceil", "e2m1_magnitude_code", "fake_quant", "fp8_block32", "nvfp4_block16",
           "mxfp4_block32", "fp8_ds_mla", "quantize_as", "hadamard_rotate", "FAKE_QUANT", "CACHE_FORMATS",
           "E2M1_LEVELS", "FP4_TABLE"]

E2M1_LEVELS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
# e2m1 code (4 bits, sign in bit 3) → value, as the release's checkpoint decoder: code 8 is +0
FP4_TABLE = np.concatenate([E2M1_LEVELS, np.float32(0.0) - E2M1_LEVELS]).astype(np.float32)
FP4_TABLE[8] = 0.0
_E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)


def round_through(x: jax.Array, dtype) -> jax.Array:
    """FP32 ``x`` rounded to ``dtype`` and back (round to nearest even) — a value the reference stores in ``dtype``
    at that point; the identity when ``dtype`` is FP32. BF16 rounds on the IEEE bits, so that every compiled
    program rounds (a convert pair is not kept by XLA)."""
    if jnp.dtype(dtype) == jnp.float32:
        return x
    if jnp.dtype(dtype) == jnp.bfloat16:
        # on the bits: XLA drops an f32 → bf16 → f32 convert pair where it allows excess precision (the default,
        # on CPU and GPU alike), so the pair would round in some compiled programs and not in others
        bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & jnp.int32(-65536)
        return jnp.where(jnp.isnan(x), x, jax.lax.bitcast_convert_type(bits, jnp.float32))
    return x.astype(dtype).astype(jnp.float32)


def pow2ceil(x: jax.Array) -> jax.Array:
    """Round positive normal FP32 values up to a power of two via the IEEE bits (ue8m0 rounding)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    exponent = (bits >> 23) & 255
    increment = ((bits & ((1 << 23) - 1)) != 0).astype(jnp.int32)
    return jax.lax.bitcast_convert_type((exponent + increment) << 23, jnp.float32)


def e2m1_magnitude_code(normalized: jax.Array) -> jax.Array:
    """Code 0..7 of the e2m1 magnitude nearest ``|normalized|`` (values in [-6, 6]), ties to the even code."""
    mag = jnp.abs(normalized)
    mids = jnp.asarray(_E2M1_MIDPOINTS)
    lower = jnp.sum(mag[..., None] > mids, axis=-1)              # number of midpoints strictly below
    tie = mag == mids[jnp.minimum(lower, 6)]
    return lower + (tie & (lower % 2 == 1)).astype(lower.dtype)


def _round_e2m1(normalized: jax.Array) -> jax.Array:
    """Round values in [-6, 6] to the e2m1 grid with ties to the even code."""
    return jnp.copysign(jnp.asarray(E2M1_LEVELS)[e2m1_magnitude_code(normalized)], normalized)


def fake_quant(x: jax.Array, fmt: str, block: int) -> jax.Array:
    """Quantize-dequantize ``x [..., C]`` in blocks of ``block`` channels with format ``fmt``."""
    if fmt not in ("fp8", "nvfp4", "mxfp4"):
        raise ValueError(f"unknown fake-quant format {fmt!r}; expected fp8, nvfp4 or mxfp4")
    channels = x.shape[-1]
    pad = -channels % block
    v = x.astype(jnp.float32)
    if pad:
        v = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, pad)])
    nblocks = v.shape[-1] // block
    g = v.reshape(*v.shape[:-1], nblocks, block)
    amax = jnp.max(jnp.abs(g), axis=-1, keepdims=True)
    if fmt == "fp8":
        scale = pow2ceil(jnp.maximum(amax, jnp.float32(1e-4)) * jnp.float32(1 / 448))
        q = jnp.clip(g / scale, -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    else:
        if fmt == "nvfp4":
            # the e4m3 cast saturates at 448 (as torch's does; ml_dtypes would give NaN)
            scale = jnp.minimum(jnp.maximum(amax, jnp.float32(6 * 2.0**-9)) / jnp.float32(6), jnp.float32(448))
            scale = scale.astype(jnp.float8_e4m3fn).astype(jnp.float32)
        else:
            scale = pow2ceil(jnp.maximum(amax, jnp.float32(6 * 2.0**-126)) * jnp.float32(1 / 6))
        q = _round_e2m1(jnp.clip(g / scale, -6.0, 6.0))
    out = (q * scale).reshape(*v.shape[:-1], nblocks * block)[..., :channels]
    return out.astype(x.dtype)


def fp8_block32(x: jax.Array) -> jax.Array:
    """Window-KV format: FP8 e4m3 with a ue8m0 scale per 32 channels."""
    return fake_quant(x, "fp8", 32)


def nvfp4_block16(x: jax.Array) -> jax.Array:
    """Compressed-KV format: e2m1 with an e4m3 scale per 16 channels."""
    return fake_quant(x, "nvfp4", 16)


def mxfp4_block32(x: jax.Array) -> jax.Array:
    """Indexer Q/K format: e2m1 with a ue8m0 scale per 32 channels."""
    return fake_quant(x, "mxfp4", 32)


# cache format name → its fake-quant (the window ring, compressed KV, index keys)
FAKE_QUANT = {"fp8": fp8_block32, "nvfp4": nvfp4_block16, "mxfp4": mxfp4_block32}


def fp8_ds_mla(x: jax.Array, rope: int) -> jax.Array:
    """DeepSeek-V4's main-entry / window-row format of ``x [..., C]``: channels ``[0, C − rope)`` FP8 e4m3 with a
    ue8m0 scale per 64 (as the release's ``act_quant(kv[..., :-rope], 64)``), the last ``rope`` channels as BF16."""
    if rope <= 0:
        raise ValueError(f"fp8_ds_mla keeps the RoPE channels in BF16: give their count (rope > 0), got {rope}")
    nope = x.shape[-1] - rope
    head = fake_quant(x[..., :nope], "fp8", 64)
    tail = round_through(x[..., nope:].astype(jnp.float32), jnp.bfloat16).astype(x.dtype)
    return jnp.concatenate([head, tail], axis=-1)


# every cache format of v41cp's stores: V4.1's window (fp8), compressed KV (nvfp4) and index keys (mxfp4); V4's
# window rows and main entries (fp8_ds_mla) and index keys (mxfp4)
CACHE_FORMATS = ("fp8", "nvfp4", "mxfp4", "fp8_ds_mla")


def quantize_as(x: jax.Array, fmt: str, rope: int = 0) -> jax.Array:
    """``x [..., C]`` as a store of cache format ``fmt`` holds it (``rope``: the RoPE channels, for ``fp8_ds_mla``)."""
    if fmt == "fp8_ds_mla":
        return fp8_ds_mla(x, rope)
    if fmt not in FAKE_QUANT:
        raise ValueError(f"unknown cache format {fmt!r}; expected one of {CACHE_FORMATS}")
    return FAKE_QUANT[fmt](x)


def hadamard_rotate(x: jax.Array) -> jax.Array:
    """``x [..., C]`` (C a power of two) times the orthonormal Sylvester Hadamard matrix ``H_C · C^-1/2`` (symmetric:
    the order of ``fast_hadamard_transform`` with ``scale = C^-1/2``), computed in FP32, returned in ``x``'s dtype."""
    c = x.shape[-1]
    if c & (c - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two channel count, got {c}")
    h = jnp.asarray(scipy.linalg.hadamard(c).astype(np.float32) * np.float32(c ** -0.5))
    y = jnp.einsum("...c,cd->...d", x.astype(jnp.float32), h, precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)
