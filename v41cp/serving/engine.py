"""Continuous-batching engine over the static-capacity decode step (issue 4, reference path).

`Engine(params, cfg, capacity, mesh=None)`: `submit` validates a request (errors name the offending
value and change nothing) and queues it, or rejects it when ``max_waiting`` requests already wait; every `step` first admits queued requests that fit (FIFO;
each reserves the blocks for its whole prompt + output budget, so no running request is ever
preempted) and prefills them (a prefill round, chunk by chunk), then runs one decode round for every
running request. Sampling is greedy, or temperature / top-p with a per-request seed (deterministic:
the draw of output token ``i`` uses ``default_rng([seed, i])``). A request stops on EOS (unless
disabled) or after ``max_new_tokens``; `cancel` frees it at once. With ``speculative`` (`v41cp.serving.runner.speculative`:
the DSpark drafter, or injected proposals) a decode round drafts ``n`` tokens per request, verifies them in one
``n + 1``-row step and keeps the accepted ones (greedy tokens as without it; sampling lossless).
With ``Capacity(prefix_caching=True)`` a prompt that starts with cached whole blocks reuses their pages and the
stored slot state and prefills only the rest (`v41cp.serving.cache.prefix`): bit-identical to a cold prefill.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from v41cp.config import ModelConfig
from v41cp.engram_hash import engram_hash_ids
from v41cp.model import embedding_and_head, shard_params
from v41cp.serving.attention.dcp import DCPPlan
from v41cp.serving.cache.allocator import BlockAllocator, content_residue
from v41cp.serving.cache.prefix import PrefixCache
from v41cp.serving.cache.prefix import admit as prefix_admit
from v41cp.serving.cache.prefix import grow as prefix_grow
from v41cp.serving.cache.request_state import request_state
from v41cp.serving.cache.slot_state import put_slot_state, state_bytes, take_slot_state
from v41cp.serving.multihost.fetch import fetch
from v41cp.serving.runner.span_metadata import build_span_metadata, round_up, row_capacities
from v41cp.serving.runner.span_prefill import SpanLayout, prefill_span
from v41cp.serving.runner.span_prefill import compile_count as span_compile_count
from v41cp.serving.runner.speculative import (
    Speculative,
    accept_drafts,
    check_speculative,
    draft_step,
    init_draft_cache,
    write_draft_context,
)
from v41cp.serving.runner.steps import (
    DecodeMetadata,
    StepRows,
    ced_boundary,
    ced_rows,
    commit_rows,
    decode_step,
    engram_ids_for_last,
    init_cache,
    prefill_chunk,
    verify_step,
)
from v41cp.sharding.topology import ParallelConfig

__all__ = ["Capacity", "SamplingParams", "Engine", "EngineFull", "RequestError", "sample_token",
           "token_distribution"]


class RequestError(ValueError):
    """A request is rejected at submit; ``field`` names the offending input (``prompt``, ``max_new_tokens``,
    ``temperature``, ``top_p``, ``seed``, ``request_id``). Nothing else changes."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


class EngineFull(RequestError):
    """The waiting queue holds ``Capacity.max_waiting`` requests already (retry later)."""


@dataclass(frozen=True)
class Capacity:
    """Static capacity (the compile bucket): batch rows, tokens per request, block size and count."""

    max_batch: int = 4
    max_tokens: int = 256
    block_tokens: int = 16
    num_blocks: int | None = None          # default: enough for max_batch full requests
    prefill_chunk: int = 32
    ced: bool = False                      # CED narrowing of prefill (exact; off by default)
    # prefill admissions in one pass per round (`v41cp.serving.runner.span_prefill`) instead of token-serial chunks;
    # always on under model-wide QCP
    span_prefill: bool = False
    span_chunk: int | None = None          # span prefill rows per request per pass (None: the whole prompt)
    max_waiting: int = 64                  # queued requests beyond this are rejected at submit
    # exact prefix caching (token-serial prefill; `v41cp.serving.cache.prefix`) and its stored slot states at most
    prefix_caching: bool = False
    prefix_states: int | None = None       # default: 4 per batch slot

    def __post_init__(self):
        if self.prefix_states is not None and (type(self.prefix_states) is not int or self.prefix_states <= 0):
            raise ValueError(f"capacity prefix_states must be a positive integer or None, got {self.prefix_states!r}")
        if self.span_chunk is not None and (type(self.span_chunk) is not int or self.span_chunk <= 0):
            raise ValueError(f"capacity span_chunk must be a positive integer or None, got {self.span_chunk!r}")
        for name in ("max_batch", "max_tokens", "block_tokens", "prefill_chunk"):
            v = getattr(self, name)
            if type(v) is not int or v <= 0:
                raise ValueError(f"capacity {name} must be a positive integer, got {v!r}")

    @property
    def max_blocks(self) -> int:
        return -(-self.max_tokens // self.block_tokens)

    @property
    def blocks(self) -> int:
        return self.num_blocks or self.max_batch * self.max_blocks


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_on_eos: bool = True


@dataclass
class _Request:
    rid: object
    prompt: list[int]
    sampling: SamplingParams
    output: list[int] = field(default_factory=list)
    status: str = "waiting"                # waiting | running | done | cancelled
    finish_reason: str | None = None
    last_logits: np.ndarray | None = None  # FP32 logits that produced the latest output token
    spec: dict = field(default_factory=lambda: {"steps": 0, "proposed": 0, "accepted": 0, "emitted": 0})
    cached: int = 0                        # prompt tokens reused from the prefix cache (not prefilled)
    prefix_nodes: list = field(default_factory=list)   # prefix-cache nodes this request holds
    cuts: tuple = ()                       # prompt positions where its prefill stores a slot state

    @property
    def history(self) -> list[int]:
        return self.prompt + self.output


def _support(logits: np.ndarray, sp: SamplingParams):
    """Temperature / top-p sampling's support and probabilities ``(ids, q)`` (descending), or None for greedy
    (temperature 0, or so small that logits / T overflows: the greedy limit)."""
    if sp.temperature <= 0:
        return None
    z = logits.astype(np.float64) / sp.temperature
    if not np.isfinite(z).all():
        return None
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    cum = np.cumsum(p[order])
    keep = order[: max(1, int(np.searchsorted(cum, sp.top_p) + 1))]
    return keep, p[keep] / p[keep].sum()


def sample_token(logits: np.ndarray, sp: SamplingParams, index: int) -> int:
    """Greedy (temperature 0) or temperature / top-p sampling of one token, seeded by (seed, index)."""
    support = _support(logits, sp)
    if support is None:
        return int(np.argmax(logits))
    keep, q = support
    return int(keep[np.random.default_rng([sp.seed, index]).choice(len(keep), p=q)])


def token_distribution(logits: np.ndarray, sp: SamplingParams) -> np.ndarray | None:
    """The distribution `sample_token` draws from, as probabilities over the vocabulary (float64); None for
    greedy (speculative acceptance then compares with the argmax)."""
    support = _support(logits, sp)
    if support is None:
        return None
    p = np.zeros(logits.shape[-1])
    p[support[0]] = support[1]
    return p


def _ratios(steps: int, accepted: int, emitted: int) -> dict:
    return {"mean_accepted_length": accepted / steps if steps else 0.0,
            "target_steps_per_token": steps / emitted if emitted else 0.0}


def _spec_stats(spec: dict) -> dict:
    """A request's speculative counters (``emitted``: the tokens of its decode steps, after EOS / length cuts)."""
    return {"target_steps": spec["steps"], "drafts_proposed": spec["proposed"], "drafts_accepted": spec["accepted"],
            "emitted_tokens": spec["emitted"], **_ratios(spec["steps"], spec["accepted"], spec["emitted"])}


def _checked_proposals(ids, n: int, vocab: int) -> np.ndarray:
    """A proposer's answer as ``n`` token ids, or ValueError naming the bad value."""
    ids = [int(t) for t in ids]
    if len(ids) != n or any(not 0 <= t < vocab for t in ids):
        raise ValueError(f"speculative proposer returned {ids!r}: expected {n} token ids in [0, {vocab})")
    return np.asarray(ids, np.int32)


class Engine:
    """See the module docstring. ``mesh``: run with parameters sharded over its attention-TP axes (TP_RULES).
    ``parallel`` (`ParallelConfig`): the topology — builds the mesh over the first ``tp · dp`` devices
    (unless ``mesh`` is given) and, with ``kv_parallel_size > 1``, splits the global cache pages over the KVP
    group and decodes with DCP (`v41cp.serving.attention.dcp`); prefill then also runs through the owner-masked
    cached path (token-serial chunks; every rank computes the complete span and writes what it owns).
    With ``query_context_parallel_size > 1`` (model-wide QCP; KVP 1 or equal to it), operator-local indexer /
    attention QCP, or ``Capacity(span_prefill=True)`` the admissions of a round are prefilled in one span-prefill pass
    (`v41cp.serving.runner.span_prefill`), whose caches the decode step (DCP under KVP) reads as they are."""

    def __init__(self, params, cfg: ModelConfig, capacity: Capacity = Capacity(), mesh=None,
                 parallel: ParallelConfig | None = None, speculative: Speculative | None = None,
                 devices=None, role: str = "both"):
        if role not in ("both", "prefill", "decode"):
            raise ValueError(f"engine role must be 'both', 'prefill' or 'decode', got {role!r}")
        self.cfg, self.capacity, self.role = cfg, capacity, role
        if speculative is not None:
            check_speculative(cfg, speculative)
            if speculative.params is None and speculative.proposer is None:
                raise ValueError("speculative decoding needs the drafter's parameters (v41cp.checkpoint.open_drafter) "
                                 "or a proposer")
        self.speculative = speculative
        self.parallel = parallel
        self.plan = None               # KVP / DCP layout (pages split over cp)
        self.step_plan = None          # what the cached steps run with: the KVP plan, or plain TP's selection split
        n = 1
        if parallel is not None and mesh is None:
            devices = list(jax.devices() if devices is None else devices)
            if len(devices) < parallel.num_devices:
                raise ValueError(f"the topology needs {parallel.num_devices} devices, {len(devices)} given")
            mesh = parallel.make_mesh(devices[:parallel.num_devices])
        if mesh is not None:
            from jax.sharding import NamedSharding, PartitionSpec

            rules = parallel.rules() if parallel is not None else None
            params = shard_params(params, cfg, mesh, *([rules] if rules else []))
            cache_sharding = NamedSharding(mesh, PartitionSpec())
            if parallel is not None and parallel.kv_parallel_size > 1:
                self.plan = DCPPlan.build(cfg, parallel, mesh)
                n = parallel.kv_parallel_size
            elif "cp" in mesh.shape and mesh.shape["tp"] * mesh.shape["cp"] > 1:
                # plain attention TP: the cached steps' selection scoring split over the TP ranks (replicated pages)
                self.step_plan = DCPPlan.split_selection(mesh)
        else:
            cache_sharding = None
        self.step_plan = self.step_plan or self.plan
        self.mesh = mesh
        self.params = params
        self.span_layout = SpanLayout.from_parallel(parallel, mesh) if parallel is not None else SpanLayout(mesh)
        lay = self.span_layout
        self.span = (capacity.span_prefill or capacity.span_chunk is not None or lay.query_parallel
                     or lay.operator is not None)
        num_blocks = self.num_blocks = self.block_count(capacity, n)
        self.cache = init_cache(cfg, num_blocks, capacity.block_tokens, capacity.max_batch,
                                None if self.plan else cache_sharding, plan=self.plan)
        self.alloc = BlockAllocator(num_blocks, capacity.block_tokens, capacity.max_batch, capacity.max_blocks, n)
        self.prefix = None
        if capacity.prefix_caching:
            if self.span:
                raise ValueError("prefix caching resumes the token-serial prefill from a stored boundary (bit-identical "
                                 "to a cold prefill); it does not combine with span prefill / query context "
                                 f"parallelism (span_prefill={capacity.span_prefill}, span_chunk={capacity.span_chunk}, "
                                 f"query-parallel={lay.query_parallel}, operator QCP={lay.operator is not None})")
            if capacity.ced:
                raise ValueError("prefix caching does not combine with CED narrowing (capacity ced=True): a narrowed "
                                 "prefill leaves the decoder layers' window rows of a mid-prompt boundary unwritten")
            self.prefix = PrefixCache(capacity.block_tokens, capacity.prefix_states or 4 * capacity.max_batch)
        self.requests: "OrderedDict[object, _Request]" = OrderedDict()
        self.stats = {"prefill_tokens": 0, "prefill_s": 0.0, "decode_steps": 0, "decode_tokens": 0,
                      "decode_s": 0.0, "step_s": deque(maxlen=4096), "ced_encoder_only_rows": 0}
        self.dparams = self.dcache = None
        if speculative is not None:
            rep = None if mesh is None else NamedSharding(mesh, PartitionSpec())
            if speculative.params is not None:
                self.dparams = speculative.params if rep is None else jax.device_put(speculative.params, rep)
            self.dcache = init_draft_cache(cfg, capacity.max_batch, rep)
            self.stats.update(spec_steps=0, drafts_proposed=0, drafts_accepted=0)

    # ------------------------------------------------------------------ requests
    def submit(self, rid, prompt_ids, sampling: SamplingParams = SamplingParams()) -> None:
        """Queue a request; raises ValueError (naming the value) without touching any other request."""
        if rid in self.requests and self.requests[rid].status in ("waiting", "running"):
            raise RequestError(f"request id {rid!r} is already active", "request_id")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise RequestError(f"request {rid!r}: the prompt is empty", "prompt")
        bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"request {rid!r}: token id {bad[0]} is outside the vocabulary "
                               f"[0, {self.cfg.vocab_size})", "prompt")
        if type(sampling.max_new_tokens) is not int or sampling.max_new_tokens <= 0:
            raise RequestError(f"request {rid!r}: max_new_tokens must be a positive integer, got "
                               f"{sampling.max_new_tokens!r}", "max_new_tokens")
        if not sampling.temperature >= 0:
            raise RequestError(f"request {rid!r}: temperature must be >= 0, got {sampling.temperature!r}",
                               "temperature")
        if not 0 < sampling.top_p <= 1:
            raise RequestError(f"request {rid!r}: top_p must be in (0, 1], got {sampling.top_p!r}", "top_p")
        if type(sampling.seed) is not int or not 0 <= sampling.seed < 2**63:
            raise RequestError(f"request {rid!r}: seed must be an integer in [0, 2**63), got {sampling.seed!r}", "seed")
        total = len(prompt) + sampling.max_new_tokens
        if total > self.capacity.max_tokens:
            field = "prompt" if len(prompt) >= self.capacity.max_tokens else "max_new_tokens"
            raise RequestError(f"request {rid!r}: prompt ({len(prompt)}) + max_new_tokens ({sampling.max_new_tokens}) "
                               f"= {total} tokens is beyond the capacity of {self.capacity.max_tokens} per request",
                               field)
        need = max(total - 1, 1)                                          # tokens that enter the cache
        if not self.alloc.fits_when_empty(need):
            raise RequestError(f"request {rid!r}: {need} cached tokens need {self.alloc.blocks_needed(need)} blocks of "
                               f"{self.capacity.block_tokens}, more than the engine's {self.num_blocks} blocks"
                               + (f" ({self.num_blocks // self.alloc.n} per KVP rank)" if self.alloc.n > 1 else ""),
                               "max_new_tokens")
        waiting = sum(r.status == "waiting" for r in self.requests.values())
        if waiting >= self.capacity.max_waiting:
            raise EngineFull(f"request {rid!r} rejected: the engine is full ({waiting} requests already queued)",
                             "request_id")
        self.requests[rid] = _Request(rid, prompt, sampling)

    def cancel(self, rid) -> None:
        req = self.requests.get(rid)
        if req is None or req.status not in ("waiting", "running"):
            raise ValueError(f"cannot cancel unknown or finished request {rid!r}")
        if req.status == "running":
            self._free(req)
        req.status, req.finish_reason = "cancelled", "cancelled"

    def release(self, rid) -> dict:
        """Forget finished or cancelled request ``rid`` (a long-running server calls this); returns its result."""
        req = self.requests.get(rid)
        if req is None or req.status in ("waiting", "running"):
            raise ValueError(f"cannot release unknown or active request {rid!r}")
        out = self.result(rid)
        del self.requests[rid]
        return out

    def load(self) -> dict:
        """Requests waiting / running and free cache blocks (a health probe; with prefix caching the blocks only
        the prefix cache holds count as free: they are evicted on demand); speculative / prefix-cache counters."""
        status = [r.status for r in self.requests.values()]
        reclaimable = self.prefix.reclaimable if self.prefix is not None else 0
        out = {"waiting": status.count("waiting"), "running": status.count("running"),
               "free_blocks": self.alloc.free_blocks + reclaimable, "total_blocks": self.num_blocks,
               "free_slots": self.alloc.free_slots}
        if self.speculative is not None:                 # the server's /health shows them
            out["speculative"] = self.speculative_stats()
        if self.prefix is not None:
            out["prefix_cache"] = self.prefix_stats()
        return out

    def result(self, rid) -> dict:
        r = self.requests[rid]
        out = {"id": rid, "prompt_ids": r.prompt, "output_ids": r.output, "status": r.status,
               "finish_reason": r.finish_reason, "cached_tokens": r.cached}
        if self.speculative is not None:
            out["speculative"] = _spec_stats(r.spec)
        return out

    @property
    def pending(self) -> bool:
        return any(r.status in ("waiting", "running") for r in self.requests.values())

    # ------------------------------------------------------------------ rounds
    def step(self) -> None:
        """One prefill round (admissions) then one decode round (a prefill-role engine: the prefill round only)."""
        t0 = time.perf_counter()
        self.prefill_round()
        if self.role != "prefill":
            self.decode_round()
        self.stats["step_s"].append(time.perf_counter() - t0)

    def _need(self, req: _Request) -> int:
        """Tokens of blocks ``req`` reserves: its prompt and outputs (a prefill-role engine: the prompt only)."""
        extra = 0 if self.role == "prefill" else req.sampling.max_new_tokens - 1
        return max(len(req.prompt) + extra, 1)

    def prefill_round(self) -> list:
        """Admit waiting requests that fit (FIFO) and prefill them; returns the admitted ids."""
        admitted = []
        for req in [r for r in self.requests.values() if r.status == "waiting"]:
            if not self._admit(req, self._need(req)):
                break                                                     # FIFO: wait for capacity
            req.status = "running"
            admitted.append(req)
            if not self.span:
                self._prefill(req)
        if not admitted:
            self._check_progress()
        if self.span and admitted:
            self._prefill_span(admitted)
        return [r.rid for r in admitted]

    def _check_progress(self) -> None:
        """Requests wait only while others run (and will free pages and slots): with nothing running, admission
        takes the head of the queue, since `submit` refused every request that cannot fit an empty engine."""
        status = [r.status for r in self.requests.values()]
        if "waiting" in status and "running" not in status:
            head = next(r for r in self.requests.values() if r.status == "waiting")
            raise RuntimeError(f"request {head.rid!r} cannot be admitted into an idle engine "
                               f"({self.alloc.free_blocks} blocks and {self.alloc.free_slots} slots free): "
                               "an admission defect")

    def decode_round(self) -> None:
        """One decode round of every running request (none on a prefill-role engine)."""
        running = [r for r in self.requests.values() if r.status == "running" and r.output]
        if running and self.role != "prefill":
            self._decode(running)

    # ------------------------------------------------------------------ disaggregated roles
    def adopt(self, rid, prompt, sampling: SamplingParams, output, last_logits=None, residue: int | None = None):
        """Take over request ``rid`` prefilled elsewhere (a decode-role engine): reserve its slot and the blocks of
        its whole budget (page cycle from ``residue``; default the content placement) and register it running with
        ``output`` (its first token(s)). Returns its block ids — the caller then fills its pages and slot state
        (`v41cp.serving.pd.transfer`) — or None when it does not fit now (nothing changed)."""
        if rid in self.requests and self.requests[rid].status in ("waiting", "running"):
            raise RequestError(f"request id {rid!r} is already active", "request_id")
        req = _Request(rid, [int(t) for t in prompt], sampling, output=[int(t) for t in output],
                       status="running", last_logits=last_logits)
        need = self._need(req)
        residue = content_residue(req.prompt, self.capacity.block_tokens, self.alloc.n) if residue is None else residue
        if not self.alloc.fits_when_empty(need):
            raise RequestError(f"request {rid!r}: {need} cached tokens do not fit this engine's capacity",
                               "max_new_tokens")
        if not self.alloc.can_admit(need, 0, residue):
            return None
        blocks = self.alloc.admit(rid, need, residue=residue)
        self.requests[rid] = req
        return blocks

    def hand_off(self, rid) -> dict:
        """Forget running request ``rid`` (a prefill-role engine, after its state moved to a decode engine): its
        slot and pages are free. Returns its result as of now."""
        req = self.requests.get(rid)
        if req is None or req.status != "running":
            raise ValueError(f"cannot hand off unknown or inactive request {rid!r}")
        self._free(req)
        out = self.result(rid)
        del self.requests[rid]
        return out

    def run(self, max_steps: int = 1_000_000) -> list[dict]:
        for _ in range(max_steps):
            if not self.pending:
                break
            self.step()
        return [self.result(rid) for rid in self.requests]

    def _finish_if_done(self, req: _Request) -> None:
        tok = req.output[-1]
        if req.sampling.stop_on_eos and tok == self.cfg.eos_token_id:
            req.status, req.finish_reason = "done", "eos"
        elif len(req.output) >= req.sampling.max_new_tokens:
            req.status, req.finish_reason = "done", "length"
        if req.status == "done":
            self._free(req)

    # ------------------------------------------------------------------ admission and prefix caching
    def _admit(self, req: _Request, need: int) -> bool:
        """Reserve ``need`` tokens of blocks and a slot for ``req`` (False: not now); with prefix caching it
        reuses its prompt's longest cached prefix (`v41cp.serving.cache.prefix.admit`) and its slot gets the
        state stored there."""
        if self.prefix is None:
            residue = content_residue(req.prompt, self.capacity.block_tokens, self.alloc.n)
            if not self.alloc.can_admit(need, 0, residue):
                if not self.alloc.can_admit(need):
                    return False
                residue = None                               # the content placement is full: any that fits
            self.alloc.admit(req.rid, need, residue=residue)
            return True
        got = prefix_admit(self.alloc, self.prefix, req.rid, req.prompt, need)
        if got is None:
            return False
        req.cached, req.prefix_nodes, req.cuts = got.cached, got.nodes, got.cuts
        if got.cached:
            self.cache, self.dcache = put_slot_state(self.cache, self.alloc.slot(req.rid), got.state, self.dcache)
        return True

    def _store_prefix(self, req: _Request, cut: int) -> None:
        """``req``'s prefill has reached ``cut``: its blocks join the prefix cache, the slot state is stored."""
        node = prefix_grow(self.alloc, self.prefix, req.rid, req.prompt, req.prefix_nodes, cut)
        if node.state is None:
            self.prefix.set_state(node, take_slot_state(self.cache, self.alloc.slot(req.rid), self.dcache))

    def _free(self, req: _Request) -> None:
        """Free ``req``'s slot and own blocks and drop its references on cached blocks (finish or cancel)."""
        self.alloc.release(req.rid)
        if self.prefix is not None:
            self.prefix.release(req.prefix_nodes)
            req.prefix_nodes = []

    def prefix_stats(self) -> dict:
        """Prefix-cache counters: lookups, hits, prompt / reused tokens (``hit_rate`` = reused / prompt tokens),
        cached blocks and stored states (and their bytes per device), evictions."""
        out = self.prefix.summary()
        out["prefill_tokens_saved"] = out["hit_tokens"]
        held = [n.state for n in self.prefix.nodes if n.state is not None]
        out["state_bytes"] = sum(state_bytes(s) for s in held)
        return out

    def check(self) -> None:
        """Raise AssertionError unless pages, slots and the prefix cache are consistent (tests, debugging)."""
        self.alloc.check(self.prefix.blocks if self.prefix is not None else ())
        if self.prefix is not None:
            self.prefix.check()
            held = {id(n) for r in self.requests.values() if r.status == "running" for n in r.prefix_nodes}
            refs = {}
            for r in self.requests.values():
                for n in r.prefix_nodes:
                    refs[id(n)] = refs.get(id(n), 0) + 1
            assert all(n.refs == refs.get(id(n), 0) for n in self.prefix.nodes), "prefix references disagree"
            assert held == set(refs), "a finished request holds prefix nodes"

    def _table(self, rid) -> np.ndarray:
        t = np.full(self.capacity.max_blocks, -1, np.int32)
        blocks = self.alloc.blocks(rid)
        t[: len(blocks)] = blocks
        return t

    def _prefill(self, req: _Request) -> None:
        t0 = time.perf_counter()
        cfg, c = self.cfg, self.capacity.prefill_chunk
        n = len(req.prompt)
        eng = (engram_hash_ids(cfg, np.asarray([req.prompt]))[0] if cfg.engram_layer_ids
               else np.zeros((n, 0, 0), np.int32))
        table, slot = self._table(req.rid), self.alloc.slot(req.rid)
        # CED narrowing: rows before the decoder's dependency halo run the encoder (+ boundary prepass) only
        encoder_rows = max(0, n - ced_rows(cfg)) if self.capacity.ced and ced_boundary(cfg) is not None else 0
        spans = [(a, min(a + c, encoder_rows), True) for a in range(0, encoder_rows, c)]
        # from the reused prefix on; chunks also end at the boundaries where the prefix cache stores a state
        bounds = sorted({*range(max(encoder_rows, req.cached), n, c), *req.cuts, n})
        spans += [(a, end, False) for a, end in zip(bounds, bounds[1:])]
        last = None
        for a, end, encoder_only in spans:
            m = end - a
            tok = np.zeros((c, 1), np.int32)
            pos = np.zeros((c, 1), np.int32)
            act = np.zeros((c, 1), bool)
            ids = np.zeros((c, 1, *eng.shape[1:]), np.int32)
            tok[:m, 0], pos[:m, 0], act[:m, 0], ids[:m, 0] = req.prompt[a:a + m], np.arange(a, a + m), True, eng[a:a + m]
            metas = DecodeMetadata(jnp.asarray(tok), jnp.asarray(pos), jnp.full((c, 1), slot, jnp.int32),
                                   jnp.asarray(np.broadcast_to(table, (c, 1, table.size))), jnp.asarray(act),
                                   jnp.asarray(ids), 1, self.capacity.max_blocks)
            if self.dcache is not None and not encoder_only:
                logits, self.cache, feats = prefill_chunk(self.params, self.cache, metas, cfg, encoder_only,
                                                          self.step_plan, features=True)
                pos = jnp.asarray(np.arange(a, a + c)[None], jnp.int32)          # the chunk's last W rows only
                self._write_context(np.array([slot]), jnp.swapaxes(feats, 0, 1), pos,
                                    (pos < end) & (pos >= end - cfg.sliding_window))
            else:
                logits, self.cache = prefill_chunk(self.params, self.cache, metas, cfg, encoder_only, self.step_plan)
            if not encoder_only:
                last = fetch(logits[m - 1, 0])
            if end in req.cuts:
                self._store_prefix(req, end)
        req.last_logits = last
        req.output.append(sample_token(last, req.sampling, 0))
        self.stats["prefill_tokens"] += n - req.cached
        self.stats["ced_encoder_only_rows"] += encoder_rows
        self.stats["prefill_s"] += time.perf_counter() - t0
        self._finish_if_done(req)

    def span_buckets(self, lengths, starts=None, totals=None) -> dict:
        """Static buckets of a span prefill pass over chunks of ``lengths`` rows: span (power of two ≥ 8, at
        most the capacity's tokens rounded to 8) and per-rank rows (powers of two), so few shapes compile."""
        pow2 = lambda x: 1 << max(int(x) - 1, 0).bit_length()
        span = min(max(8, pow2(max(lengths))), round_up(self.capacity.max_tokens, 8))
        rows, dec_rows = row_capacities(self.cfg, lengths, self.span_layout.n, self.capacity.ced, starts, totals)
        return {"span": span, "capacity": pow2(rows), "dec_capacity": pow2(dec_rows)}

    def _prefill_span(self, reqs: list[_Request]) -> None:
        """Prefill ``reqs`` (fresh prompts) by span-prefill passes of at most ``span_chunk`` rows per request
        (later passes continue from the cached history); batch rows past them are idle."""
        t0 = time.perf_counter()
        cfg, b = self.cfg, self.capacity.max_batch
        prompts = [r.prompt for r in reqs] + [[]] * (b - len(reqs))
        totals = np.array([len(p) for p in prompts], np.int32)
        chunk = self.capacity.span_chunk or int(totals.max())
        slots = [self.alloc.slot(r.rid) for r in reqs] + [0] * (b - len(reqs))
        tables = np.full((b, self.capacity.max_blocks), -1, np.int32)
        for i, r in enumerate(reqs):
            tables[i] = self._table(r.rid)
        for start in range(0, int(totals.max()), chunk):
            starts = np.minimum(start, totals)
            ends = np.minimum(start + chunk, totals)
            meta = build_span_metadata(cfg, prompts, self.span_layout.n, starts=starts, ends=ends, slots=slots,
                                       block_tables=tables, ced=self.capacity.ced,
                                       **self.span_buckets(ends - starts, starts, totals))
            if self.dcache is not None:
                w = cfg.sliding_window
                logits, self.cache, (feats, pos, ok) = prefill_span(self.params, self.cache, meta, cfg,
                                                                    self.span_layout, features=w)
                self._write_context(np.asarray(slots), feats, pos, ok)
            else:
                logits, self.cache = prefill_span(self.params, self.cache, meta, cfg, self.span_layout)
            logits = fetch(logits)
            for i, req in enumerate(reqs):
                if starts[i] < ends[i] == totals[i]:                 # this pass holds the prompt's last row
                    req.last_logits = logits[i]
                    req.output.append(sample_token(logits[i], req.sampling, 0))
        for req in reqs:
            n = len(req.prompt)
            self.stats["prefill_tokens"] += n
            if self.capacity.ced and ced_boundary(cfg) is not None:
                self.stats["ced_encoder_only_rows"] += max(0, n - ced_rows(cfg))
        self.stats["prefill_s"] += time.perf_counter() - t0
        for req in reqs:
            self._finish_if_done(req)

    def _write_context(self, slots, features, positions, keep) -> None:
        if self.dparams is not None:
            self.dcache = write_draft_context(self.dparams, self.cfg, self.dcache, jnp.asarray(slots, jnp.int32),
                                              features, positions, keep)

    def _decode(self, rows: list[_Request]) -> None:
        if self.speculative is not None:
            return self._decode_speculative(rows)
        t0 = time.perf_counter()
        cfg, b, mb = self.cfg, self.capacity.max_batch, self.capacity.max_blocks
        n_eng = len(cfg.engram_layer_ids)
        tok, pos, slots = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
        tables, active = np.full((b, mb), -1, np.int32), np.zeros(b, bool)
        eng = np.zeros((b, n_eng, cfg.engram_hash_heads if n_eng else 0), np.int32)
        for i, req in enumerate(rows):
            hist = req.history
            tok[i], pos[i], slots[i], active[i] = hist[-1], len(hist) - 1, self.alloc.slot(req.rid), True
            tables[i] = self._table(req.rid)
            eng[i] = engram_ids_for_last(cfg, hist)
        meta = DecodeMetadata(*(jnp.asarray(a) for a in (tok, pos, slots, tables, active, eng)), b, mb)
        logits, self.cache = decode_step(self.params, self.cache, meta, cfg, self.step_plan)
        logits = fetch(logits)
        for i, req in enumerate(rows):
            req.last_logits = logits[i]
            req.output.append(sample_token(logits[i], req.sampling, len(req.output)))
            self._finish_if_done(req)
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += len(rows)
        self.stats["decode_s"] += time.perf_counter() - t0

    def _decode_speculative(self, rows: list[_Request]) -> None:
        """One speculative round (`v41cp.serving.runner.speculative`): draft, verify ``n + 1`` rows, accept, commit."""
        t0 = time.perf_counter()
        cfg, b, mb, spec = self.cfg, self.capacity.max_batch, self.capacity.max_blocks, self.speculative
        n, r = spec.num_draft_tokens, spec.num_draft_tokens + 1
        n_eng = len(cfg.engram_layer_ids)
        anchors, pos, slots = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
        for i, req in enumerate(rows):
            hist = req.history
            anchors[i], pos[i], slots[i] = hist[-1], len(hist) - 1, self.alloc.slot(req.rid)
        if spec.proposer is None:
            drafts, _ = draft_step(self.dparams, *embedding_and_head(self.params), cfg, self.dcache,
                                   jnp.asarray(slots), jnp.asarray(anchors), jnp.asarray(pos), n)
            drafts = fetch(drafts)
        else:
            drafts = np.zeros((b, n), np.int32)
            for i, req in enumerate(rows):
                drafts[i] = _checked_proposals(spec.proposer(req.rid, list(req.history), n), n, cfg.vocab_size)
        tok, lengths = np.zeros((b, r), np.int32), np.zeros(b, np.int32)
        tables = np.full((b, mb), -1, np.int32)
        eng = np.zeros((b, r, n_eng, cfg.engram_hash_heads if n_eng else 0), np.int32)
        for i, req in enumerate(rows):
            hist = req.history
            lengths[i] = min(r, req.sampling.max_new_tokens - len(req.output))    # rows within the reserved pages
            tok[i, :lengths[i]] = [hist[-1], *drafts[i, :lengths[i] - 1]]
            tables[i] = self._table(req.rid)
            for j in range(lengths[i]):
                eng[i, j] = engram_ids_for_last(cfg, hist + list(drafts[i, :j]))
        meta = StepRows(*(jnp.asarray(a) for a in (tok, pos, lengths, slots, tables, eng)), b, mb, r)
        logits, self.cache, undo, (feats, fpos, fok) = verify_step(self.params, self.cache, meta, cfg,
                                                                   self.step_plan, features=True)
        logits = fetch(logits)
        kept, emitted_total = np.zeros(b, np.int32), 0
        for i, req in enumerate(rows):
            sp = req.sampling
            emitted, m = accept_drafts(list(drafts[i, :lengths[i] - 1]), logits[i, :lengths[i]],
                                       lambda lg: token_distribution(lg, sp), sp.seed, len(req.output))
            kept[i] = m + 1                                                        # the anchor and m drafts
            req.last_logits = logits[i, m]
            req.spec["steps"] += 1
            req.spec["proposed"] += int(lengths[i] - 1)
            req.spec["accepted"] += m
            for t in emitted:
                req.output.append(t)
                req.spec["emitted"] += 1
                emitted_total += 1
                self._finish_if_done(req)
                if req.status != "running":
                    break
        self.cache = commit_rows(self.cache, undo, jnp.asarray(kept), cfg, self.step_plan)
        if self.dparams is not None:
            self._write_context(slots, feats, fpos, fok & (fpos < jnp.asarray(pos + kept)[:, None]))
        self.stats["decode_steps"] += 1
        self.stats["spec_steps"] += len(rows)                  # target steps of requests (rows of the rounds)
        self.stats["drafts_proposed"] += int(np.maximum(lengths - 1, 0).sum())
        self.stats["drafts_accepted"] += int(kept.sum()) - len(rows)
        self.stats["decode_tokens"] += emitted_total
        self.stats["decode_s"] += time.perf_counter() - t0

    def speculative_stats(self) -> dict:
        """Engine-wide speculative counters: drafts proposed / accepted, the mean accepted drafts per target step
        of a request, and target steps per emitted token (1 / (n + 1) when every draft is accepted)."""
        st = self.stats
        return {"target_steps": st["spec_steps"], "drafts_proposed": st["drafts_proposed"],
                "drafts_accepted": st["drafts_accepted"], "emitted_tokens": st["decode_tokens"],
                **_ratios(st["spec_steps"], st["drafts_accepted"], st["decode_tokens"])}

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

        pages = on_dev({k: self.cache[k] for k in ("ckv", "ikey")})
        replicated = on_dev({k: v for k, v in self.cache.items() if k not in ("ckv", "ikey")})
        return {"global_pages": pages, "replicated_state": replicated, "total": pages + replicated,
                "pages_per_device": self.num_blocks // (self.plan.n if self.plan else 1)}

    def request_state(self, rid) -> dict:
        """Running request ``rid``'s decode state as host bytes (`v41cp.serving.cache.request_state`): its complete
        entries of every global group as stored, and its slot state; ``tokens``: the positions it holds."""
        req = self.requests.get(rid)
        if req is None or req.status != "running":
            raise ValueError(f"request {rid!r} is not running: its decode state is not held")
        tokens = len(req.history) - 1                     # the newest output token is not in the cache yet
        slot = take_slot_state(self.cache, self.alloc.slot(rid), self.dcache)
        out = request_state(self.cache, self.alloc.blocks(rid), tokens, self.capacity.block_tokens, self.alloc.n, slot)
        return {**out, "tokens": tokens}

    def compiled_decode_text(self) -> str:
        """Optimized HLO of this engine's decode step (its static bucket), for structure checks."""
        meta = DecodeMetadata.idle(self.cfg, self.capacity.max_batch, self.capacity.max_blocks)
        return decode_step.lower(self.params, self.cache, meta, self.cfg, self.step_plan).compile().as_text()

    @staticmethod
    def block_count(capacity: Capacity, kv_parallel_size: int = 1) -> int:
        """Virtual cache blocks of an engine of ``capacity`` under KVP ``kv_parallel_size``: every rank holds
        num_blocks / N pages, so the count rounds up to whole ranks."""
        n = kv_parallel_size
        if capacity.num_blocks:
            return -(-capacity.blocks // n) * n
        return n * capacity.max_batch * -(-capacity.max_blocks // n)

    @staticmethod
    def compile_counts() -> dict[str, int]:
        """Compilations so far of the jitted decode step, token-serial prefill chunk, span prefill and the
        speculative verification and draft steps (one per bucket — and verification width — expected; the span
        prefill also once more for continuing passes)."""
        return {"decode_step": decode_step._cache_size(), "prefill_chunk": prefill_chunk._cache_size(),
                "prefill_span": span_compile_count(), "verify_step": verify_step._cache_size(),
                "draft_step": draft_step._cache_size()}
