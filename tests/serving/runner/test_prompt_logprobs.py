"""Prompt log-probabilities (``echo``'s log-likelihoods) on the token-serial reference and the packed span prefill,
with CED narrowing on (model-wide QCP with CED: `test_qcp_engine.py`) — each equal to the
log-softmax of the full forward's logits (the first prompt token has none), the alternatives in `jax.lax.top_k`
order. A pass (or token-serial prefill) that scores a prompt runs all its rows through the decoder (the prompt is
longer than CED's retained rows); a plain request beside it generates the tokens it does alone, where it is
narrowed. The span-prefill engines are warmed up first: scoring compiles nothing more."""

import numpy as np
import pytest
from helpers import compile_events, run_recording_logits, top_gap

from v41cp import model
from v41cp.checkpoint import default_checkpoint, load
from v41cp.serving.engine import Capacity, Engine, SamplingParams
from v41cp.serving.runner.steps import ced_boundary, ced_rows

BASE = dict(max_batch=2, max_tokens=64, block_tokens=4, max_logprobs=4, ced=True)
PATHS = {
    "token-serial": (Capacity(**BASE, span_prefill=False, prefill_chunk=8), None),
    "span": (Capacity(**BASE, prefill_tokens=16), None),
}


@pytest.fixture(scope="module")
def checkpoint():
    cfg, params = load(default_checkpoint())
    assert ced_boundary(cfg) is not None
    return cfg, params


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("path", list(PATHS))
def test_prompt_logprobs_on_every_prefill_path(checkpoint, path):
    cfg, params = checkpoint
    cap, parallel = PATHS[path]
    rng = np.random.default_rng(11)
    scored, plain = (rng.integers(3, cfg.vocab_size, n).tolist() for n in (27, 2 * ced_rows(cfg) + 5))
    sp = SamplingParams(max_new_tokens=3, stop_on_eos=False)
    alone = Engine(params, cfg, cap, parallel=parallel, record_logits=True)
    plain_logits = run_recording_logits(alone, {"plain": (plain, sp)})["plain"]
    plain_out = alone.result("plain")["output_ids"]
    assert min(top_gap(x) for x in plain_logits) > 1e-4            # greedy choices well above rounding
    assert alone.stats["ced_encoder_only_rows"] > 0                 # (the plain prompt alone is narrowed)

    eng = Engine(params, cfg, cap, parallel=parallel)
    eng.warm_up()
    with compile_events() as compiled:
        eng.submit("scored", scored, SamplingParams(max_new_tokens=3, stop_on_eos=False, prompt_logprobs=3))
        eng.submit("plain", plain, sp)
        res = {r["id"]: r for r in eng.run()}
    if cap.by_span:                                  # (the token-serial reference is not warmed up exactly)
        assert compiled == [], sorted(set(compiled))
    assert res["plain"]["output_ids"] == plain_out                   # narrowed or not, beside a scored prompt
    assert "prompt_logprobs" not in res["plain"]

    got = res["scored"]["prompt_logprobs"]
    assert len(got) == len(scored) and got[0] is None
    want = _log_softmax(np.asarray(model.forward(params, cfg, np.asarray([scored])))[0, :-1])
    tol = 1e-5
    assert np.abs(np.array([e[0] for e in got[1:]]) - want[np.arange(len(scored) - 1), scored[1:]]).max() <= tol
    for j, (_, alternatives) in enumerate(got[1:]):
        order = np.argsort(-want[j], kind="stable")
        gaps = -np.diff(want[j][order[:4]])
        assert gaps.min() > 10 * tol, f"near-tie in row {j}'s alternatives (gaps {gaps}); pick another seed"
        assert [a for a, _ in alternatives] == order[:3].tolist()
        assert np.allclose([v for _, v in alternatives], want[j][order[:3]], atol=tol, rtol=0)
