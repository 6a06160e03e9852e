"""Host-built metadata of one span prefill (`v41cp.serving.runner.span_prefill`): a batch of fresh prompts, their
rows laid out per rank by the model-wide QCP row plan (`v41cp.sharding.query_shard.QueryShardPlan`).

Layouts (``N`` ranks, ``C`` = `capacity` local rows per rank, ``B`` batch rows, ``S`` = `span` padded prompt
length; rank-major: the all-gather of the local rows is ``[N·C, ·]``):

* ``tokens / positions / requests [N, C]`` — each local row's token, position in its prompt and batch row
  (−1 = padding slot); ``engram_ids [N, C, n_engram, hash_heads]`` (hashed on the host per prompt);
* ``span_index [B, S]`` — where row ``(b, p)`` lies in the gathered ``[N·C]`` rows; ``N·C`` (one zero row
  appended after the gather) for ``p ≥ length_b``: gathering then indexing restores span order, which is
  what pooling, compressor pairing, SWA windows and cache writes read;
* CED narrowing (``ced=True``): after the CED boundary only the last `ced_rows` rows of each prompt run
  the decoder. They stay on the rank that owned them: ``dec_slots [N, Cd]`` lists each rank's retained
  local slots in order (−1 padding) and ``dec_span_index [B, S]`` is ``span_index`` for the narrowed
  ``[N·Cd]`` layout (``N·Cd`` = not retained). Without CED these equal the full layout;
* ``sampled [B]`` — position of each row's last row of this pass in the (narrowed) gathered layout (−1 = an
  empty row, or, under CED, a pass whose last row is not retained);
* ``lengths / slots [B]``, ``block_tables [B, max_blocks]`` — where the caches are written (an empty row,
  length 0, writes nothing);
* ``starts [B]`` — tokens of each prompt already in the caches (a later chunk); ``positions`` are absolute
  (``starts + row``), ``span_index`` is chunk-relative. ``continued`` (static) = some start > 0: the
  prefill then reads the cached history (SWA rings, open ratio-2 pairs, pages).

Every host builds the same metadata from the prompts alone; `n`, `capacity`, `dec_capacity`, `span` and
`ced` are static (the compile bucket).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import numpy as np

from v41cp.ced import ced_boundary, ced_rows
from v41cp.config import ModelConfig
from v41cp.engram_hash import engram_hash_ids
from v41cp.sharding.query_shard import QueryShardPlan

__all__ = ["SpanMetadata", "build_span_metadata", "row_capacities", "round_up"]


def round_up(x: int, m: int) -> int:
    return -(-max(int(x), 1) // m) * m


@partial(jax.tree_util.register_dataclass,
         data_fields=["tokens", "positions", "requests", "engram_ids", "dec_slots", "span_index", "dec_span_index",
                      "sampled", "lengths", "starts", "slots", "block_tables"],
         meta_fields=["n", "capacity", "dec_capacity", "span", "ced", "continued"])
@dataclasses.dataclass(frozen=True)
class SpanMetadata:
    """See the module docstring. The first five fields are per rank (leading axis ``N``, sharded over
    attention TP under QCP); the next seven are replicated."""

    tokens: np.ndarray
    positions: np.ndarray
    requests: np.ndarray
    engram_ids: np.ndarray
    dec_slots: np.ndarray
    span_index: np.ndarray
    dec_span_index: np.ndarray
    sampled: np.ndarray
    lengths: np.ndarray
    starts: np.ndarray
    slots: np.ndarray
    block_tables: np.ndarray
    n: int
    capacity: int
    dec_capacity: int
    span: int
    ced: bool
    continued: bool

    @property
    def batch(self) -> int:
        return int(self.lengths.shape[0])

    def encoder_rows(self):
        """CED: each request's rows before its retained decoder rows ``[B]`` int32 (NumPy on the host, traced
        inside a program; zeros without CED)."""
        import jax.numpy as jnp

        fed = jnp.arange(self.span)[None] < jnp.asarray(self.lengths)[:, None]
        kept = jnp.asarray(self.dec_span_index) < self.n * self.dec_capacity
        return (fed & ~kept).sum(axis=1).astype(jnp.int32)


def _retained(cfg: ModelConfig, plan: QueryShardPlan, starts: np.ndarray, totals: np.ndarray, ced: bool):
    """CED decoder rows of each local slot ``[N, C]`` bool: the last `ced_rows` rows of each prompt of ``totals``
    tokens (this chunk starts at ``starts``). None without a CED boundary / CED off."""
    if not ced or ced_boundary(cfg) is None:
        return None
    req, pos = plan.request_of_slot(), plan.positions()
    r = np.maximum(req, 0)
    return (req >= 0) & (starts[r] + pos >= totals[r] - ced_rows(cfg))


def row_capacities(cfg: ModelConfig, lengths, n: int, ced: bool = False, starts=None,
                   totals=None) -> tuple[int, int]:
    """The smallest (per-rank rows, per-rank CED decoder rows) buckets that fit chunks of ``lengths`` rows
    (starting at ``starts`` of prompts of ``totals`` tokens; default: whole prompts)."""
    lengths = np.asarray(lengths, np.int32)
    starts = np.zeros_like(lengths) if starts is None else np.asarray(starts, np.int32)
    totals = starts + lengths if totals is None else np.asarray(totals, np.int32)
    plan = QueryShardPlan.build(lengths, n)
    keep = _retained(cfg, plan, starts, totals, ced)
    return plan.capacity, plan.capacity if keep is None else max(int(keep.sum(axis=1).max()), 1)


def build_span_metadata(cfg: ModelConfig, prompts, n: int = 1, *, starts=None, ends=None, slots=None,
                        block_tables=None, span=None, capacity=None, dec_capacity=None,
                        ced: bool = False) -> SpanMetadata:
    """Metadata of prefilling ``prompts`` (token-id lists; an empty list is an idle batch row) over ``n``
    ranks: rows ``[starts[b], ends[b])`` of prompt ``b`` (default: all of it). ``starts > 0`` continues a
    prefill whose first ``starts[b]`` tokens are already in the caches (a later chunk; ``continued``).
    ``slots [B]`` / ``block_tables [B, MB]`` locate the caches (default: slot ``b``, no pages);
    ``span`` / ``capacity`` / ``dec_capacity`` are the static buckets (default: the smallest that fit,
    ``span`` a multiple of 8). CED retains the last `ced_rows` rows of each whole prompt. Errors name the
    offending value."""
    prompts = [list(map(int, p)) for p in prompts]
    b = len(prompts)
    if b == 0:
        raise ValueError("span prefill: no prompts")
    totals = np.array([len(p) for p in prompts], np.int32)
    starts = np.zeros(b, np.int32) if starts is None else np.asarray(starts, np.int32)
    ends = totals.copy() if ends is None else np.asarray(ends, np.int32)
    if starts.shape != (b,) or ends.shape != (b,) or (starts < 0).any() or (ends < starts).any() \
            or (ends > totals).any():
        raise ValueError(f"span prefill: chunk bounds starts={starts.tolist()} ends={ends.tolist()} do not fit "
                         f"prompts of {totals.tolist()} tokens")
    lengths = (ends - starts).astype(np.int32)
    for i, p in enumerate(prompts):
        bad = cfg.out_of_vocabulary(p)
        if bad:
            raise ValueError(f"span prefill: prompt {i}: {bad}")
    s = round_up(lengths.max(), 8) if span is None else int(span)
    if lengths.max() > s:
        raise ValueError(f"span prefill: a prompt of {int(lengths.max())} tokens exceeds the span bucket {s}")
    if s % 2:
        raise ValueError(f"span prefill: span={s} must be even (compression pairs)")
    plan = QueryShardPlan.build(lengths, n, capacity)
    if plan.capacity == 0:                                     # an all-idle batch still has one (padding) slot
        plan = QueryShardPlan.build(lengths, n, 1)
    c = plan.capacity
    req, pos = plan.request_of_slot(), plan.positions()
    ok = req >= 0
    tokens = np.zeros((n, c), np.int32)
    n_eng = len(cfg.engram_layer_ids)
    eng = np.zeros((n, c, n_eng, cfg.engram_hash_heads if n_eng else 0), np.int32)
    # hashing looks back max_ngram − 1 tokens: hash from there to the chunk's end
    back = np.maximum(starts - max(cfg.engram_max_ngram_size - 1, 0), 0)
    hashed = [engram_hash_ids(cfg, np.asarray([p[back[i]:ends[i]]]))[0] if n_eng and ends[i] > starts[i] else None
              for i, p in enumerate(prompts)]
    pos = pos + np.where(ok, starts[np.maximum(req, 0)], 0)                  # absolute positions
    for r, k in zip(*np.nonzero(ok)):
        i = req[r, k]
        tokens[r, k] = prompts[i][pos[r, k]]
        if n_eng:
            eng[r, k] = hashed[i][pos[r, k] - back[i]]
    offsets = np.concatenate([[0], np.cumsum(lengths)])

    def span_map(where: np.ndarray, size: int) -> np.ndarray:
        """``where [T]`` (gathered position of each span-order row) → ``[B, S]`` with ``size`` for absent."""
        out = np.full((b, s), size, np.int32)
        for i in range(b):
            out[i, :lengths[i]] = where[offsets[i]:offsets[i + 1]]
        return out

    span_index = span_map(plan.restore, n * c)
    keep = _retained(cfg, plan, starts, totals, ced)
    if keep is None:
        dec_slots = np.where(ok, np.arange(c)[None], -1).astype(np.int32)
        cd, dec_span_index = c, span_index
        sampled = plan.sampled
    else:
        need = int(keep.sum(axis=1).max())
        cd = need if dec_capacity is None else int(dec_capacity)
        if cd < need:
            raise ValueError(f"span prefill: a rank retains {need} CED decoder rows but dec_capacity={cd}")
        cd = max(cd, 1)
        dec_slots = np.full((n, cd), -1, np.int32)
        where = np.full(n * c, n * cd, np.int32)                    # gathered full position → narrowed position
        for r in range(n):
            kept = np.nonzero(keep[r])[0]
            dec_slots[r, :len(kept)] = kept
            where[r * c + kept] = r * cd + np.arange(len(kept))
        dec_span_index = np.where(span_index < n * c, where[np.minimum(span_index, n * c - 1)], n * cd)
        mapped = where[np.maximum(plan.sampled, 0)]
        sampled = np.where((plan.sampled >= 0) & (mapped < n * cd), mapped, -1).astype(np.int32)
    if slots is None:
        slots = np.arange(b, dtype=np.int32)
    if block_tables is None:
        block_tables = np.full((b, 1), -1, np.int32)
    slots, block_tables = np.asarray(slots, np.int32), np.asarray(block_tables, np.int32)
    if slots.shape != (b,) or block_tables.ndim != 2 or block_tables.shape[0] != b:
        raise ValueError(f"span prefill: slots {slots.shape} / block_tables {block_tables.shape} do not match "
                         f"the batch of {b} prompts")
    return SpanMetadata(tokens, pos.astype(np.int32), req.astype(np.int32), eng, dec_slots, span_index,
                        dec_span_index.astype(np.int32), sampled.astype(np.int32), lengths, starts, slots,
                        block_tables, n, c, cd, s, keep is not None, bool((starts > 0).any()))
