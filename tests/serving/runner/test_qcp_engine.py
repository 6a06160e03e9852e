"""The engine's span prefill (one pass per round under its row budget `Capacity.prefill_tokens`) and QCP in the engine:
equal to the token-serial single-device engine (tokens, logits, cache records).

* one device: span prefill = token-serial prefill (last logits, every cache byte but adjacent codes at rounding
  boundaries) = the full-sequence forward, and decode continues alike;
* model-wide QCP 4 with KVP 4 pages, CED, passes of 8 rows (prompts over several rounds), DCP decode — and prompt
  log-probabilities there equal to the full forward's; operator-local indexer + attention QCP.
"""

import jax
import numpy as np
import pytest
from helpers import TOKEN_MAP, assert_caches_agree, cache_by_virtual_block, compile_events, perturbed, rel_err

from v41cp import model
from v41cp.config import preset
from v41cp.serving.engine import Capacity, Engine, SamplingParams
from v41cp.serving.runner.steps import ced_rows
from v41cp.sharding.topology import ParallelConfig

ENGINE_PROMPTS = (21, 2, 16)


def _engine_run(params, cfg, cap, parallel=None, warm=False):
    """Round 1: prefill + one decode round of each prompt (2 tokens, then done); round 2: the same prompts again
    for 4 tokens. Returns the engine and (round-1 outputs, last logits, cache after round 1, round-2 outputs).
    ``warm``: `Engine.warm_up` first, and assert that the traffic compiles nothing."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in ENGINE_PROMPTS]
    eng = Engine(params, cfg, cap, parallel=parallel, record_logits=True)
    if warm:
        eng.warm_up()
        with compile_events() as compiled:
            out = _traffic(eng, prompts, parallel)
        assert compiled == [], sorted(set(compiled))
        return out
    return _traffic(eng, prompts, parallel)


def _traffic(eng, prompts, parallel):
    for i, p in enumerate(prompts):
        eng.submit(i, p, SamplingParams(max_new_tokens=2, stop_on_eos=False))
    while any(eng.requests[i].active for i in range(len(prompts))):         # (a prompt may span rounds)
        eng.step()
    first = ([eng.requests[i].output for i in range(len(prompts))],
             [eng.requests[i].last_logits for i in range(len(prompts))],
             cache_by_virtual_block(eng.cache, parallel.kv_parallel_size if parallel else 1))
    for i, p in enumerate(prompts):
        eng.submit(f"g{i}", p, SamplingParams(max_new_tokens=4, stop_on_eos=False, logprobs=3))
    eng.run()
    return eng, prompts, (*first, [(eng.result(f"g{i}")["output_ids"], eng.result(f"g{i}")["logprobs"])
                                   for i in range(len(prompts))])


def _same_generation(got, want) -> None:
    """Round 2's tokens equal; their log-probabilities (3 alternatives) within the logits' 1e-5."""
    for (ids, lps), (w_ids, w_lps) in zip(got, want, strict=True):
        assert ids == w_ids
        for (lp, alt), (w_lp, w_alt) in zip(lps, w_lps, strict=True):
            assert [i for i, _ in alt] == [i for i, _ in w_alt]
            assert np.allclose([lp, *(v for _, v in alt)], [w_lp, *(v for _, v in w_alt)], atol=1e-4, rtol=0)


def _cached(n: int, block_tokens: int = 4) -> int:
    """Prompt tokens a prompt of ``n`` sent again reuses: its whole blocks but the one holding its last token."""
    return (n - 1) // block_tokens * block_tokens


@pytest.fixture(scope="module")
def serial_run():
    cfg = preset("tiny-tp8", engram_token_map=TOKEN_MAP)
    params = perturbed(model.init_params(cfg, jax.random.key(0)))
    cap = Capacity(prefill_bucket_count=1,
                   max_batch=3, max_tokens=32, block_tokens=4, prefill_chunk=8, span_prefill=False)
    eng, prompts, res = _engine_run(params, cfg, cap)
    return cfg, params, cap, eng, prompts, res


def test_span_prefill_equals_token_serial_prefill_and_forward(serial_run):
    """The engine's caches are records (FP8 / NVFP4 / MXFP4 bytes): byte-identical to the token-serial path."""
    cfg, params, cap, serial, prompts, (out, last, cache, gen) = serial_run
    span, _, (s_out, s_last, s_cache, s_gen) = _engine_run(params, cfg, Capacity(**{**cap.__dict__,
                                                                                     "span_prefill": True}))
    assert s_out == out
    _same_generation(s_gen, gen)
    # one forward over the padded batch: the prefill's last row and the decode row (which read the caches)
    width = max(ENGINE_PROMPTS) + 1
    tokens = np.full((len(prompts), width), 3, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p) + 1] = p + [out[i][0]]
    fwd = np.asarray(model.forward(params, cfg, tokens))
    for i, p in enumerate(prompts):
        assert out[i][0] == int(np.argmax(fwd[i, len(p) - 1]))
        assert rel_err(s_last[i], fwd[i, len(p)]) <= 1e-5
        assert rel_err(s_last[i], last[i]) <= 1e-5
    assert_caches_agree(s_cache, cache, cfg, "span vs serial")
    # round 2 sends the prompts again: prefix caching (the default) reuses each prompt's whole blocks but the last
    assert span.stats["prefill_tokens"] == serial.stats["prefill_tokens"] == \
        sum(ENGINE_PROMPTS) + sum(n - _cached(n) for n in ENGINE_PROMPTS)
    assert Engine.compile_counts()["prefill_span"] >= 1


def test_engine_with_qcp_and_dcp_decode_equals_single_device(serial_run):
    """QCP 4 prefill (CED on, passes of 8 rows) hands its caches to DCP decode over KVP 4 pages: the same tokens
    as the single-device token-serial engine, logits ≤ 1e-5. Warmed up first (the fresh and continued passes of
    the one 8-row bucket, decode): the traffic compiles nothing."""
    cfg, params, cap, _, _, (out, last, _, gen) = serial_run
    par = ParallelConfig(tp_size=4, query_context_parallel_size=4, kv_parallel_size=4, decode_context_parallel_size=4)
    eng, _, (q_out, q_last, _, q_gen) = _engine_run(params, cfg, Capacity(**{**cap.__dict__, "ced": True,
                                                                              "span_prefill": None, "prefill_tokens": 8}),
                                                    par, warm=True)
    assert q_out == out
    _same_generation(q_gen, gen)
    assert max(rel_err(a, b) for a, b in zip(q_last, last)) <= 1e-5
    assert eng.span and eng.plan is not None
    # prompt log-probabilities (echo): the prompt (longer than CED's retained rows, over 4 passes) runs unnarrowed
    # passes, its ranks' rows gathered and scored against the vocab-split head — the full forward's log-softmax;
    # warmed up, nothing compiles
    prompt = np.random.default_rng(9).integers(3, cfg.vocab_size, 2 * ced_rows(cfg)).tolist()
    encoder_only = eng.stats["ced_encoder_only_rows"]
    with compile_events() as compiled:
        eng.submit("scored", prompt, SamplingParams(max_new_tokens=1, stop_on_eos=False, prompt_logprobs=2))
        got = {r["id"]: r for r in eng.run()}["scored"]["prompt_logprobs"]
    assert compiled == [], sorted(set(compiled))
    assert eng.stats["ced_encoder_only_rows"] == encoder_only
    logits = np.asarray(model.forward(params, cfg, np.asarray([prompt])), np.float64)[0, :-1]
    want = logits - logits.max(-1, keepdims=True)
    want -= np.log(np.exp(want).sum(-1, keepdims=True))
    assert got[0] is None and len(got) == len(prompt)
    assert np.abs(np.array([e[0] for e in got[1:]]) - want[np.arange(len(prompt) - 1), prompt[1:]]).max() <= 1e-5
    for j, (_, alternatives) in enumerate(got[1:]):
        order = np.argsort(-want[j], kind="stable")
        assert -np.diff(want[j][order[:3]]).min() > 1e-4, f"near-tie in row {j}'s alternatives"
        assert [a for a, _ in alternatives] == order[:2].tolist()
    # round 2's hits skip the rows before the decoder's halo (none left to run the encoder only)
    assert eng.stats["ced_encoder_only_rows"] == sum(max(0, n - ced_rows(cfg)) + max(0, n - ced_rows(cfg) - _cached(n))
                                                     for n in ENGINE_PROMPTS)


def test_engine_with_operator_local_qcp_equals_single_device(serial_run):
    """Operator-local indexer + attention QCP (TP 4, thresholds 1 row) in the engine's span prefill, decode under
    plain TP: the same tokens as the single-device engine, logits ≤ 1e-5."""
    cfg, params, cap, _, _, (out, last, _, gen) = serial_run
    par = ParallelConfig(tp_size=4, indexer_query_parallel_size=4, attention_query_parallel_size=4,
                         indexer_query_min_tokens=1, attention_query_min_tokens=1, attention_query_swa_min_tokens=1)
    eng, _, (q_out, q_last, _, q_gen) = _engine_run(params, cfg, Capacity(**{**cap.__dict__, "span_prefill": None}),
                                                    par)
    assert q_out == out
    _same_generation(q_gen, gen)
    assert max(rel_err(a, b) for a, b in zip(q_last, last)) <= 1e-5
    assert eng.span and eng.span_layout.operator is not None and not eng.span_layout.query_parallel
