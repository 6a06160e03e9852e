"""The device cache declared once: `PagedCache` (a registered dataclass), each leaf's shape, dtype, logical axes and
initial value (`declare_cache`), and what follows from that declaration — the abstract cache (`cache_layout`), its
partition specs (`cache_specs`) and the zeroed cache on the devices (`init_cache`).

Fields (``L`` layers, ``B`` batch slots, ``W`` window, ``NB`` logical blocks of ``block_tokens`` tokens, ``epb =
block_tokens / ratio`` entries per block of a ratio-``ρ`` KV source, ``D`` / ``Di`` head / index-head dims):

* ``swa [L, B, W, ·]`` — the window ring: row ``p % W`` of slot ``b`` holds the window KV of position ``p``;
* ``ckv[g] / ikey[g] [NB, epb, ·]`` per KV source ``g`` (its layer index as a string) — the paged global pools:
  entry ``j`` of a request lives in block ``block_table[j // epb]`` at row ``j % epb``;
* ``open_kv[g] / open_score[g] [B, D]`` FP32 per ratio-2 source — the open pair's first row (compressor projections);
  DeepSeek-V4: per compressor a ring of its last ``n`` rows' projections, flattened ``[B, n·width]`` (HCA ``n = r``,
  width ``D``; CSA ``n = 2r``, width ``2D``, and its indexer's under ``"<g>i"``, width ``2·Di``).

A *store* (``swa``, each pool) is an array of values in the model dtype (BF16 as its uint16 words), or the release's
byte records ``{"q": payload, "s": scale}`` (uint8; V4.1 FP8 window rows, NVFP4 compressed KV, MXFP4 index keys;
DeepSeek-V4 its 584 B window rows / entries ``{"q", "s", "r"}`` and MXFP4 index keys: `ModelConfig.cache_formats`,
`v41cp.serving.cache.records`).

Each field declares its logical axes (``layers``, ``slots``, ``window``, ``pages``, ``page_rows``, ``channels``);
partitioning maps those names to mesh axes (`CACHE_RULES`): under KVP the ``pages`` axis is split page-cyclically over
the mesh's ``cp`` axis (rank ``r`` holds virtual block ``l·N + r`` at its row ``l``: `v41cp.sharding.ownership`),
everything else is replicated. No sharding is chosen by a field's name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from v41cp.config import LayerRole, ModelConfig
from v41cp.layers.common import dtype_of
from v41cp.serving.cache.records import record_widths
from v41cp.sharding.mesh import CP
from v41cp.sharding.rules import AxisRules

__all__ = ["ArrayDecl", "PagedCache", "DraftCache", "CACHE_RULES", "POOLS", "kv_groups", "declare_cache",
           "cache_layout", "cache_specs", "init_cache", "pool_spec", "pool_sharding", "SLOT_FIELDS",
           "declare_draft_cache", "init_draft_cache"]

# logical cache axis → mesh axis under KVP (the global pools' pages over cp); without KVP every axis is replicated
CACHE_RULES = AxisRules((("pages", CP),))


@dataclass(frozen=True)
class ArrayDecl:
    """One cache leaf: ``shape``, ``dtype``, ``axes`` (its logical axis names, one per dimension) and ``init``
    (``init(shape, dtype)`` → its initial value)."""

    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str, ...]
    init: Callable = jnp.zeros

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"cache leaf of shape {self.shape} declares {len(self.axes)} axes {self.axes}")


def _axes(*names: str):
    return dataclasses.field(metadata={"axes": names})


class _Declared:
    """What a declared cache (a registered dataclass whose fields declare their leaves' logical axes) offers."""

    def replace(self, **fields):
        return dataclasses.replace(self, **fields)

    @classmethod
    def axes_of(cls, name: str) -> tuple[str, ...]:
        """The logical axes of field ``name``'s leaves."""
        return {f.name: f for f in dataclasses.fields(cls)}[name].metadata["axes"]

    @classmethod
    def slot_fields(cls) -> tuple[str, ...]:
        """The fields with a ``slots`` axis (a request's bounded state outside the pages)."""
        return tuple(f.name for f in dataclasses.fields(cls) if "slots" in f.metadata["axes"])

    def per_slot(self) -> dict:
        """The fields with a ``slots`` axis: ``{field: subtree}``."""
        return {f: getattr(self, f) for f in self.slot_fields()}


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PagedCache(_Declared):
    """The decode state of every batch slot and the paged global pools (see the module docstring). Its leaves are
    device arrays in a step, `jax.ShapeDtypeStruct` in `cache_layout`, `ArrayDecl` in `declare_cache`."""

    swa: Any = _axes("layers", "slots", "window", "channels")           # store [L, B, W, ·]
    ckv: dict = _axes("pages", "page_rows", "channels")                 # {source: store [NB, epb, ·]}
    ikey: dict = _axes("pages", "page_rows", "channels")                # {source: store [NB, epb, ·]}
    open_kv: dict = _axes("slots", "channels")                          # {source: [B, D] FP32}
    open_score: dict = _axes("slots", "channels")                       # {source: [B, D] FP32}

    def pool(self, name: str) -> dict:
        """Global pool ``name`` (one of `POOLS`): ``{source: store}``."""
        if name not in POOLS:
            raise KeyError(f"{name!r} is not a paged pool of the cache (pools: {POOLS})")
        return getattr(self, name)

    def with_pool(self, name: str, source: str, store) -> PagedCache:
        """The cache with pool ``name``'s store of ``source`` replaced."""
        return self.replace(**{name: {**self.pool(name), source: store}})

    def axes(self) -> PagedCache:
        """The same tree with each leaf replaced by its field's logical axes (a `P` of axis names)."""
        return PagedCache(**{f.name: jax.tree.map(lambda _, n=f.name: P(*self.axes_of(n)), getattr(self, f.name))
                             for f in dataclasses.fields(self)})


POOLS = tuple(f.name for f in dataclasses.fields(PagedCache) if "pages" in f.metadata["axes"])  # ("ckv", "ikey")
SLOT_FIELDS = PagedCache.slot_fields()                                          # swa, open_kv, open_score


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DraftCache(_Declared):
    """The drafter's context windows: row ``t mod W`` of a slot holds, per drafter stage, the key of position ``t``
    (DSpark: of the target feature there; V4's MTP layer: of its input there, from the target's streams and the
    next token). ``last``: V4's MTP only, the target's output streams at each slot's last fed position (the next
    draft's first row; ``[B, 0]`` for DSpark) and ``fed``, the position after it (``[B, 1]`` int32; 0: nothing
    fed). Replicated (the drafter runs replicated)."""

    keys: Any = _axes("stages", "slots", "window", "channels")          # [K, B, W, D] model dtype
    last: Any = _axes("slots", "channels")                              # [B, hc·H] model dtype (MTP) | [B, 0]
    fed: Any = _axes("slots", "channels")                               # [B, 1] int32 (MTP) | [B, 0]


def declare_draft_cache(cfg: ModelConfig, max_batch: int) -> DraftCache:
    """The drafter's cache for ``max_batch`` slots, as `ArrayDecl` leaves."""
    shape = (cfg.num_nextn_predict_layers, max_batch, cfg.sliding_window, cfg.head_dim)
    mtp = cfg.has_mtp
    return DraftCache(keys=ArrayDecl(shape, dtype_of(cfg.dtype), DraftCache.axes_of("keys")),
                      last=ArrayDecl((max_batch, cfg.hc_mult * cfg.hidden_size if mtp else 0), dtype_of(cfg.dtype),
                                     DraftCache.axes_of("last")),
                      fed=ArrayDecl((max_batch, int(mtp)), jnp.int32, DraftCache.axes_of("fed")))


def _initial(decl):
    """A declared cache (`ArrayDecl` leaves) → each leaf at its initial value."""
    return jax.tree.map(lambda d: d.init(d.shape, d.dtype), decl, is_leaf=lambda x: isinstance(x, ArrayDecl))


def init_draft_cache(cfg: ModelConfig, max_batch: int, sharding=None) -> DraftCache:
    """The drafter's cache at its declared initial value (zeros), on ``sharding`` (e.g. a replicated
    NamedSharding; default: uncommitted)."""
    cache = _initial(declare_draft_cache(cfg, max_batch))
    return cache if sharding is None else jax.device_put(cache, sharding)


def kv_groups(cfg: ModelConfig) -> list[LayerRole]:
    """The KV sources (one global cache group each), in layer order."""
    return [r for r in cfg.layer_roles if r.is_kv_source]


def declare_cache(cfg: ModelConfig, num_blocks: int, block_tokens: int, max_batch: int,
                  records: bool | None = None) -> PagedCache:
    """Every leaf of the cache for ``num_blocks`` logical blocks of ``block_tokens`` tokens and ``max_batch`` slots, as
    an `ArrayDecl`. ``records`` (default: ``cfg.fake_quant``) stores the release's byte records; otherwise values in
    the model dtype."""
    dt = dtype_of(cfg.dtype)
    records = cfg.fake_quant if records is None else records
    if records and not cfg.fake_quant:
        raise ValueError("byte records are the fake-quant formats: records=True needs cfg.fake_quant")
    d, di = cfg.head_dim, cfg.index_head_dim
    formats = cfg.cache_formats

    def store(field: str, shape: tuple, fmt: str):
        axes = PagedCache.axes_of(field)
        c = di if field == "ikey" else d
        if not records:
            # BF16 values are held as their 16-bit words (uint16; `paged.as_values` bitcasts them back): XLA:CPU runs
            # a BF16 scatter in FP32 on a copy of the whole store, a 16-bit integer scatter in place
            return ArrayDecl((*shape, c), jnp.uint16 if dt == jnp.bfloat16 else dt, axes)
        return {k: ArrayDecl((*shape, w), jnp.uint8, axes)
                for k, w in record_widths(fmt, c, cfg.qk_rope_head_dim).items()}

    ckv, ikey, open_kv, open_score = {}, {}, {}, {}
    for g in kv_groups(cfg):
        if block_tokens % g.ratio:
            raise ValueError(f"block_tokens={block_tokens} is not a multiple of layer {g.index}'s ratio {g.ratio}")
        src, epb = str(g.index), block_tokens // g.ratio
        ckv[src] = store("ckv", (num_blocks, epb), formats.entries)
        if cfg.is_v4:
            # V4: each compressor's ring of its last n rows' FP32 projections (flattened [B, n·width]): HCA n = r;
            # CSA n = 2r (the window before the open one), for the layer's compressor and its indexer's ("<g>i")
            n = g.window_rows
            rings = {src: n * d * (2 if g.overlapping else 1)}       # CSA's compressor projects to 2·D
            if g.is_index_source:
                ikey[src] = store("ikey", (num_blocks, epb), formats.index)
                rings[src + "i"] = n * 2 * di
            for key, width in rings.items():
                open_kv[key] = ArrayDecl((max_batch, width), jnp.float32, PagedCache.axes_of("open_kv"))
                open_score[key] = ArrayDecl((max_batch, width), jnp.float32, PagedCache.axes_of("open_score"))
            continue
        ikey[src] = store("ikey", (num_blocks, epb), formats.index)
        if g.ratio > 1:
            if g.ratio != 2:
                raise ValueError(f"the decode cache supports compress ratios 1 and 2, layer {g.index} has {g.ratio}")
            open_kv[src] = ArrayDecl((max_batch, d), jnp.float32, PagedCache.axes_of("open_kv"))
            open_score[src] = ArrayDecl((max_batch, d), jnp.float32, PagedCache.axes_of("open_score"))
    swa = store("swa", (cfg.num_hidden_layers, max_batch, cfg.sliding_window), formats.window)
    return PagedCache(swa=swa, ckv=ckv, ikey=ikey, open_kv=open_kv, open_score=open_score)


def _spec(axes: P, rules: AxisRules | None) -> P:
    """Logical axes → partition spec (trailing replicated dimensions dropped, as `P(CP)` is written)."""
    spec = [rules.mesh_axis(a) if rules is not None else None for a in axes]
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def cache_specs(cache: PagedCache, kv_parallel: bool) -> PagedCache:
    """Every leaf's `PartitionSpec`, from its logical axes (`CACHE_RULES` under KVP, else all replicated). ``cache``:
    a cache of any leaves (arrays, abstract arrays or `ArrayDecl`)."""
    rules = CACHE_RULES if kv_parallel else None
    return jax.tree.map(lambda axes: _spec(axes, rules), cache.axes(), is_leaf=lambda x: isinstance(x, P))


def pool_spec() -> P:
    """Partition spec of a global pool's leaves under KVP (its ``pages`` axis over ``cp``)."""
    return _spec(P(*PagedCache.axes_of(POOLS[0])), CACHE_RULES)


def pool_sharding(mesh) -> NamedSharding:
    """Sharding of a global cache pool under KVP (its ``pages`` axis over ``cp``)."""
    return NamedSharding(mesh, pool_spec())


def cache_layout(cfg: ModelConfig, num_blocks: int, block_tokens: int, max_batch: int, sharding=None,
                 records: bool | None = None, plan=None) -> PagedCache:
    """The cache `init_cache` allocates, as ``jax.ShapeDtypeStruct`` leaves carrying their shardings (nothing is
    allocated: for compiling a step ahead of its cache, `v41cp.plan`). ``sharding``: of every leaf without KVP
    (default: the first device); ``plan`` (KVP, a `v41cp.serving.attention.dcp.DCPPlan`): ``num_blocks`` counts
    virtual blocks (a multiple of the group size N) and the leaves follow `cache_specs` on the plan's mesh."""
    decl = declare_cache(cfg, num_blocks, block_tokens, max_batch, records)
    is_decl = lambda x: isinstance(x, ArrayDecl)
    if plan is None:
        one = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, decl, is_leaf=is_decl)
    else:
        if num_blocks % plan.n:
            raise ValueError(f"num_blocks={num_blocks} must be a multiple of kv_parallel_size={plan.n}")
        shardings = jax.tree.map(lambda spec: NamedSharding(plan.mesh, spec), cache_specs(decl, True),
                                 is_leaf=lambda x: isinstance(x, P))
    return jax.tree.map(lambda d, sh: jax.ShapeDtypeStruct(d.shape, d.dtype, sharding=sh), decl, shardings,
                        is_leaf=is_decl)


def init_cache(cfg: ModelConfig, num_blocks: int, block_tokens: int, max_batch: int, sharding=None,
               records: bool | None = None, plan=None) -> PagedCache:
    """The cache of `cache_layout`, each leaf at its declared initial value (zeros), committed to its sharding so that
    every step sees the same input types; each device allocates only its own shard (no full-size staging copy)."""
    decl = declare_cache(cfg, num_blocks, block_tokens, max_batch, records)
    layout = cache_layout(cfg, num_blocks, block_tokens, max_batch, sharding, records, plan)
    return jax.jit(lambda: _initial(decl), out_shardings=jax.tree.map(lambda a: a.sharding, layout))()
