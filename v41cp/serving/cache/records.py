"""Byte records of the decode caches in the release's formats (docs/architecture.md), in jnp.

* window KV, FP8: e4m3 bytes ``[..., D]`` + ue8m0 exponent bytes ``[..., D/32]`` (528 B at D = 512);
* compressed KV, NVFP4: packed e2m1 ``[..., D/2]`` + e4m3 scale bytes ``[..., D/16]`` (288 B);
* index keys, MXFP4: packed e2m1 ``[..., Di/2]`` + ue8m0 exponent bytes ``[..., Di/32]`` (68 B).

``decode(encode(x))`` equals the fake-quant `v41cp.quant.fake_quant(x)` value for value (tested; an e2m1
−0 comes back as +0, as the release's decoder table has it), so a cache of records computes exactly
what the full-sequence forward computes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v41cp.quant import FP4_TABLE, e2m1_magnitude_code, pow2ceil

__all__ = ["RECORD_FORMATS", "encode", "decode", "record_bytes"]

# format → (block, scale kind)
RECORD_FORMATS = {"fp8": (32, "e8m0"), "nvfp4": (16, "e4m3"), "mxfp4": (32, "e8m0")}


def record_bytes(fmt: str, channels: int) -> int:
    """Bytes of one record of ``channels`` values."""
    block, _ = RECORD_FORMATS[fmt]
    payload = channels if fmt == "fp8" else channels // 2
    return payload + channels // block


def _e8m0_byte(scale: jax.Array) -> jax.Array:
    return ((jax.lax.bitcast_convert_type(scale, jnp.int32) >> 23) & 255).astype(jnp.uint8)


def _e8m0_value(b: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(b.astype(jnp.int32) << 23, jnp.float32)


def encode(x: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
    """``x [..., C]`` → (payload bytes, scale bytes), both uint8."""
    block, _ = RECORD_FORMATS[fmt]
    c = x.shape[-1]
    if c % block:
        raise ValueError(f"{fmt} records need a multiple of {block} channels, got {c}")
    g = x.astype(jnp.float32).reshape(*x.shape[:-1], c // block, block)
    amax = jnp.max(jnp.abs(g), axis=-1, keepdims=True)
    if fmt == "fp8":
        scale = pow2ceil(jnp.maximum(amax, jnp.float32(1e-4)) * jnp.float32(1 / 448))
        q = jnp.clip(g / scale, -448.0, 448.0).astype(jnp.float8_e4m3fn)
        payload = jax.lax.bitcast_convert_type(q, jnp.uint8).reshape(x.shape)
        return payload, _e8m0_byte(scale)[..., 0]
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
    return payload.astype(jnp.uint8), scale_bytes


def decode(payload: jax.Array, scale_bytes: jax.Array, fmt: str, dtype) -> jax.Array:
    """(payload, scale bytes) → values ``[..., C]`` in ``dtype``."""
    block, _ = RECORD_FORMATS[fmt]
    if fmt == "fp8":
        values = jax.lax.bitcast_convert_type(payload, jnp.float8_e4m3fn).astype(jnp.float32)
        scale = _e8m0_value(scale_bytes)
    else:
        table = jnp.asarray(FP4_TABLE)
        values = jnp.stack([table[payload & 15], table[payload >> 4]], axis=-1)
        values = values.reshape(*payload.shape[:-1], 2 * payload.shape[-1])
        scale = (jax.lax.bitcast_convert_type(scale_bytes, jnp.float8_e4m3fn).astype(jnp.float32) if fmt == "nvfp4"
                 else _e8m0_value(scale_bytes))
    c = values.shape[-1]
    out = values.reshape(*values.shape[:-1], c // block, block) * scale[..., None]
    return out.reshape(*values.shape[:-1], c).astype(dtype)

