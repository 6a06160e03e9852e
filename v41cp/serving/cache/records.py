"""Byte records of the decode caches in the release's formats (docs/architecture.md), in jnp.

* window KV, FP8: e4m3 bytes ``[..., D]`` + ue8m0 exponent bytes ``[..., D/32]`` (528 B at D = 512);
* compressed KV, NVFP4: packed e2m1 ``[..., D/2]`` + e4m3 scale bytes ``[..., D/16]`` (288 B);
* index keys, MXFP4: packed e2m1 ``[..., Di/2]`` + ue8m0 exponent bytes ``[..., Di/32]`` (68 B);
* DeepSeek-V4 window rows and main entries, ``fp8_ds_mla``: the ``D − rope`` channels without RoPE as e4m3 bytes
  ``q [..., D − rope]``, their ue8m0 exponent bytes (one per 64) zero-padded to a multiple of 8 ``s``, the RoPE
  channels' BF16 words as little-endian byte pairs ``r [..., 2·rope]`` (584 B at D 512, rope 64: 448 + 8 + 128).

A record is a dict of uint8 leaves ``{"q", "s"}`` (``fp8_ds_mla``: ``{"q", "s", "r"}``), each ``[..., width]``.

``decode(encode(x))`` equals the fake-quant `v41cp.quant.fake_quant(x)` value for value (tested; an e2m1
−0 comes back as +0, as the release's decoder table has it), so a cache of records computes exactly
what the full-sequence forward computes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v41cp.quant import FP4_TABLE, e2m1_magnitude_code, pow2ceil

__all__ = ["RECORD_FORMATS", "encode", "decode", "record_bytes", "record_widths"]

# format → (block, scale kind)
RECORD_FORMATS = {"fp8": (32, "e8m0"), "nvfp4": (16, "e4m3"), "mxfp4": (32, "e8m0"), "fp8_ds_mla": (64, "e8m0")}


def record_widths(fmt: str, channels: int, rope: int = 0) -> dict[str, int]:
    """Each leaf's bytes per record of ``channels`` values (``rope``: the RoPE channels of ``fp8_ds_mla``)."""
    block, _ = RECORD_FORMATS[fmt]
    if fmt == "fp8_ds_mla":
        _check_rope(rope)
        nope = channels - rope
        scale_bytes = -(-nope // block)
        return {"q": nope, "s": -(-scale_bytes // 8) * 8, "r": 2 * rope}     # the scales padded to 8 B
    return {"q": channels if fmt == "fp8" else channels // 2, "s": channels // block}


def _check_rope(rope: int) -> None:
    if rope <= 0:
        raise ValueError(f"fp8_ds_mla records keep the RoPE channels in BF16: give their count (rope > 0), got {rope}")


def record_bytes(fmt: str, channels: int, rope: int = 0) -> int:
    """Bytes of one record of ``channels`` values."""
    return sum(record_widths(fmt, channels, rope).values())


def _e8m0_byte(scale: jax.Array) -> jax.Array:
    return ((jax.lax.bitcast_convert_type(scale, jnp.int32) >> 23) & 255).astype(jnp.uint8)


def _e8m0_value(b: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(b.astype(jnp.int32) << 23, jnp.float32)


def _fp8_encode(x: jax.Array, block: int) -> dict[str, jax.Array]:
    """``x [..., C]`` → e4m3 bytes ``q [..., C]`` and one ue8m0 scale byte per ``block`` channels ``s``."""
    g = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = jnp.max(jnp.abs(g), axis=-1, keepdims=True)
    scale = pow2ceil(jnp.maximum(amax, jnp.float32(1e-4)) * jnp.float32(1 / 448))
    q = jnp.clip(g / scale, -448.0, 448.0).astype(jnp.float8_e4m3fn)
    return {"q": jax.lax.bitcast_convert_type(q, jnp.uint8).reshape(x.shape), "s": _e8m0_byte(scale)[..., 0]}


def _fp4_encode(x: jax.Array, fmt: str, block: int) -> dict[str, jax.Array]:
    """``x [..., C]`` → packed e2m1 bytes ``q [..., C/2]`` (even channel low) and scale bytes ``s [..., C/block]``
    (e4m3 for ``nvfp4``, ue8m0 for ``mxfp4``)."""
    g = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = jnp.max(jnp.abs(g), axis=-1, keepdims=True)
    if fmt == "nvfp4":
        s8 = jnp.minimum(jnp.maximum(amax, jnp.float32(6 * 2.0**-9)) / jnp.float32(6), jnp.float32(448))
        s8 = s8.astype(jnp.float8_e4m3fn)
        scale, scale_bytes = s8.astype(jnp.float32), jax.lax.bitcast_convert_type(s8, jnp.uint8)[..., 0]
    else:
        scale = pow2ceil(jnp.maximum(amax, jnp.float32(6 * 2.0**-126)) * jnp.float32(1 / 6))
        scale_bytes = _e8m0_byte(scale)[..., 0]
    v = jnp.clip(g / scale, -6.0, 6.0)
    code = e2m1_magnitude_code(v).astype(jnp.uint8)
    code = jnp.where(jnp.signbit(v) & (code > 0), code + 8, code).astype(jnp.uint8).reshape(x.shape)
    payload = code[..., 0::2] | (code[..., 1::2] << 4)
    return {"q": payload.astype(jnp.uint8), "s": scale_bytes}


def encode(x: jax.Array, fmt: str, rope: int = 0) -> dict[str, jax.Array]:
    """``x [..., C]`` → the record's uint8 leaves (``rope``: the RoPE channels of ``fp8_ds_mla``)."""
    block, _ = RECORD_FORMATS[fmt]
    if fmt == "fp8_ds_mla":
        _check_rope(rope)
    c = x.shape[-1] - (rope if fmt == "fp8_ds_mla" else 0)
    if c % block:
        raise ValueError(f"{fmt} records need a multiple of {block} quantized channels, got {c}")
    if fmt == "fp8":
        return _fp8_encode(x, block)
    if fmt != "fp8_ds_mla":
        return _fp4_encode(x, fmt, block)
    head = _fp8_encode(x[..., :c], block)
    pad = record_widths(fmt, x.shape[-1], rope)["s"] - head["s"].shape[-1]
    words = jax.lax.bitcast_convert_type(x[..., c:].astype(jnp.bfloat16), jnp.uint8)    # [..., rope, 2] little-endian
    return {"q": head["q"], "s": jnp.pad(head["s"], [(0, 0)] * (x.ndim - 1) + [(0, pad)]),
            "r": words.reshape(*x.shape[:-1], 2 * rope)}


def _scaled(values: jax.Array, scale: jax.Array, block: int) -> jax.Array:
    c = values.shape[-1]
    return (values.reshape(*values.shape[:-1], c // block, block) * scale[..., None]).reshape(values.shape)


def decode(record: dict, fmt: str, dtype) -> jax.Array:
    """A record's leaves (`encode`) → values ``[..., C]`` in ``dtype``."""
    block, _ = RECORD_FORMATS[fmt]
    payload, scale_bytes = record["q"], record["s"]
    if fmt in ("fp8", "fp8_ds_mla"):
        values = jax.lax.bitcast_convert_type(payload, jnp.float8_e4m3fn).astype(jnp.float32)
        out = _scaled(values, _e8m0_value(scale_bytes[..., :payload.shape[-1] // block]), block)
        if fmt == "fp8_ds_mla":
            pairs = record["r"].reshape(*record["r"].shape[:-1], -1, 2)
            out = jnp.concatenate([out, jax.lax.bitcast_convert_type(pairs, jnp.bfloat16).astype(jnp.float32)], -1)
        return out.astype(dtype)
    table = jnp.asarray(FP4_TABLE)
    values = jnp.stack([table[payload & 15], table[payload >> 4]], axis=-1)
    values = values.reshape(*payload.shape[:-1], 2 * payload.shape[-1])
    scale = (jax.lax.bitcast_convert_type(scale_bytes, jnp.float8_e4m3fn).astype(jnp.float32) if fmt == "nvfp4"
             else _e8m0_value(scale_bytes))
    return _scaled(values, scale, block).astype(dtype)
