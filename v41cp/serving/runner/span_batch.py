"""The host-built `StepBatch` of one span-prefill pass (`v41cp.serving.runner.span_prefill`): a batch of prompt
chunks, their rows packed back to back on one rank or laid out per rank by model-wide QCP's zigzag row plan
(`v41cp.sharding.query_shard.QueryShardPlan`, the batch's nested `QCPLayout` record).

Both layouts come from the same row plan: on one rank (``n = 1``) the plan keeps each request's rows in order,
back to back, so the packed pass's rows are the plan's one rank's rows and ``offsets`` say where each request's
rows start. CED narrowing (``ced=True``) retains the last `ced_rows` rows of each whole prompt for the decoder
layers: ``CEDRows.encoder_rows [B]`` counts each request's rows before them and ``CEDRows.decoder_rows`` is the
decoder rows' bucket (packed: in all; model-wide QCP: per rank, the retained rows staying on the rank that owned
them — `QCPLayout.dec_slots`).

Every host builds the same batch from the prompts alone; the row, CED-row and span buckets are static (one
compiled program per bucket).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from v41cp.ced import ced_boundary, ced_rows
from v41cp.config import ModelConfig
from v41cp.engram_hash import engram_hash_ids
from v41cp.serving.step_batch import CEDRows, QCPLayout, StepBatch
from v41cp.sharding.query_shard import QueryShardPlan

__all__ = ["build_span_batch", "round_up"]


def round_up(x: int, m: int) -> int:
    return -(-max(int(x), 1) // m) * m


def _retained(cfg: ModelConfig, plan: QueryShardPlan, starts: np.ndarray, decoder_ends: np.ndarray, ced: bool):
    """CED decoder rows of each local slot ``[N, C]`` bool: the rows of each chunk (starting at ``starts``) among
    the last `ced_rows` rows before its request's ``decoder_ends``. None without a CED boundary / CED off."""
    if not ced or ced_boundary(cfg) is None:
        return None
    req, pos = plan.request_of_slot(), plan.positions()
    r = np.maximum(req, 0)
    return (req >= 0) & (starts[r] + pos >= decoder_ends[r] - ced_rows(cfg))


def build_span_batch(cfg: ModelConfig, prompts, n: int = 1, *, query_parallel: bool | None = None, starts=None,
                     ends=None, slots=None, block_tables=None, span=None, capacity=None, dec_capacity=None,
                     ced: bool = False, decoder_ends=None) -> StepBatch:
    """The `StepBatch` of prefilling ``prompts`` (token-id lists; an empty list is an idle batch row): rows
    ``[starts[b], ends[b])`` of prompt ``b`` (default: all of it). ``starts > 0`` continues a prefill whose first
    ``starts[b]`` tokens are already in the caches (a later chunk; `QCPLayout.continued`). ``query_parallel``
    (default ``n > 1``): the model-wide QCP layout over ``n`` ranks (`StepBatch.qcp`), else the packed rows of one
    rank (``n`` must be 1). ``slots [B]`` / ``block_tables [B, MB]`` locate the caches (default: slot ``b``, no
    pages); ``span`` (the chunk length bucket of the QCP layout's span order), ``capacity`` (rows per rank) and
    ``dec_capacity`` (CED decoder rows per rank) are the static buckets (default: the smallest that fit, ``span``
    a multiple of 8). CED retains the last `ced_rows` rows before ``decoder_ends[b]`` (default: the prompt's end;
    a chunk that ends where prefix caching stores the slot state gives its own end, so that the decoder layers'
    window rows there are complete). Errors name the offending value."""
    query_parallel = n > 1 if query_parallel is None else bool(query_parallel)
    if not query_parallel and n != 1:
        raise ValueError(f"span prefill: packed rows are one rank's, but n={n} ranks were asked for")
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
    decoder_ends = totals if decoder_ends is None else np.asarray(decoder_ends, np.int32)
    if decoder_ends.shape != (b,) or (decoder_ends < ends).any() or (decoder_ends > totals).any():
        raise ValueError(f"span prefill: CED decoder ends {decoder_ends.tolist()} must lie between the chunk ends "
                         f"{ends.tolist()} and the prompts' lengths {totals.tolist()}")
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
    keep = _retained(cfg, plan, starts, decoder_ends, ced)
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
    i32 = lambda a: jnp.asarray(a, jnp.int32)
    ced_rec = None
    if keep is not None:
        # each request's rows before its retained decoder rows (they run the encoder layers only)
        fed = np.arange(s)[None] < lengths[:, None]
        enc = (fed & ~(dec_span_index < n * cd)).sum(axis=1)
        ced_rec = CEDRows(i32(enc), cd)
    common = dict(starts=i32(starts), lengths=i32(lengths), slots=i32(slots), block_tables=i32(block_tables),
                  max_batch=b, max_blocks=int(block_tables.shape[1]), rows=c, ced=ced_rec)
    if not query_parallel:              # one rank: the plan's rows are the requests' rows back to back
        return StepBatch(tokens=i32(tokens), engram_ids=i32(eng), offsets=i32(offsets[:-1]), **common)
    layout = QCPLayout(i32(pos), i32(req), i32(dec_slots), i32(span_index), i32(dec_span_index), i32(sampled), n, s,
                       bool((starts > 0).any()))
    return StepBatch(tokens=i32(tokens), engram_ids=i32(eng), qcp=layout, **common)
