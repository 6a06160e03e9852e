"""Prefill / decode disaggregation in one program: a prefill role and a decode role on disjoint device sets.

`DisaggregatedEngine(params, cfg, capacity, prefill=ParallelConfig, decode=ParallelConfig, devices)` runs a
prefill-role `Engine` on the first ``prefill.num_devices`` devices (attention TP with its QCP / KVP: the token-serial
or span prefill of that topology) and a decode-role `Engine` on the next ``decode.num_devices`` (KVP = DCP decode).
Every `step`: the prefill role admits and prefills (reserving only the prompt's pages); each prefilled request that
the decode role can take (FIFO) gets its decode slot and blocks, its cache moves by the page-owner transfer plan
(`v41cp.serving.pd.transfer`: rank-matched when the KVP sizes are equal, relayout from prefill KVP 1), and the
prefill role frees it; then the decode role runs one decode round. A request whose first token already ends it
finishes on the prefill role. With prefix caching the prefill role holds the cache (a hit prefills the rest of the
prompt; its reused pages move like its own). The interface is the `Engine`'s (``submit / step / run / result / cancel / load``).
``transport``: ``"copy"`` (`pd_transfer.execute`: per-device gathers, copies and scatters) or ``"collective"`` (the
transfer PD across processes runs, `v41cp.serving.pd.wire`: one ppermute over both roles' devices, which need equal
counts).
"""

from __future__ import annotations

import dataclasses

import jax

from v41cp.config import ModelConfig
from v41cp.serving.cache.slot_state import slot_state_bytes, take_slot_state
from v41cp.serving.engine import Capacity, Engine, SamplingParams
from v41cp.serving.pd.transfer import check_sizes, execute, plan_transfer, ratios_of
from v41cp.serving.pd.wire import Wire, WireLayout, check_pairing, device_ranks
from v41cp.serving.runner.speculative import Speculative
from v41cp.sharding.topology import ParallelConfig

__all__ = ["DisaggregatedEngine", "TwoRoles"]


class TwoRoles:
    """What every disaggregated engine shares: ``run`` over its ``requests`` and the ``transfers`` summary."""

    transfers: list[dict]

    def _waiting_order(self) -> list:
        return list(self.requests)

    def run(self, max_steps: int = 1_000_000) -> list[dict]:
        """Step until nothing is pending; the results of the requests known when it was called, in order."""
        order = self._waiting_order()
        for _ in range(max_steps):
            if not self.pending:
                break
            self.step()
        return [self.result(rid) for rid in order]

    def warm_up(self, progress=None) -> dict:
        """Compile every program of this process's roles before traffic (`Engine.warm_up`)."""
        done = [e.warm_up(progress) for e in self._engines()]
        return {"programs": sum(d["programs"] for d in done), "seconds": sum(d["seconds"] for d in done)}

    def transfer_stats(self) -> dict:
        t = self.transfers
        return {"requests": len(t), "pages": sum(x["pages"] for x in t), "bytes": sum(x["bytes"] for x in t),
                "planned_bytes": sum(x["planned_bytes"] for x in t), "modes": sorted({x["mode"] for x in t})}


class DisaggregatedEngine(TwoRoles):
    """See the module docstring. ``devices``: the devices of both roles (default: the host's), prefill first."""

    def __init__(self, params, cfg: ModelConfig, capacity: Capacity, prefill: ParallelConfig,
                 decode: ParallelConfig, devices=None, transport: str = "copy", record_logits: bool = False,
                 speculative: Speculative | None = None, tokenizer: str | None = None):
        if transport not in ("copy", "collective"):
            raise ValueError(f"transport must be 'copy' or 'collective', got {transport!r}")
        devices = list(jax.devices() if devices is None else devices)
        p, d = prefill.num_devices, decode.num_devices
        if p + d > len(devices):
            raise ValueError(f"disaggregation: {p} prefill + {d} decode devices, but only {len(devices)} are given")
        check_sizes(prefill.kv_parallel_size, decode.kv_parallel_size)
        capacity = capacity.for_model(cfg)
        self.cfg, self.capacity = cfg, capacity
        # with DSpark both roles run the drafter: the prefill writes its context window, the transfer carries it;
        # with prefix caching the prefill role keeps the cache (a hit's pages and state move like a cold prefill's)
        # with a grammar each role keeps its own matcher, rebuilt from the request's outputs (the first token's)
        self.prefill = Engine(params, cfg, capacity, parallel=prefill, devices=devices[:p], role="prefill",
                              record_logits=record_logits, speculative=speculative, tokenizer=tokenizer)
        self.decode = Engine(params, cfg, dataclasses.replace(capacity, prefix_caching=False), parallel=decode,
                             devices=devices[p:p + d], role="decode", record_logits=record_logits,
                             speculative=speculative, tokenizer=tokenizer)
        self.speculative, self.prefix = speculative, self.prefill.prefix
        self._finished: dict = {}                      # rid -> (request, result): ended by its first token
        self.transfers: list[dict] = []
        leaf = jax.tree.leaves(self.decode.cache.swa)[0]
        self._dst_state_sharding = leaf.sharding
        self._dst_devices = len(leaf.sharding.device_set)
        pool = jax.tree.leaves(self.decode.cache.ckv)[0] if self.decode.cache.ckv else None
        self._dst_replicas = 1 if pool is None else self._dst_devices // self.decode.alloc.n
        self.wire = None
        if transport == "collective":      # the cross-process transfer (`pd_wire`), both sides in this program
            pre_devs, dec_devs = devices[:p], devices[p:p + d]
            src = device_ranks(self.prefill.cache, pre_devs, prefill.kv_parallel_size)
            dst = device_ranks(self.decode.cache, dec_devs, decode.kv_parallel_size)
            check_pairing(src, dst, prefill.kv_parallel_size, decode.kv_parallel_size)
            self.wire = Wire(pre_devs, dec_devs, src, dst)
            self._state_shapes = jax.eval_shape(lambda c, dc: take_slot_state(c, 0, dc), self.prefill.cache,
                                                self.prefill.dcache)

    # ------------------------------------------------------------------ the Engine interface
    def submit(self, rid, prompt_ids, sampling: SamplingParams = SamplingParams()) -> None:
        if rid in self.decode.requests and self.decode.requests[rid].status == "running":
            raise ValueError(f"request id {rid!r} is already active")
        self._finished.pop(rid, None)
        self.prefill.submit(rid, prompt_ids, sampling)

    def cancel(self, rid) -> None:
        eng = self.decode if rid in self.decode.requests else self.prefill
        eng.cancel(rid)

    def release(self, rid) -> dict:
        if rid in self._finished:
            return self._finished.pop(rid)[1]
        eng = self.decode if rid in self.decode.requests else self.prefill
        return eng.release(rid)

    @property
    def requests(self) -> dict:
        """Every request either role holds (and those their first token ended), by id."""
        return {**{rid: req for rid, (req, _) in self._finished.items()}, **self.prefill.requests,
                **self.decode.requests}

    def result(self, rid) -> dict:
        if rid in self._finished:
            return self._finished[rid][1]
        return (self.decode if rid in self.decode.requests else self.prefill).result(rid)

    @property
    def pending(self) -> bool:
        return self.prefill.pending or self.decode.pending

    def _engines(self) -> list:
        return [self.prefill, self.decode]

    def _waiting_order(self) -> list:
        return list(self.prefill.requests)

    @property
    def stats(self) -> dict:
        p, d = self.prefill.stats, self.decode.stats
        return {"prefill_tokens": p["prefill_tokens"], "prefill_s": p["prefill_s"], "decode_steps": d["decode_steps"],
                "decode_tokens": d["decode_tokens"], "decode_s": d["decode_s"], "step_s": d["step_s"],
                "ced_encoder_only_rows": p["ced_encoder_only_rows"], "transfers": self.transfer_stats()}

    def load(self) -> dict:
        p, d = self.prefill.load(), self.decode.load()
        return {"waiting": p["waiting"], "running": p["running"] + d["running"], "free_blocks": d["free_blocks"],
                "total_blocks": d["total_blocks"], "free_slots": d["free_slots"],
                "prefill": p, "decode": d, "transfers": self.transfer_stats()}

    compile_counts = staticmethod(Engine.compile_counts)

    def prefix_stats(self) -> dict:
        """The prefill role's prefix-cache counters (`Engine.prefix_stats`): it admits and prefills."""
        return self.prefill.prefix_stats()

    def speculative_stats(self) -> dict:
        """The decode role's speculative counters (`Engine.speculative_stats`): it drafts and verifies."""
        return self.decode.speculative_stats()

    # ------------------------------------------------------------------ rounds
    def step(self) -> None:
        self.prefill.prefill_round()
        for rid, req in list(self.prefill.requests.items()):
            if req.status == "done":                                   # ended by its first token
                self._finished[rid] = (req, self.prefill.release(rid))
            elif req.status == "running" and req.output and not self._hand_over(rid, req):
                break                                                  # the decode role is full: FIFO
        self.decode.decode_round()

    def _hand_over(self, rid, req) -> bool:
        """Move prefilled request ``rid`` to the decode role (False: it has no room now)."""
        pre, dec = self.prefill, self.decode
        src = pre.alloc.blocks(rid)
        rank_matched = pre.alloc.n == dec.alloc.n
        residue = src[0] % dec.alloc.n if rank_matched else None
        dst = dec.adopt(rid, req.prompt, req.sampling, req.output, req.last_logits, residue, req.logprobs,
                        req.prompt_logprobs)
        if dst is None:
            return False
        bt = self.capacity.block_tokens
        plan = plan_transfer(src, dst, len(req.prompt), bt, ratios_of(pre.cache, bt), pre.alloc.n, dec.alloc.n)
        planned = plan.bytes(pre.cache, self._dst_replicas, self._dst_devices, slot_state_bytes(pre.cache, pre.dcache))
        if self.wire is None:
            dec.cache, dec.runner.dcache, moved = execute(plan, pre.cache, dec.cache, pre.alloc.slot(rid),
                                                          dec.alloc.slot(rid), self._dst_state_sharding, pre.dcache,
                                                          dec.dcache)
        else:
            layout = WireLayout(plan, pre.cache, self._state_shapes)
            state = take_slot_state(pre.cache, pre.alloc.slot(rid), pre.dcache)
            dec.cache, dec.runner.dcache, moved = self.wire.transfer(layout, pre.cache, state, dec.cache,
                                                                     dec.alloc.slot(rid), dec.dcache)
        self.transfers.append({"id": rid, "mode": plan.mode, "tokens": plan.tokens, "pages": plan.pages,
                               "entries": {g: plan.entries(g) for g in plan.copies}, "bytes": moved,
                               "planned_bytes": planned, "rank_pairs": sorted(plan.rank_pairs())})
        pre.hand_off(rid)
        return True
