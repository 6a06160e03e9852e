"""`Engine`: continuous batching over the compiled steps — the thin orchestrator of a scheduler and a model runner.

`Engine(params, cfg, capacity, mesh=None, parallel=None, speculative=None, devices=None, role="both",
record_logits=False)`:

* `submit` validates a request (errors name the offending value and change nothing) and queues it, or rejects it
  when ``max_waiting`` requests already wait (`v41cp.serving.scheduler`);
* every `step` runs a prefill round — the scheduler admits waiting requests that fit (FIFO; pages on demand: each
  takes the blocks of its history and next token) and the runner prefills up to `Capacity.round_tokens` prompt rows
  by span-prefill passes (requests whose prefill continues first; a long prompt spans rounds), or, as the
  reference, token-serial chunks — then a decode round of every running request
  (`v41cp.serving.runner.model_runner`), each grown to the tokens the round writes; where pages run out the newest
  running requests are preempted and later recomputed (`v41cp.serving.scheduler.scheduler`);
* sampling is greedy, or temperature with top-k / top-p / min-p and a per-request seed, on the device inside the
  steps (`v41cp.serving.runner.sampling`): only token ids come to the host (``record_logits=True`` also keeps the
  FP32 logits of each request's latest token in ``Request.last_logits``, for tests); a request stops on EOS
  (unless disabled) or after ``max_new_tokens``; `cancel` frees it at once;
* with ``speculative`` (`v41cp.serving.runner.speculative`: V4.1's DSpark drafter, DeepSeek-V4's MTP layer, or
  injected proposals) a decode round drafts ``n`` tokens per request, verifies them in one ``n + 1``-row step and
  keeps the accepted ones (greedy tokens as without it; sampling lossless);
* prefix caching (on by default, ``Capacity.prefix_caching``): a prompt that starts with cached whole blocks reuses
  their pages and the slot state stored at the deepest of them and prefills only the rest
  (`v41cp.serving.cache.prefix`), on every prefill path and layout (tested equal to a cold prefill);
* `warm_up` compiles every program the rounds can run (a fixed ladder of prefill buckets, decode / speculative)
  before traffic (`serve` does, before it opens its port);
* ``role`` ``"prefill"`` / ``"decode"``: one side of prefill / decode disaggregation (`v41cp.serving.pd`).

`EngineLike` is the surface the engine loop and the server drive (the engine and the PD engines implement it).
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

from v41cp.config import ModelConfig
from v41cp.serving.capacity import Capacity
from v41cp.serving.runner.grammar import GrammarError, Grammars
from v41cp.serving.runner.model_runner import ModelRunner
from v41cp.serving.runner.speculative import Speculative, resolved
from v41cp.serving.scheduler.request import EngineFull, Request, RequestError, SamplingParams
from v41cp.serving.scheduler.scheduler import ROLES, Scheduler
from v41cp.sharding.topology import ParallelConfig

__all__ = ["Capacity", "SamplingParams", "Engine", "EngineLike", "EngineFull", "RequestError"]


@runtime_checkable
class EngineLike(Protocol):
    """What the engine loop (`v41cp.serving.api.engine_loop`) and the server drive: submit / cancel / release
    requests, step, read results, load and statistics."""

    cfg: ModelConfig
    capacity: Capacity

    def submit(self, rid, prompt_ids, sampling: SamplingParams = ...) -> None: ...
    def cancel(self, rid) -> None: ...
    def release(self, rid) -> dict: ...
    def result(self, rid) -> dict: ...
    def step(self) -> None: ...
    def load(self) -> dict: ...

    @property
    def pending(self) -> bool: ...

    @property
    def requests(self) -> dict: ...

    @property
    def stats(self) -> dict: ...


def _ratios(steps: int, accepted: int, emitted: int) -> dict:
    return {"mean_accepted_length": accepted / steps if steps else 0.0,
            "target_steps_per_token": steps / emitted if emitted else 0.0}


def spec_stats(spec: dict) -> dict:
    """A request's speculative counters (``emitted``: the tokens of its decode steps, after EOS / length cuts)."""
    return {"target_steps": spec["steps"], "drafts_proposed": spec["proposed"], "drafts_accepted": spec["accepted"],
            "emitted_tokens": spec["emitted"], **_ratios(spec["steps"], spec["accepted"], spec["emitted"])}


def _common_blocks(a: list, b: list, bt: int, most: int) -> int:
    """Leading whole blocks of ``bt`` tokens that token lists ``a`` and ``b`` share (at most ``most``)."""
    k = 0
    while k < most and a[k * bt:(k + 1) * bt] == b[k * bt:(k + 1) * bt] and len(b) >= (k + 1) * bt:
        k += 1
    return k


class Engine:
    """See the module docstring. ``scheduler`` (`Scheduler`: requests, pages, slots, prefix cache) and ``runner``
    (`ModelRunner`: weights, cache, steps, sampling, statistics) are its two parts."""

    def __init__(self, params, cfg: ModelConfig, capacity: Capacity = Capacity(), mesh=None,
                 parallel: ParallelConfig | None = None, speculative: Speculative | None = None,
                 devices=None, role: str = "both", record_logits: bool = False, tokenizer: str | None = None):
        if role not in ROLES:
            raise ValueError(f"engine role must be 'both', 'prefill' or 'decode', got {role!r}")
        capacity = capacity.for_model(cfg)                      # the model's page unless one is given
        if speculative is not None:
            speculative = resolved(cfg, speculative)            # its algorithm and draft count for cfg
            if speculative.params is None and speculative.proposer is None:
                raise ValueError("speculative decoding needs the drafter's parameters (v41cp.checkpoint.open_drafter) "
                                 "or a proposer")
        self.cfg, self.capacity, self.role, self.parallel, self.speculative = cfg, capacity, role, parallel, speculative
        # structured output needs the tokenizer (`v41cp.serving.runner.grammar`); without it grammars are refused
        self.grammars = Grammars(tokenizer, cfg.vocab_size, cfg.eos_token_id) if tokenizer is not None else None
        self.runner = ModelRunner(params, cfg, capacity, mesh, parallel, speculative, devices, record_logits,
                                  self.grammars)
        self.scheduler = Scheduler(cfg, capacity, self.runner.kv_parallel_size, role)

    # ------------------------------------------------------------------ the parts' state, by name
    @property
    def requests(self):
        return self.scheduler.requests

    @property
    def alloc(self):
        return self.scheduler.alloc

    @property
    def prefix(self):
        return self.scheduler.prefix

    @property
    def num_blocks(self) -> int:
        return self.scheduler.num_blocks

    @property
    def cache(self) -> dict:
        return self.runner.cache

    @cache.setter
    def cache(self, value: dict) -> None:
        self.runner.cache = value

    @property
    def dcache(self):
        return self.runner.dcache

    @property
    def params(self):
        return self.runner.params

    @property
    def mesh(self):
        return self.runner.mesh

    @property
    def plan(self):
        return self.runner.plan

    @property
    def step_plan(self):
        return self.runner.step_plan

    @property
    def span_layout(self):
        return self.runner.span_layout

    @property
    def span(self) -> bool:
        return self.runner.span

    @property
    def stats(self) -> dict:
        return self.runner.stats

    # ------------------------------------------------------------------ requests
    def submit(self, rid, prompt_ids, sampling: SamplingParams = SamplingParams()) -> None:
        """Queue a request; raises ValueError (naming the value) without touching any other request."""
        if sampling.grammar is not None:
            if self.grammars is None:
                raise RequestError.of(rid, "structured output needs the checkpoint's tokenizer, which this engine was "
                                           "not given (Engine(tokenizer=...))", "response_format")
            try:
                self.grammars.check(sampling.grammar)
            except GrammarError as e:
                raise RequestError.of(rid, f"the grammar is not usable: {e}", "response_format") from None
        self.scheduler.submit(rid, prompt_ids, sampling)

    def cancel(self, rid) -> None:
        self.scheduler.cancel(rid)

    def release(self, rid) -> dict:
        """Forget finished or cancelled request ``rid`` (a long-running server calls this); returns its result."""
        req = self.requests.get(rid)
        if req is None or req.active:
            raise ValueError(f"cannot release unknown or active request {rid!r}")
        out = self.result(rid)
        del self.requests[rid]
        return out

    def load(self) -> dict:
        """Requests waiting / running, free cache blocks and slots (a health probe); speculative / prefix-cache
        counters."""
        out = self.scheduler.load()
        if self.speculative is not None:                 # the server's /health shows them
            out["speculative"] = self.speculative_stats()
        if self.prefix is not None:
            out["prefix_cache"] = self.prefix_stats()
        return out

    def result(self, rid) -> dict:
        r = self.requests[rid]
        out = {"id": rid, "prompt_ids": r.prompt, "output_ids": r.output, "status": r.status,
               "finish_reason": r.finish_reason, "cached_tokens": r.cached}
        if r.logprobs is not None:
            out["logprobs"] = r.logprobs
        if r.grammar_error is not None:
            out["grammar_error"] = r.grammar_error
        if r.prompt_logprobs is not None:
            out["prompt_logprobs"] = r.prompt_logprobs
        if self.speculative is not None:
            out["speculative"] = spec_stats(r.spec)
        return out

    @property
    def pending(self) -> bool:
        return self.scheduler.pending

    # ------------------------------------------------------------------ rounds
    def step(self) -> None:
        """One prefill round (admissions) then one decode round (a prefill-role engine: the prefill round only)."""
        t0 = time.perf_counter()
        self.prefill_round()
        if self.role != "prefill":
            self.decode_round()
        self.stats["step_s"].append(time.perf_counter() - t0)

    def prefill_round(self) -> list:
        """Admit waiting requests that fit (FIFO) and prefill; returns the admitted ids. Span prefill: at most
        `Capacity.round_tokens` rows — the requests whose prefill continues first (oldest first), then new admissions
        while rows are left — each request taking what remains of its history or of the rows, in one pass; with
        prefix caching the pass is split where a request's chunk crosses one of its cache boundaries
        (`Request.cuts`): the blocks up to there join the cache and the slot state there is stored between the passes
        (the round's schedule is the same as without prefix caching). Token-serial: each admission is prefilled
        whole as it is admitted (so the next may hit the prefix it stored)."""
        if not self.span:
            return self._serial_round()
        sched, admitted, left = self.scheduler, [], self.capacity.round_tokens
        plan = []                                                         # [request, the end of its chunk]
        for req in sched.prefilling():
            if left <= 0:
                break
            plan.append([req, min(req.prefill_to, req.filled + left)])
            left -= plan[-1][1] - req.filled
        for req in sched.waiting():
            if left <= 0:
                break                                                     # the round's rows are taken
            if self._shares_with(req, admitted):
                continue                                                  # next round, when it can hit
            if not self._admit(req):
                break                                                     # FIFO: wait for capacity
            admitted.append(req)
            plan.append([req, min(req.prefill_to, req.filled + left)])
            left -= plan[-1][1] - req.filled
        if not admitted:
            sched.check_progress()
        while plan:                                   # one pass; more only where a chunk crosses a cache boundary
            reqs = [r for r, _ in plan]
            starts = [r.filled for r in reqs]
            ends = [min([c for c in r.cuts if c > r.filled] + [end]) for r, end in plan]
            self.runner.prefill_span(reqs, [self.alloc.slot(r.rid) for r in reqs], [sched.table(r.rid) for r in reqs],
                                     starts, ends, sched.finish_if_done)
            for req, end in zip(reqs, ends):
                if end in req.cuts:
                    self._store_prefix(req, end)
            plan = [p for p, end in zip(plan, ends) if end < p[1]]
        return [r.rid for r in admitted]

    def _serial_round(self) -> list:
        """The token-serial prefill round (the reference): each admission prefilled whole as it is admitted."""
        sched, admitted = self.scheduler, []
        for req in sched.waiting():
            if not self._admit(req):
                break
            admitted.append(req)
            self.runner.prefill_serial(req, self.alloc.slot(req.rid), sched.table(req.rid), sched.finish_if_done,
                                       self._store_prefix)
        if not admitted:
            sched.check_progress()
        return [r.rid for r in admitted]

    def _shares_with(self, req: Request, admitted: list) -> bool:
        """With prefix caching: whether waiting ``req`` shares more whole blocks with a request admitted this round
        than the cache holds for it now. Then it waits a round and reuses them instead of computing them again
        beside it (in-batch prefix deferral, as SGLang's scheduler does): the admitted request also stores its slot
        state where the two part (a cache boundary added to its ``cuts``)."""
        if self.prefix is None or not admitted:
            return False
        bt, hist = self.capacity.block_tokens, req.history
        usable = (len(hist) - 1) // bt                                    # a hit leaves a token to prefill
        shared, other = max((_common_blocks(hist, o.history, bt, usable), i) for i, o in enumerate(admitted))
        other = admitted[other]
        cut = shared * bt
        if shared == 0 or shared <= len(self.prefix.match(hist, usable).nodes) or not \
                other.filled < cut < len(other.history):
            return False
        other.cuts = tuple(sorted({*other.cuts, cut}))
        return True

    def _admit(self, req: Request) -> bool:
        """Admit waiting ``req`` if it fits (a prefix hit: its stored slot state put into its slot)."""
        got = self.scheduler.admit(req)
        if got is False:
            return False
        if got is not True:
            self.runner.put_slot_state(self.alloc.slot(req.rid), got)
        req.status = "running"
        return True

    def warm_up(self, progress=None) -> dict:
        """Compile (or load from the compilation cache) every program this engine's rounds can run (a prefill-role
        engine: the prefill's; a decode role: the decode's), on idle batches (`ModelRunner.warm_up`;
        ``progress(name, done, total)`` after each): after it, no arrival compiles anything."""
        return self.runner.warm_up(progress, prefill=self.role != "decode", decode=self.role != "prefill")

    def decode_round(self) -> None:
        """One decode round of every running request (none on a prefill-role engine): each first grows to the
        tokens the round writes (one row, or with speculative decoding up to ``n + 1``), preempting the newest
        running requests where pages run out (`Scheduler.grow`)."""
        rows = self.scheduler.decoding()
        if not rows or self.role == "prefill":
            return
        r = self.speculative.num_draft_tokens + 1 if self.speculative is not None else 1
        rows = self.scheduler.grow(
            rows, lambda req: len(req.history) - 1 + min(r, req.sampling.max_new_tokens - len(req.output)))
        if rows:
            self.runner.decode(rows, [self.alloc.slot(r.rid) for r in rows], [self.scheduler.table(r.rid) for r in rows],
                               self.scheduler.finish_if_done)

    def run(self, max_steps: int = 1_000_000) -> list[dict]:
        for _ in range(max_steps):
            if not self.pending:
                break
            self.step()
        return [self.result(rid) for rid in self.requests]

    def _store_prefix(self, req: Request, cut: int) -> None:
        """``req``'s prefill has reached ``cut``: its blocks join the prefix cache, the slot state is stored."""
        node = self.scheduler.grow_prefix(req, cut)
        if node.state is None:
            self.prefix.set_state(node, self.runner.take_slot_state(self.alloc.slot(req.rid)))

    # ------------------------------------------------------------------ disaggregated roles
    def adopt(self, rid, prompt, sampling: SamplingParams, output, last_logits=None, residue: int | None = None,
              logprobs=None, prompt_logprobs=None):
        """Take over request ``rid`` prefilled elsewhere (a decode-role engine): reserve its slot and the blocks of
        its whole budget (page cycle from ``residue``; default the content placement) and register it running with
        ``output`` (its first token(s), with their ``logprobs`` entries when it asks). Returns its block ids — the caller then fills its pages and slot state
        (`v41cp.serving.pd.transfer`) — or None when it does not fit now (nothing changed)."""
        return self.scheduler.adopt(rid, prompt, sampling, output, last_logits, residue, logprobs, prompt_logprobs)

    def hand_off(self, rid) -> dict:
        """Forget running request ``rid`` (a prefill-role engine, after its state moved to a decode engine): its
        slot and pages are free. Returns its result as of now."""
        req = self.requests.get(rid)
        if req is None or req.status != "running":
            raise ValueError(f"cannot hand off unknown or inactive request {rid!r}")
        self.scheduler.free(req)
        out = self.result(rid)
        del self.requests[rid]
        return out

    # ------------------------------------------------------------------ reports
    def prefix_stats(self) -> dict:
        """Prefix-cache counters: lookups, hits, prompt / reused tokens (``hit_rate`` = reused / prompt tokens),
        cached blocks and stored states (and their bytes per device), evictions."""
        return self.scheduler.prefix_stats()

    def speculative_stats(self) -> dict:
        """Engine-wide speculative counters: drafts proposed / accepted, the mean accepted drafts per target step
        of a request, and target steps per emitted token (1 / (n + 1) when every draft is accepted)."""
        st = self.stats
        return {"target_steps": st["spec_steps"], "drafts_proposed": st["drafts_proposed"],
                "drafts_accepted": st["drafts_accepted"], "emitted_tokens": st["decode_tokens"],
                **_ratios(st["spec_steps"], st["drafts_accepted"], st["decode_tokens"])}

    def check(self) -> None:
        """Raise AssertionError unless pages, slots and the prefix cache are consistent (tests, debugging)."""
        self.scheduler.check()

    def span_buckets(self, rows: int) -> dict:
        return self.runner.span_buckets(rows)

    def cache_bytes_per_device(self) -> dict[str, int]:
        return self.runner.cache_bytes_per_device()

    def request_state(self, rid) -> dict:
        """Running request ``rid``'s decode state as host bytes (`v41cp.serving.cache.request_state`): its complete
        entries of every global group as stored, and its slot state; ``tokens``: the positions it holds."""
        req = self.requests.get(rid)
        if req is None or req.status != "running":
            raise ValueError(f"request {rid!r} is not running: its decode state is not held")
        tokens = len(req.history) - 1                     # the newest output token is not in the cache yet
        out = self.runner.request_state(self.alloc.blocks(rid), tokens, self.alloc.slot(rid))
        return {**out, "tokens": tokens}

    def compiled_decode_text(self) -> str:
        """Optimized HLO of this engine's decode step (its static bucket), for structure checks."""
        return self.runner.compiled_decode_text()

    @staticmethod
    def block_count(capacity: Capacity, kv_parallel_size: int = 1) -> int:
        """Virtual cache blocks of an engine of ``capacity`` under KVP ``kv_parallel_size`` (`Capacity.block_count`)."""
        return capacity.block_count(kv_parallel_size)

    @staticmethod
    def compile_counts() -> dict[str, int]:
        """Compilations so far of the jitted steps (`ModelRunner.compile_counts`)."""
        return ModelRunner.compile_counts()
