"""Log-probabilities computed in the steps (`v41cp.serving.runner.logprobs`): each output token's entry equals the
log-softmax of the FP32 logits that produced it (the engine's own, recorded) — for greedy and sampled requests, the
prefill's first token and every decode step, and the speculative verification rows —, the alternatives in
`jax.lax.top_k` order; a request that does not ask gets none and nothing is fetched for it; bad counts are refused
naming the field."""

import jax
import numpy as np
import pytest
from helpers import run_recording_logits
from jax.sharding import NamedSharding, PartitionSpec

from v41cp.checkpoint import default_checkpoint, load
from v41cp.serving.engine import Capacity, Engine, RequestError, SamplingParams
from v41cp.serving.runner.logprobs import top_n
from v41cp.serving.runner.speculative import Speculative
from v41cp.sharding.topology import ParallelConfig


CAP = Capacity(max_batch=3, max_tokens=48, block_tokens=4, max_logprobs=5, prefill_tokens=16)


@pytest.fixture(scope="module")
def setup():
    cfg, params = load(default_checkpoint())
    return cfg, params, Engine(params, cfg, CAP, record_logits=True)       # one engine (its programs) for the file


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def _check_entries(req, logits, count):
    assert len(req.logprobs) == len(req.output) == len(logits)
    for token, (lp, alternatives), row in zip(req.output, req.logprobs, logits):
        want = _log_softmax(row)
        assert abs(lp - want[token]) <= 1e-5, (token, lp, want[token])
        order = np.argsort(-want, kind="stable")[:count]            # descending, lower id first on ties
        assert [i for i, _ in alternatives] == order.tolist()
        assert np.allclose([v for _, v in alternatives], want[order], atol=1e-5)


@pytest.mark.fast
def test_logprobs_are_the_log_softmax_of_each_tokens_logits(setup):
    cfg, params, eng = setup
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 256, n).tolist() for n in (6, 13, 9)]
    requests = {"greedy": (prompts[0], SamplingParams(max_new_tokens=7, stop_on_eos=False, logprobs=3)),
                "sampled": (prompts[1], SamplingParams(max_new_tokens=7, temperature=0.7, top_k=8, seed=4,
                                                       stop_on_eos=False, logprobs=5)),
                "none": (prompts[2], SamplingParams(max_new_tokens=7, stop_on_eos=False))}
    logits = run_recording_logits(eng, requests)
    _check_entries(eng.requests["greedy"], logits["greedy"], 3)
    _check_entries(eng.requests["sampled"], logits["sampled"], 5)     # the model's distribution, not the tempered one
    assert eng.requests["none"].logprobs is None and "logprobs" not in eng.result("none")
    g = eng.requests["greedy"]
    assert all(alt[0][0] == t for t, (_, alt) in zip(g.output, g.logprobs))     # greedy: the top alternative
    for bad in (-1, 6, 1.5):
        with pytest.raises(RequestError) as e:
            eng.submit("bad", [5, 6], SamplingParams(logprobs=bad))
        assert e.value.field == "logprobs" and "max_logprobs" in str(e.value)
    with pytest.raises(RequestError) as e:                             # an engine that computes none refuses 0 too
        Engine(params, cfg, Capacity(max_batch=1, max_tokens=16, max_logprobs=0)).submit("x", [5], SamplingParams(
            logprobs=0))
    assert e.value.field == "logprobs" and "max_logprobs=0" in str(e.value)


def test_speculative_rows_carry_the_logprobs_of_plain_decoding(setup):
    """Injected proposals (the target's greedy continuation, a wrong token at draft 1): the verification rows'
    entries equal plain decoding's for the same tokens."""
    cfg, params, plain = setup
    rng = np.random.default_rng(8)
    prompts = {f"p{n}": rng.integers(3, 256, n).tolist() for n in (5, 11)}
    sp = SamplingParams(max_new_tokens=9, stop_on_eos=False, logprobs=2)
    for rid, p in prompts.items():
        plain.submit(rid, p, sp)
    want = {r["id"]: r for r in plain.run()}
    truth = {rid: prompts[rid] + want[rid]["output_ids"] for rid in prompts}

    def propose(rid, history, n):
        cont = truth[rid][len(history):len(history) + n]
        cont += [3] * (n - len(cont))
        cont[1 % n] = (cont[1 % n] + 1) % cfg.vocab_size
        return cont

    eng = Engine(params, cfg, CAP, speculative=Speculative(None, 3, proposer=propose))
    for rid, p in prompts.items():
        eng.submit(rid, p, sp)
    got = {r["id"]: r for r in eng.run()}
    for rid in prompts:
        assert got[rid]["output_ids"] == want[rid]["output_ids"]
        assert got[rid]["speculative"]["drafts_accepted"] > 0
        for (lp, alt), (wlp, walt) in zip(got[rid]["logprobs"], want[rid]["logprobs"], strict=True):
            assert abs(lp - wlp) <= 1e-5 and [i for i, _ in alt] == [i for i, _ in walt]
            assert np.allclose([v for _, v in alt], [v for _, v in walt], atol=1e-5)


@pytest.mark.parametrize("topology", [dict(tp_size=8), dict(tp_size=8, kv_parallel_size=4,
                                                             decode_context_parallel_size=4)], ids=["tp8", "tp8-kvp4"])
@pytest.mark.fast
def test_top_n_over_a_split_vocabulary_equals_top_k(topology):
    """Each device's top n of its vocabulary slice, then the top n of the candidates: `jax.lax.top_k`'s values and
    order exactly, ties (small integers: many) included."""
    mesh = ParallelConfig(**topology).make_mesh(jax.devices()[:8])
    x = np.random.default_rng(0).integers(0, 5, (3, 2, 256)).astype(np.float32)
    sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, None, ("tp", "cp"))))
    for n in (1, 5, 20):
        got = jax.jit(lambda a: top_n(a, n, mesh, ("tp", "cp")))(sharded)
        want = jax.lax.top_k(x, n)
        assert (np.asarray(got[0]) == np.asarray(want[0])).all() and (np.asarray(got[1]) == np.asarray(want[1])).all()


@pytest.mark.fast
def test_prompt_logprobs_equal_the_full_forward(setup):
    """Prompt log-probabilities from the span prefill's passes (a prompt over two passes of 16 rows, one of one
    token): None for the first token, then each prompt token's log-softmax under the full forward, the alternatives
    in order. A cached prompt that asks for them is prefilled whole (no prefix hit) and gets the same entries (the
    other prefill paths: `test_prompt_logprobs.py`)."""
    from v41cp import model

    cfg, params, eng = setup
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 256, n).tolist() for n in (20, 7, 1)]
    sp = SamplingParams(max_new_tokens=2, stop_on_eos=False, prompt_logprobs=3)
    for i, p in enumerate(prompts):
        eng.submit(f"q{i}", p, sp)
    res = {r["id"][1:]: r for r in eng.run() if r["id"] in ("q0", "q1", "q2")}
    res = {int(k): v for k, v in res.items()}
    for i, p in enumerate(prompts):
        got = res[i]["prompt_logprobs"]
        assert len(got) == len(p) and got[0] is None
        if len(p) == 1:
            continue
        want = np.stack([_log_softmax(x) for x in np.asarray(model.forward(params, cfg, np.asarray([p])))[0, :-1]])
        assert np.abs(np.array([e[0] for e in got[1:]]) - want[np.arange(len(p) - 1), p[1:]]).max() <= 1e-5
        for j, (_, alternatives) in enumerate(got[1:]):
            assert [a for a, _ in alternatives] == np.argsort(-want[j], kind="stable")[:3].tolist()
    plain = SamplingParams(max_new_tokens=2, stop_on_eos=False)
    eng.submit("seed", prompts[0], plain)                        # (a scoring request stores no prefix)
    eng.run()
    eng.submit("again", prompts[0], sp)
    eng.submit("hit", prompts[0], plain)
    again = {r["id"]: r for r in eng.run()}
    assert again["again"]["cached_tokens"] == 0 and again["hit"]["cached_tokens"] > 0
    assert again["again"]["prompt_logprobs"] == res[0]["prompt_logprobs"]
