"""In-kernel decoders of the cache record formats (`v41cp.serving.cache.records`), written with integer and
bit operations only, so that they lower to Triton and give exactly `records.decode`'s values.

The FP4 formats pack channel ``2i`` in the low nibble and ``2i+1`` in the high nibble of byte ``i``. DeepSeek-V4's
``fp8_ds_mla`` record (refs ``(q, s, r)``: e4m3 bytes without RoPE, a ue8m0 byte per 64 of them, the RoPE channels'
BF16 words as byte pairs) is decoded straight into the split layout by per-channel index arithmetic (each channel's
byte, scale byte or word bytes addressed, then a select): no slicing or concatenation of registers.
Kernels therefore work in a **split channel layout**: even channels ``[..., C/2]`` and odd channels
``[..., C/2]`` (a dot product is the sum of both halves; an output is re-interleaved by the wrapper).

Loads are **whole rows**: a gathered row's payload bytes and its scale bytes are each read as one contiguous
run (``ref[rows[:, None], arange(width)[None, :]]``, which Triton turns into vector loads), then split in
registers — the FP8 and value rows by a reshape to ``[T, C/2, 2]`` and an unstack, the FP4 rows by their
nibbles; a scale byte is broadcast over the channels it covers. Values are decoded **in the dot's dtype**
(`decode_split`'s ``dtype``): every record value is exact in BF16 (an e4m3 or e2m1 code times a power of two or
an e4m3 scale has at most 6 significant bits), so BF16 decoding gives the same keys as FP32 decoding followed
by a cast, without the FP32 intermediate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["pow2", "e8m0", "e4m3", "e2m1", "bf16_word", "split_channels", "merge_channels", "gather_rows",
           "decode_split", "load_rows_split", "record_refs", "spread", "SCALE_BLOCK"]

SCALE_BLOCK = {"fp8": 32, "nvfp4": 16, "mxfp4": 32, "fp8_ds_mla": 64}      # channels per scale byte


def record_refs(store, fmt: str | None) -> tuple:
    """A store's arrays in the order the decoders take them: ``(values,)``, ``(payload, scales)`` or, for
    ``fp8_ds_mla``, ``(payload, scales, rope words)``."""
    if fmt is None:
        return (store,)
    return (store["q"], store["s"], store["r"]) if fmt == "fp8_ds_mla" else (store["q"], store["s"])


def pow2(k: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``2**k`` for int32 ``k`` in the normal range, built from bits (exact) in FP32 or BF16."""
    if jnp.dtype(dtype) == jnp.bfloat16:
        return jax.lax.bitcast_convert_type(((k + 127) << 7).astype(jnp.int16), jnp.bfloat16)
    return jax.lax.bitcast_convert_type((k + 127) << 23, jnp.float32)


def e8m0(b: jax.Array, dtype=jnp.float32) -> jax.Array:
    """ue8m0 scale bytes (int32 0..255) → ``2**(b−127)`` in FP32 or BF16 (byte 0 → 0, as `records.decode`
    reads it)."""
    if jnp.dtype(dtype) == jnp.bfloat16:
        return jax.lax.bitcast_convert_type((b << 7).astype(jnp.int16), jnp.bfloat16)
    return jax.lax.bitcast_convert_type(b << 23, jnp.float32)


def e4m3(b: jax.Array, dtype=jnp.float32) -> jax.Array:
    """float8 e4m3fn bytes (int32 0..255) → FP32 or BF16 (NaN codes are never written by the encoder)."""
    e = (b >> 3) & 15
    m = b & 7
    mag = jnp.where(e == 0, m, m + 8).astype(dtype) * pow2(jnp.where(e == 0, 1, e) - 10, dtype)
    return jnp.where((b & 128) != 0, -mag, mag)


def e2m1(c: jax.Array, dtype=jnp.float32) -> jax.Array:
    """e2m1 codes (int32 0..15) → FP32 or BF16; code 8 (−0) reads as +0 like the release's decoder table."""
    m = c & 7
    e = m >> 1
    mant = m & 1
    twice = jnp.where(e == 0, mant, (2 + mant) << jnp.maximum(e - 1, 0)).astype(dtype)
    mag = twice * jnp.asarray(0.5, dtype)
    return jnp.where(((c & 8) != 0) & (m != 0), -mag, mag)


def bf16_word(lo: jax.Array, hi: jax.Array, dtype=jnp.float32) -> jax.Array:
    """A BF16 value from its little-endian bytes (int32 0..255 each) → FP32 or BF16 (exact)."""
    word = (lo | (hi << 8)).astype(jnp.int16)          # (wraps above 0x7FFF: the same 16 bits)
    return jax.lax.bitcast_convert_type(word, jnp.bfloat16).astype(dtype)


def split_channels(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[..., C]`` → (even channels, odd channels), each ``[..., C/2]``."""
    return x[..., 0::2], x[..., 1::2]


def merge_channels(even: jax.Array, odd: jax.Array) -> jax.Array:
    """Inverse of `split_channels`."""
    return jnp.stack([even, odd], axis=-1).reshape(*even.shape[:-1], 2 * even.shape[-1])


def _deinterleave(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[T, C]`` held in registers → (even, odd) ``[T, C/2]`` (a reshape and an unstack: Triton's split)."""
    t, c = x.shape
    even, odd = jnp.unstack(x.reshape(t, c // 2, 2), axis=-1)
    return even, odd


def spread(s: jax.Array, block: int) -> jax.Array:
    """Per-block values ``[T, n]`` → ``[T, n·block]`` (each repeated over its block, in registers)."""
    t, n = s.shape
    return jnp.broadcast_to(s[:, :, None], (t, n, block)).reshape(t, n * block)


def gather_rows(refs, fmt: str | None, rows: jax.Array) -> tuple[jax.Array, ...]:
    """Rows ``rows [T]`` of a store, undecoded: ``(values [T, C],)`` or ``(payload [T, W], scales [T, S])``
    bytes — each read as one contiguous run per row."""
    r = rows[:, None]
    return tuple(a[r, jnp.arange(a.shape[-1])[None, :]] for a in refs)


def decode_split(raw: tuple, fmt: str | None, channels: int, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """`gather_rows`' output → decoded (even, odd) channels ``[T, C/2]`` in ``dtype`` (FP32 or the dot's BF16;
    a value store is cast)."""
    if fmt is None:
        (values,) = raw
        return _deinterleave(values.astype(dtype))
    payload, scales = (a.astype(jnp.int32) for a in raw)
    if fmt == "fp8":
        vals = e4m3(payload, dtype) * spread(e8m0(scales, dtype), SCALE_BLOCK[fmt])
        return _deinterleave(vals)
    if fmt == "nvfp4":
        s = e4m3(scales, dtype)
    elif fmt == "mxfp4":
        s = e8m0(scales, dtype)
    else:
        raise ValueError(f"unknown record format {fmt!r}")
    s = spread(s, SCALE_BLOCK[fmt] // 2)                 # per byte: both of its channels share the scale
    return e2m1(payload & 15, dtype) * s, e2m1(payload >> 4, dtype) * s


def _ds_mla_split(refs, rows: jax.Array, channels: int, dtype) -> tuple[jax.Array, jax.Array]:
    """Rows ``rows [T]`` of an ``fp8_ds_mla`` store → (even, odd) channels ``[T, C/2]``: channel ``c`` below
    ``nope`` (the payload width) is ``e4m3(q[c]) · 2^(s[c // 64] − 127)``, above it the BF16 word ``r[2k], r[2k+1]``
    of RoPE channel ``k = c − nope``."""
    payload, scales, words = refs
    nope, r = payload.shape[-1], rows[:, None]
    halves = []
    for parity in (0, 1):
        c = 2 * jnp.arange(channels // 2) + parity                                   # [C/2]
        cq, k = jnp.minimum(c, nope - 1)[None, :], jnp.maximum(c - nope, 0)[None, :]
        fp8 = (e4m3(payload[r, cq].astype(jnp.int32), dtype)
               * e8m0(scales[r, cq // SCALE_BLOCK["fp8_ds_mla"]].astype(jnp.int32), dtype))
        rope = bf16_word(words[r, 2 * k].astype(jnp.int32), words[r, 2 * k + 1].astype(jnp.int32), dtype)
        halves.append(jnp.where((c < nope)[None, :], fp8, rope))
    return halves[0], halves[1]


def load_rows_split(refs, fmt: str | None, rows: jax.Array, channels: int,
                    dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """Gather rows ``rows [T]`` of a store and decode them → (even, odd) channels ``[T, C/2]`` in ``dtype``.

    ``refs`` (`record_refs`): ``(values,)`` for an unquantized store ``[N, C]``, or ``(payload, scales)`` byte refs
    for a record store: ``fmt`` ``"fp8"`` (payload ``[N, C]``, ue8m0 per 32), ``"nvfp4"`` (``[N, C/2]``, e4m3 per
    16) or ``"mxfp4"`` (``[N, C/2]``, ue8m0 per 32); ``"fp8_ds_mla"``: ``(payload [N, C − rope], scales [N, S]`` (one per 64
    payload bytes, padded to 8), ``rope words [N, 2·rope])``."""
    if fmt is not None and fmt not in SCALE_BLOCK:
        raise ValueError(f"unknown record format {fmt!r}")
    if fmt == "fp8_ds_mla":
        return _ds_mla_split(refs, rows, channels, dtype)
    return decode_split(gather_rows(refs, fmt, rows), fmt, channels, dtype)
