"""Pages on demand with preemption: a request takes blocks as it grows; when they run out the newest running request
is preempted (pages and slot freed, back to the queue with its outputs) and recomputed later. Greedy and seeded
outputs equal a run with ample pages, every page comes back, and the oldest request always progresses. Two of the
requests carry penalties, so a recomputed request's token counts are rebuilt exactly in whatever slot it lands."""

import dataclasses

import numpy as np
import pytest
from helpers import penalized_reference, top_gap

from v41cp.checkpoint import default_checkpoint, load
from v41cp.config import preset
from v41cp.serving.capacity import Capacity
from v41cp.serving.engine import Engine, SamplingParams
from v41cp.serving.scheduler.scheduler import Scheduler
from v41cp.sharding.topology import ParallelConfig

AMPLE = Capacity(prefill_bucket_count=1,
                 max_batch=2, max_tokens=48, block_tokens=4, prefill_chunk=8)       # 24 blocks: two whole budgets
TIGHT = dataclasses.replace(AMPLE, num_blocks=14)


@pytest.fixture(scope="module")
def tiny():
    return load(default_checkpoint())


@pytest.mark.fast
def test_scheduler_takes_pages_as_requests_grow_and_preempts_the_newest():
    cfg = preset("tiny")
    s = Scheduler(cfg, Capacity(max_batch=3, max_tokens=48, block_tokens=4, num_blocks=10))
    sp = SamplingParams(max_new_tokens=30, stop_on_eos=False)
    for rid, n in (("a", 6), ("b", 5), ("c", 3)):
        s.submit(rid, list(range(3, 3 + n)), sp)
    for req in s.waiting():
        assert s.admit(req) is True                  # history + the next token: 7, 6, 4 tokens → 2, 2, 1 blocks
        req.status, req.filled = "running", req.prefill_to          # (as if prefilled)
        req.output.append(9)
    assert [len(s.alloc.blocks(r)) for r in "abc"] == [2, 2, 1] and s.alloc.free_blocks == 5
    order = []
    for _ in range(20):                              # every round: each running request writes one more token
        before = {r.rid for r in s.requests.values() if r.status == "running"}
        rows = s.grow(s.decoding(), lambda req: len(req.history))
        order += sorted(before - {r.rid for r in rows}, key="abc".index)
        for req in rows:
            assert s.alloc.tokens(req.rid) == len(req.history)      # exactly the blocks it writes into
            req.output.append(9)
        s.check()
    # pages ran out twice: the newest running request went first (c, then b); a kept every page it needs
    a, b, c = (s.requests[r] for r in "abc")
    assert order == ["c", "b"] and s.preemptions == 2 and a.status == "running" and a.preemptions == 0
    assert b.status == c.status == "waiting" and b.preemptions == c.preemptions == 1 and len(b.output) > 1
    # a preempted request is admitted again in arrival order, with its prompt and outputs to recompute
    s.cancel("a")
    assert s.waiting()[0] is b and s.need(b) == len(b.history) + 1 and s.admit(b) is True
    b.status = "running"
    for rid in "bc":
        s.cancel(rid)
    s.check()
    assert s.alloc.free_blocks == 10 and s.alloc.free_slots == 3


def _workload(cfg):
    rng = np.random.default_rng(11)
    stem = rng.integers(3, cfg.vocab_size, 10).tolist()
    greedy = SamplingParams(max_new_tokens=26, stop_on_eos=False)
    seeded = SamplingParams(max_new_tokens=22, temperature=1.0, top_p=0.9, top_k=40, seed=3, stop_on_eos=False)
    # (id, prompt, sampling, submitted at step): shared prefixes, long outputs, late arrivals, penalties
    return [("a", stem + rng.integers(3, cfg.vocab_size, 4).tolist(), greedy, 0),
            ("b", stem + rng.integers(3, cfg.vocab_size, 9).tolist(), seeded, 0),
            ("c", rng.integers(3, cfg.vocab_size, 7).tolist(), dataclasses.replace(greedy, frequency_penalty=0.7), 2),
            ("d", stem[:6], dataclasses.replace(seeded, seed=8, presence_penalty=0.5, repetition_penalty=1.3), 5)]


def _run(eng, work, logits=None):
    step = 0
    while step == 0 or eng.pending:
        for rid, prompt, sp, at in work:
            if at == step:
                eng.submit(rid, prompt, sp)
        eng.step()
        eng.scheduler.check()
        if logits is not None:
            for rid, r in eng.requests.items():
                if r.sampling.temperature == 0 and r.last_logits is not None and len(r.output) > len(logits[rid]):
                    logits[rid].append((len(r.output) - 1, np.array(r.last_logits)))   # (output index, logits)
        step += 1
        assert step < 400
    return {rid: eng.result(rid)["output_ids"] for rid, *_ in work}


KVP2 = ParallelConfig(tp_size=2, kv_parallel_size=2, decode_context_parallel_size=2)


@pytest.fixture(scope="module")
def ample(tiny):
    """The workload and its outputs on one device with ample pages (the reference)."""
    cfg, params = tiny
    work = _workload(cfg)
    logits = {rid: [] for rid, *_ in work}
    want = _run(Engine(params, cfg, AMPLE, record_logits=True), work, logits)
    # no greedy token sits on a near-tie that a recompute's rounding could flip (top-1 − top-2 gap of its logits; the
    # logits of each step's last token per request: a prefill step also decodes, so one token per prompt is unseen)
    prompt, sp = {rid: p for rid, p, *_ in work}, {rid: s for rid, _, s, _ in work}
    gaps = [top_gap(penalized_reference(row, prompt[rid], want[rid][:i], sp[rid].presence_penalty,
                                        sp[rid].frequency_penalty, sp[rid].repetition_penalty))
            for rid, rows in logits.items() for i, row in rows]
    assert len(gaps) >= 2 * 26 - 2 and min(gaps) > 1e-4, min(gaps)
    return work, want


@pytest.mark.parametrize("capacity,parallel", [(dataclasses.replace(TIGHT, prefix_caching=False), None), (TIGHT, None),
                                               (dataclasses.replace(AMPLE, max_batch=1, num_blocks=12), None),
                                               (TIGHT, KVP2)],
                         ids=["tight-no-prefix-caching", "tight", "one-slot", "tight-kvp2"])
def test_preempted_outputs_equal_ample_pages_and_every_page_comes_back(tiny, ample, capacity, parallel):
    """Against one device with ample pages: tight pages (two requests, blocks for 14 · 4 tokens; without prefix
    caching; under KVP = DCP 2, each rank holding 7 pages) and one batch slot (prefix caching on, the default, unless
    said)."""
    cfg, params = tiny
    work, want = ample
    eng = Engine(params, cfg, capacity, parallel=parallel)
    assert _run(eng, work) == want
    load = eng.load()
    assert load["preemptions"] > 0 or capacity.max_batch == 1
    assert load["running"] == load["waiting"] == 0 and load["free_slots"] == capacity.max_batch
    assert eng.alloc.free_blocks + (len(eng.prefix.blocks) if eng.prefix is not None else 0) == eng.num_blocks
    assert all(eng.requests[rid].preemptions == 0 for rid in "a")            # the oldest is never preempted


@pytest.mark.fast
def test_reserving_the_output_budget_admits_fewer_and_never_grows():
    """``Capacity(reserve_output=True)``: admission takes prompt + the whole output budget (the comparison point of
    benchmarks/on_demand_pages.py), so a decode round never needs a new block and nothing is preempted."""
    cfg = preset("tiny")
    s = Scheduler(cfg, Capacity(max_batch=3, max_tokens=48, block_tokens=4, num_blocks=12, reserve_output=True))
    sp = SamplingParams(max_new_tokens=30, stop_on_eos=False)
    for rid in "abc":
        s.submit(rid, list(range(3, 9)), sp)
    got = [s.admit(req) for req in s.waiting()]
    assert got == [True, False, False]                 # 6 + 30 − 1 = 35 tokens: 9 blocks; a second does not fit
    assert len(s.alloc.blocks("a")) == 9 and s.need(s.requests["b"]) == 35
