"""The engine's default prefill: span-prefill passes under a per-round row budget (`Capacity.prefill_tokens`) —
requests whose prefill continues first, then admissions; a prompt longer than the budget spans rounds while the
others decode — with the pass's rows padded to a fixed ladder of buckets that `Engine.warm_up` compiles.

* the default engine prefills by span (not token-serial chunks) and lists one warm-up program per bucket;
* budgeted rounds give the token-serial reference's greedy tokens (near-ties excluded), pages all back;
* after warm-up, hundreds of random arrivals (counts, lengths over the budget, sampling settings, cancellations,
  preemptions) compile nothing: no XLA compilation happens on the request path.
"""

import dataclasses

import numpy as np
import pytest
from helpers import compile_events

from v41cp.checkpoint import default_checkpoint, load
from v41cp.serving.capacity import Capacity
from v41cp.serving.engine import Engine, SamplingParams

CAP = Capacity(max_batch=3, max_tokens=48, block_tokens=4, prefill_chunk=8, prefill_tokens=12)


@pytest.fixture(scope="module")
def tiny():
    return load(default_checkpoint())


@pytest.mark.fast
def test_the_default_engine_prefills_by_span_and_warms_every_bucket(tiny):
    cfg, params = tiny
    cap = Capacity()
    assert cap.by_span and cap.round_tokens == min(8192, cap.max_batch * cap.max_tokens)
    assert cap.prefill_buckets == (16, 32, 64, 128, 256, 512, 1024)
    eng = Engine(params, cfg, cap)
    names = [name for name, _ in eng.runner.warm_up_programs()]
    assert cap.prefix_caching and eng.prefix is not None                   # on by default, on the span prefill
    assert eng.span and names == [f"prefill {r} rows" for r in cap.prefill_buckets] + ["prefix-cache slot state",
                                                                                         "decode", "penalty counts"]
    # the token-serial prefill (the reference) when asked for
    e = Engine(params, cfg, Capacity(span_prefill=False, prefix_caching=False))
    assert not e.span and [n for n, _ in e.runner.warm_up_programs()] == ["token-serial prefill", "decode",
                                                                           "penalty counts"]
    with pytest.raises(ValueError, match="prefill_tokens"):
        Capacity(prefill_tokens=0)
    with pytest.raises(ValueError, match="exceeds the round's budget"):
        eng.span_buckets(1025)
    assert eng.span_buckets(17) == {"span": 32, "capacity": 32, "dec_capacity": None}
    # fewer buckets: the largest of the ladder, a short pass padded to the smallest kept
    two = Capacity(prefill_bucket_count=2)
    assert two.prefill_buckets == (512, 1024) and Capacity(prefill_bucket_count=99).prefill_buckets == cap.prefill_buckets
    short = Engine(params, cfg, two)
    assert short.span_buckets(17)["span"] == 512
    assert [n for n, _ in short.runner.warm_up_programs()][:3] == ["prefill 512 rows", "prefill 1024 rows",
                                                                    "prefix-cache slot state"]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=f"prefill_bucket_count must be a positive integer or None, got {bad!r}"):
            Capacity(prefill_bucket_count=bad)


def _arrivals(cfg, count: int, seed: int, greedy_only: bool, pace: int = 3):
    """``count`` requests ``(id, prompt, sampling, step)``: 0-3 arriving every 1 to ``pace - 1`` steps, prompts of 1-40 tokens (most over
    the 12-row budget), 1-8 new tokens; sampled settings mixed in unless ``greedy_only``."""
    rng = np.random.default_rng(seed)
    out, step = [], 0
    while len(out) < count:
        for _ in range(int(rng.integers(0, 4))):
            n, new = int(rng.integers(1, 41)), int(rng.integers(1, 9))
            sp = SamplingParams(max_new_tokens=new, stop_on_eos=False)
            if not greedy_only and rng.random() < 0.5:
                sp = dataclasses.replace(sp, temperature=float(rng.uniform(0.5, 1.5)), top_k=int(rng.integers(0, 30)),
                                         top_p=float(rng.uniform(0.5, 1.0)), min_p=float(rng.uniform(0, 0.1)),
                                         seed=int(rng.integers(0, 2**40)))
                if rng.random() < 0.5:                      # penalized: its slot's token counts rebuilt, counted
                    sp = dataclasses.replace(sp, presence_penalty=float(rng.uniform(-1, 1)),
                                             frequency_penalty=float(rng.uniform(-1, 1)),
                                             repetition_penalty=float(rng.uniform(0.8, 1.5)))
            out.append((len(out), rng.integers(3, cfg.vocab_size, n).tolist(), sp, step))
        step += int(rng.integers(1, pace))
    return out[:count]


def _drive(eng, work, logits=None, cancel=()):
    """Submit ``work`` at its steps and step until done; ``logits[rid]`` collects each greedy token's logits.
    Returns the outputs and whether some round had a request still prefilling while others decoded."""
    step, overlapped = 0, False
    while step == 0 or eng.pending or any(at >= step for *_, at in work):
        for rid, prompt, sp, at in work:
            if at == step:
                eng.submit(rid, prompt, sp)
        overlapped |= bool(eng.scheduler.prefilling()) and bool(eng.scheduler.decoding())
        eng.step()
        for rid in cancel:
            if rid in eng.requests and eng.requests[rid].active and eng.requests[rid].output:
                eng.cancel(rid)
        eng.check()
        if logits is not None:
            for rid, r in eng.requests.items():
                if r.last_logits is not None and len(r.output) > len(logits.setdefault(rid, [])):
                    logits[rid].append(np.array(r.last_logits))
        step += 1
        assert step < 2000
    return {rid: eng.result(rid)["output_ids"] for rid, *_ in work}, overlapped


def test_budgeted_rounds_equal_the_token_serial_reference(tiny):
    """40 requests arriving over time, most longer than the 12-row budget: the default engine's tokens equal the
    token-serial engine's, while long prompts spanned rounds beside decoding requests; every page comes back."""
    cfg, params = tiny
    work = _arrivals(cfg, 40, seed=5, greedy_only=True)
    logits = {}
    want, _ = _drive(Engine(params, cfg, dataclasses.replace(CAP, span_prefill=False), record_logits=True), work,
                     logits)
    # no greedy token sits on a near-tie that the span prefill's rounding could flip (top-1 − top-2 gap; the logits
    # of each step's latest token per request)
    gaps = [np.diff(np.sort(row)[-2:])[0] / np.abs(row).max() for rows in logits.values() for row in rows]
    assert len(gaps) >= 100 and min(gaps) > 1e-4, min(gaps)
    eng = Engine(params, cfg, CAP)
    got, overlapped = _drive(eng, work)
    assert got == want and overlapped
    assert eng.stats["prefill_tokens"] == sum(len(p) for _, p, *_ in work)
    load = eng.load()
    assert load["running"] == load["waiting"] == 0 and load["free_blocks"] == load["total_blocks"]


def test_after_warm_up_random_arrivals_compile_nothing(tiny):
    """`Engine.warm_up` runs every program of the rounds on idle batches; then 300 random arrivals — counts per step,
    prompt lengths below and over the budget, greedy, sampled and penalized settings, cancellations, tight pages
    forcing preemptions — trigger no XLA compilation at all (jax's compile events, every function counted; under model-wide
    QCP, whose passes are fresh or continued programs: test_qcp_engine)."""
    cfg, params = tiny
    eng = Engine(params, cfg, dataclasses.replace(CAP, num_blocks=14, max_waiting=300))
    warm = eng.warm_up()
    # + the prefix cache's slot state, decode, the penalties' count reset
    assert warm["programs"] == len(CAP.prefill_buckets) + 3
    with compile_events() as compiled:
        work = _arrivals(cfg, 300, seed=9, greedy_only=False, pace=6)
        outputs, _ = _drive(eng, work, cancel={rid for rid, *_ in work if rid % 17 == 0})
    assert compiled == [], sorted(set(compiled))
    assert eng.load()["preemptions"] > 0
    assert all(len(outputs[rid]) == sp.max_new_tokens for rid, _, sp, _ in work if rid % 17)
    load = eng.load()
    assert load["running"] == load["waiting"] == 0 and load["free_blocks"] == load["total_blocks"]
