"""`ModelRunner`: the device side of an engine — the sharded weights, the paged cache, the drafter's cache and the
jitted steps — building each step's metadata from the scheduled requests and sampling their tokens.

The runner is given the requests of a round with their batch slots and block tables (the scheduler's decisions) and
a ``done(request)`` callback that ends a request after a token (the scheduler's `finish_if_done`); it appends the
sampled tokens to the requests and keeps the step statistics (``stats``). Steps (`v41cp.serving.runner.steps`,
`v41cp.serving.runner.span_prefill`, `v41cp.serving.runner.speculative`) are pure jitted functions of (weights,
cache, metadata); the runner holds the cache between them.

Topology: ``parallel`` (`ParallelConfig`) builds the mesh over the first ``tp · dp`` devices (unless ``mesh`` is
given); with ``kv_parallel_size > 1`` the global pages are split over the KVP group and decode runs DCP
(`v41cp.serving.attention.dcp.DCPPlan`); with plain attention TP the steps split only the selection's scoring
(`DCPPlan.split_selection`). Model-wide QCP, operator-local QCP and, by default, every engine prefill
prompts by span-prefill passes (`span`): one pass per round over the rows the engine schedules (`prefill_span`),
padded to a fixed ladder of row buckets (`span_buckets`) that `warm_up` compiles before traffic; the token-serial
prefill (`prefill_serial`) is the exactness reference and prefix caching's path.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from v41cp.config import ModelConfig
from v41cp.engram_hash import engram_hash_ids
from v41cp.model import embedding_and_head, shard_params
from v41cp.serving.attention.dcp import DCPPlan
from v41cp.serving.cache.device_cache import POOLS, init_draft_cache
from v41cp.serving.cache.request_state import request_state
from v41cp.serving.cache.slot_state import put_slot_state, take_slot_state
from v41cp.serving.capacity import Capacity
from v41cp.serving.multihost.fetch import fetch
from v41cp.serving.runner.grammar import GrammarError, Grammars, no_masks
from v41cp.serving.runner.logprobs import TokenLogprobs, chunk_logprobs, entries
from v41cp.serving.runner.mtp_draft import mtp_draft_step, write_mtp_context
from v41cp.serving.runner.penalties import TokenCounts, reset_slot
from v41cp.serving.runner.sampling import ReplicateOn, SamplingRows, sample_tokens
from v41cp.serving.runner.span_batch import build_span_batch
from v41cp.serving.runner.span_prefill import SpanLayout, prefill_span
from v41cp.serving.runner.span_prefill import compile_count as span_compile_count
from v41cp.serving.runner.speculative import Speculative, draft_step, write_draft_context
from v41cp.serving.runner.steps import (
    ced_boundary,
    ced_rows,
    commit_rows,
    decode_and_sample,
    init_cache,
    prefill_chunk,
    verify_and_accept,
)
from v41cp.serving.scheduler.request import Request
from v41cp.serving.step_batch import StepBatch
from v41cp.sharding.topology import ParallelConfig

__all__ = ["ModelRunner", "checked_proposals"]

Done = Callable[[Request], None]


def checked_proposals(ids, n: int, vocab: int) -> np.ndarray:
    """A proposer's answer as ``n`` token ids, or ValueError naming the bad value."""
    ids = [int(t) for t in ids]
    if len(ids) != n or any(not 0 <= t < vocab for t in ids):
        raise ValueError(f"speculative proposer returned {ids!r}: expected {n} token ids in [0, {vocab})")
    return np.asarray(ids, np.int32)


class ModelRunner:
    """See the module docstring. Attributes: ``params`` (sharded), ``cache`` (`init_cache`), ``plan`` (the KVP /
    DCP layout or None), ``step_plan`` (what the cached steps run with: the KVP plan or plain TP's selection split),
    ``span_layout`` / ``span`` (the span prefill's layout and whether admissions prefill by span), ``dparams`` /
    ``dcache`` (the drafter), ``num_blocks``, ``kv_parallel_size``, ``stats``.

    Tokens are sampled on the device (`v41cp.serving.runner.sampling`); only their ids come to the host.
    ``record_logits=True`` also fetches the FP32 logits behind each request's latest token into
    ``Request.last_logits`` (``[vocab]`` per request and step: for tests and debugging, not for serving)."""

    def __init__(self, params, cfg: ModelConfig, capacity: Capacity, mesh=None, parallel: ParallelConfig | None = None,
                 speculative: Speculative | None = None, devices=None, record_logits: bool = False,
                 grammars: Grammars | None = None):
        self.cfg, self.capacity, self.parallel, self.speculative = cfg, capacity, parallel, speculative
        self.record_logits = record_logits
        self.grammars = grammars                 # structured output (`v41cp.serving.runner.grammar`), if any
        self._all_allowed: dict = {}   # per batch width (and verification rows): the masks without grammar rows
        self.eos = cfg.eos_token_id              # held back from a request's first min_tokens outputs
        self.plan = None
        self.step_plan = None
        n = 1
        if parallel is not None and mesh is None:
            devices = list(jax.devices() if devices is None else devices)
            if len(devices) < parallel.num_devices:
                raise ValueError(f"the topology needs {parallel.num_devices} devices, {len(devices)} given")
            mesh = parallel.make_mesh(devices[:parallel.num_devices])
        # the caches committed to their devices from the start: a program's first call then has the same argument
        # placement as every later one (whose caches are its outputs), so it compiles once
        cache_sharding = jax.sharding.SingleDeviceSharding((jax.devices() if devices is None else list(devices))[0])
        if mesh is not None:
            rules = parallel.rules() if parallel is not None else None
            params = shard_params(params, cfg, mesh, *([rules] if rules else []))
            cache_sharding = NamedSharding(mesh, PartitionSpec())
            if parallel is not None and parallel.kv_parallel_size > 1:
                self.plan = DCPPlan.build(cfg, parallel, mesh)
                n = parallel.kv_parallel_size
            elif "cp" in mesh.shape and mesh.shape["tp"] * mesh.shape["cp"] > 1:
                # plain attention TP: the cached steps' selection scoring split over the TP ranks (replicated pages)
                self.step_plan = DCPPlan.split_selection(mesh)
        self.step_plan = self.step_plan or self.plan
        self.mesh, self.params, self.kv_parallel_size = mesh, params, n
        self.whole = ReplicateOn(mesh) if mesh is not None else None    # the sampler's vocabulary gather
        self.span_layout = SpanLayout.from_parallel(parallel, mesh) if parallel is not None else SpanLayout(mesh)
        lay = self.span_layout
        if capacity.span_prefill is False and (lay.query_parallel or lay.operator is not None):
            raise ValueError("the token-serial prefill (capacity span_prefill=False) does not split query rows: query "
                             "context parallelism (model-wide or operator-local) prefills by span")
        self.span = capacity.by_span or lay.query_parallel or lay.operator is not None
        # prompt log-probabilities: the span prefill's passes score their rows (`prefill_span(score=...)`; a pass
        # with a scored row is not CED-narrowed), the token-serial prefill its chunks' logits (`chunk_logprobs`)
        self.scores_prompts = capacity.max_logprobs
        self.narrows = bool(capacity.ced and ced_boundary(cfg) is not None)       # CED narrowing of prefill
        self.num_blocks = capacity.block_count(n)
        self.cache = init_cache(cfg, self.num_blocks, capacity.block_tokens, capacity.max_batch,
                                None if self.plan else cache_sharding, plan=self.plan)
        self._replicated = cache_sharding          # step metadata kept on the devices (replicated)
        # the penalties' per-slot token counts; ``_counted[slot] = (request, outputs)``: whose they are, and how many
        # of its outputs they hold (`_sync_counts`)
        self.counts = TokenCounts.zeros(capacity.max_batch, cfg.vocab_size, mesh, cache_sharding)
        self._counted: dict[int, tuple[Request, int]] = {}
        self.stats = {"prefill_tokens": 0, "prefill_s": 0.0, "decode_steps": 0, "decode_tokens": 0,
                      "decode_s": 0.0, "step_s": deque(maxlen=4096), "ced_encoder_only_rows": 0}
        self.dparams = self.dcache = None
        if speculative is not None:
            rep = cache_sharding
            if speculative.params is not None:
                self.dparams = speculative.params if rep is None else jax.device_put(speculative.params, rep)
            self.dcache = init_draft_cache(cfg, capacity.max_batch, rep)
            self.stats.update(spec_steps=0, drafts_proposed=0, drafts_accepted=0)

    # ------------------------------------------------------------------ slot states
    def put_slot_state(self, slot: int, state) -> None:
        self.cache, self.dcache = put_slot_state(self.cache, slot, state, self.dcache)

    def take_slot_state(self, slot: int):
        return take_slot_state(self.cache, slot, self.dcache)

    def request_state(self, blocks, tokens: int, slot: int) -> dict:
        """A request's decode state as host bytes (`v41cp.serving.cache.request_state`)."""
        state = self.take_slot_state(slot)
        return request_state(self.cache, blocks, tokens, self.capacity.block_tokens, self.kv_parallel_size, state)

    # ------------------------------------------------------------------ prefill
    def prefill_serial(self, req: Request, slot: int, table: np.ndarray, done: Done,
                       at_cut: Callable[[Request, int], None]) -> None:
        """Token-serial prefill of ``req``'s history (its prompt; after a preemption, prompt and outputs) in chunks
        (from its reused prefix on; chunks also end where the prefix cache stores a state, and ``at_cut(req,
        position)`` is called there), then its next token."""
        t0 = time.perf_counter()
        cfg, c = self.cfg, self.capacity.prefill_chunk
        tokens = req.history
        n = len(tokens)
        eng = (engram_hash_ids(cfg, np.asarray([tokens]))[0] if cfg.engram_layer_ids
               else np.zeros((n, 0, 0), np.int32))
        # CED narrowing: rows before the decoder's dependency halo (of the history's end, and of each prefix-cache
        # boundary, so the state stored there is complete) run the encoder (+ boundary prepass) only
        full = np.ones(n, bool)
        scoring = self.scores_prompts and req.scoring_prompt         # then every row runs the decoder
        if self.narrows and not scoring:
            full[:] = False
            for e in (*req.cuts, n):
                full[max(0, e - ced_rows(cfg)):e] = True
        edges = [i for i in range(req.cached + 1, n) if full[i] != full[i - 1]]
        bounds = sorted({*range(req.cached, n, c), *edges, *req.cuts, n})
        spans = [(a, end, not full[a]) for a, end in zip(bounds, bounds[1:])]
        encoder_rows = int((~full[req.cached:]).sum())
        last = None
        for a, end, encoder_only in spans:
            m = end - a
            tok = np.zeros((c, 1), np.int32)
            pos = np.zeros((c, 1), np.int32)
            act = np.zeros((c, 1), bool)
            ids = np.zeros((c, 1, *eng.shape[1:]), np.int32)
            tok[:m, 0], pos[:m, 0], act[:m, 0], ids[:m, 0] = tokens[a:a + m], np.arange(a, a + m), True, eng[a:a + m]
            metas = StepBatch.decode(tok, pos, np.full((c, 1), slot, np.int32),
                                     np.broadcast_to(table, (c, 1, table.size)), act, ids)
            if self.dcache is not None and not encoder_only:
                logits, self.cache, feats = prefill_chunk(self.params, self.cache, metas, cfg, encoder_only,
                                                          self.step_plan, features=True)
                pos = jnp.asarray(np.arange(a, a + c)[None], jnp.int32)          # the chunk's last W rows only
                self._write_context(np.array([slot]), jnp.swapaxes(feats, 0, 1), pos,
                                    (pos < end) & (pos >= end - cfg.sliding_window), jnp.asarray(tok.T))
            else:
                logits, self.cache = prefill_chunk(self.params, self.cache, metas, cfg, encoder_only, self.step_plan)
            if not encoder_only:
                # [1, vocab], on the device (the row index as data: one program for every chunk length)
                last = jax.lax.dynamic_index_in_dim(logits[:, 0], np.int32(m - 1), keepdims=True)
            if scoring:
                self._score_chunk(req, logits[:, 0], a, end)
            if end in req.cuts:
                at_cut(req, end)
        if self.record_logits:
            req.last_logits = fetch(last)[0]
        self._sync_counts([req], [slot])
        tokens, lp, self.counts = sample_tokens(last, self._rows([req], 1, slots=[slot]), self.counts,
                                                whole=self.whole, logprobs=self.capacity.max_logprobs)
        lp = self._logprobs(lp, [req])
        self._emit(req, int(fetch(tokens)[0]), self._entry(lp, req, 0))
        self._counted_now([req], [slot])
        self.stats["prefill_tokens"] += n - req.cached
        req.filled = n
        self.stats["ced_encoder_only_rows"] += encoder_rows
        self.stats["prefill_s"] += time.perf_counter() - t0
        done(req)

    def _score_chunk(self, req: Request, logits, a: int, end: int) -> None:
        """The prompt log-probabilities of token-serial chunk positions ``a … end − 1`` (``logits [chunk, vocab]``)
        that ``req`` has not had yet, appended to ``req.prompt_logprobs``."""
        targets = np.full(logits.shape[0], -1, np.int32)
        todo = range(max(a, len(req.prompt_logprobs) - 1), min(end, len(req.prompt) - 1))
        for p in todo:
            targets[p - a] = req.prompt[p + 1]
        lp = jax.tree.map(fetch, chunk_logprobs(logits, jnp.asarray(targets), self.scores_prompts, self.whole))
        req.prompt_logprobs.extend(entries(lp, p - a, req.sampling.prompt_logprobs) for p in todo)

    def span_buckets(self, rows: int) -> dict:
        """The static buckets of a span prefill pass of ``rows`` prompt rows in all: the smallest
        `Capacity.prefill_buckets` entry ``R ≥ rows`` fixes the span (``R``: the longest chunk's bucket), the rows
        per rank (packed: ``R``; model-wide QCP over ``n`` ranks: ``⌈R/n⌉ + 2·max_batch`` at most — a request's zigzag
        gives a rank at most ``L/n + 2`` rows — capped at ``R``) and the CED decoder rows per rank (at most
        ``max_batch · ced_rows``). One compiled program per bucket (and, under model-wide QCP, per ``continued``)."""
        ladder = self.capacity.prefill_buckets
        if rows > ladder[-1]:
            raise ValueError(f"span prefill: a pass of {rows} rows exceeds the round's budget of {ladder[-1]} rows")
        r = next(x for x in ladder if x >= rows)
        n, b = self.span_layout.n, self.capacity.max_batch
        cap = r if n == 1 else min(r, -(-r // n) + 2 * b)
        dec = min(cap, b * ced_rows(self.cfg)) if self.capacity.ced and ced_boundary(self.cfg) is not None else None
        return {"span": r, "capacity": cap, "dec_capacity": dec}

    def prefill_span(self, reqs: list[Request], slots: list[int], tables, starts, ends, done: Done) -> None:
        """One span-prefill pass: rows ``[starts[i], ends[i])`` of each of ``reqs``' histories (their prompts; a
        preempted request's outputs too) in batch ``slots`` with block ``tables [len(reqs), max_blocks]``, continuing
        from the cached history below ``starts[i]``; each request whose history ends in the pass gets its next token
        (``done``); ``Request.filled`` advances to ``ends[i]``. Batch rows past ``reqs`` are idle. A chunk that ends at
        one of its request's prefix-cache boundaries (``Request.cuts``) is CED-narrowed as if the history ended there,
        so the slot state stored there is complete."""
        t0 = time.perf_counter()
        cfg, b, k = self.cfg, self.capacity.max_batch, len(reqs)
        histories = [r.history for r in reqs] + [[]] * (b - k)
        totals = np.array([len(h) for h in histories], np.int32)
        starts = np.concatenate([np.asarray(starts, np.int32), np.zeros(b - k, np.int32)])
        ends = np.concatenate([np.asarray(ends, np.int32), np.zeros(b - k, np.int32)])
        decoder_ends = np.array([int(ends[i]) if i < k and int(ends[i]) in reqs[i].cuts else int(totals[i])
                                 for i in range(b)], np.int32)
        slots = list(slots) + [0] * (b - k)
        full = np.full((b, self.capacity.max_blocks), -1, np.int32)
        full[:k] = tables
        # a pass that scores prompt rows runs every row through the decoder (no CED narrowing)
        narrows = self.narrows and not any(r.scoring_prompt for r in reqs)
        batch = build_span_batch(cfg, histories, self.span_layout.n, query_parallel=self.span_layout.query_parallel,
                                 starts=starts, ends=ends, slots=slots, block_tables=full, ced=narrows,
                                 decoder_ends=decoder_ends, **self.span_buckets(int((ends - starts).sum())))
        targets, scoring = self._targets(reqs, starts, ends, batch)
        logits, scored = self._span_pass(batch, slots, targets)
        if scoring:                                      # each scored row's entry, in prompt order
            scored = jax.tree.map(fetch, scored)
            for req, row in scoring:
                req.prompt_logprobs.append(entries(scored, (0, row), req.sampling.prompt_logprobs))
        last = [i for i in range(k) if starts[i] < ends[i] == totals[i]]          # whose history ends in the pass
        if last:
            self._sync_counts([reqs[i] for i in last], [slots[i] for i in last])
            rows = self._rows([reqs[i] for i in last], b, rows=last, slots=[slots[i] for i in last])
            tokens, lp, self.counts = sample_tokens(logits, rows, self.counts, whole=self.whole,
                                                    logprobs=self.capacity.max_logprobs)
            tokens, lp = fetch(tokens), self._logprobs(lp, [reqs[i] for i in last])
            recorded = fetch(logits) if self.record_logits else None
        for i, req in enumerate(reqs):
            req.filled = int(ends[i])
            self.stats["prefill_tokens"] += int(ends[i] - starts[i])
            if narrows:                                                  # rows that ran the encoder layers only
                self.stats["ced_encoder_only_rows"] += max(0, min(int(ends[i]), int(decoder_ends[i]) - ced_rows(cfg))
                                                          - int(starts[i]))
        for i in last:
            self._emit(reqs[i], int(tokens[i]), self._entry(lp, reqs[i], i))
            if recorded is not None:
                reqs[i].last_logits = recorded[i]
        self._counted_now([reqs[i] for i in last], [slots[i] for i in last])
        self.stats["prefill_s"] += time.perf_counter() - t0
        for i in last:
            done(reqs[i])

    def _span_pass(self, batch: StepBatch, slots, targets=None):
        """Run one span-prefill pass (and write the drafter's context): ``(the pass's last-row logits [B, vocab],
        its rows' prompt log-probabilities or None)``. ``targets [1, rows]``: each row's next prompt token to score
        (−1: none; None: the engine scores no prompts)."""
        score = dict(targets=jnp.asarray(targets), score=self.scores_prompts) if targets is not None else {}
        features = self.cfg.sliding_window if self.dcache is not None else 0
        out = prefill_span(self.params, self.cache, batch, self.cfg, self.span_layout, features=features, **score)
        logits, self.cache = out[:2]
        if features:
            self._write_context(np.asarray(slots), *out[2])
        return logits, out[-1] if score else None

    def _targets(self, reqs, starts, ends, batch: StepBatch):
        """``(targets [1, rows] int32, scoring)``: each row of the pass its next prompt token when its request asks
        for prompt log-probabilities and has not had that position's yet (−1 elsewhere), and the ``(request, row)``
        pairs so scored, in prompt order; ``(None, [])`` when the engine scores none or the pass is CED-narrowed. The
        rows are the packed rows
        (``batch.rows``), or under model-wide QCP every rank's local rows in rank order (``N · batch.rows``, a
        request's chunk-relative row ``j`` at ``batch.qcp.span_index[i, j]``)."""
        if not self.scores_prompts or batch.ced is not None:           # (a narrowed pass scores nothing)
            return None, []
        qcp = batch.qcp
        rows = batch.rows * (qcp.n if qcp is not None else 1)
        index = np.asarray(qcp.span_index) if qcp is not None else None
        out, scoring, at = np.full((1, rows), -1, np.int32), [], 0
        for i, req in enumerate(reqs):
            a, e = int(starts[i]), int(ends[i])
            if req.sampling.prompt_logprobs is not None:
                done = len(req.prompt_logprobs)                     # positions 0 … done − 1 have their entry
                for p in range(max(a, done - 1), min(e, len(req.prompt) - 1)):
                    row = int(index[i, p - a]) if index is not None else at + p - a
                    out[0, row] = req.prompt[p + 1]
                    scoring.append((req, row))
            at += e - a
        return out, scoring

    # ------------------------------------------------------------------ warm-up
    def warm_up_programs(self, prefill: bool = True, decode: bool = True) -> list[tuple[str, Callable[[], None]]]:
        """Every program this runner's rounds can run (``prefill`` / ``decode``: those of each round), as ``(name,
        run)`` pairs: each ``run()`` executes it once on an idle batch (nothing is written), so it is compiled (or
        loaded from the compilation cache) before traffic. Span prefill: one per `Capacity.prefill_buckets` entry
        (model-wide QCP: fresh and continued passes), each with the first-token sampler on its logits; with prefix
        caching the slot-state store / resume; decode with its sampling, or the speculative draft / verify / commit
        programs."""
        out = []
        if prefill and self.span:
            # with CED narrowing, a pass that scores prompt rows is unnarrowed: both programs
            narrowed = (True, False) if self.narrows and self.scores_prompts else (self.narrows,)
            for r in self.capacity.prefill_buckets:
                for continued in ((False, True) if self.span_layout.query_parallel else (False,)):
                    for ced in narrowed:
                        out.append((f"prefill {r} rows" + (" (continued)" if continued else "")
                                    + (" (scoring, unnarrowed)" if self.narrows and not ced else ""),
                                    partial(self._idle_pass, r, continued, ced)))
        elif prefill:
            out.append(("token-serial prefill", self._idle_chunk))
        if prefill and self.capacity.prefix_caching:
            out.append(("prefix-cache slot state", self._idle_slot_state))
        if decode:
            out.append(("decode", self._idle_decode) if self.speculative is None else
                       ("speculative round", self._idle_speculative))
        if prefill or decode:
            out.append(("penalty counts", self._idle_counts))
        return out

    def warm_up(self, progress: Callable[[str, int, int], None] | None = None, prefill: bool = True,
                decode: bool = True) -> dict:
        """Run `warm_up_programs` (``progress(name, done, total)`` after each): ``{"programs": count, "seconds": wall
        time}``. The statistics are left as they were."""
        t0 = time.perf_counter()
        programs = self.warm_up_programs(prefill, decode)
        if self.grammars is not None:           # the grammar library's view of the vocabulary (~1 s at 129K ids)
            try:
                self.grammars.tokenizer
            except GrammarError:                # a tokenizer it cannot read: grammar requests are refused
                pass
        counters = {k: v for k, v in self.stats.items() if not isinstance(v, deque)}
        for i, (name, run) in enumerate(programs):
            run()
            if progress is not None:
                progress(name, i + 1, len(programs))
        self.stats.update(counters)                       # idle programs served nothing
        return {"programs": len(programs), "seconds": time.perf_counter() - t0}

    def _idle_pass(self, rows: int, continued: bool, narrowed: bool) -> None:
        b = self.capacity.max_batch
        batch = build_span_batch(self.cfg, [[]] * b, self.span_layout.n, query_parallel=self.span_layout.query_parallel,
                                 block_tables=np.full((b, self.capacity.max_blocks), -1, np.int32),
                                 ced=narrowed, **self.span_buckets(rows))
        if continued:
            batch = dataclasses.replace(batch, qcp=dataclasses.replace(batch.qcp, continued=True))
        logits, _ = self._span_pass(batch, [0] * b, self._targets([], [], [], batch)[0])
        tokens, _, self.counts = sample_tokens(logits, self._rows([], b), self.counts, whole=self.whole,
                                               logprobs=self.capacity.max_logprobs)
        fetch(tokens)

    def _idle_chunk(self) -> None:
        cfg, b, c = self.cfg, 1, self.capacity.prefill_chunk        # (`prefill_serial` feeds one request)
        n_eng = len(cfg.engram_layer_ids)
        z = np.zeros((c, b), np.int32)
        metas = StepBatch.decode(z, z, z, np.full((c, b, self.capacity.max_blocks), -1, np.int32), z.astype(bool),
                                 np.zeros((c, b, n_eng, cfg.engram_hash_heads if n_eng else 0), np.int32))
        if self.dcache is not None:
            logits, self.cache, _ = prefill_chunk(self.params, self.cache, metas, cfg, False, self.step_plan,
                                                  features=True)
        else:
            logits, self.cache = prefill_chunk(self.params, self.cache, metas, cfg, False, self.step_plan)
        last = jax.lax.dynamic_index_in_dim(logits[:, 0], np.int32(0), keepdims=True)      # as `prefill_serial`
        if self.scores_prompts:                                                            # (its prompt scores)
            fetch(chunk_logprobs(logits[:, 0], jnp.full(c, -1, jnp.int32), self.scores_prompts, self.whole).chosen)
        tokens, _, self.counts = sample_tokens(last, self._rows([], 1), self.counts, whole=self.whole,
                                               logprobs=self.capacity.max_logprobs)
        fetch(tokens)

    def _idle_counts(self) -> None:
        """Rebuild slot 0's token counts from an empty history (what it holds is no one's afterwards)."""
        self._counted.pop(0, None)
        self.counts = reset_slot(self.counts, np.int32(0), np.full(self.capacity.max_tokens, -1, np.int32),
                                 np.int32(0), mesh=self.mesh)

    def _idle_slot_state(self) -> None:
        """Take slot 0's state and put it back (unchanged): the prefix cache's store and resume programs."""
        self.put_slot_state(0, self.take_slot_state(0))

    def _idle_decode(self) -> None:
        b = self.capacity.max_batch
        meta = StepBatch.idle(self.cfg, b, self.capacity.max_blocks)
        tokens, _, _, self.cache, self.counts = decode_and_sample(
            self.params, self.cache, meta, self._rows([], b), self.counts, self.cfg, self.step_plan,
            self.capacity.max_logprobs)
        fetch(tokens)

    def _idle_speculative(self) -> None:
        self.decode_speculative([], [], np.zeros((0, self.capacity.max_blocks), np.int32), lambda req: None)

    def _write_context(self, slots, features, positions, keep, tokens) -> None:
        """The drafter's context of fed rows (``[B, F, ·]`` features, positions, keep, their own tokens)."""
        if self.dparams is None:
            return
        slots = jnp.asarray(slots, jnp.int32)
        if self.speculative.algorithm == "mtp":
            self.dcache = write_mtp_context(self.dparams, embedding_and_head(self.params)[0], self.cfg, self.dcache,
                                            slots, features, positions, keep, tokens)
        else:
            self.dcache = write_draft_context(self.dparams, self.cfg, self.dcache, slots, features, positions, keep)

    # ------------------------------------------------------------------ decode
    def decode(self, rows: list[Request], slots: list[int], tables: np.ndarray, done: Done) -> None:
        """One decode round of ``rows`` (running requests with their ``slots`` and block ``tables``): one token
        each, or with speculative decoding one draft-verify-accept round (`decode_speculative`)."""
        if self.speculative is not None:
            return self.decode_speculative(rows, slots, tables, done)
        t0 = time.perf_counter()
        cfg = self.cfg
        meta = StepBatch.for_histories(cfg, [r.history for r in rows], slots, tables, self.capacity.max_batch,
                                       self.capacity.max_blocks)
        sampling = self._rows(rows, self.capacity.max_batch, slots=slots)
        self._sync_counts(rows, slots)
        tokens, lp, logits, self.cache, self.counts = decode_and_sample(
            self.params, self.cache, meta, sampling, self.counts, cfg, self.step_plan, self.capacity.max_logprobs)
        tokens, lp = fetch(tokens), self._logprobs(lp, rows)
        logits = fetch(logits) if self.record_logits else None
        for i, req in enumerate(rows):
            if logits is not None:
                req.last_logits = logits[i]
            self._emit(req, int(tokens[i]), self._entry(lp, req, i))
            self._counted_now([req], [slots[i]])
            done(req)
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += len(rows)
        self.stats["decode_s"] += time.perf_counter() - t0

    def decode_speculative(self, rows: list[Request], slots: list[int], tables: np.ndarray, done: Done) -> None:
        """One speculative round (`v41cp.serving.runner.speculative`): draft, verify ``n + 1`` rows, accept,
        commit."""
        t0 = time.perf_counter()
        cfg, b, mb, spec = self.cfg, self.capacity.max_batch, self.capacity.max_blocks, self.speculative
        n, r = spec.num_draft_tokens, spec.num_draft_tokens + 1
        anchors, pos, slot_ids = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
        for i, req in enumerate(rows):
            hist = req.history
            anchors[i], pos[i], slot_ids[i] = hist[-1], len(hist) - 1, slots[i]
        if spec.proposer is None:
            at = tuple(jnp.asarray(a, jnp.int32) for a in (slot_ids, anchors, pos))
            if spec.algorithm == "mtp":
                drafts = mtp_draft_step(self.dparams, *embedding_and_head(self.params), cfg, self.dcache, *at, n)
            else:
                drafts, _ = draft_step(self.dparams, *embedding_and_head(self.params), cfg, self.dcache, *at, n)
            drafts = fetch(drafts)
        else:
            drafts = np.zeros((b, n), np.int32)
            for i, req in enumerate(rows):
                drafts[i] = checked_proposals(spec.proposer(req.rid, list(req.history), n), n, cfg.vocab_size)
        # rows within the reserved pages; a grammar row verifies the drafts its grammar accepts, each row masked
        lengths = np.array([min(r, req.sampling.max_new_tokens - len(req.output)) for req in rows], np.int32)
        masks, valid = self._draft_masks(rows, drafts, b, r)
        lengths = np.minimum(lengths, valid + 1).astype(np.int32)
        meta = StepBatch.verify(cfg, [req.history for req in rows], drafts, lengths, slots, tables, b, mb, r)
        sampling = self._rows(rows, b, slots=slots, masks=masks)
        self._sync_counts(rows, slots)
        emitted, accepted, lp, logits, self.cache, self.counts, undo, (feats, fpos, fok, ftok) = verify_and_accept(
            self.params, self.cache, meta, sampling, self.counts, cfg, self.step_plan, features=True,
            logprobs=self.capacity.max_logprobs)
        self.cache = commit_rows(self.cache, undo, accepted + 1, cfg, self.step_plan)   # the anchor and the kept
        emitted, lp = fetch(emitted), self._logprobs(lp, rows)
        kept = np.where(np.arange(b) < len(rows), fetch(accepted) + 1, 0)       # the anchor and m drafts; idle 0
        logits = fetch(logits) if self.record_logits else None
        emitted_total = 0
        for i, req in enumerate(rows):
            m = int(kept[i]) - 1
            if logits is not None:
                req.last_logits = logits[i, m]
            req.spec["steps"] += 1
            req.spec["proposed"] += int(lengths[i] - 1)
            req.spec["accepted"] += m
            self._counted_now([req], [slots[i]], len(req.output) + m + 1)    # the device counted all it emitted
            for j, t in enumerate(emitted[i, :m + 1]):
                self._emit(req, int(t), self._entry(lp, req, (i, j)))
                req.spec["emitted"] += 1
                emitted_total += 1
                done(req)
                if req.status != "running":
                    break
        if self.dparams is not None:
            self._write_context(slot_ids, feats, fpos, fok & (fpos < jnp.asarray(pos + kept)[:, None]), ftok)
        self.stats["decode_steps"] += 1
        self.stats["spec_steps"] += len(rows)                  # target steps of requests (rows of the rounds)
        self.stats["drafts_proposed"] += int(np.maximum(lengths - 1, 0).sum())
        self.stats["drafts_accepted"] += int(kept.sum()) - len(rows)
        self.stats["decode_tokens"] += emitted_total
        self.stats["decode_s"] += time.perf_counter() - t0

    # ------------------------------------------------------------------ sampling rows, grammars
    def _draft_masks(self, reqs, drafts: np.ndarray, batch: int, r: int):
        """A speculative round's grammar masks on the devices, ``[batch, r, words]`` (`Grammars.draft_masks`), and
        how many of each request's drafts its grammar accepts (``r − 1`` without a grammar)."""
        if self.grammars is not None and any(q.sampling.grammar is not None for q in reqs):
            masks, valid = self.grammars.draft_masks(reqs, drafts[:len(reqs)], batch)
            return jax.device_put(masks, self._replicated), valid
        key = (batch, r)
        if key not in self._all_allowed:
            words = no_masks(batch, self.cfg.vocab_size)
            self._all_allowed[key] = jax.device_put(np.repeat(words[:, None], r, axis=1), self._replicated)
        return self._all_allowed[key], np.full(len(reqs), r - 1)

    def _rows(self, reqs, batch: int, rows=None, slots=None, masks=None) -> SamplingRows:
        """The `SamplingRows` of ``reqs`` (at their next output index) in ``rows`` of a ``batch``-row step, in batch
        ``slots``, with their grammars' masks (every step carries masks, all bits set without grammar rows; given:
        ``masks``, on the devices)."""
        if masks is None and self.grammars is not None and any(r.sampling.grammar is not None for r in reqs):
            # placed as the all-allowed masks are (the same input type: no second compilation of a step)
            masks = jax.device_put(self.grammars.masks(reqs, batch, rows), self._replicated)
        elif masks is None:                     # no grammar row: the all-allowed masks, kept on the device
            if batch not in self._all_allowed:
                self._all_allowed[batch] = jax.device_put(no_masks(batch, self.cfg.vocab_size), self._replicated)
            masks = self._all_allowed[batch]
        return SamplingRows.build([r.sampling for r in reqs], [len(r.output) for r in reqs], batch, rows=rows,
                                  eos=self.eos, slots=slots, masks=masks)

    def _emit(self, req: Request, token: int, logprob) -> None:
        """Append a sampled token to ``req``; a request whose grammar is complete is marked to end."""
        req.emit(token, logprob)
        if self.grammars is not None and self.grammars.advance(req):
            req.grammar_done = True

    # ------------------------------------------------------------------ penalties
    def _sync_counts(self, reqs, slots) -> None:
        """Make the token counts of each penalized request's slot its own (`v41cp.serving.runner.penalties`):
        rebuilt from its prompt and outputs unless the slot already holds them (the same request, as many
        outputs)."""
        for req, slot in zip(reqs, slots):
            if not req.sampling.penalized:
                continue
            held = self._counted.get(slot)
            if held is not None and held[0] is req and held[1] == len(req.output):
                continue
            ids = np.full(self.capacity.max_tokens, -1, np.int32)
            hist = req.history
            ids[:len(hist)] = hist
            self.counts = reset_slot(self.counts, np.int32(slot), ids, np.int32(len(req.prompt)), mesh=self.mesh)
            self._counted[slot] = (req, len(req.output))

    def _counted_now(self, reqs, slots, outputs: int | None = None) -> None:
        """After a sampling step: the penalized requests' slots count ``outputs`` (default: all) of their outputs."""
        for req, slot in zip(reqs, slots):
            if slot in self._counted and self._counted[slot][0] is req:
                self._counted[slot] = (req, len(req.output) if outputs is None else outputs)

    # ------------------------------------------------------------------ log-probabilities
    def _logprobs(self, lp, reqs) -> TokenLogprobs | None:
        """A step's `TokenLogprobs` on the host when one of ``reqs`` asks for them (else nothing is fetched)."""
        if lp is None or not any(r.sampling.logprobs is not None for r in reqs):
            return None
        return jax.tree.map(fetch, lp)

    @staticmethod
    def _entry(lp: TokenLogprobs | None, req: Request, index):
        """``req``'s log-probability entry of the token at ``index`` of the fetched ``lp`` (None: not asked)."""
        return None if lp is None or req.sampling.logprobs is None else entries(lp, index, req.sampling.logprobs)

    # ------------------------------------------------------------------ structure
    def cache_bytes_per_device(self) -> dict[str, int]:
        """Decode-state bytes allocated on the first device: the global pages (split over KVP ranks) and the
        replicated per-request state (SWA rings, compressor tails)."""
        dev = jax.devices()[0] if self.mesh is None else self.mesh.devices.flat[0]

        def on_dev(tree):
            total = 0
            for leaf in jax.tree.leaves(tree):
                total += sum(sh.data.nbytes for sh in leaf.addressable_shards if sh.device == dev)
            return total

        pages = on_dev([self.cache.pool(k) for k in POOLS])
        replicated = on_dev(list(self.cache.per_slot().values()))
        return {"global_pages": pages, "replicated_state": replicated, "total": pages + replicated,
                "pages_per_device": self.num_blocks // (self.plan.n if self.plan else 1)}

    def compiled_decode_text(self) -> str:
        """Optimized HLO of this runner's decode step (its static bucket, with the sampling), for structure checks."""
        b = self.capacity.max_batch
        meta = StepBatch.idle(self.cfg, b, self.capacity.max_blocks)
        return decode_and_sample.lower(self.params, self.cache, meta, self._rows([], b), self.counts,
                                       self.cfg, self.step_plan, self.capacity.max_logprobs).compile().as_text()

    @staticmethod
    def compile_counts() -> dict[str, int]:
        """Compilations so far of the engine's jitted decode step (with its sampling), token-serial prefill chunk,
        span prefill and the speculative verification (with its acceptance) and draft steps (one per bucket — and
        verification width — expected; the span prefill also once more for continuing passes)."""
        return {"decode_step": decode_and_sample._cache_size(), "prefill_chunk": prefill_chunk._cache_size(),
                "prefill_span": span_compile_count(), "verify_step": verify_and_accept._cache_size(),
                "draft_step": draft_step._cache_size() + mtp_draft_step._cache_size()}
