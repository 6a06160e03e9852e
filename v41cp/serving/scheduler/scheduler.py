"""`Scheduler`: the request table and the host-side decisions about it — which requests run, which wait, and which
pages and batch slot each holds.

Pages on demand: admission is FIFO — a waiting request is admitted when a batch slot and the blocks of its history
(its prompt; a preempted request's prompt and outputs so far) and of the next token it feeds are free; with prefix
caching it reuses the history's longest cached prefix (`v41cp.serving.cache.prefix.admit`). Before each decode
round every running request grows to the tokens the round writes (`grow`): the prefix cache's unreferenced blocks
are evicted first, then the newest running requests are preempted — their slot and pages freed, back to the queue
with their outputs, recomputed (prefilled with prompt + outputs) when admitted again — until it fits. The oldest
request therefore always progresses, and `submit` refuses what an empty engine cannot hold, so no request waits on
nothing. A prefill-role engine reserves the prompt's blocks only; a decode-role engine (PD) reserves an adopted
request's whole budget (its requests are never preempted: a recompute would need the prefill role). The device
side (the cache, the steps) is the model runner's; the scheduler never touches a device array.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from v41cp.config import ModelConfig
from v41cp.serving.cache.allocator import BlockAllocator, content_residue
from v41cp.serving.cache.prefix import PrefixCache
from v41cp.serving.cache.prefix import admit as prefix_admit
from v41cp.serving.cache.prefix import grow as prefix_grow
from v41cp.serving.cache.slot_state import state_bytes
from v41cp.serving.capacity import Capacity
from v41cp.serving.scheduler.request import EngineFull, Request, RequestError, SamplingParams, check_request

__all__ = ["Scheduler", "ROLES"]

ROLES = ("both", "prefill", "decode")


class Scheduler:
    """Requests by id (``requests``, in arrival order), the page allocator (``alloc``: ``num_blocks`` blocks, KVP
    page cycles of ``kv_parallel_size``) and the prefix cache (``prefix``, with ``Capacity.prefix_caching``)."""

    def __init__(self, cfg: ModelConfig, capacity: Capacity, kv_parallel_size: int = 1, role: str = "both"):
        self.cfg, self.capacity, self.role = cfg, capacity, role
        self.num_blocks = capacity.block_count(kv_parallel_size)
        self.alloc = BlockAllocator(self.num_blocks, capacity.block_tokens, capacity.max_batch, capacity.max_blocks,
                                    kv_parallel_size)
        self.prefix = (PrefixCache(capacity.block_tokens, capacity.prefix_states or 4 * capacity.max_batch)
                       if capacity.prefix_caching else None)
        self.requests: "OrderedDict[object, Request]" = OrderedDict()
        self.preemptions = 0

    # ------------------------------------------------------------------ the request table
    def is_active(self, rid) -> bool:
        return rid in self.requests and self.requests[rid].active

    def submit(self, rid, prompt_ids, sampling: SamplingParams) -> Request:
        """Validate and queue a request; raises `RequestError` (naming the value) without changing anything."""
        if self.is_active(rid):
            raise RequestError(f"request id {rid!r} is already active", "request_id")
        prompt = [int(t) for t in prompt_ids]
        need = check_request(rid, prompt, sampling, self.cfg, self.capacity)
        if not self.alloc.fits_when_empty(need):
            raise RequestError.of(rid, f"{need} cached tokens need {self.alloc.blocks_needed(need)} blocks of "
                                  f"{self.capacity.block_tokens}, more than the engine's {self.num_blocks} blocks"
                                  + (f" ({self.num_blocks // self.alloc.n} per KVP rank)" if self.alloc.n > 1 else ""),
                                  "max_new_tokens")
        waiting = len(self.waiting())
        if waiting >= self.capacity.max_waiting:
            raise EngineFull(f"request {rid!r} rejected: the engine is full ({waiting} requests already queued)",
                             "request_id")
        req = self.requests[rid] = Request(rid, prompt, sampling)
        return req

    def waiting(self) -> list[Request]:
        return [r for r in self.requests.values() if r.status == "waiting"]

    def decoding(self) -> list[Request]:
        """Running requests past their prefill, with a next token to feed (the rows of a decode round)."""
        return [r for r in self.requests.values() if r.status == "running" and r.output and not r.prefilling]

    def prefilling(self) -> list[Request]:
        """Running requests whose prefill continues (arrival order)."""
        return [r for r in self.requests.values() if r.prefilling]

    @property
    def pending(self) -> bool:
        return any(r.active for r in self.requests.values())

    def cancel(self, rid) -> None:
        req = self.requests.get(rid)
        if req is None or not req.active:
            raise ValueError(f"cannot cancel unknown or finished request {rid!r}")
        if req.status == "running":
            self.free(req)
        req.status, req.finish_reason = "cancelled", "cancelled"

    def finish_if_done(self, req: Request) -> None:
        """End ``req`` after its newest token if that is EOS (unless disabled) or one of its stop tokens, or its
        output budget is reached."""
        tok = req.output[-1]
        if req.sampling.stop_on_eos and tok == self.cfg.eos_token_id:
            req.status, req.finish_reason = "done", "eos"
        elif tok in req.sampling.stop_token_ids:
            req.status, req.finish_reason = "done", "stop"
        elif req.grammar_done:                   # its grammar admits nothing more
            req.status, req.finish_reason = "done", "stop"
        elif len(req.output) >= req.sampling.max_new_tokens:
            req.status, req.finish_reason = "done", "length"
        if req.status == "done":
            self.free(req)

    def free(self, req: Request) -> None:
        """Free ``req``'s slot and own blocks and drop its references on cached blocks (finish or cancel)."""
        self.alloc.release(req.rid)
        if self.prefix is not None:
            self.prefix.release(req.prefix_nodes)
            req.prefix_nodes = []

    # ------------------------------------------------------------------ admission
    @staticmethod
    def budget(req: Request) -> int:
        """The most tokens ``req`` ever holds in the cache: its prompt and every output but the last."""
        return max(len(req.prompt) + req.sampling.max_new_tokens - 1, 1)

    def need(self, req: Request) -> int:
        """Tokens of blocks ``req`` takes at admission: its history and the next token it feeds, within its budget
        (a prefill-role engine: the prompt only; with ``Capacity.reserve_output`` the whole budget)."""
        if self.role == "prefill":
            return max(len(req.prompt), 1)
        if self.capacity.reserve_output:
            return self.budget(req)
        return min(len(req.history) + 1, self.budget(req))

    def admit(self, req: Request):
        """Reserve ``req``'s blocks and a slot (False: not now). With prefix caching the request reuses its prompt's
        longest cached prefix: returns the slot state stored there (the runner puts it into the slot), else True."""
        need = self.need(req)
        req.filled, req.prefill_to = 0, len(req.history)
        # (placement by the prompt: a recompute keeps it); a request scoring its prompt computes every row: no reuse
        if self.prefix is None or req.scoring_prompt:
            residue = content_residue(req.prompt, self.capacity.block_tokens, self.alloc.n)
            if not self.alloc.can_admit(need, 0, residue):
                if not self.alloc.can_admit(need):
                    return False
                residue = None                               # the content placement is full: any that fits
            self.alloc.admit(req.rid, need, residue=residue)
            return True
        got = prefix_admit(self.alloc, self.prefix, req.rid, req.history, need)
        if got is None:
            return False
        req.cached, req.prefix_nodes, req.cuts, req.filled = got.cached, got.nodes, got.cuts, got.cached
        return got.state if got.cached else True

    # ------------------------------------------------------------------ pages on demand
    def grow(self, rows: list[Request], tokens) -> list[Request]:
        """Blocks for a decode round: each of ``rows`` (running requests, in arrival order) grows to ``tokens(req)``
        tokens (within its budget) — the prefix cache's unreferenced blocks are evicted first, then the newest
        running requests are preempted (`preempt`; possibly ``req`` itself) until it fits. Returns the rows still
        running, in order."""
        for req in rows:
            if req.status != "running":
                continue
            need = min(tokens(req), self.budget(req))
            while not self._extend(req, need):
                victim = next(r for r in reversed(self.requests.values()) if r.status == "running")
                self.preempt(victim)
                if victim is req:
                    break
        return [r for r in rows if r.status == "running"]

    def _extend(self, req: Request, tokens: int) -> bool:
        """Grow ``req`` to ``tokens`` tokens, evicting unreferenced prefix-cache blocks as needed; False when even
        that does not make room (nothing changed but evictions)."""
        if tokens <= self.alloc.tokens(req.rid):
            return True
        while not self.alloc.can_extend(req.rid, tokens):
            victims = self.prefix.evictable() if self.prefix is not None else []
            if not victims:
                return False
            self.alloc.free([self.prefix.evict(victims[0])])
        self.alloc.extend(req.rid, tokens)
        return True

    def preempt(self, req: Request) -> None:
        """Free running ``req``'s slot and pages and queue it again, keeping its outputs: it is recomputed (its
        prompt and outputs prefilled) when admitted again."""
        self.free(req)
        req.status, req.cached, req.cuts, req.filled, req.prefill_to = "waiting", 0, (), 0, 0
        req.preemptions += 1
        self.preemptions += 1

    def check_progress(self) -> None:
        """Requests wait only while others run (and will free pages and slots): with nothing running, admission
        takes the head of the queue, since `submit` refused every request that cannot fit an empty engine."""
        status = [r.status for r in self.requests.values()]
        if "waiting" in status and "running" not in status:
            head = next(r for r in self.requests.values() if r.status == "waiting")
            raise RuntimeError(f"request {head.rid!r} cannot be admitted into an idle engine "
                               f"({self.alloc.free_blocks} blocks and {self.alloc.free_slots} slots free): "
                               "an admission defect")

    def adopt(self, rid, prompt, sampling: SamplingParams, output, last_logits=None, residue: int | None = None,
              logprobs=None, prompt_logprobs=None):
        """Register request ``rid`` prefilled elsewhere as running with ``output`` (and its ``logprobs`` /
        ``prompt_logprobs`` entries),
        reserving its slot and the blocks of its whole budget (page cycle from ``residue``; default the content
        placement). Returns its block ids, or None when it does not fit now (nothing changed)."""
        if self.is_active(rid):
            raise RequestError(f"request id {rid!r} is already active", "request_id")
        req = Request(rid, [int(t) for t in prompt], sampling, output=[int(t) for t in output], status="running",
                      last_logits=last_logits, logprobs=None if logprobs is None else list(logprobs),
                      prompt_logprobs=None if prompt_logprobs is None else list(prompt_logprobs))
        need = self.budget(req)                   # the whole budget: a decode role never preempts (see above)
        residue = content_residue(req.prompt, self.capacity.block_tokens, self.alloc.n) if residue is None else residue
        if not self.alloc.fits_when_empty(need):
            raise RequestError.of(rid, f"{need} cached tokens do not fit this engine's capacity", "max_new_tokens")
        if not self.alloc.can_admit(need, 0, residue):
            return None
        blocks = self.alloc.admit(rid, need, residue=residue)
        self.requests[rid] = req
        return blocks

    # ------------------------------------------------------------------ prefix caching
    def grow_prefix(self, req: Request, cut: int):
        """``req``'s prefill has reached ``cut``: its blocks join the prefix cache; returns the node (its ``state``
        is None until the caller stores the slot state there)."""
        return prefix_grow(self.alloc, self.prefix, req.rid, req.history, req.prefix_nodes, cut)

    # ------------------------------------------------------------------ reports
    def table(self, rid) -> np.ndarray:
        """``rid``'s block table ``[max_blocks]`` int32 (−1 past its blocks)."""
        t = np.full(self.capacity.max_blocks, -1, np.int32)
        blocks = self.alloc.blocks(rid)
        t[: len(blocks)] = blocks
        return t

    def load(self) -> dict:
        """Requests waiting / running and free cache blocks (with prefix caching the blocks only the prefix cache
        holds count as free: they are evicted on demand) and free slots."""
        status = [r.status for r in self.requests.values()]
        reclaimable = self.prefix.reclaimable if self.prefix is not None else 0
        return {"waiting": status.count("waiting"), "running": status.count("running"),
                "free_blocks": self.alloc.free_blocks + reclaimable, "total_blocks": self.num_blocks,
                "free_slots": self.alloc.free_slots, "preemptions": self.preemptions}

    def prefix_stats(self) -> dict:
        """Prefix-cache counters: lookups, hits, prompt / reused tokens (``hit_rate`` = reused / prompt tokens),
        cached blocks and stored states (and their bytes per device), evictions."""
        out = self.prefix.summary()
        out["prefill_tokens_saved"] = out["hit_tokens"]
        out["state_bytes"] = sum(state_bytes(n.state) for n in self.prefix.nodes if n.state is not None)
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
