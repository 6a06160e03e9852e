"""Every read and write of the paged decode cache (`v41cp.serving.cache.device_cache.PagedCache`): its stores
(values or byte records) and its page addressing.

Every mode that touches the cache — the decode / verification step, the token-serial prefill, the span prefill, their
KVP (owner-masked) variants and the kernels' in-place reads — goes through these functions, so the record encoding
and the page addressing are written once.

A *store* is either an array of values (model dtype — BF16 as its 16-bit words, `as_values`; fake-quantized on
write when ``cfg.fake_quant``) or the release's byte records, a dict of uint8 leaves ``{"q": payload, "s": scales}``
(V4's ``fp8_ds_mla`` also ``"r"``: its BF16 RoPE channels; `v41cp.serving.cache.records`): V4.1's FP8 window rows,
NVFP4 compressed KV and MXFP4 index keys, V4's 584 B window rows / main entries and MXFP4 index keys (the formats:
`ModelConfig.cache_formats`). Reading a record store decodes to exactly the fake-quant values.

KVP: the global pools' ``pages`` axis is split over the mesh's ``cp`` axis; rank ``r`` holds virtual blocks
``l·N + r`` at its row ``l`` (`v41cp.sharding.ownership`). Inside a ``cp`` island a pool is the rank's rows; under
GSPMD it is the global array whose rank-``r`` rows are ``[r·LB, (r+1)·LB)``. Writes out of bounds are dropped (how
inactive rows and non-owners write nothing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from v41cp.config import ModelConfig
from v41cp.quant import quantize_as
from v41cp.serving.cache.device_cache import PagedCache, pool_spec
from v41cp.serving.cache.records import decode, encode
from v41cp.sharding.mesh import CP
from v41cp.sharding.ownership import is_owned, local_row, owner

__all__ = ["write", "read", "as_values", "stored_values", "store_rows", "entries_per_block", "cache_slots", "take_raw",
           "put_raw", "gather_pages", "entry_location", "page_rows", "write_entries", "read_pages", "write_owned",
           "restore_owned"]


# ---------------------------------------------------------------------------------------------- one store
def _leaf(store) -> jax.Array:
    return store["q"] if isinstance(store, dict) else store


def store_rows(store) -> int:
    """Leading dimension of a store (pool blocks, or layers for the window ring)."""
    return _leaf(store).shape[0]


def entries_per_block(store) -> int:
    """Rows per page of a global pool."""
    return _leaf(store).shape[1]


def cache_slots(cache) -> int:
    """Batch slots of a `PagedCache` (the window ring's declared ``slots`` axis)."""
    return _leaf(cache.swa).shape[PagedCache.axes_of("swa").index("slots")]


def stored_values(cfg: ModelConfig, values: jax.Array, fmt: str, dtype) -> jax.Array:
    """What a store returns for ``values`` written in format ``fmt`` (fake-quant when ``cfg.fake_quant``; the
    record round trip equals it value for value), in ``dtype``."""
    return (quantize_as(values, fmt, cfg.qk_rope_head_dim) if cfg.fake_quant else values).astype(dtype)


def as_values(a: jax.Array) -> jax.Array:
    """A value store's (or its selection's) values: BF16 stores hold their values' 16-bit words (uint16,
    `device_cache.declare_cache`), read back by a bitcast; other dtypes as they are."""
    return jax.lax.bitcast_convert_type(a, jnp.bfloat16) if a.dtype == jnp.uint16 else a


def _as_stored(values: jax.Array, store: jax.Array) -> jax.Array:
    """``values`` in a value store's element type (BF16 values as their uint16 words)."""
    if store.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(values.astype(jnp.bfloat16), jnp.uint16)
    return values.astype(store.dtype)


def write(cfg: ModelConfig, store, idx: tuple, values: jax.Array, fmt: str):
    """Scatter ``values`` (pre-quantization) into ``store`` at ``idx`` (out-of-bounds = dropped)."""
    if isinstance(store, dict):
        record = encode(values, fmt, cfg.qk_rope_head_dim)
        return {k: store[k].at[idx].set(v, mode="drop") for k, v in record.items()}
    if cfg.fake_quant:
        values = quantize_as(values, fmt, cfg.qk_rope_head_dim)
    return store.at[idx].set(_as_stored(values, store), mode="drop")


def read(store, fmt: str, dtype, select) -> jax.Array:
    """``select`` (an indexing function) applied to the store, decoded to values in ``dtype``."""
    if isinstance(store, dict):
        return decode({k: select(a) for k, a in store.items()}, fmt, dtype)
    return as_values(select(store)).astype(dtype)


def take_raw(store, idx: tuple):
    """The stored leaves at ``idx`` as they are (record bytes undecoded): for undo records."""
    return jax.tree.map(lambda a: a[idx], store)


def put_raw(store, idx: tuple, raw):
    """Write leaves taken by `take_raw` back at ``idx`` (out-of-bounds = dropped)."""
    return jax.tree.map(lambda a, v: a.at[idx].set(v, mode="drop"), store, raw)


def gather_pages(pages: jax.Array, tables: jax.Array) -> jax.Array:
    """``pages [NB, epb, C]`` gathered by ``tables [B, MB]`` → ``[B, MB·epb, C]`` (entry order)."""
    got = pages[jnp.maximum(tables, 0)]
    return got.reshape(tables.shape[0], -1, pages.shape[-1])


# ------------------------------------------------------------------------------ pages under KVP ownership
def entry_location(block_tables: jax.Array, j: jax.Array, epb: int):
    """Entry ids ``j [B, ·]`` of requests with ``block_tables [B, MB]`` → (virtual block ``[B, ·]``, row in the
    page, inside: the entry's page position is within the table). Entry ``j`` is in page ``j // epb``."""
    mb = block_tables.shape[1]
    blk = jnp.take_along_axis(block_tables, jnp.clip(j // epb, 0, mb - 1), axis=1)
    return blk, j % epb, j // epb < mb


def page_rows(kvp: int, in_map: bool, v: jax.Array, pool_rows: int) -> jax.Array:
    """Virtual block ids ``v`` (−1 = none) → rows of the pool to write (``pool_rows`` = out of bounds, dropped).
    ``kvp`` ranks own pages cyclically; ``in_map``: inside a ``cp`` island (the pool is this rank's rows) else
    the GSPMD global pool."""
    if kvp == 1:
        return jnp.where(v >= 0, v, pool_rows)
    if in_map:
        return jnp.where(is_owned(v, kvp, jax.lax.axis_index(CP)), local_row(v, kvp), pool_rows)
    return jnp.where(v >= 0, owner(v, kvp) * (pool_rows // kvp) + local_row(v, kvp), pool_rows)


def write_entries(cfg: ModelConfig, kvp: int, in_map: bool, store, values, j, ok, block_tables, fmt: str):
    """Entries ``values [B, Gn, ·]`` with ids ``j [B, Gn]`` (written where ``ok``) → their pages (entry ``j`` in
    block-table position ``j // epb`` at row ``j % epb``)."""
    v, row, inside = entry_location(block_tables, j, entries_per_block(store))
    v = jnp.where(ok & inside, v, -1)
    return write(cfg, store, (page_rows(kvp, in_map, v, store_rows(store)), row), values, fmt)


def read_pages(kvp: int, in_map: bool, store, block_tables, fmt: str, dtype):
    """A request's entries from its pages ``[B, MB·epb, ·]`` decoded to ``dtype`` (zeros for −1 pages). Inside a
    KVP island every rank contributes the pages it owns and one all-reduce over the group gives every rank the
    same history (records move as stored bytes: one non-zero term per page)."""
    leaves = store if isinstance(store, dict) else {"v": store}
    rows = store_rows(store)
    v = block_tables
    if kvp > 1 and in_map:
        own = is_owned(v, kvp, jax.lax.axis_index(CP))
        idx = jnp.where(own, local_row(v, kvp), 0)
        got = {k: jax.lax.psum(jnp.where(own[..., None, None], a[idx], jnp.zeros((), a.dtype)), CP)
               for k, a in leaves.items()}
    else:
        idx = jnp.maximum(page_rows(kvp, False, v, rows), 0) if kvp > 1 else jnp.maximum(v, 0)
        got = {k: jnp.where((v >= 0)[..., None, None], a[jnp.minimum(idx, rows - 1)], jnp.zeros((), a.dtype))
               for k, a in leaves.items()}
    flat = {k: a.reshape(a.shape[0], -1, a.shape[-1]) for k, a in got.items()}
    if isinstance(store, dict):
        return decode(flat, fmt, dtype)
    return as_values(flat["v"]).astype(dtype)


def write_owned(plan, cfg: ModelConfig, pool, blk: jax.Array, row: jax.Array, values: jax.Array, emits: jax.Array,
                fmt: str, keep_old: bool = False):
    """KVP owner-masked write (a ``cp`` island of ``plan``): ``values [R, C]`` (replicated, pre-quantization) to
    virtual block ``blk [R]`` row ``row [R]`` where ``emits``; only the page's owner writes, at its local row.
    ``keep_old``: also return what each rank's pool held there (`take_raw` leaves, ``[N, R, ·]`` split over
    ``cp``; a rank's rows it does not own are zeros), for `restore_owned`."""
    n = plan.n

    def body(pool, blk, row, values, emits):
        r = jax.lax.axis_index(CP)
        lb = store_rows(pool)
        own = emits & is_owned(blk, n, r)
        at = (jnp.where(own, local_row(blk, n), lb), row)
        new = write(cfg, pool, at, values, fmt)
        if not keep_old:
            return new
        old = take_raw(pool, (jnp.minimum(at[0], lb - 1), row))
        return new, jax.tree.map(lambda a: a[None], old)

    spec = jax.tree.map(lambda _: pool_spec(), pool)
    out = (spec, spec) if keep_old else spec
    return plan.shard_map(body, (spec, P(), P(), P(), P()), out)(pool, blk, row, values, emits)


def restore_owned(plan, pool, blk: jax.Array, row: jax.Array, old, undo: jax.Array):
    """Undo of `write_owned`: where ``undo [R]``, the owner of ``blk`` puts back its kept ``old`` leaves."""
    n = plan.n

    def body(pool, blk, row, old, undo):
        lb = store_rows(pool)
        own = undo & is_owned(blk, n, jax.lax.axis_index(CP))
        return put_raw(pool, (jnp.where(own, local_row(blk, n), lb), row), jax.tree.map(lambda a: a[0], old))

    spec = jax.tree.map(lambda _: pool_spec(), pool)
    return plan.shard_map(body, (spec, P(), P(), spec, P()), spec)(pool, blk, row, old, undo)
