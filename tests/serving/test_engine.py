"""Engine: greedy generation == full-recompute greedy, batch == alone, chunked prefill == one-shot,
seeded sampling, bad input rejected without harming other requests."""

import jax
import numpy as np
import pytest

from v41cp import model
from v41cp.checkpoint import default_checkpoint, load
from v41cp.serving.engine import Capacity, Engine, SamplingParams

CAP = Capacity(prefill_bucket_count=1, max_batch=3, max_tokens=48, block_tokens=4, prefill_chunk=8)


@pytest.fixture(scope="module")
def tiny():
    return load(default_checkpoint())


def _greedy_by_recompute(params, cfg, prompt, n):
    """Greedy tokens by full re-forward. The model is causal, so a sequence right-padded to a fixed
    length gives the same logits at every real position: one compilation for all calls."""
    seq = list(prompt)
    for _ in range(n):
        padded = np.zeros((1, CAP.max_tokens), np.int32)
        padded[0, :len(seq)] = seq
        seq.append(int(np.argmax(np.asarray(model.forward(params, cfg, padded))[0, len(seq) - 1])))
    return seq[len(prompt):]


def test_batch_of_mixed_lengths_equals_recompute_and_alone(tiny):
    cfg, params = tiny
    rng = np.random.default_rng(3)
    prompts = {"p5": rng.integers(3, 256, 5).tolist(), "p13": rng.integers(3, 256, 13).tolist(),
               "p21": rng.integers(3, 256, 21).tolist()}
    sp = SamplingParams(max_new_tokens=6, stop_on_eos=False)
    eng = Engine(params, cfg, CAP)
    for rid, p in prompts.items():
        eng.submit(rid, p, sp)
    batch = {r["id"]: r["output_ids"] for r in eng.run()}
    for rid, p in prompts.items():
        assert batch[rid] == _greedy_by_recompute(params, cfg, p, 6), rid
        alone = Engine(params, cfg, CAP)
        alone.submit(rid, p, sp)
        assert alone.run()[0]["output_ids"] == batch[rid]
    assert eng.load()["free_blocks"] == CAP.blocks                 # free, or cached and reclaimable


def test_chunked_prefill_equals_one_shot_caches_and_logits(tiny):
    """Chunks of 3 tokens split 4-token blocks and 2-token compression groups anywhere."""
    cfg, params = tiny
    prompt = np.random.default_rng(4).integers(3, 256, 19).tolist()
    caches, outputs = [], []
    for chunk in (3, 32):
        eng = Engine(params, cfg, Capacity(max_batch=3, max_tokens=48, block_tokens=4, prefill_chunk=chunk))
        eng.submit("x", prompt, SamplingParams(max_new_tokens=1, stop_on_eos=False))
        eng.step()
        caches.append(jax.tree.map(np.asarray, eng.cache))
        outputs.append(eng.result("x")["output_ids"])
    for c in caches[1:]:
        for a, b in zip(jax.tree.leaves(caches[0]), jax.tree.leaves(c)):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert outputs[0] == outputs[1]


def test_only_token_ids_come_to_the_host(tiny, monkeypatch):
    """Sampling runs inside the steps: a prefill pass and a decode round each fetch ``max_batch`` int32 ids (never the
    ``[batch, vocab]`` logits); ``record_logits`` adds the logits rows, for tests only. Seeded sampling
    with top-k / top-p / min-p gives the same tokens whatever the batch's other rows."""
    from v41cp.serving.runner import model_runner

    cfg, params = tiny
    fetched = []
    real = model_runner.fetch
    monkeypatch.setattr(model_runner, "fetch", lambda x: fetched.append(real(x)) or fetched[-1])
    sp = SamplingParams(max_new_tokens=4, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=5, stop_on_eos=False)
    eng = Engine(params, cfg, CAP)
    eng.submit("a", [5, 6, 7, 8, 9], sp)
    eng.step()                                           # the prefill's first token, then one decode round
    assert [(a.dtype, a.shape) for a in fetched] == [(np.int32, (CAP.max_batch,))] * 2
    fetched.clear()
    eng.step()
    assert sum(a.nbytes for a in fetched) == 4 * CAP.max_batch
    alone = eng.run()[0]["output_ids"]
    crowd = Engine(params, cfg, CAP)
    crowd.submit("x", [9, 9, 9], SamplingParams(max_new_tokens=6, temperature=1.0, seed=1, stop_on_eos=False))
    crowd.submit("a", [5, 6, 7, 8, 9], sp)
    assert {r["id"]: r["output_ids"] for r in crowd.run()}["a"] == alone
    fetched.clear()
    recorded = Engine(params, cfg, CAP, record_logits=True)
    recorded.submit("a", [5, 6, 7, 8, 9], sp)
    recorded.step()
    assert [a.shape for a in fetched if a.dtype == np.float32] == [(CAP.max_batch, cfg.vocab_size)] * 2


def test_seeded_sampling_is_deterministic(tiny):
    cfg, params = tiny
    prompt = [5, 6, 7, 8, 9]
    runs = []
    for seed in (1, 1, 2):
        eng = Engine(params, cfg, CAP)
        eng.submit("s", prompt, SamplingParams(max_new_tokens=8, temperature=1.5, top_p=0.9, seed=seed,
                                               stop_on_eos=False))
        runs.append(eng.run()[0]["output_ids"])
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_bad_input_is_rejected_and_others_unharmed(tiny):
    cfg, params = tiny
    eng = Engine(params, cfg, CAP)
    eng.submit("ok", [5, 6, 7], SamplingParams(max_new_tokens=4, stop_on_eos=False))
    with pytest.raises(ValueError, match="token id 256 is outside"):
        eng.submit("a", [5, 256], SamplingParams())
    with pytest.raises(ValueError, match="the prompt has 56 tokens; the capacity is 48 tokens per request"):
        eng.submit("b", list(range(3, 59)), SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match=r"prompt \(40\) \+ output \(9\) = 49 tokens is beyond the capacity of 48"):
        eng.submit("b", list(range(3, 43)), SamplingParams(max_new_tokens=9))
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer, got 0"):
        eng.submit("c", [5], SamplingParams(max_new_tokens=0))
    with pytest.raises(ValueError, match="'ok' is already active"):
        eng.submit("ok", [5], SamplingParams())
    with pytest.raises(ValueError, match="cannot cancel unknown or finished request 'zz'"):
        eng.cancel("zz")
    eng.submit("gone", [9, 9, 9], SamplingParams(max_new_tokens=4))
    eng.step()
    eng.cancel("gone")
    out = {r["id"]: r for r in eng.run()}
    assert out["ok"]["output_ids"] == _greedy_by_recompute(params, cfg, [5, 6, 7], 4)
    assert out["gone"]["status"] == "cancelled" and set(out) == {"ok", "gone"}
    assert eng.load()["free_blocks"] == CAP.blocks                 # free, or cached and reclaimable


def test_full_engine_queues_instead_of_corrupting(tiny):
    cfg, params = tiny
    eng = Engine(params, cfg, CAP)                       # 3 batch slots, 4 requests
    for rid in ("a", "b", "c", "d"):
        eng.submit(rid, [11, 12, 13], SamplingParams(max_new_tokens=3, stop_on_eos=False))
    eng.step()
    assert [eng.requests[r].status for r in "abcd"] == ["running"] * 3 + ["waiting"]
    out = {r["id"]: r["output_ids"] for r in eng.run()}
    assert out["a"] == out["b"] == out["c"] == out["d"]
    assert Engine.compile_counts()["decode_step"] >= 1


def test_ced_narrowed_prefill_equals_full_prefill(tiny):
    """CED: rows before the decoder's dependency halo (W + (L-1)(W-1) = 15 rows here) run only the encoder
    and the boundary layer's cache prepass; the generated tokens equal full-recompute greedy."""
    import dataclasses

    from v41cp.serving.runner.steps import ced_boundary, ced_rows

    cfg, params = tiny
    assert ced_boundary(cfg) == 4 and ced_rows(cfg) == 15
    rng = np.random.default_rng(9)
    prompts = {n: rng.integers(3, 256, n).tolist() for n in (16, 30, 41)}
    eng = Engine(params, cfg, dataclasses.replace(CAP, ced=True), record_logits=True)
    full = Engine(params, cfg, CAP, record_logits=True)
    for e in (eng, full):
        for n, p in prompts.items():
            e.submit(n, p, SamplingParams(max_new_tokens=5, stop_on_eos=False))
    while eng.pending:                                   # step both in lock-step and compare every logit row
        eng.step()
        full.step()
        for n in prompts:
            a, b = eng.requests[n].last_logits, full.requests[n].last_logits
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
    out = {r["id"]: r["output_ids"] for r in eng.run()}
    # prefix caching (the default) stores each prompt's state at its last whole block (n - 1) // 4 · 4, and a chunk
    # ending there runs the decoder over the halo before it: the encoder-only rows are those before that halo
    assert eng.stats["ced_encoder_only_rows"] == sum(max(0, (n - 1) // 4 * 4 - 15) for n in (16, 30, 41)) == 38
    for n, p in prompts.items():
        assert out[n] == _greedy_by_recompute(params, cfg, p, 5), n


def test_engine_on_tp_mesh_equals_single_device(tiny):
    """Plain TP over 4 devices (the tiny model's 4 heads / experts): the selection's scoring split over the
    TP ranks (`DCPPlan.split_selection`: replicated pages, exact distributed top-k) gives the single device's
    tokens and logits — prompts around page and compression boundaries, and a 3-token prompt whose one page
    leaves every other rank owning nothing."""
    from v41cp.sharding import make_mesh

    cfg, params = tiny
    prompts = {"a": [5, 6, 7], "b": list(range(20, 37)), "c": list(range(40, 70))}
    engines = [Engine(params, cfg, CAP, record_logits=True)] + [
        Engine(params, cfg, CAP, mesh=make_mesh(tp=n, devices=jax.devices()[:n]), record_logits=True) for n in (4,)]
    assert engines[1].params["layers_1"]["attn"]["wq_b"].sharding.spec[1] == "tp"
    assert [e.step_plan.n for e in engines[1:]] == [4] and engines[1].step_plan.replicated_pages
    for e in engines:
        for rid, p in prompts.items():
            e.submit(rid, p, SamplingParams(max_new_tokens=5, stop_on_eos=False))
    while engines[0].pending:
        for e in engines:
            e.step()
        for rid in prompts:
            want = engines[0].requests[rid].last_logits
            for e in engines[1:]:
                np.testing.assert_allclose(e.requests[rid].last_logits, want, rtol=0, atol=1e-5 * np.abs(want).max())
    for e in engines[1:]:
        assert [e.result(r)["output_ids"] for r in prompts] == [engines[0].result(r)["output_ids"] for r in prompts]


def test_engine_rejects_when_the_queue_is_full(tiny):
    import dataclasses

    cfg, params = tiny
    eng = Engine(params, cfg, dataclasses.replace(CAP, max_waiting=2))
    eng.submit(1, [5, 6], SamplingParams(max_new_tokens=2))
    eng.submit(2, [5, 6], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="request 3 rejected: the engine is full"):
        eng.submit(3, [5, 6], SamplingParams(max_new_tokens=2))
    assert [r["status"] for r in eng.run()] == ["done", "done"]


@pytest.mark.fast
def test_submit_names_the_field_and_rejects_what_can_never_run(tiny):
    """Errors carry the offending field; a request larger than the whole cache is rejected at submit rather than
    left waiting forever (blocking the queue); a negative seed is rejected before it can fail a step."""
    import dataclasses

    from v41cp.serving.engine import EngineFull, RequestError

    cfg, params = tiny
    eng = Engine(params, cfg, dataclasses.replace(CAP, num_blocks=2, max_waiting=1))
    cases = [([5, 256], SamplingParams(), "prompt"), ([5], SamplingParams(max_new_tokens=0), "max_new_tokens"),
             ([5], SamplingParams(temperature=-1.0), "temperature"), ([5], SamplingParams(top_p=0.0), "top_p"),
             ([5], SamplingParams(seed=-1, temperature=1.0), "seed"), ([5], SamplingParams(top_k=-1), "top_k"),
             ([5], SamplingParams(top_k=2.5), "top_k"), ([5], SamplingParams(min_p=1.0), "min_p"),
             ([5], SamplingParams(min_p=float("nan")), "min_p"),
             (list(range(3, 13)), SamplingParams(max_new_tokens=30), "max_new_tokens")]
    for prompt, sp, field in cases:
        with pytest.raises(RequestError) as err:
            eng.submit("x", prompt, sp)
        assert err.value.field == field, (field, str(err.value))
    assert "more than the engine's 2 blocks" in str(err.value)
    eng.submit("fits", [5, 6], SamplingParams(max_new_tokens=2))
    with pytest.raises(EngineFull):
        eng.submit("later", [5, 6], SamplingParams(max_new_tokens=2))
    eng.cancel("fits")                                  # (nothing runs here: this cache shape is not compiled)
    assert eng.release("fits")["status"] == "cancelled"
    assert not eng.requests and eng.load()["free_blocks"] == eng.num_blocks
