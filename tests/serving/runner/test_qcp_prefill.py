"""Span prefill and model-wide QCP (`v41cp.serving.runner.span_prefill`) at the prefill level (the engine: test_qcp_engine.py).

* model-wide QCP over N ∈ {2, 4, 8} ranks (KVP 1 and N, CED off and on) equals the unsharded span prefill:
  logits and every cache group ≤ 1e-5 relative (FP32 values), and QCP with KVP = N equals QCP with replicated
  pages exactly; the batch is ragged (prompts shorter than N rows, an empty batch row; lengths on and off page
  and compression-pair boundaries);
* a prefill in passes continues from the cached history (SWA rings, open pairs, pages; under KVP gathered from
  the owners) and equals the one-pass prefill;
* per-device FLOPs fall to 1/N (compiled cost analysis).
"""

import dataclasses

import jax
import numpy as np
import pytest
from helpers import REPO, TOKEN_MAP, cache_by_virtual_block, perturbed, rel_err
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from v41cp import model
from v41cp.config import preset
from v41cp.serving.attention.dcp import DCPPlan
from v41cp.serving.runner.span_batch import build_span_batch
from v41cp.serving.runner.span_prefill import SpanLayout, prefill_span
from v41cp.serving.runner.steps import ced_rows, init_cache
from v41cp.sharding.topology import ParallelConfig

LENGTHS = (21, 3, 16, 8, 0)          # odd (open pair, mid page) / fewer rows than ranks / page end / = window / idle
NUM_BLOCKS, BLOCK, MAX_BLOCKS, SPAN = 40, 4, 8, 24


@pytest.fixture(scope="module")
def setup():
    cfg = preset("tiny-tp8", engram_token_map=TOKEN_MAP, fake_quant=False)
    params = perturbed(model.init_params(cfg, jax.random.key(0)))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in LENGTHS]
    tables = np.full((len(LENGTHS), MAX_BLOCKS), -1, np.int32)
    free = list(rng.permutation(NUM_BLOCKS))                     # scattered pages, any residue first
    for i, n in enumerate(LENGTHS):
        k = -(-n // BLOCK)
        tables[i, :k] = [free.pop() for _ in range(k)]
    slots = np.array([2, 0, 4, 1, 3])
    return cfg, params, prompts, tables, slots


def _prefill(setup, n=1, kvp=1, ced=False, chunk=None, tile_bytes=None):
    """Span prefill of the setup's prompts over ``n`` ranks (KVP ``kvp``), whole or in passes of ``chunk`` rows
    (later passes continue from the cached history); ``tile_bytes``: QCP's selection / attention tile budget.
    Returns (last-row logits, cache by virtual block, meta)."""
    cfg, params, prompts, tables, slots = setup
    totals = np.array([len(p) for p in prompts])
    if n == 1:
        cache, prm, layout = init_cache(cfg, NUM_BLOCKS, BLOCK, len(prompts)), params, SpanLayout()
    else:
        par = ParallelConfig(tp_size=n, query_context_parallel_size=n, kv_parallel_size=kvp,
                             decode_context_parallel_size=kvp)
        mesh = par.make_mesh()
        plan = DCPPlan.build(cfg, par, mesh) if kvp > 1 else None
        cache = init_cache(cfg, NUM_BLOCKS, BLOCK, len(prompts), NamedSharding(mesh, P()), plan=plan)
        prm, layout = model.shard_params(params, cfg, mesh, par.rules()), SpanLayout.from_parallel(par, mesh)
        if tile_bytes is not None:
            layout = dataclasses.replace(layout, tile_bytes=tile_bytes)
    chunk = chunk or int(totals.max())
    logits = np.zeros((len(prompts), cfg.vocab_size), np.float32)
    for start in range(0, int(totals.max()), chunk):
        starts, ends = np.minimum(start, totals), np.minimum(start + chunk, totals)
        meta = build_span_batch(cfg, prompts, n, query_parallel=n > 1, starts=starts, ends=ends, slots=slots,
                                block_tables=tables, span=SPAN, ced=ced)
        got, cache = prefill_span(prm, cache, meta, cfg, layout)
        last = (starts < ends) & (ends == totals)
        logits[last] = np.asarray(got)[last]
    return logits, cache_by_virtual_block(cache, kvp), meta


def test_one_device_span_pass_is_packed(setup):
    """The one-device (cached-rows) span pass computes only its rows: the requests' rows back to back in one
    ``[1, Σ lengths]`` row list (not ``[batch, span]``), each request's tokens at its offset in order; CED packs
    the retained decoder rows again (at most the batch's CED row capacity)."""
    cfg, _, prompts, tables, slots = setup
    for ced in (False, True):
        rows = build_span_batch(cfg, prompts, 1, slots=slots, block_tables=tables, span=SPAN, ced=ced)
        assert rows.qcp is None and rows.mode.value == "prefill"
        assert rows.packed and rows.rows == sum(LENGTHS) and rows.tokens.shape == (1, sum(LENGTHS))
        off = np.asarray(rows.offsets)
        assert off.tolist() == np.concatenate([[0], np.cumsum(LENGTHS)[:-1]]).tolist()
        for b, p in enumerate(prompts):
            assert np.asarray(rows.tokens)[0, off[b]:off[b] + len(p)].tolist() == p
        req, local = (np.asarray(a) for a in rows.row_requests())
        assert (np.asarray(rows.positions)[0] == local).all() and (np.asarray(rows.row_valid)[0]).all()
        assert req.tolist() == [b for b, n in enumerate(LENGTHS) for _ in range(n)]
        if ced:
            assert rows.decoder_rows == sum(min(n, ced_rows(cfg)) for n in LENGTHS)
            assert np.asarray(rows.ced.encoder_rows).tolist() == [max(n - ced_rows(cfg), 0) for n in LENGTHS]


@pytest.fixture(scope="module")
def unsharded(setup):
    return {ced: _prefill(setup, ced=ced) for ced in (False, True)}


@pytest.mark.fast
def test_span_batch_rows_and_ced_owners(setup):
    cfg, _, prompts, tables, slots = setup
    full = build_span_batch(cfg, prompts, 4, slots=slots, block_tables=tables, span=SPAN)
    ced = build_span_batch(cfg, prompts, 4, slots=slots, block_tables=tables, span=SPAN, ced=True)
    n, c, cd = 4, ced.rows, ced.decoder_rows
    fq, cq = (jax.tree.map(np.asarray, b.qcp) for b in (full, ced))
    # span_index ∘ gather covers every prompt row exactly once
    real = fq.span_index[fq.span_index < n * c]
    assert sorted(real.tolist()) == sorted((np.nonzero(fq.requests.reshape(-1) >= 0)[0]).tolist())
    # CED: a retained row stays on its owner rank, in the same order; exactly the last ced_rows rows are kept
    r_keep = ced_rows(cfg)
    for r in range(n):
        kept = cq.dec_slots[r][cq.dec_slots[r] >= 0]
        assert (np.diff(kept) > 0).all()
        for k in kept:
            b, p = cq.requests[r, k], cq.positions[r, k]
            assert p >= LENGTHS[b] - r_keep
            assert cq.dec_span_index[b, p] == r * cd + list(kept).index(k)
    assert (cq.dec_span_index < n * cd).sum() == sum(min(x, r_keep) for x in LENGTHS)
    for b, x in enumerate(LENGTHS):
        assert cq.sampled[b] == (cq.dec_span_index[b, x - 1] if x else -1)
    # a pass whose last row is not retained samples nothing; an all-idle batch keeps one padding slot
    first = build_span_batch(cfg, [list(range(3, 43))], 2, ends=[8], ced=True)
    assert np.asarray(first.qcp.sampled).tolist() == [-1] and np.asarray(first.starts).tolist() == [0] \
        and not first.qcp.continued
    later = build_span_batch(cfg, [list(range(3, 43))], 2, starts=[32], ced=True)
    assert later.qcp.continued and int(later.qcp.positions.max()) == 39 and int(later.qcp.sampled[0]) >= 0
    assert build_span_batch(cfg, [[], []], 2).rows == 1
    with pytest.raises(ValueError, match="chunk bounds"):
        build_span_batch(cfg, [[5, 6]], 2, starts=[1], ends=[3])
    with pytest.raises(ValueError, match="exceeds the span bucket 8"):
        build_span_batch(cfg, prompts, 2, span=8)
    with pytest.raises(ValueError, match="token id 999"):
        build_span_batch(cfg, [[5, 999]], 2)
    with pytest.raises(ValueError, match="capacity=2"):
        build_span_batch(cfg, prompts, 2, capacity=2)
    with pytest.raises(ValueError, match="n=2 ranks"):
        build_span_batch(cfg, prompts, 2, query_parallel=False)


def test_ced_narrowed_span_prefill_equals_full(unsharded):
    (want, want_c, _), (got, got_c, meta) = unsharded[False], unsharded[True]
    assert meta.ced is not None and meta.decoder_rows < meta.rows
    live = np.array(LENGTHS) > 0
    assert rel_err(got[live], want[live]) <= 1e-5
    for k in want_c:
        assert rel_err(got_c[k], want_c[k]) <= 1e-5, k


@pytest.mark.parametrize("n", [4, 8])
def test_model_wide_qcp_equals_unsharded(setup, unsharded, n):
    live = np.array(LENGTHS) > 0
    results = {}
    for kvp, ced in ((1, False), (n, False), (n, True)):
        logits, cache, meta = _prefill(setup, n, kvp, ced)
        want, want_c, _ = unsharded[ced]
        assert meta.qcp.n == n
        if n == 8:                   # the 3-row prompt leaves ranks with no row of it
            assert ((np.asarray(meta.qcp.requests) == 1).sum(axis=1) == 0).sum() == n - 3
        assert rel_err(logits[live], want[live]) <= 1e-5, (kvp, ced)
        np.testing.assert_array_equal(logits[live].argmax(-1), want[live].argmax(-1))
        assert not logits[~live].any()
        for k in want_c:
            assert rel_err(cache[k], want_c[k]) <= 1e-5, (kvp, ced, k)
        results[kvp, ced] = logits, cache
    # pages split over the KVP group = replicated pages, bit for bit (only ownership differs)
    (l1, c1), (ln, cn) = results[1, False], results[n, False]
    np.testing.assert_array_equal(l1, ln)
    for k in c1:
        np.testing.assert_array_equal(c1[k], cn[k], err_msg=k)


@pytest.mark.parametrize("n,tile_bytes", [(1, None), (4, 1)])
def test_chunked_span_prefill_continues_from_cached_history(setup, unsharded, n, tile_bytes):
    """Passes of 7 rows (odd starts: a compression pair spans two passes through the cached open pair; window rows
    from the SWA ring; compressed entries and index keys read back from the pages — under KVP 4 every rank
    gathers the same history from the page owners) equal the one-pass prefill. Under QCP 4 the selection and
    attention run with a 1-byte tile budget: one key per selection tile and one row per attention tile, so their
    loops (and the running top-k's carry inside the map) are what is compared."""
    want, want_c, _ = unsharded[False]
    logits, cache, meta = _prefill(setup, n, n, chunk=7, tile_bytes=tile_bytes)
    assert np.asarray(meta.starts).max() > 0 and (meta.qcp is None or meta.qcp.continued)    # a later pass
    live = np.array(LENGTHS) > 0
    assert rel_err(logits[live], want[live]) <= 1e-5
    np.testing.assert_array_equal(logits[live].argmax(-1), want[live].argmax(-1))
    for k in want_c:
        assert rel_err(cache[k], want_c[k]) <= 1e-5, k


def test_qcp_per_device_flops_fall_to_one_nth():
    """Compiled cost analysis of one long prefill (benchmarks/qcp_prefill_structure.py, 8 ranks): attention,
    indexer and MoE FLOPs per device ≈ 1/N of the unsharded ones, and the attention layer moves exactly one
    FP32 window-KV row per prefill token (the span-order gather; head_dim · 4 bytes)."""
    import json
    import subprocess
    import sys

    script = REPO / "benchmarks" / "qcp_prefill_structure.py"
    res = subprocess.run([sys.executable, str(script), "--devices", "8", "--rows", "512"], capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    parts = out["parts"]
    assert abs(parts["attention"]["flops_ratio_qcp_vs_unsharded"] - 1 / 8) <= 0.005
    assert abs(parts["indexer"]["flops_ratio_qcp_vs_unsharded"] - 1 / 8) <= 0.005
    assert 1 / 8 <= parts["moe"]["flops_ratio_qcp_vs_unsharded"] <= 0.14       # the dispatch sorts every row's pairs
    assert 1 / 8 <= out["whole"]["flops_ratio_qcp_vs_unsharded"] <= 0.135
    assert parts["attention"]["qcp"]["collective_bytes_per_token"] == preset("tiny-tp8").head_dim * 4
    assert set(out["whole"]["qcp"]["collectives"]) <= {"all-gather", "all-reduce", "reduce-scatter"}
