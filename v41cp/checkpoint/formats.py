"""The release's weight storage formats, on the host in NumPy (docs/architecture.md).

* dense FP8: e4m3 ``[out, in]`` with ``float8_e8m0fnu`` scales ``[ceil(out/b), ceil(in/b)]`` over b×b blocks
  (V4.1: b = 32; V4: b = 128; ``quantization_config.weight_block_size``), ragged edge blocks allowed;
* routed experts FP4: e2m1 codes packed two per int8 ``[out, in/2]`` (even column in the low
  nibble), e8m0 scales ``[out, ceil(in/32)]``;
* Engram tables FP8: e4m3 ``[rows, dim]`` with e8m0 scales ``[rows, dim/32]`` (per row).

Dequantization is exact in FP32 (e4m3/e2m1 values times a power of two) and then cast to the
target dtype. The quantizers (used to write release-format checkpoints: the embedded tiny model,
test fixtures, synthetic benchmark inputs) use ue8m0 power-of-two scales: FP8 ``2^⌈log2(max(amax,
1e-4)/448)⌉``, FP4 ``2^⌈log2(max(amax, 6·2⁻¹²⁶)/6)⌉`` with e2m1 ties to the even code.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from v41cp.quant import FP4_TABLE

__all__ = ["FP4_TABLE", "dequant_fp8_blocks", "dequant_fp8_rows", "dequant_fp4_rows", "quant_fp8_blocks",
           "quant_fp8_rows", "quant_fp4_rows", "block_scale_shape", "row_scale_shape"]

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)


def block_scale_shape(shape: tuple[int, int], block: int = 32) -> tuple[int, int]:
    """Scale shape of a dense FP8 ``[out, in]`` weight (``block``×``block`` blocks, ragged edges rounded up)."""
    return (-(-shape[0] // block), -(-shape[1] // block))


def row_scale_shape(shape: tuple[int, int]) -> tuple[int, int]:
    """Scale shape of a per-row / 32-column format (FP4 experts, FP8 Engram rows)."""
    return (shape[0], -(-shape[1] // 32))


def _expand_cols(scale: np.ndarray, cols: int, block: int = 32) -> np.ndarray:
    return np.repeat(scale.astype(np.float32), block, axis=1)[:, :cols]


def dequant_fp8_blocks(weight: np.ndarray, scale: np.ndarray, dtype=np.float32, block: int = 32) -> np.ndarray:
    """Dense FP8 e4m3 ``[out, in]`` × ``block``×``block``-block e8m0 scales → ``dtype``."""
    rows, cols = weight.shape
    if scale.shape != block_scale_shape(weight.shape, block):
        raise ValueError(f"FP8 block scale shape {scale.shape} does not match weight {weight.shape} "
                         f"(expected {block_scale_shape(weight.shape, block)})")
    s = np.repeat(_expand_cols(scale, cols, block), block, axis=0)[:rows]
    return (np.asarray(weight).astype(np.float32) * s).astype(dtype)


def dequant_fp8_rows(weight: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """FP8 e4m3 rows ``[rows, dim]`` × per-row/32-column e8m0 scales → ``dtype`` (Engram tables)."""
    if scale.shape != row_scale_shape(weight.shape):
        raise ValueError(f"scale shape {scale.shape} does not match weight {weight.shape} "
                         f"(expected {row_scale_shape(weight.shape)})")
    return (np.asarray(weight).astype(np.float32) * _expand_cols(scale, weight.shape[1])).astype(dtype)


def dequant_fp4_rows(packed: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """Packed e2m1 ``[out, in/2]`` (int8, even column in the low nibble) × e8m0 ``[out, in/32]`` → ``[out, in]``."""
    raw = np.asarray(packed).view(np.uint8)
    rows, cols = raw.shape[0], raw.shape[1] * 2
    if scale.shape != row_scale_shape((rows, cols)):
        raise ValueError(f"scale shape {scale.shape} does not match FP4 weight {(rows, cols)} "
                         f"(expected {row_scale_shape((rows, cols))})")
    values = np.empty((rows, cols), np.float32)
    values[:, 0::2] = FP4_TABLE[raw & 15]
    values[:, 1::2] = FP4_TABLE[raw >> 4]
    return (values * _expand_cols(scale, cols)).astype(dtype)


def _pow2ceil(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, np.float32).view(np.int32)
    exponent = (bits >> 23) & 255
    inc = ((bits & ((1 << 23) - 1)) != 0).astype(np.int32)
    return ((exponent + inc) << 23).astype(np.int32).view(np.float32)


def _blocks(x: np.ndarray, rb: int, cb: int) -> np.ndarray:
    """Per-block amax of ``x [R, C]`` over rb×cb blocks (zero-padded ragged edges)."""
    r, c = x.shape
    pad = np.pad(np.abs(x), ((0, -r % rb), (0, -c % cb)))
    return pad.reshape(pad.shape[0] // rb, rb, pad.shape[1] // cb, cb).max(axis=(1, 3))


def _scaled(x: np.ndarray, scale: np.ndarray, rb: int, cb: int = 32) -> np.ndarray:
    s = np.repeat(_expand_cols(scale, x.shape[1], cb), rb, axis=0)[: x.shape[0]]
    return x / s


def quant_fp8_blocks(x: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """``[out, in]`` → (e4m3 weight, e8m0 scales over ``block``×``block`` blocks)."""
    x = np.asarray(x, np.float32)
    scale = _pow2ceil(np.maximum(_blocks(x, block, block), np.float32(1e-4)) / np.float32(448))
    q = np.clip(_scaled(x, scale, block, block), -448, 448).astype(E4M3)
    return q, scale.astype(E8M0)


def quant_fp8_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[rows, dim]`` → (e4m3 rows, e8m0 per-row/32-column scales)."""
    x = np.asarray(x, np.float32)
    scale = _pow2ceil(np.maximum(_blocks(x, 1, 32), np.float32(1e-4)) / np.float32(448))
    q = np.clip(_scaled(x, scale, 1), -448, 448).astype(E4M3)
    return q, scale.astype(E8M0)


def quant_fp4_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[out, in]`` (``in`` even) → (packed int8 ``[out, in/2]``, e8m0 ``[out, ceil(in/32)]``)."""
    x = np.asarray(x, np.float32)
    if x.shape[1] % 2:
        raise ValueError(f"FP4 packing needs an even input dimension, got {x.shape}")
    scale = _pow2ceil(np.maximum(_blocks(x, 1, 32), np.float32(6 * 2.0**-126)) / np.float32(6))
    v = np.clip(_scaled(x, scale, 1), -6, 6)
    mag = np.abs(v)
    lower = (mag[..., None] > _MIDPOINTS).sum(-1)
    tie = mag == _MIDPOINTS[np.minimum(lower, 6)]
    code = (lower + (tie & (lower % 2 == 1))).astype(np.uint8)
    code = np.where((v < 0) & (code > 0), code + 8, code).astype(np.uint8)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    return packed, scale.astype(E8M0)
