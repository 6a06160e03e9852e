"""Span prefill: a batch of prompts through the one model (`v41cp.model.Transformer`) in one pass (rows in
parallel, not token-serial), writing the paged decode caches and returning the logits of each prompt's last row.

`prefill_span(params, cache, batch, cfg, layout)` — ``batch`` the pass's `StepBatch` from
`v41cp.serving.runner.span_batch.build_span_batch`; ``layout``
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

CED narrowing (``batch.ced``): the rows before each request's retained decoder rows (the last `ced_rows` of the
prompt) stop at the CED boundary's cache writes; the decoder layers run only the retained rows (cached rows: packed
again, at most ``ced.decoder_rows`` in all; QCP: each retained row on the rank that owned it, ``qcp.dec_slots``).

Caches after the call equal those of the token-serial prefill of the same prompts (`v41cp.serving.runner.steps`):
SWA ring rows of the last ``W`` positions, every complete compressed entry and index key of each KV source in
the prompt's pages, and the open ratio-2 pair's projections. A prompt may be prefilled in passes
(``batch.starts``): a later pass (``batch.qcp.continued``; packed: any start > 0) reads the cached history —
window rows from the SWA ring (before writing it), the open ratio-2 pair, and the request's compressed entries /
index keys from its pages (under KVP from their owners). One compiled program per bucket.
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
from v41cp.drafter import drafter_rows
from v41cp.kernels import interpret_mode
from v41cp.layers.tiled_select import ROW_TILE_BYTES
from v41cp.model import Transformer, abstract_params, embedding_and_head
from v41cp.serving.attention.dcp import DCPPlan
from v41cp.serving.attention.qcp_rows import QCPRows
from v41cp.serving.cache.device_cache import PagedCache, cache_specs
from v41cp.serving.runner.logprobs import row_logprobs
from v41cp.serving.runner.sampling import ReplicateOn
from v41cp.serving.runner.steps import _forward_rows
from v41cp.serving.step_batch import CEDRows, QCPLayout, StepBatch
from v41cp.sharding.mesh import ATTN_TP, CP
from v41cp.sharding.row_group import RowGroup
from v41cp.sharding.rules import QCP_RULES, ShardingContext, logical_sharding, param_shardings

__all__ = ["SpanLayout", "prefill_span", "lower_prefill_span", "qcp_batch_spec", "compile_count"]


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


def _qcp_body(params, cache, batch: StepBatch, scored, cfg: ModelConfig, layout: SpanLayout, features: int = 0,
              score: bool = False):
    """The one model over this rank's rows (inside the map): ``(logits [B, vocab/N], cache)``, with ``features``
    the drafter's rows of each request's last ``features`` rows in span order (`drafter_rows`), and
    with ``score`` (an unnarrowed pass) every rank's head inputs ``[N·C, H]`` all-gathered in rank order — when the
    replicated ``scored`` says some row is scored (else zeros: the gather is skipped)."""
    grp = RowGroup(layout.mesh, layout.axes, chunk_bytes=16 * layout.tile_bytes)
    rows = QCPRows(cfg, grp, batch, cache, layout.kv_parallel, layout.tile_bytes)
    mutable = (["taps"] if features else []) + (["final"] if score else [])
    out = Transformer(cfg, grp).apply({"params": params}, batch.tokens, batch.engram_ids, rows=rows, cache=cache,
                                      logits_at=batch.qcp.sampled, mutable=mutable or False)
    (logits, _, cache), sown = out if mutable else (out, {})
    result = (logits[:, 0], cache)
    if features:
        result += (drafter_rows(cfg, rows, sown["taps"], batch.tokens, features),)
    if score:
        h = sown["final"]["hidden"][0][0]                                                     # [C, H]
        zeros = jnp.zeros((grp.n * h.shape[0], h.shape[1]), h.dtype)
        result += (jax.lax.cond(scored, grp.gather, lambda h: zeros, h),)
    return result


def qcp_batch_spec(batch: StepBatch, rank: P) -> StepBatch:
    """The map's specs of a model-wide QCP batch: the local rows (tokens, Engram ids, positions, requests, CED
    decoder slots) split over the ranks, the rest replicated."""
    q = batch.qcp
    return StepBatch(rank, P(), P(), P(), P(), rank, batch.max_batch, batch.max_blocks, batch.rows,
                     None if batch.ced is None else CEDRows(P(), batch.ced.decoder_rows), None,
                     QCPLayout(rank, rank, rank, P(), P(), P(), q.n, q.span, q.continued))


def _specs(cfg: ModelConfig, layout: SpanLayout, params, cache, batch):
    shardings = param_shardings(abstract_params(cfg), layout.mesh, QCP_RULES)
    pspec = jax.tree.map(lambda s: s.spec, shardings, is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))
    cspec = cache_specs(cache, layout.kv_parallel > 1)
    vocab = logical_sharding((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), layout.mesh, QCP_RULES).spec
    return pspec, cspec, qcp_batch_spec(batch, P(layout.axes)), vocab


def _run(params, cache, batch: StepBatch, cfg: ModelConfig, layout: SpanLayout, features: int = 0,
         scored=None):
    with jax.default_matmul_precision("highest" if cfg.dtype == "float32" else "default"):
        pspec, cspec, bspec, hspec = _specs(cfg, layout, params, cache, batch)
        score = scored is not None
        body = partial(_qcp_body, cfg=cfg, layout=layout, features=features, score=score)
        # as in the DCP islands: JAX's Pallas interpreter trips its own varying-axes check (CPU only)
        check = not (cfg.indexer_backend == "pallas" and interpret_mode(layout.mesh))
        out_specs = ((P(None, *hspec[1:]), cspec) + (((P(), P(), P(), P()),) if features else ())
                     + ((P(),) if score else ()))
        return jax.shard_map(body, mesh=layout.mesh, in_specs=(pspec, cspec, bspec, P()), out_specs=out_specs,
                             check_vma=check)(params, cache, batch, jnp.bool_(False) if scored is None else scored)


@partial(jax.jit, static_argnames=("cfg", "layout", "features", "score", "whole"), donate_argnames=("cache",))
def _prefill_qcp(params, cache: PagedCache, batch: StepBatch, cfg: ModelConfig, layout: SpanLayout,
                 features: int = 0, targets=None, score: int = 0, whole=None):
    if not score:
        return _run(params, cache, batch, cfg, layout, features)
    out = _run(params, cache, batch, cfg, layout, features, scored=jnp.any(targets >= 0))
    # the gathered rows' prompt log-probabilities against the vocab-split head (`targets [1, N·C]`, rank order)
    return out[:-1] + (row_logprobs(out[-1][None], embedding_and_head(params)[1], targets, score, whole),)


@partial(jax.jit, static_argnames=("cfg", "plan", "operator", "features", "score", "whole"),
         donate_argnames=("cache",))
def _prefill_rows(params, cache: PagedCache, rows: StepBatch, cfg: ModelConfig, plan, operator, features: int = 0,
                  targets=None, score: int = 0, whole=None):
    last = rows.lengths - 1 - (0 if rows.ced is None else rows.ced.encoder_rows)        # in the decoder rows
    logits, cache, _, feats, hidden = _forward_rows(params, cache, rows, cfg, plan, logits_at=last, operator=operator,
                                                    features=features, hidden=bool(score))
    out = (logits[:, 0], cache) + ((feats,) if features else ())
    return out + ((row_logprobs(hidden, embedding_and_head(params)[1], targets, score, whole),) if score else ())


def _layout_plan(cfg: ModelConfig, layout: SpanLayout):
    """The DCP plan of a KVP layout (None: replicated pages)."""
    if layout.kv_parallel == 1:
        return None

    tp = layout.mesh.shape["tp"] * layout.mesh.shape[CP]
    return DCPPlan(layout.mesh, heads_sharded=cfg.num_attention_heads % tp == 0)


def prefill_span(params, cache: PagedCache, batch: StepBatch, cfg: ModelConfig, layout: SpanLayout = SpanLayout(),
                 features: int = 0, targets=None, score: int = 0):
    """Prefill the prompt chunks of ``batch`` (`build_span_batch`) in one pass: ``(logits [B, vocab] FP32 of each
    prompt's last row — zeros for an empty row or a pass without it —, updated cache)``. See the module
    docstring. ``features > 0``: also the drafter's rows of each request's last ``features`` rows of the pass
    (`v41cp.drafter.drafter_rows`: ``(features [B, F, ·], positions [B, F], valid [B, F], tokens [B, F])``,
    replicated; under model-wide QCP gathered back to span order from the ranks that own the rows). ``score = n >
    0`` (packed rows, no CED narrowing): also each row's prompt log-probability of ``targets [1, rows]`` (its next
    prompt token; −1: none) with the top ``n`` (`v41cp.serving.runner.logprobs.row_logprobs`, computed only when a
    target is set), last in the tuple. The rows
    are those of the pass: packed (``rows`` = the batch's row capacity), or under model-wide QCP the ranks' local
    rows in rank order (``rows`` = N · the per-rank capacity; `StepBatch.qcp.span_index` says which row is which).
    A scored pass is not CED-narrowed (its scored rows need the decoder)."""
    if score and batch.ced is not None:
        raise ValueError("span prefill: prompt log-probabilities need every row of the pass through the decoder "
                         "(build the pass without CED narrowing: build_span_batch(..., ced=False))")
    return _dispatch(params, cache, batch, cfg, layout, lower=False, features=features,
                     score=(targets, score) if score else None)


def lower_prefill_span(params, cache: PagedCache, batch: StepBatch, cfg: ModelConfig,
                       layout: SpanLayout = SpanLayout()):
    """The lowered program of one span-prefill pass (for structure measurements)."""
    return _dispatch(params, cache, batch, cfg, layout, lower=True)


def _dispatch(params, cache, batch: StepBatch, cfg, layout, lower: bool, features: int = 0, score=None):
    ranks = batch.qcp.n if batch.qcp is not None else None
    if layout.query_parallel != (ranks is not None) or (ranks is not None and ranks != layout.n):
        laid = f"over {ranks} ranks (model-wide QCP)" if ranks is not None else "packed on one rank"
        want = f"over {layout.n} ranks (model-wide QCP)" if layout.query_parallel else "packed on one rank"
        raise ValueError(f"span prefill: the batch's rows are laid out {laid} but the layout wants them {want} "
                         f"(build_span_batch(..., n, query_parallel=...))")
    if layout.query_parallel:          # (on a one-device mesh: the same program over a one-rank group)
        fn, args = _prefill_qcp, (params, cache, batch, cfg, layout)
    else:
        fn, args = _prefill_rows, (params, cache, batch, cfg, _layout_plan(cfg, layout), layout.operator)
    if score is not None:
        return fn(*args, features, score[0], score[1], ReplicateOn(layout.mesh) if layout.mesh is not None else None)
    args += (features,) if features else ()
    return fn.lower(*args) if lower else fn(*args)


def compile_count() -> int:
    """Compiled span-prefill programs so far (every bucket and layout)."""
    return _prefill_qcp._cache_size() + _prefill_rows._cache_size()
