"""DeepSeek-V4 served on one device (`tiny-v4`: SWA | HCA ratio 8 | CSA | CSA, two hash-routed MoE layers): the paged
caches hold every CSA / HCA layer's entries (CSA's index keys too) and each compressor's ring of its last rows
(`device_cache.declare_cache`); the cached rows pool each entry's window from the ring and the step's rows
(`PagedRows.compressor_windows`), HCA attends every visible entry (`PagedRows.every_entry`).

* the decode step, token by token through every window / ratio-4 / ratio-8 / page boundary, equals the full
  forward (teacher forcing), one compile;
* the engine's greedy tokens equal the full forward's greedy continuation with the span prefill (one pass, and
  passes of 16 rows continuing over rounds: the rings carried across passes) and the token-serial reference, with
  no near-tie on any selection or greedy choice, prefix-cache hits included;
* what is not built is refused by name: tensor / context parallel steps, MTP speculative decoding, PD.
"""

import jax
import numpy as np
import pytest
from helpers import decode_teacher_forcing, perturbed, rel_err, selection_margin

from v41cp import model
from v41cp.config import preset
from v41cp.serving.engine import Capacity, Engine, SamplingParams

BLOCK = 8                                        # the ratios' LCM


@pytest.fixture(scope="module")
def v4():
    cfg = preset("tiny-v4")
    return cfg, perturbed(model.init_params(cfg, jax.random.key(0)))


def test_decode_teacher_forcing_matches_full_forward(v4):
    cfg, params = v4
    rng = np.random.default_rng(7)
    seqs = {"a": rng.integers(3, cfg.vocab_size, 41), "b": rng.integers(3, cfg.vocab_size, 23)}
    got = decode_teacher_forcing(cfg, params, seqs, {"a": 0, "b": 9}, BLOCK, 3, 8, 24, 45)
    for rid, seq in seqs.items():
        err = rel_err(got[rid], np.asarray(model.forward(params, cfg, seq[None]))[0])
        print(f"\n[v4 decode teacher forcing] {rid} ({len(seq)} tokens): logits rel err {err:.2e}")
        assert err <= 1e-5


@pytest.fixture(scope="module")
def greedy(v4):
    """Prompts (two, then two sharing 41 / 33 tokens of the second) and their greedy continuations by the full
    forward, with no near-tie on any greedy choice or selection."""
    cfg, params = v4
    rng = np.random.default_rng(1)
    prompts = {"r0": rng.integers(3, cfg.vocab_size, 30).tolist(), "r2": rng.integers(3, cfg.vocab_size, 41).tolist()}
    prompts["hit"] = prompts["r2"] + rng.integers(3, cfg.vocab_size, 4).tolist()         # r2 stored its state at 40
    prompts["branch"] = prompts["r2"][:33] + rng.integers(3, cfg.vocab_size, 5).tolist()   # no state at 32: cold
    want = {}
    for rid, prompt in prompts.items():
        seq = list(prompt)
        for _ in range(NEW):
            logits = np.asarray(model.forward(params, cfg, np.array([seq])))[0, -1]
            top = np.sort(logits)[-2:]
            assert (top[1] - top[0]) / np.abs(logits).max() > 1e-4, (rid, len(seq), "greedy near-tie")
            seq.append(int(logits.argmax()))
        margin, where = selection_margin(cfg, params, seq, 0)
        assert margin > 1e-5, (rid, where)
        want[rid] = seq[len(prompt):]
    return prompts, want


NEW = 4


@pytest.mark.parametrize("prefill", ["span", "span-16-row-passes", "token-serial"])
def test_engine_greedy_equals_full_forward(v4, greedy, prefill):
    """Prefix caching on (the default): a later prompt reuses the second's cached blocks and the state stored with
    them — the window rings and every compressor's ring — and still gives the full forward's tokens. (Its
    logits are not bit-identical to a cold prefill: this model's rows round differently in passes of other sizes on
    XLA:CPU, ~2e-7; `docs/architecture.md` §8.)"""
    cfg, params = v4
    prompts, want = greedy
    cap = Capacity(max_batch=3, max_tokens=64, block_tokens=BLOCK, span_prefill=prefill != "token-serial",
                   prefill_tokens=16 if prefill == "span-16-row-passes" else None)
    eng = Engine(params, cfg, cap)
    got = {}
    for batch in (("r0", "r2"), ("hit", "branch")):
        for rid in batch:
            eng.submit(rid, prompts[rid], SamplingParams(max_new_tokens=NEW, stop_on_eos=False))
        got.update({r["id"]: r["output_ids"] for r in eng.run(max_steps=200)})
    assert got == want
    assert eng.result("hit")["cached_tokens"] == 40 and eng.result("branch")["cached_tokens"] == 0
    eng.check()
    assert eng.alloc.free_blocks + eng.prefix_stats()["cached_blocks"] == eng.num_blocks


def test_what_is_not_built_is_refused_by_name(v4):
    from v41cp.sharding.topology import ParallelConfig

    cfg, params = v4
    cap = Capacity(max_batch=1, max_tokens=32, block_tokens=BLOCK)
    for parallel, needle in ((ParallelConfig(tp_size=4), "tp_size"),
                             (ParallelConfig(tp_size=2, kv_parallel_size=2, decode_context_parallel_size=2),
                              "kv_parallel_size")):
        with pytest.raises(ValueError, match=f"DeepSeek-V4 serving runs on one device.*{needle}"):
            Engine(params, cfg, cap, parallel=parallel)
    with pytest.raises(ValueError, match="DeepSeek-V4 prefill / decode disaggregation"):
        Engine(params, cfg, cap, role="prefill")
