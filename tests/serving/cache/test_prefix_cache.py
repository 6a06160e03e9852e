"""Exact prefix caching (`v41cp.serving.cache.prefix`): the block tree with the allocator under random operations, and
engines whose prefix hits give the cold engine's tokens, logits and cache bytes bit for bit — the span prefill (the
default) and the token-serial reference on one device; with CED: token-serial, the span prefill under model-wide
QCP 8 + KVP = DCP 8, and DSpark (to rounding: see `test_prefix_hits_with_ced_equal_cold_prefill`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import assert_same_request_state

from v41cp.serving.cache.allocator import BlockAllocator
from v41cp.serving.cache.prefix import PrefixCache, admit, grow


# ------------------------------------------------------------------------------------------ host bookkeeping
@pytest.mark.fast
@pytest.mark.parametrize("kvp", [1, 4])
def test_random_operations_never_free_a_held_block(kvp):
    """Requests from a few shared prefixes are admitted (hits, branch points, evictions under a small pool),
    prefilled past their cut points and finished in random order; after every operation every block is held,
    cached or free exactly once, no running request's block is free or evicted, every reused state is the one
    stored for exactly that prefix, and pages stay cyclic over the KVP ranks."""
    rng = np.random.default_rng(kvp)
    bt, cap_blocks = 4, 12
    alloc = BlockAllocator(16 * kvp, bt, 4, cap_blocks, kvp)
    cache = PrefixCache(bt, max_states=6)
    stems = [rng.integers(0, 5, 40).tolist() for _ in range(3)]
    running, rid, hits, evicted = {}, 0, 0, 0
    for _ in range(600):
        op = rng.integers(3)
        if op == 0:                                                   # a new request
            stem = stems[rng.integers(3)]
            cut = int(rng.integers(1, 30))
            prompt = stem[:cut] + rng.integers(5, 9, int(rng.integers(1, 9))).tolist()
            need = len(prompt) + int(rng.integers(0, 6))
            if not alloc.fits_when_empty(need):
                continue
            before = cache.stats["evicted_blocks"]
            got = admit(alloc, cache, rid, prompt, need)
            evicted += cache.stats["evicted_blocks"] - before
            if got is None:
                assert rid not in alloc
                assert running, "a request that fits an empty engine was refused with nothing running"
                continue
            if got.cached:
                hits += 1
                assert got.state == ("state", tuple(prompt[:got.cached])), "a hit restores another prefix's state"
                assert alloc.blocks(rid)[: got.cached // bt] == [n.block for n in got.nodes[: got.cached // bt]]
            assert got.cached < len(prompt) and got.cached % bt == 0
            running[rid] = (prompt, got)
            rid += 1
        elif op == 1 and running:                                     # a prefill reaches its cut points
            r = list(running)[rng.integers(len(running))]
            prompt, got = running[r]
            for c in got.cuts:
                node = grow(alloc, cache, r, prompt, got.nodes, c)
                cache.set_state(node, ("state", tuple(prompt[:c])))
            running[r] = (prompt, dataclasses.replace(got, cuts=()))
        elif op == 2 and running:                                     # a request ends
            r = list(running)[rng.integers(len(running))]
            alloc.release(r)
            cache.release(running.pop(r)[1].nodes)
        alloc.check(cache.blocks)
        cache.check()
        free = set(alloc._free_blocks)
        for r in running:
            assert not free & set(alloc.blocks(r)), "a running request's block is free"
        held = {id(n) for _, g in running.values() for n in g.nodes}
        assert all(n.refs > 0 for n in cache.nodes if id(n) in held)
    assert hits > 20 and evicted > 5, (hits, evicted)


@pytest.mark.fast
@pytest.mark.parametrize("kvp", [1, 2])
def test_admission_drops_the_unusable_part_of_a_match_at_tight_capacity(kvp):
    """One request's worth of blocks: the first request's chain fills the pool; the next shares all but its last
    blocks, which have no stored state. Admission must not hold those blocks (they would leave too few for its own
    recomputed copies): it takes the reusable part, else starts cold, evicting what it needs; nothing waits."""
    bt = 4
    alloc = BlockAllocator(8, bt, 1, 8, kvp)
    cache = PrefixCache(bt, max_states=4)
    stem = list(range(3, 27))                                          # 24 tokens: 6 blocks
    first, second = stem + [40, 41], stem[:22] + [50, 51, 52, 53]      # the second leaves the tree inside block 5
    got = admit(alloc, cache, "a", first, 30)
    assert got.cached == 0 and got.cuts == (24,)
    cache.set_state(grow(alloc, cache, "a", first, got.nodes, 24), "state-24")
    alloc.release("a")
    cache.release(got.nodes)
    assert admit(alloc, cache, "b", second, 40) is None                 # never fits: 10 blocks of 4 > 8
    assert alloc.free_blocks + len(cache.blocks) == 8 and not cache.stats["evicted_blocks"]
    got = admit(alloc, cache, "b", second, 30)                         # 5 matched blocks, none with a state
    assert got is not None and got.cached == 0 and got.cuts == (20, 24), got   # still stores its branch point
    assert alloc.blocks("b") and cache.stats["evicted_blocks"] > 0
    alloc.check(cache.blocks)
    cache.check()
    for cut in got.cuts:
        cache.set_state(grow(alloc, cache, "b", second, got.nodes, cut), f"state-b-{cut}")
    alloc.check(cache.blocks)
    cache.check()
    alloc.release("b")
    cache.release(got.nodes)
    for prompt, hit in ((stem[:22] + [50, 51, 52, 53, 60], 24), (stem[:21] + [70] * 6, 20)):
        got = admit(alloc, cache, "c", prompt, 30)                     # the end, or the branch point "b" stored
        assert got.cached == hit and got.state == f"state-b-{hit}"
        alloc.check(cache.blocks)
        alloc.release("c")
        cache.release(got.nodes)


@pytest.mark.fast
def test_allocator_shares_blocks_without_freeing_them():
    alloc = BlockAllocator(8, 4, 2, 4, 2)
    assert alloc.admit("x", 8) == [0, 1]
    alloc.give("x", [0, 1])                                 # the prefix cache holds them now
    alloc.release("x")
    alloc.check([0, 1])
    with pytest.raises(ValueError, match="shared block 3 breaks the cyclic page order from residue 1"):
        alloc.admit("a", 12, prefix=[1, 3])
    assert alloc.admit("b", 12, prefix=[0, 1]) == [0, 1, 2]
    with pytest.raises(ValueError, match="block position 1 is not one of its own"):
        alloc.give("b", [1])
    alloc.release("b")
    alloc.check([0, 1])
    assert alloc.free_blocks == 6
    with pytest.raises(ValueError, match="block 2 cannot be freed"):
        alloc.free([2])


# ------------------------------------------------------------------------------------------ engines, bit for bit
BT, W = 4, 8                                  # tiny model: pages of 4 tokens, window 8, ratio-2 and ratio-1 groups
# (id, prefix of the shared stem, own tokens, max_new_tokens, submitted before step); expected cached tokens
WORKLOAD = (
    ("a", 22, 0, 3, 0),        # cold; stores its state at 20 (last whole block leaving a token to prefill)
    ("dup", 22, 0, 4, 1),      # the same prompt: reuses 20 tokens, prefills 2
    ("div", 20, 6, 3, 1),      # reuses 20 and diverges at the first new token
    ("mid", 13, 5, 3, 2),      # shares 13 (inside a ratio-2 pair): no state at 12 -> cold, stores one there
    ("mid2", 14, 3, 5, 3),     # reuses 12 (the branch point "mid" stored), 14 shared
    ("short", 5, 2, 2, 4),     # shares one block: cold, stores its state at 4
    ("short2", 4, 3, 3, 5),    # reuses 4 tokens, a hit shorter than the window
)
CACHED = {"a": 0, "dup": 20, "div": 20, "mid": 0, "mid2": 12, "short": 0, "short2": 4}


@pytest.fixture(scope="module")
def tiny_tp8():
    import jax
    from helpers import TOKEN_MAP, perturbed

    from v41cp import model
    from v41cp.config import preset

    cfg = preset("tiny-tp8", engram_token_map=TOKEN_MAP)
    return cfg, perturbed(model.init_params(cfg, jax.random.key(0)))


# CED (ced_rows 15 here): a branch point far before the prompt's end (y stores its state at 12 of 40 tokens, where
# without the halo before it the decoder layers' window rows would not be written) that a later request resumes from
# with its last rows' windows reaching back across it (z: 17 tokens; window 8)
LONG = (
    ("x", 40, 0, 3, 0),        # cold; stores its state at 36
    ("y", 14, 26, 3, 1),       # matches 12 tokens of x's chain without a state there: cold, stores one at 12 and 36
    ("z", 13, 4, 4, 2),        # reuses 12 (y's branch point)
    ("x2", 40, 0, 3, 3),       # x again: reuses 36
)
LONG_CACHED = {"x": 0, "y": 0, "z": 12, "x2": 36}


def _prompts(cfg, workload=WORKLOAD):
    rng = np.random.default_rng(7)
    stem = rng.integers(3, cfg.vocab_size, max(w[1] for w in workload)).tolist()
    return {rid: stem[:shared] + rng.integers(3, cfg.vocab_size, own).tolist()
            for rid, shared, own, _, _ in workload}


def _lockstep(params, cfg, cap, parallel=None, workload=WORKLOAD, cached=CACHED, speculative=None):
    """The workload through a cold engine (prefix caching off) and a prefix-caching one of the same capacity and
    layout, step by step: every logits row the two emit and every running request's cache bytes after every step
    are identical — a hit's shorter pass, and a pass split at a cache boundary, compute each row as the cold pass
    does. Returns both engines."""
    from v41cp.serving.engine import Engine, SamplingParams

    prompts = _prompts(cfg, workload)
    kw = dict(parallel=parallel, record_logits=True, speculative=speculative)
    cold = Engine(params, cfg, dataclasses.replace(cap, prefix_caching=False), **kw)
    warm = Engine(params, cfg, dataclasses.replace(cap, prefix_caching=True), **kw)
    step = 0
    while step == 0 or cold.pending:
        for rid, _, _, new, at in workload:
            if at == step:
                for e in (cold, warm):
                    e.submit(rid, prompts[rid], SamplingParams(max_new_tokens=new, stop_on_eos=False))
        cold.step()
        warm.step()
        warm.check()
        step += 1
        for rid, r in cold.requests.items():
            s = warm.requests[rid]
            assert s.output == r.output and s.status == r.status, rid
            assert s.spec == r.spec, (rid, s.spec, r.spec)        # DSpark: the same drafts accepted (context window)
            if r.last_logits is not None:
                np.testing.assert_array_equal(s.last_logits, r.last_logits, err_msg=f"{rid} step {step}")
            if r.status == "running":
                assert_same_request_state(warm.request_state(rid), cold.request_state(rid), rid, W)
    assert not warm.pending and step < 40
    assert {rid: warm.result(rid)["cached_tokens"] for rid in cached} == cached
    assert all(cold.result(rid)["cached_tokens"] == 0 for rid in cached)
    return cold, warm


@pytest.mark.parametrize("prefill", ["span", "serial"])
def test_prefix_hits_equal_cold_prefill_on_one_device(tiny_tp8, prefill):
    """The span prefill (the default) and the token-serial reference on one device, bit for bit: hits, stored states
    and their bytes, reclaimable blocks."""
    from v41cp.serving.engine import Capacity

    cfg, params = tiny_tp8
    cap = Capacity(max_batch=3, max_tokens=32, block_tokens=BT, prefill_chunk=8,     # the whole ladder: hits and
                   span_prefill=None if prefill == "span" else False)           # cold passes in other buckets
    cold, warm = _lockstep(params, cfg, cap)
    st = warm.prefix_stats()
    prompt_tokens = sum(shared + own for _, shared, own, _, _ in WORKLOAD)
    assert st["hit_tokens"] == sum(CACHED.values()) and st["prompt_tokens"] == prompt_tokens
    assert warm.stats["prefill_tokens"] == cold.stats["prefill_tokens"] - sum(CACHED.values())
    assert st["hits"] == 4 and st["queries"] == len(WORKLOAD)
    warm.check()
    assert warm.alloc.free_blocks + st["cached_blocks"] == warm.num_blocks      # only the cache holds blocks now
    assert warm.load()["free_blocks"] == warm.num_blocks                         # every cached block reclaimable
    # the stored states: exactly the spec's bytes each (window rings of every layer + open ratio-2 pairs)
    from v41cp.serving.cache.spec import CacheSpec

    assert st["states"] == 6 and st["state_bytes"] == 6 * CacheSpec(cfg, BT, quantized=cfg.fake_quant).prefix_state_bytes


@pytest.mark.parametrize("layout", ["serial", "qcp8-kvp8", "dspark"])
def test_prefix_hits_with_ced_equal_cold_prefill(tiny_tp8, layout):
    """CED narrowing with a branch point far before the prompt's end: a chunk that ends at a cache boundary runs
    the decoder layers over the halo before it (so the stored window rows are complete). The token-serial reference
    on one device; the span prefill under model-wide QCP 8 + KVP = DCP 8 (cached pages stay with their owners, a
    hit's own blocks continue the chain's page cycle; short prompts leave ranks owning none of a request's pages and
    ranks without rows); the span prefill on one device with DSpark (the stored state holds the drafter's context
    window), against the cold engine. A 48-row budget: every prompt in one round, so the two engines stay in step.
    Bit for bit under each, DSpark's model (the embedded checkpoint, 4 routed experts) included: its cold 40-row
    pass sorts the MoE's (token, expert) pairs into tiles of 2 rows where the hit's shorter passes use tiles of 1
    (`moe_dispatch.DispatchShape`), and a token's expert outputs are combined in one order whatever the tiles
    (before they were not: one FP8 window code of y differed, its logits by 2.4e-7)."""
    from v41cp.serving.engine import Capacity
    from v41cp.sharding.topology import ParallelConfig

    cfg, params = tiny_tp8
    cap = Capacity(max_batch=3, max_tokens=48, block_tokens=BT, prefill_chunk=8, ced=True, prefill_tokens=48,
                   span_prefill=False if layout == "serial" else None)
    par = spec = None
    if layout == "qcp8-kvp8":
        par = ParallelConfig(tp_size=8, query_context_parallel_size=8, kv_parallel_size=8,
                             decode_context_parallel_size=8)
    if layout == "dspark":
        from v41cp.checkpoint import default_checkpoint, load, open_drafter
        from v41cp.serving.runner.speculative import Speculative

        cfg, params = load(default_checkpoint())
        spec = Speculative(open_drafter(default_checkpoint(), cfg), 2)
    from v41cp.ced import ced_rows

    assert ced_rows(cfg) == 15                                   # y's boundary at 12 is before its halo (25 .. 40)
    cold, warm = _lockstep(params, cfg, cap, par, LONG, LONG_CACHED, spec)
    assert warm.stats["ced_encoder_only_rows"] > 0
    assert warm.alloc.n == (8 if par else 1) and warm.prefix_stats()["hits"] == 2


# ------------------------------------------------------------------------------------------ tight capacity
# prompts sharing a 22-token stem at block-aligned (8, 16, 20) and unaligned (13, 18, 22) lengths, each with its
# own tail; budgets that make every request need most of one request's pages (8 blocks of 4)
TIGHT = ((22, 4, 3), (22, 4, 4), (16, 7, 2), (13, 9, 3), (18, 5, 3), (20, 3, 4), (8, 14, 2), (22, 0, 3))


def _tight_workload(cfg):
    rng = np.random.default_rng(11)
    stem = rng.integers(3, cfg.vocab_size, 22).tolist()
    return [(f"t{i}", stem[:shared] + rng.integers(3, cfg.vocab_size, own).tolist(), new)
            for i, (shared, own, new) in enumerate(TIGHT)]


def _parallel(n):
    from v41cp.sharding.topology import ParallelConfig

    return ParallelConfig(tp_size=8, kv_parallel_size=n, decode_context_parallel_size=n) if n > 1 else None


@pytest.fixture(scope="module")
def cold_tokens(tiny_tp8):
    """Each layout's greedy tokens of the tight workload from a cold engine (no prefix caching) with ample pages: on one
    device one slot with a whole request's pages (every request alone: the programs of the tight engine below), under
    KVP 2 the pages of 3 requests. Computed on first use, per layout."""
    from v41cp.serving.engine import Capacity, Engine, SamplingParams

    cfg, params = tiny_tp8
    out = {}

    def tokens(n):
        if n not in out:
            batch = 1 if n == 1 else 3
            eng = Engine(params, cfg, Capacity(prefill_bucket_count=1,
                                               max_batch=batch, max_tokens=32, block_tokens=BT, prefill_chunk=8,
                                               prefix_caching=False), parallel=_parallel(n))
            for rid, prompt, new in _tight_workload(cfg):
                eng.submit(rid, prompt, SamplingParams(max_new_tokens=new, stop_on_eos=False))
            out[n] = {r["id"]: r["output_ids"] for r in eng.run(max_steps=60)}
            assert not eng.pending
        return out[n]

    return tokens


@pytest.mark.parametrize("batch, n", [(1, 1), (2, 2)], ids=["batch1", "batch2-kvp2"])
def test_tight_capacity_admits_every_request_and_returns_every_page(tiny_tp8, cold_tokens, batch, n):
    """Pages for one request at the per-request capacity (8 blocks), ``batch`` slots, prefix caching on, every
    request submitted at once (one device, and KVP = DCP 2 with two slots): the engine admits as pages come back
    (evicting cached blocks it needs, never holding matched blocks it cannot reuse), never steps idle while requests
    wait, finishes every request within a bounded number of steps with the cold run's tokens, and every page is
    free or reclaimable at the end. (The CLI run of three 310-token prompts under KVP = DCP = 8 that hung before
    is the same admission: docs/benchmarks.md.)"""
    from v41cp.serving.engine import Capacity, Engine, SamplingParams

    cfg, params = tiny_tp8
    cap = Capacity(prefill_bucket_count=1,
                   max_batch=batch, max_tokens=32, block_tokens=BT, prefill_chunk=8, prefix_caching=True,
                   num_blocks=8)
    eng = Engine(params, cfg, cap, parallel=_parallel(n))
    assert eng.num_blocks == cap.max_blocks == 8                                 # no spare page
    work = _tight_workload(cfg)
    for rid, prompt, new in work:
        eng.submit(rid, prompt, SamplingParams(max_new_tokens=new, stop_on_eos=False))
    bound = sum(new for _, _, new in work) + len(work)                          # one request at a time, serially
    for _ in range(bound):
        if not eng.pending:
            break
        eng.step()                                                               # raises if it cannot progress
        eng.check()
    assert not eng.pending, f"requests still pending after {bound} steps: {eng.load()}"
    assert {rid: eng.result(rid)["output_ids"] for rid, _, _ in work} == cold_tokens(n)
    st = eng.prefix_stats()
    assert eng.alloc.free_blocks + st["cached_blocks"] == eng.num_blocks and eng.alloc.free_slots == batch
    assert eng.load()["free_blocks"] == eng.num_blocks
    assert st["evicted_blocks"] > 0 and st["hits"] >= 3, st                     # tight, and still reusing
