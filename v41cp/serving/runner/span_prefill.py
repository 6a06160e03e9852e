"""Span prefill: a batch of prompts through the one model (`v41cp.model.Transformer`) in one pass (rows in
parallel, not token-serial), writing the paged decode caches and returning the logits of each prompt's last row.

`prefill_span(params, cache, meta, cfg, layout)` — ``meta`` from `build_span_metadata`; ``layout``
(`SpanLayout`, static) says how the rows are partitioned. Every layout runs the same model; they differ in the
rows backend and the shard the modules get:

* one device, or GSPMD over a plain-TP / KVP mesh (``query_parallel=False``): the pass's rows as packed cached
  rows (`v41cp.serving.attention.paged_rows`: the requests' rows back to back, ``rows`` = the metadata's row capacity, so
  a ragged batch computes Σ lengths rows, not batch × longest; KVP through the DCP islands, operator-local QCP
  through the layers' islands);
* **model-wide QCP** (``query_parallel=True``, N = attention TP): one ``jax.shard_map`` over attention TP. Each
  rank holds its rows of the per-request zigzag plan from the embedding to the final norm; the modules' shard is
  the `v41cp.sharding.row_group.RowGroup` (attention replicated — a rank attends its own rows with every head
  against the complete history, no partial attention is merged —; vocab, expert / MLP widths and Engram rows
  split: split lookups and gather → local slice → reduce-scatter) and the rows backend is
  `v41cp.serving.attention.qcp_rows.QCPRows` (window KV, compressor pairs and entries all-gathered to span order, so a
  rank boundary is never a pairing or cache boundary; every rank writes the same cache rows, owner-masked when
  KVP = QCP; ranks without rows still join every collective); the head multiplies only the sampled rows and
  returns vocab-sharded logits.

CED narrowing (``meta.ced``): the rows before each request's retained decoder rows (the last `ced_rows` of the
prompt) stop at the CED boundary's cache writes; the decoder layers run only the retained rows (cached rows: packed
again, at most the metadata's ``dec_capacity`` rows in all; QCP: each retained row on the rank that owned it,
``dec_slots``).

Caches after the call equal those of the token-serial prefill of the same prompts (`v41cp.serving.runner.steps`):
SWA ring rows of the last ``W`` positions, every complete compressed entry and index key of each KV source in
the prompt's pages, and the open ratio-2 pair's projections. A prompt may be prefilled in passes
(``meta.starts``): a later pass (``meta.continued``) reads the cached history — window rows from the SWA ring
(before writing it), the open ratio-2 pair, and the request's compressed entries / index keys from its pages
(under KVP from their owners). One compiled program per bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from v41cp.config import ModelConfig
from v41cp.drafter import target_features
from v41cp.kernels import interpret_mode
from v41cp.layers.tiled_select import ROW_TILE_BYTES
from v41cp.model import Transformer, abstract_params
from v41cp.serving.attention.dcp import DCPPlan
from v41cp.serving.attention.qcp_rows import QCPRows
from v41cp.serving.cache.device_cache import PagedCache, cache_specs
from v41cp.serving.runner.span_metadata import SpanMetadata
from v41cp.serving.runner.steps import _forward_rows
from v41cp.serving.step_batch import CEDRows, StepBatch
from v41cp.sharding.mesh import ATTN_TP, CP
from v41cp.sharding.row_group import RowGroup
from v41cp.sharding.rules import QCP_RULES, ShardingContext, logical_sharding, param_shardings

__all__ = ["SpanLayout", "prefill_span", "lower_prefill_span", "compile_count"]


@dataclass(frozen=True)
class SpanLayout:
    """Static partitioning of a span prefill. ``mesh`` None = one device; ``query_parallel``: model-wide QCP
    over the mesh's attention-TP axes; ``kv_parallel``: the KVP group size (the mesh's ``cp`` axis) when the
    pages are split over it (`init_cache(..., plan=...)`), else 1 (replicated pages); ``operator``: the
    operator-local indexer / attention QCP settings (a `ShardingContext`; the cached-rows path); ``tile_bytes``:
    the temporaries of one tile of model-wide QCP's row-tiled selection / attention
    (`v41cp.layers.tiled_select`), and a sixteenth of the MoE's gathered-row chunk (`RowGroup.chunk_bytes`).
    Build from a topology with `from_parallel`."""

    mesh: Mesh | None = None
    query_parallel: bool = False
    kv_parallel: int = 1
    operator: ShardingContext | None = None
    tile_bytes: int = ROW_TILE_BYTES

    def __post_init__(self):
        if self.kv_parallel > 1 and (self.mesh is None or self.mesh.shape.get(CP, 1) != self.kv_parallel):
            raise ValueError(f"span prefill: kv_parallel={self.kv_parallel} needs a mesh whose cp axis has that size")

    @classmethod
    def from_parallel(cls, parallel, mesh: Mesh | None) -> "SpanLayout":
        """The layout of `v41cp.sharding.topology.ParallelConfig` ``parallel`` on ``mesh``."""
        if mesh is None:
            return cls()
        local = parallel.indexer_query_parallel_size > 1 or parallel.attention_query_parallel_size > 1
        return cls(mesh, parallel.query_context_parallel_size > 1, parallel.kv_parallel_size,
                   parallel.sharding_context(mesh) if local else None)

    @property
    def axes(self) -> tuple[str, ...]:
        if self.mesh is None:
            return ()
        return tuple(a for a in ATTN_TP if self.mesh.shape.get(a, 1) > 1)

    @property
    def n(self) -> int:
        """Ranks the rows are split over (1 without QCP)."""
        return int(np.prod([self.mesh.shape[a] for a in self.axes])) if self.query_parallel else 1


def _qcp_body(params, cache, meta: SpanMetadata, cfg: ModelConfig, layout: SpanLayout, features: int = 0):
    """The one model over this rank's rows (inside the map): ``(logits [B, vocab/N], cache)``, and with
    ``features`` the DSpark target features of each request's last ``features`` rows in span order
    (`QCPRows.last_rows`)."""
    grp = RowGroup(layout.mesh, layout.axes, chunk_bytes=16 * layout.tile_bytes)
    rows = QCPRows(cfg, grp, meta, cache, layout.kv_parallel, layout.tile_bytes)
    call = lambda **kw: Transformer(cfg, grp).apply({"params": params}, meta.tokens, meta.engram_ids, rows=rows,
                                                    cache=cache, logits_at=meta.sampled, **kw)
    if not features:
        logits, _, cache = call()
        return logits[:, 0], cache

    (logits, _, cache), taps = call(mutable=["taps"])
    narrow = rows.ced_split()[2] if rows.narrows else None
    return logits[:, 0], cache, rows.last_rows(target_features(cfg, taps["taps"], narrow), features)


def _specs(cfg: ModelConfig, layout: SpanLayout, params, cache, meta):
    shardings = param_shardings(abstract_params(cfg), layout.mesh, QCP_RULES)
    pspec = jax.tree.map(lambda s: s.spec, shardings, is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))
    cspec = cache_specs(cache, layout.kv_parallel > 1)
    rank = P(layout.axes)
    mspec = SpanMetadata(*(rank,) * 5, *(P(),) * 7, meta.n, meta.capacity, meta.dec_capacity, meta.span, meta.ced,
                         meta.continued)
    vocab = logical_sharding((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), layout.mesh, QCP_RULES).spec
    return pspec, cspec, mspec, vocab


def _run(params, cache, meta: SpanMetadata, cfg: ModelConfig, layout: SpanLayout, features: int = 0):
    with jax.default_matmul_precision("highest" if cfg.dtype == "float32" else "default"):
        pspec, cspec, mspec, hspec = _specs(cfg, layout, params, cache, meta)
        body = partial(_qcp_body, cfg=cfg, layout=layout, features=features)
        # as in the DCP islands: JAX's Pallas interpreter trips its own varying-axes check (CPU only)
        check = not (cfg.indexer_backend == "pallas" and interpret_mode())
        out_specs = (P(None, *hspec[1:]), cspec) + (((P(), P(), P()),) if features else ())
        return jax.shard_map(body, mesh=layout.mesh, in_specs=(pspec, cspec, mspec), out_specs=out_specs,
                             check_vma=check)(params, cache, meta)


@partial(jax.jit, static_argnames=("cfg", "layout", "features"), donate_argnames=("cache",))
def _prefill_qcp(params, cache: PagedCache, meta: SpanMetadata, cfg: ModelConfig, layout: SpanLayout, features: int = 0):
    return _run(params, cache, meta, cfg, layout, features)


@partial(jax.jit, static_argnames=("cfg", "plan", "operator", "features"), donate_argnames=("cache",))
def _prefill_rows(params, cache: PagedCache, rows, cfg: ModelConfig, plan, operator, features: int = 0):
    last = rows.lengths - 1 - (0 if rows.ced is None else rows.ced.encoder_rows)        # in the decoder rows
    logits, cache, _, feats = _forward_rows(params, cache, rows, cfg, plan, logits_at=last, operator=operator,
                                            features=features)
    return (logits[:, 0], cache, feats) if features else (logits[:, 0], cache)


def _span_rows(cfg: ModelConfig, meta: SpanMetadata):
    """One-rank span metadata → the pass's packed `StepBatch`: the requests' rows back to back (``rows`` = the
    metadata's row capacity, ``offsets`` = where each request's rows start), so a ragged batch computes only its
    rows; under CED narrowed at the boundary to the retained decoder rows (``decoder_rows`` = the metadata's CED
    row capacity). Host NumPy."""
    lengths = np.asarray(meta.lengths, np.int32)
    t = meta.capacity                                  # one rank: every row of the pass (≥ Σ lengths)
    offsets = (np.cumsum(lengths) - lengths).astype(np.int32)
    where = np.full(t, t, np.int32)                    # packed row → the rank's local row (t: padding)
    for b, n in enumerate(lengths):
        where[offsets[b]:offsets[b] + n] = meta.span_index[b, :n]
    pad = lambda a: np.concatenate([np.asarray(a[0]), np.zeros((1, *a.shape[2:]), a.dtype)])[where][None]
    # CED: the rows before the retained decoder rows run the encoder only
    ced = CEDRows(meta.encoder_rows(), meta.dec_capacity) if meta.ced else None
    return StepBatch(jnp.asarray(pad(meta.tokens)), jnp.asarray(meta.starts, jnp.int32), jnp.asarray(lengths),
                     jnp.asarray(meta.slots), jnp.asarray(meta.block_tables), jnp.asarray(pad(meta.engram_ids)),
                     len(lengths), meta.block_tables.shape[1], t, ced, jnp.asarray(offsets))


def _layout_plan(cfg: ModelConfig, layout: SpanLayout):
    """The DCP plan of a KVP layout (None: replicated pages)."""
    if layout.kv_parallel == 1:
        return None

    tp = layout.mesh.shape["tp"] * layout.mesh.shape[CP]
    return DCPPlan(layout.mesh, heads_sharded=cfg.num_attention_heads % tp == 0)


def prefill_span(params, cache: PagedCache, meta: SpanMetadata, cfg: ModelConfig, layout: SpanLayout = SpanLayout(),
                 features: int = 0):
    """Prefill the prompts of ``meta`` (`build_span_metadata`) in one pass: ``(logits [B, vocab] FP32 of each
    prompt's last row — zeros for an empty row or a pass without it —, updated cache)``. See the module
    docstring. ``features > 0``: also the DSpark target features of each request's last ``features`` rows of the
    pass (``([B, F, n·H], positions [B, F], valid [B, F])``, replicated; under model-wide QCP gathered back to
    span order from the ranks that own the rows)."""
    return _dispatch(params, cache, meta, cfg, layout, lower=False, features=features)


def lower_prefill_span(params, cache: PagedCache, meta: SpanMetadata, cfg: ModelConfig, layout: SpanLayout = SpanLayout()):
    """The lowered program of one span-prefill pass (for structure measurements)."""
    return _dispatch(params, cache, meta, cfg, layout, lower=True)


def _dispatch(params, cache, meta, cfg, layout, lower: bool, features: int = 0):
    if meta.n != layout.n:
        raise ValueError(f"span prefill: the metadata plans {meta.n} ranks but the layout splits rows over "
                         f"{layout.n} (query_context_parallel_size)")
    if layout.query_parallel:          # (on a one-device mesh: the same program over a one-rank group)
        fn, args = _prefill_qcp, (params, cache, meta, cfg, layout) + ((features,) if features else ())
    else:
        fn, args = _prefill_rows, (params, cache, _span_rows(cfg, meta), cfg, _layout_plan(cfg, layout),
                                   layout.operator) + ((features,) if features else ())
    return fn.lower(*args) if lower else fn(*args)


def compile_count() -> int:
    """Compiled span-prefill programs so far (every bucket and layout)."""
    return _prefill_qcp._cache_size() + _prefill_rows._cache_size()
