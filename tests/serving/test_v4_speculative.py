"""DeepSeek-V4 speculative verification (`tiny-v4`: SWA | HCA ratio 8 | CSA | CSA, window 8): a step of ``n + 1``
rows writes every compressor's ring (CSA: the last 8 rows' projections, main and indexer; HCA: the open window),
the compressed entries and index keys completed inside the step and the window ring; `commit_rows` keeps the
anchor and the accepted drafts and puts back what the rejected rows overwrote (`RingUndo`, `EntriesUndo`).

* every acceptance length 0 … n by injected proposals (the target's greedy continuation with a wrong token at
  draft j), prompts and outputs crossing the window, ratio-4, ratio-8 and page boundaries, so rejected rows
  complete entries and wrap rings: the tokens equal the full forward's greedy continuation (no near-tie) and the
  caches after the run equal plain decoding's — every page in table order, every compressor ring and window ring;
* a verification wider than the rings (window 16, 9 drafts: 10 rows over CSA's 8-row rings, so a rejected row
  shares its ring row with a kept one): the caches equal plain decoding's too;
* greedy tokens equal under KVP = DCP 2 (the entries of rejected rows restored on their owners) and after a
  model-wide QCP prefill.
"""

import jax
import numpy as np
import pytest
from helpers import (
    SPECULATIVE_TOPOLOGIES,
    continuation_proposer,
    greedy_reference,
    pages_in_table_order,
    perturbed,
    rel_err,
    tables_at_finish,
)

from v41cp import model
from v41cp.config import preset
from v41cp.serving.engine import Capacity, Engine, SamplingParams
from v41cp.serving.runner.speculative import Speculative

CAP = Capacity(prefill_bucket_count=1, max_batch=3, max_tokens=48, block_tokens=8)
N = 3                                                         # drafts per step
PROMPT_LENGTHS = (6, 15, 29)
NEW = 14


@pytest.fixture(scope="module")
def setup():
    cfg = preset("tiny-v4")
    params = perturbed(model.init_params(cfg, jax.random.key(0)))
    rng = np.random.default_rng(5)
    prompts = {f"p{n}": rng.integers(3, cfg.vocab_size, n).tolist() for n in PROMPT_LENGTHS}
    want, _ = greedy_reference(cfg, params, prompts, NEW, 64)      # the length the other tiny-v4 files' references use
    plain = Engine(params, cfg, CAP)
    plain.tables = tables_at_finish(plain)
    assert _run(plain, prompts) == want
    return cfg, params, prompts, want, plain


def _run(engine, prompts) -> dict:
    for rid, p in prompts.items():
        engine.submit(rid, p, SamplingParams(max_new_tokens=NEW, stop_on_eos=False))
    return {r["id"]: r["output_ids"] for r in engine.run()}


@pytest.mark.parametrize("j", range(N + 1))
def test_every_acceptance_length_rolls_back_every_ring(setup, j):
    cfg, params, prompts, want, plain = setup
    eng = Engine(params, cfg, CAP, speculative=Speculative(None, N, proposer=continuation_proposer(cfg, prompts, want, j)))
    tables = tables_at_finish(eng)
    assert _run(eng, prompts) == want
    for rid in prompts:
        st = eng.result(rid)["speculative"]
        assert j * (st["target_steps"] - 1) <= st["drafts_accepted"] <= j * st["target_steps"], (j, rid, st)
    blocks = {rid: len(t) for rid, t in plain.tables.items()}
    got = pages_in_table_order(eng.cache, tables, blocks)
    ref = pages_in_table_order(plain.cache, plain.tables, blocks)
    assert any("open_kv" in key for key in ref) and any("ckv" in key for key in ref)
    for key in ref:
        assert rel_err(got[key], ref[key]) <= 1e-5, (j, key, rel_err(got[key], ref[key]))


@pytest.mark.parametrize("name", list(SPECULATIVE_TOPOLOGIES))
def test_sharded_verification_equals_plain_greedy(setup, name):
    cfg, params, prompts, want, _ = setup
    eng = Engine(params, cfg, CAP, parallel=SPECULATIVE_TOPOLOGIES[name],
                 speculative=Speculative(None, N, proposer=continuation_proposer(cfg, prompts, want, 1)))
    assert _run(eng, prompts) == want
    assert eng.speculative_stats()["drafts_accepted"] > 0


def test_verification_wider_than_the_rings_rolls_back(setup):
    """Window 16, 9 drafts with draft 5 wrong: 10 verification rows over CSA's 8-row rings (rows 8 and 9 share ring
    rows with rows 0 and 1), so each rejected row's ring row goes back to the kept row of its residue or to the
    ring before the step; tokens and caches equal plain decoding's."""
    _, params, prompts, _, _ = setup
    cfg = preset("tiny-v4", sliding_window=16)
    want, _ = greedy_reference(cfg, params, prompts, NEW, 48)
    plain = Engine(params, cfg, CAP)
    plain.tables = tables_at_finish(plain)
    assert _run(plain, prompts) == want
    eng = Engine(params, cfg, CAP, speculative=Speculative(None, 9, proposer=continuation_proposer(cfg, prompts, want, 5)))
    tables = tables_at_finish(eng)
    assert _run(eng, prompts) == want
    assert eng.speculative_stats()["drafts_accepted"] >= 5 * len(prompts)
    blocks = {rid: len(t) for rid, t in plain.tables.items()}
    got = pages_in_table_order(eng.cache, tables, blocks)
    ref = pages_in_table_order(plain.cache, plain.tables, blocks)
    for key in ref:
        assert rel_err(got[key], ref[key]) <= 1e-5, (key, rel_err(got[key], ref[key]))
