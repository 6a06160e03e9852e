"""DeepSeek-V4 served on one device (`tiny-v4`: SWA | HCA ratio 8 | CSA | CSA, two hash-routed MoE layers): the paged
caches hold every CSA / HCA layer's entries (CSA's index keys too) and each compressor's ring of its last rows
(`device_cache.declare_cache`); the cached rows pool each entry's window from the ring and the step's rows
(`PagedRows.compressor_windows`), HCA attends every visible entry (`PagedRows.every_entry`).

* the decode step, token by token through every window / ratio-4 / ratio-8 / page boundary, equals the full
  forward (teacher forcing), one compile;
* the engine's greedy tokens equal the full forward's greedy continuation with the span prefill (one pass, and
  passes of 16 rows continuing over rounds: the rings carried across passes) and the token-serial reference, with
  no near-tie on any selection or greedy choice, prefix-cache hits included — bit-identical to a cold prefill
  (logits and every cache byte) with every prefill path;
* what is not built is refused by name: MTP speculative decoding without the MTP layer
  (MTP: `tests/serving/test_v4_mtp.py`; verification with a host proposer: `tests/serving/test_v4_speculative.py`).
  (Every topology: `tests/serving/test_v4_parallel.py`; PD: `tests/serving/pd/test_disaggregated.py`.)
"""

import numpy as np
import pytest
from helpers import (
    assert_prefix_hit_bit_identical,
    decode_teacher_forcing,
    full_forward_rows,
    greedy_reference,
    greedy_rounds,
    perturbed_model,
    rel_err,
)

from v41cp.config import preset
from v41cp.serving.engine import Capacity, Engine, SamplingParams

BLOCK = 8                                        # the ratios' LCM


@pytest.fixture(scope="module")
def v4():
    return perturbed_model("tiny-v4")


def test_decode_teacher_forcing_matches_full_forward(v4):
    cfg, params = v4
    rng = np.random.default_rng(7)
    seqs = {"a": rng.integers(3, cfg.vocab_size, 41), "b": rng.integers(3, cfg.vocab_size, 23)}
    # test_v4_parallel's capacity (4 slots, 8 pages each, 32 pages): the same compiled step, loaded, not compiled again
    got = decode_teacher_forcing(cfg, params, seqs, {"a": 0, "b": 9}, BLOCK, 4, 8, 32, 45)
    for rid, seq in seqs.items():
        err = rel_err(got[rid], full_forward_rows(params, cfg, seq, 64))          # the greedy fixture's program
        print(f"\n[v4 decode teacher forcing] {rid} ({len(seq)} tokens): logits rel err {err:.2e}")
        assert err <= 1e-5


@pytest.fixture(scope="module")
def greedy(v4):
    """Prompts (two, then two sharing 41 / 33 tokens of the second), their greedy continuations by the full forward
    and the logits behind each continuation token, with no near-tie on any greedy choice or selection."""
    cfg, params = v4
    rng = np.random.default_rng(1)
    prompts = {"r0": rng.integers(3, cfg.vocab_size, 30).tolist(), "r2": rng.integers(3, cfg.vocab_size, 41).tolist()}
    prompts["hit"] = prompts["r2"] + rng.integers(3, cfg.vocab_size, 4).tolist()         # r2 stored its state at 40
    prompts["branch"] = prompts["r2"][:33] + rng.integers(3, cfg.vocab_size, 5).tolist()   # no state at 32: cold
    return (prompts,) + greedy_reference(cfg, params, prompts, NEW, 64)


NEW = 4


@pytest.mark.parametrize("prefill", ["span", "span-16-row-passes", "token-serial"])
def test_engine_greedy_equals_full_forward(v4, greedy, prefill):
    """Prefix caching on (the default): a later prompt reuses the second's cached blocks and the state stored with
    them — the window rings and every compressor's ring — and still gives the full forward's tokens, and every
    output token's logits equal the full forward's to 1e-5 (a cold prefill's bit for bit:
    `test_prefix_hit_is_bit_identical_to_a_cold_prefill`)."""
    cfg, params = v4
    prompts, want, want_logits = greedy
    cap = Capacity(prefill_bucket_count=1,
                   max_batch=3, max_tokens=64, block_tokens=BLOCK, span_prefill=prefill != "token-serial",
                   prefill_tokens=16 if prefill == "span-16-row-passes" else None)
    eng = Engine(params, cfg, cap, record_logits=True)
    got, logits = greedy_rounds(eng, prompts, (("r0", "r2"), ("hit", "branch")), NEW)
    assert got == want
    for rid in prompts:
        err = rel_err(logits[rid], want_logits[rid])
        assert err <= 1e-5, (rid, err)
    assert eng.result("hit")["cached_tokens"] == 40 and eng.result("branch")["cached_tokens"] == 0
    eng.check()
    assert eng.alloc.free_blocks + eng.prefix_stats()["cached_blocks"] == eng.num_blocks


@pytest.mark.parametrize("prefill", ["span", "span-16-row-passes", "token-serial"])
def test_prefix_hit_is_bit_identical_to_a_cold_prefill(v4, greedy, prefill):
    """The hit (40 of its 45 tokens cached, after two other prompts shared their passes) against the same prompt
    prefilled cold in an engine of its own: its first token's logits bit for bit and every byte of its cache —
    pages, window rings, every compressor's ring (`Engine.request_state`)."""
    cfg, params = v4
    prompts = greedy[0]
    cap = Capacity(max_batch=3, max_tokens=64, block_tokens=BLOCK, span_prefill=prefill != "token-serial",
                   prefill_tokens=16 if prefill == "span-16-row-passes" else None)
    sp = SamplingParams(max_new_tokens=NEW, stop_on_eos=False)

    keys = assert_prefix_hit_bit_identical(params, cfg, cap, prompts, ("r0", "r2"), "hit", sp, 40)
    assert any("open_kv" in k for k in keys)


def test_what_is_not_built_is_refused_by_name(v4):
    from v41cp.serving.runner.speculative import Speculative

    cfg, params = v4
    cap = Capacity(max_batch=1, max_tokens=32)
    assert Engine(params, cfg, cap).capacity.block_tokens == cfg.page_tokens == 16       # the model's page
    with pytest.raises(ValueError, match="'mtp' needs the MTP layer.*num_nextn_predict_layers=0"):
        Engine(params, cfg, cap, speculative=Speculative({}, 2))               # tiny-v4 has none


@pytest.mark.fast
def test_the_default_page_is_the_models():
    """`Capacity()` leaves the page to the model (`ModelConfig.page_tokens`: whole entries of every pool): 128 tokens
    for V4-Flash / V4-Pro (HCA's ratio), 16 for V4.1; an engine resolves it; a capacity not yet resolved says so."""
    cap = Capacity()
    assert cap.for_model(preset("v4-flash")).block_tokens == 128 == cap.for_model(preset("v4-pro")).block_tokens
    assert cap.for_model(preset("v41-flash")).block_tokens == 16
    assert Capacity(block_tokens=256).for_model(preset("v4-flash")).block_tokens == 256
    with pytest.raises(ValueError, match="for_model"):
        cap.max_blocks
