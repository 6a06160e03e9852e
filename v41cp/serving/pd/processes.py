"""PD disaggregation across two processes (`jax.distributed`): the prefill role in process 0, the decode role in 1.

`CrossProcessDisaggregatedEngine(params, cfg, capacity, prefill, decode)` is what `DisaggregatedEngine` is inside
one program, with each role's `Engine` on its own process's ``L`` local devices (the same device count on both: the
transfer pairs them one to one, `v41cp.serving.pd.wire`). Both processes construct it and call the same methods in
the same order (SPMD host control, as every multi-process command does); each `step` is, on both:

1. process 0 runs the prefill role's admission round and broadcasts what it has: the requests its first token ended
   (their results) and the prefilled ones, FIFO, with their prompt, sampling, first token, its logits and blocks;
2. process 1's decode role adopts them in order while it has room (the page cycle continues the prefill's when the
   KVP sizes are equal) and broadcasts the accepted requests' blocks;
3. for each accepted request both processes build its page-owner `TransferPlan` (`v41cp.serving.pd.transfer`,
   deterministic from the two block lists) and run the transfer collective: process 0 sends, hands the request off
   and frees its pages; process 1 receives into its pages and slot;
4. process 1 runs a decode round and broadcasts each request's new tokens, its status, the transfer records (bytes
   moved and planned) and its counters.

Every process keeps a view of every request (``requests``: prompt, output so far, status), so rank 0 prints the
results, and each role's `load`; `cancel` frees the request where its role holds it. ``serve`` runs it with the
multi-process control plane (`v41cp.serving.multihost.control_plane`): rank 0 — the prefill process — serves HTTP
and broadcasts each iteration's submits and cancels, process 1 applies them and steps with it. With prefix caching
the prefill process holds the cache (its admission round alone decides what a prompt reuses). With DSpark both roles
run the drafter, as in one program: the prefill writes each request's drafter context window, the transfer carries
it with the slot state, the decode role drafts and verifies (its counters reach every process with the tokens).
Refused: more or fewer than two processes.
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import asdict, dataclass, field, replace

import jax
import numpy as np

from v41cp.config import ModelConfig
from v41cp.serving.cache.allocator import BlockAllocator
from v41cp.serving.cache.slot_state import slot_state_bytes, take_slot_state
from v41cp.serving.engine import Capacity, Engine, RequestError, SamplingParams, spec_stats
from v41cp.serving.multihost.control_plane import broadcast_json
from v41cp.serving.pd.engines import TwoRoles
from v41cp.serving.pd.transfer import check_sizes, plan_transfer, ratios_of
from v41cp.serving.pd.wire import Wire, WireLayout, check_pairing, device_ranks
from v41cp.serving.runner.speculative import Speculative
from v41cp.sharding.topology import ParallelConfig

__all__ = ["CrossProcessDisaggregatedEngine"]


@dataclass
class RequestView:
    """What every process knows of a request: its prompt, the tokens so far and its status."""
    rid: object
    prompt: list[int]
    sampling: SamplingParams
    output: list[int] = field(default_factory=list)
    status: str = "waiting"
    finish_reason: str | None = None
    cached: int = 0                     # prompt tokens reused from the prefill role's prefix cache
    spec: dict | None = None            # DSpark: the decode role's counters of the request (`Engine.result`'s)
    logprobs: list | None = None        # with sampling.logprobs: an entry per output token (`Request.logprobs`)
    prompt_logprobs: list | None = None  # with sampling.prompt_logprobs (`Request.prompt_logprobs`)


def _bcast(obj, source: bool):
    return json.loads(broadcast_json(json.dumps(obj).encode() if source else None, source=source).decode())


class CrossProcessDisaggregatedEngine(TwoRoles):
    """See the module docstring."""

    def __init__(self, params, cfg: ModelConfig, capacity: Capacity, prefill: ParallelConfig,
                 decode: ParallelConfig, record_logits: bool = False, speculative: Speculative | None = None,
                 tokenizer: str | None = None):
        if jax.process_count() != 2:
            raise ValueError(f"PD across processes runs the prefill role in process 0 and the decode role in process "
                             f"1: it needs exactly 2 processes, got {jax.process_count()}")
        local = sorted(jax.local_devices(), key=lambda d: d.id)
        n_local = len(local)
        if prefill.num_devices != n_local or decode.num_devices != n_local:
            raise ValueError(f"PD across processes: each role takes one process's {n_local} devices "
                             f"(--prefill-devices must equal --devices {n_local}); got {prefill.num_devices} prefill "
                             f"and {decode.num_devices} decode devices")
        check_sizes(prefill.kv_parallel_size, decode.kv_parallel_size)
        capacity = capacity.for_model(cfg)
        self.cfg, self.capacity = cfg, capacity
        self.is_prefill = jax.process_index() == 0
        self.role = "prefill" if self.is_prefill else "decode"
        self.prefill_kvp, self.decode_kvp = prefill.kv_parallel_size, decode.kv_parallel_size
        mine = prefill if self.is_prefill else decode
        # with prefix caching the prefill role (process 0) holds the cache: its admissions alone decide what it reuses
        self.engine = Engine(params, cfg, capacity if self.is_prefill else replace(capacity, prefix_caching=False),
                             parallel=mine, devices=local, role=self.role, record_logits=record_logits,
                             speculative=speculative, tokenizer=tokenizer)
        # the other role's allocator (host only): a request is accepted when it fits both roles, on both processes
        other_kvp = decode.kv_parallel_size if self.is_prefill else prefill.kv_parallel_size
        self._other_alloc = BlockAllocator(Engine.block_count(capacity, other_kvp), capacity.block_tokens,
                                           capacity.max_batch, capacity.max_blocks, other_kvp)
        self.speculative, self.prefix = speculative, self.engine.prefix
        self.requests: dict[object, RequestView] = {}
        self.transfers: list[dict] = []
        self._pending = False
        self._sent: dict = {}                        # decode process: tokens reported so far, by request
        self._decode_stats: dict = {"decode_steps": 0, "decode_tokens": 0, "decode_s": 0.0}
        self._spec_stats: dict = {}                  # the decode role's `speculative_stats`, as of the last step
        self._remote_compiles: dict = {}
        self._step_s: list[float] = []
        # the other role's load as of its last report: here, then each step's offer (prefill) or decode report
        own = self.engine.load()
        prefill_load = _bcast(own if self.is_prefill else None, self.is_prefill)
        decode_load = _bcast(None if self.is_prefill else own, not self.is_prefill)
        self._remote_load = decode_load if self.is_prefill else prefill_load
        ranks = device_ranks(self.engine.cache, local, mine.kv_parallel_size)
        src_ranks = _bcast(ranks if self.is_prefill else None, self.is_prefill)
        dst_ranks = _bcast(None if self.is_prefill else ranks, not self.is_prefill)
        check_pairing(src_ranks, dst_ranks, self.prefill_kvp, self.decode_kvp)
        by_process = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        self.wire = Wire(by_process[:n_local], by_process[n_local:], src_ranks, dst_ranks)
        self._ratios = ratios_of(self.engine.cache, capacity.block_tokens)
        self._state_shapes = jax.eval_shape(lambda c, dc: take_slot_state(c, 0, dc), self.engine.cache,
                                            self.engine.dcache)
        leaf = jax.tree.leaves(self.engine.cache.ckv)
        self._dst_replicas = 1 if not leaf else n_local // self.decode_kvp

    def _engines(self) -> list:
        return [self.engine]

    # ------------------------------------------------------------------ the Engine interface (generate / bench)
    def submit(self, rid, prompt_ids, sampling: SamplingParams = SamplingParams()) -> None:
        """Queue a request on both processes (each checks it alike: the prefill role's checks, and the whole budget
        fitting the decode role's cache)."""
        if not isinstance(rid, (str, int)):
            raise TypeError(f"request ids across processes must be str or int, got {rid!r}")
        prompt = [int(t) for t in prompt_ids]
        if self.is_prefill:
            self.engine.submit(rid, prompt, sampling)
        else:                                              # the same checks, against the same config and capacity
            self.engine.submit(rid, prompt, sampling)
            del self.engine.requests[rid]
        need = max(len(prompt) + sampling.max_new_tokens - 1, 1)
        if not self._other_alloc.fits_when_empty(need):
            if self.is_prefill:
                del self.engine.requests[rid]
            raise RequestError(f"request {rid!r}: {need} cached tokens do not fit the "
                               f"{'decode' if self.is_prefill else 'prefill'} role's cache", "max_new_tokens")
        self.requests[rid] = RequestView(rid, prompt, sampling)
        self._pending = True

    @property
    def pending(self) -> bool:
        return self._pending

    def result(self, rid) -> dict:
        r = self.requests[rid]
        out = {"id": rid, "prompt_ids": r.prompt, "output_ids": r.output, "status": r.status,
               "finish_reason": r.finish_reason, "cached_tokens": r.cached}
        if r.logprobs is not None:
            out["logprobs"] = r.logprobs
        if r.prompt_logprobs is not None:
            out["prompt_logprobs"] = r.prompt_logprobs
        if self.speculative is not None:
            out["speculative"] = spec_stats(r.spec or {"steps": 0, "proposed": 0, "accepted": 0, "emitted": 0})
        return out

    def speculative_stats(self) -> dict:
        """The decode role's speculative counters (`Engine.speculative_stats`, reported by process 1 each step)."""
        if self.speculative is None:
            raise ValueError("speculative decoding is off")
        return dict(self._spec_stats) if self._spec_stats else self.engine.speculative_stats()

    def cancel(self, rid) -> None:
        """Cancel active request ``rid``. Both processes call it between steps, in the same order (as every method):
        the process whose role holds the request — process 0 while it waits for admission or, prefilled, for a
        decode slot; process 1 once adopted — frees its pages and slot and forgets it; both mark their view
        cancelled (its tokens so far kept). No collective: every process already knows which role holds it."""
        view = self.requests.get(rid)
        if view is None or view.status not in ("waiting", "running"):
            raise ValueError(f"cannot cancel unknown or finished request {rid!r}")
        if rid in self.engine.requests:
            self.engine.cancel(rid)
            self.engine.release(rid)
            self._sent.pop(rid, None)
        view.status, view.finish_reason = "cancelled", "cancelled"

    def release(self, rid) -> dict:
        """Forget finished request ``rid`` on this process (its role freed its pages when it ended); its result."""
        view = self.requests.get(rid)
        if view is None or view.status in ("waiting", "running"):
            raise ValueError(f"cannot release unknown or active request {rid!r}")
        out = self.result(rid)
        del self.requests[rid]
        return out

    def load(self) -> dict:
        """As `DisaggregatedEngine.load`: requests by status (every process's view), the decode role's free blocks
        and slots, each role's load — this process's own role now, the other's as of its last report (process 1
        sees the prefill role's before the step's hand-offs) — and the transfers."""
        status = [v.status for v in self.requests.values()]
        own, other = self.engine.load(), self._remote_load
        p, d = (own, other) if self.is_prefill else (other, own)
        return {"waiting": status.count("waiting"), "running": status.count("running"),
                "free_blocks": d["free_blocks"], "total_blocks": d["total_blocks"], "free_slots": d["free_slots"],
                "prefill": p, "decode": d, "transfers": self.transfer_stats()}

    @property
    def stats(self) -> dict:
        s = self.engine.stats
        prefill = {"prefill_tokens": s["prefill_tokens"], "prefill_s": s["prefill_s"],
                   "ced_encoder_only_rows": s["ced_encoder_only_rows"]} if self.is_prefill else {}
        return {"prefill_tokens": 0, "prefill_s": 0.0, "ced_encoder_only_rows": 0, **prefill, **self._decode_stats,
                "step_s": list(self._step_s), "transfers": self.transfer_stats()}

    def prefix_stats(self) -> dict:
        """The prefill process's prefix-cache counters (`Engine.prefix_stats`; process 0 only: it holds the cache)."""
        if self.prefix is None:
            raise ValueError("the prefix cache is held by the prefill process (0), with prefix caching on")
        return self.engine.prefix_stats()

    def compile_counts(self) -> dict[str, int]:
        """This process's compiles plus the decode process's (as of the last step): both roles' programs."""
        mine = Engine.compile_counts()
        return {k: v + self._remote_compiles.get(k, 0) for k, v in mine.items()} if self.is_prefill else mine

    # ------------------------------------------------------------------ one step (a collective on both processes)
    def step(self) -> None:
        t0 = time.perf_counter()
        offered = _bcast(self._offer() if self.is_prefill else None, self.is_prefill)
        for res in offered["ended"]:
            view = self.requests[res["id"]]
            view.output, view.status, view.finish_reason = res["output_ids"], res["status"], res["finish_reason"]
            view.cached, view.logprobs = res["cached_tokens"], res.get("logprobs")
            view.prompt_logprobs = res.get("prompt_logprobs")
        for cand in offered["candidates"]:                # prefilled: running with its first token, adopted or not
            view = self.requests[cand["rid"]]
            view.output, view.status, view.cached = list(cand["output"]), "running", cand["cached"]
            view.logprobs = None if cand["logprobs"] is None else list(cand["logprobs"])
            view.prompt_logprobs = cand["prompt_logprobs"]
        accepted = _bcast(None if self.is_prefill else self._adopt(offered["candidates"]), not self.is_prefill)
        by_id = {c["rid"]: c for c in offered["candidates"]}
        records = [self._transfer(by_id[acc["rid"]], acc["blocks"]) for acc in accepted]
        report = _bcast(None if self.is_prefill else self._decode(records), not self.is_prefill)
        self._remote_load = report["load"] if self.is_prefill else offered["load"]
        for rid, new, status, reason, spec, new_logprobs in report["updates"]:
            view = self.requests[rid]
            view.output.extend(new)
            if new_logprobs is not None:
                view.logprobs.extend(new_logprobs)
            view.status, view.finish_reason, view.spec = status, reason, spec
        self.transfers.extend(report["transfers"])
        self._decode_stats = report["stats"]
        self._spec_stats = report["speculative"]
        self._remote_compiles = report["compiles"]
        self._pending = offered["held"] > len(accepted) or report["pending"]
        self._step_s.append(time.perf_counter() - t0)

    def _offer(self) -> dict:
        """Process 0: the admission round; the requests it ended, the prefilled ones (FIFO) and how many it holds."""
        pre = self.engine
        pre.prefill_round()
        ended, candidates = [], []
        for rid, req in list(pre.requests.items()):
            if req.status == "done":                              # ended by its first token
                ended.append(pre.release(rid))
            elif req.status == "running" and req.output:
                logits = None if req.last_logits is None else base64.b64encode(
                    np.asarray(req.last_logits, np.float32).tobytes()).decode()
                candidates.append({"rid": rid, "prompt": req.prompt, "sampling": asdict(req.sampling),
                                   "output": req.output, "logits": logits, "blocks": pre.alloc.blocks(rid),
                                   "cached": req.cached, "logprobs": req.logprobs,
                                   "prompt_logprobs": req.prompt_logprobs})
        held = sum(r.status in ("waiting", "running") for r in pre.requests.values())
        return {"ended": ended, "candidates": candidates, "held": held, "load": pre.load()}

    def _adopt(self, candidates: list[dict]) -> list[dict]:
        """Process 1: reserve decode slots and blocks for the offered requests, in order, while they fit."""
        dec, accepted = self.engine, []
        for c in candidates:
            residue = c["blocks"][0] % dec.alloc.n if self.prefill_kvp == self.decode_kvp else None
            logits = None if c["logits"] is None else np.frombuffer(base64.b64decode(c["logits"]), np.float32)
            dst = dec.adopt(c["rid"], c["prompt"], SamplingParams(**c["sampling"]), c["output"], logits, residue,
                            c["logprobs"], c["prompt_logprobs"])
            if dst is None:
                break
            accepted.append({"rid": c["rid"], "blocks": [int(b) for b in dst]})
            self._sent[c["rid"]] = len(c["output"])
        return accepted

    def _transfer(self, cand: dict, dst_blocks: list[int]) -> dict | None:
        """Both processes: move one request's pages and slot state (process 0 sends, process 1 receives)."""
        rid, bt = cand["rid"], self.capacity.block_tokens
        plan = plan_transfer(cand["blocks"], dst_blocks, len(cand["prompt"]), bt, self._ratios, self.prefill_kvp,
                             self.decode_kvp)
        layout = WireLayout(plan, self.engine.cache, self._state_shapes)
        eng = self.engine
        if self.is_prefill:
            state = take_slot_state(eng.cache, eng.alloc.slot(rid), eng.dcache)
            self.wire.send(layout, eng.cache, state)
            eng.hand_off(rid)
            return None
        eng.cache, eng.runner.dcache, moved = self.wire.receive(layout, eng.cache, eng.alloc.slot(rid), None,
                                                                eng.dcache)
        planned = plan.bytes(eng.cache, self._dst_replicas, len(self.wire.decode),
                             slot_state_bytes(eng.cache, eng.dcache))
        return {"id": rid, "mode": plan.mode, "tokens": plan.tokens, "pages": plan.pages,
                "entries": {g: plan.entries(g) for g in plan.copies}, "bytes": moved, "planned_bytes": planned,
                "wire_bytes": layout.bucket(self.wire.dst_ranks) * len(self.wire.decode),
                "rank_pairs": sorted(plan.rank_pairs())}

    def _decode(self, records: list[dict]) -> dict:
        """Process 1: a decode round; each request's new tokens and status (finished ones are released)."""
        dec = self.engine
        dec.decode_round()
        updates = []
        for rid, req in list(dec.requests.items()):
            sent = self._sent[rid]
            new = req.output[sent:]
            self._sent[rid] = len(req.output)
            updates.append((rid, [int(t) for t in new], req.status, req.finish_reason,
                            dict(req.spec) if self.speculative is not None else None,
                            None if req.logprobs is None else req.logprobs[sent:]))
            if req.status in ("done", "cancelled"):
                dec.release(rid)
                del self._sent[rid]
        s = dec.stats
        return {"updates": updates, "transfers": records, "pending": dec.pending, "compiles": Engine.compile_counts(),
                "speculative": dec.speculative_stats() if self.speculative is not None else {},
                "load": dec.load(),
                "stats": {"decode_steps": s["decode_steps"], "decode_tokens": s["decode_tokens"],
                          "decode_s": s["decode_s"]}}
