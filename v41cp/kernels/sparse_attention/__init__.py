"""Sparse attention over paged V4.1 caches: the window pool and the index-selected compressed entries in
one softmax (the FlashMLA sparse-decode contract).

`sparse_attention(q, stores, indices, lengths=None, sink=None, backend=...)`:

* ``q [R, H, D]``: query rows (decode: one per request; prefill: one per token), any float dtype;
* ``stores``: the key pools, each addressed by **physical slot** (row of the flattened pool): an
  unquantized ``[N, D]`` array, or the release's byte records ``{"q", "s"}`` — FP8 window rows
  (``q [N, D]``, ue8m0 per 32) or NVFP4 compressed KV (``q [N, D/2]``, e4m3 per 16) — or DeepSeek-V4's 584 B
  window rows / entries ``{"q", "s", "r"}`` (``fp8_ds_mla``), decoded on the fly;
* ``indices``: per store ``[R, K_i]`` int32 slots with −1 padding; ``lengths``: per store ``[R]`` — only
  the first ``lengths`` slots are read (so padding costs nothing in the kernel);
* returns ``(o [R, H, D] FP32, lse [R, H] FP32)``: the output **without** the sink and the natural-log LSE
  (a row with no valid key: ``o = 0``, ``lse = −inf``). ``sink [H]`` (optional) is an epilogue on the output
  only (`v41cp.sharding.lse_merge.apply_sink`), so DCP can merge partials first and apply it once.

Backends: ``"xla"`` (`sparse_attention_reference`) or ``"pallas"`` (`sparse_attention_pallas`; interpret mode
off the GPU). Kernel parameters: ``block_h`` heads per program (default: all heads, padded to a power of two
≥ 16, so every key is read once per row; at most 32 with FP32 queries, for shared memory), ``block_k`` slots per
tile, ``splits`` parts of the key list per row (default `v41cp.kernels.default_splits`: enough programs to fill the
GPU; merged exactly by LSE),
``num_warps`` (default 8 for 64-head blocks, else 4) and ``num_stages``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v41cp.kernels import check_backend, cost_scope, default_splits, nbytes, on_platform, pow2_at_least, row_bytes
from v41cp.kernels.dequant import merge_channels, record_refs, split_channels
from v41cp.kernels.sparse_attention.pallas_triton import sparse_attention_pallas
from v41cp.kernels.sparse_attention.reference import gather_keys, sparse_attention_reference
from v41cp.sharding.lse_merge import apply_sink, merge_partials

__all__ = ["sparse_attention", "sparse_attention_reference", "sparse_attention_pallas", "store_format",
           "flatten_store", "gather_keys"]


def store_format(store, channels: int) -> str | None:
    """The record format of a store: None (values), ``"fp8"`` or ``"nvfp4"`` (from the payload width), or
    DeepSeek-V4's ``"fp8_ds_mla"`` (its BF16 RoPE leaf ``"r"``)."""
    if not isinstance(store, dict):
        return None
    width = store["q"].shape[-1]
    if "r" in store:
        nope, scales = width, store["s"].shape[-1]
        # one scale byte per 64 payload bytes, padded to 8 (`records.record_widths`)
        if nope + store["r"].shape[-1] // 2 == channels and scales == -(-nope // 512) * 8:
            return "fp8_ds_mla"
        raise ValueError(f"unknown record layout: payload width {width}, RoPE bytes {store['r'].shape[-1]} for "
                         f"{channels} channels")
    if width == channels:
        return "fp8"
    if width == channels // 2 and store["s"].shape[-1] == channels // 16:
        return "nvfp4"
    raise ValueError(f"unknown record layout: payload width {width}, scale width {store['s'].shape[-1]} "
                     f"for {channels} channels")


def flatten_store(store):
    """A pool ``[..., slots, C]`` (or a record dict of such) → rows ``[N, C]`` addressed by physical slot. A value
    store of uint16 words holds BF16 values (`v41cp.serving.cache.paged.as_values`): bitcast back."""
    if not isinstance(store, dict) and store.dtype == jnp.uint16:
        store = jax.lax.bitcast_convert_type(store, jnp.bfloat16)
    return jax.tree.map(lambda a: a.reshape(-1, a.shape[-1]), store)


def _pad_to(x: jax.Array, axis: int, multiple: int, value) -> jax.Array:
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def sparse_attention(q: jax.Array, stores, indices, lengths=None, sink: jax.Array | None = None,
                     backend: str = "xla", block_h: int | None = None, block_k: int = 32, splits: int | None = None,
                     num_warps: int | None = None, num_stages: int = 2, interpret: bool | None = None):
    """See the module docstring. Returns ``(o, lse)``; with ``sink``, ``o`` has the sink applied
    (``lse`` never includes it)."""
    check_backend(backend, "attention_backend")
    d = q.shape[-1]
    stores, indices = tuple(stores), tuple(indices)
    formats = tuple(store_format(s, d) for s in stores)
    if lengths is None:
        lengths = tuple(jnp.full((q.shape[0],), i.shape[1], jnp.int32) for i in indices)
    if backend == "xla":
        o, lse = sparse_attention_reference(q, stores, formats, indices, lengths)
    else:
        r, h, _ = q.shape
        # all heads per program, but at most 32 with FP32 queries: 64 FP32 heads × 512 channels and the key
        # tiles exceed an H200 program's 227 KiB of shared memory (measured, 2026-12-04)
        block_h = block_h or min(pow2_at_least(h), 64 if q.dtype != jnp.float32 else 32)
        q_e, q_o = (_pad_to(x, 1, block_h, 0) for x in split_channels(q))
        refs = tuple(record_refs(s, f) for s, f in zip(stores, formats))
        idx = tuple(_pad_to(i.astype(jnp.int32), 1, block_k, -1) for i in indices)
        lens = jnp.stack([jnp.minimum(n, i.shape[1]) for n, i in zip(lengths, indices)], axis=1).astype(jnp.int32)
        tiles = sum(i.shape[1] // block_k for i in idx)
        splits = splits or default_splits(r * q_e.shape[1] // block_h, tiles)
        warps = num_warps or (8 if block_h >= 64 else 4)
        call = lambda q_e, q_o, refs, idx, lens, interpret: sparse_attention_pallas(
            q_e, q_o, refs, formats, idx, lens, block_h=block_h, block_k=block_k, splits=splits, num_warps=warps,
            num_stages=num_stages, interpret=interpret)
        # per call (grid: rows × head blocks × splits): each program loads its query block and its row's lengths,
        # and its split of every listed entry's record and index for its head block (all listed entries valid:
        # an upper bound); the split partials written; QKᵀ and PV over every listed entry
        listed = sum(i.shape[0] * i.shape[1] for i in idx)
        blocks = q_e.shape[1] // block_h
        read = splits * nbytes(q_e, q_o) + blocks * splits * nbytes(lens) \
            + blocks * sum(i.shape[0] * i.shape[1] * (row_bytes(f) + 4) for i, f in zip(idx, refs))
        written = r * splits * q_e.shape[1] * (2 * q_e.shape[2] + 1) * 4
        with cost_scope(read, written, 4 * listed * q_e.shape[1] * d, q.dtype):
            o_e, o_o, lse = on_platform(call, q_e, q_o, refs, idx, lens, interpret=interpret)
        o, lse = merge_channels(o_e, o_o)[:, :, :h], lse[:, :, :h]            # [R, splits, H, D], [R, splits, H]
        if splits == 1:
            o, lse = o[:, 0], lse[:, 0]
        else:
            o, lse = merge_partials(jnp.moveaxis(o, 1, 0), jnp.moveaxis(lse, 1, 0))
    if sink is not None:
        o = apply_sink(o, lse, sink)
    return o, lse
