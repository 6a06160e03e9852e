"""The single-device model against the independent oracle (NeMo AutoModel 0.7.0's V4.1 port), live.

Tolerances: ≤ 1e-5 relative with the cache fake-quant off on both sides, ≤ 1e-4 with it
on; relative error = max|Δ| / max|reference| per tensor. Selections are compared as sets
(this code base orders top-k by score desc, then position asc; torch's order among exact ties
is unspecified, so only sets are comparable and only where the k-th/(k+1)-th scores differ).
"""

import numpy as np
import pytest
from helpers import boundary_gap, candidate_block_scores, load_export, rel_err, selection_sets

from v41cp import model

pytestmark = pytest.mark.oracle

# Relative score gap below which two boundary scores count as tied: JAX and torch scores agree to
# ~1e-7 relative, so a smaller gap may legitimately flip between the two implementations.
TIE_GAP = 1e-5


def _run(oracle, preset, fake_quant):
    out = oracle.run("model", "--preset", preset, "--fake-quant", "on" if fake_quant else "off")
    cfg, params, ref = load_export(out, fake_quant=fake_quant)
    logits, hidden, inter = model.forward_debug(params, cfg, ref["input_ids"])
    return cfg, ref, np.asarray(logits), np.asarray(hidden), inter


def _topk(inter, layer):
    return np.asarray(inter[f"layers_{layer}"]["attn"]["topk"][0])


def _scores(inter, layer):
    return np.asarray(inter[f"layers_{layer}"]["attn"]["index_scores"][0])


@pytest.mark.parametrize("fake_quant,tol", [(False, 1e-5), (True, 1e-4)], ids=["fq-off", "fq-on"])
def test_complete_selection_matches_oracle(oracle, fake_quant, tol):
    """index_topk / candidate blocks large enough that every visible entry is selected."""
    cfg, ref, logits, hidden, inter = _run(oracle, "tiny-dense", fake_quant)
    roles = {r.kind for r in cfg.layer_roles} | {"candidate" for r in cfg.layer_roles if r.candidate_source}
    assert roles == {"swa", "full", "reuse", "reindex", "candidate"}
    errs = [rel_err(hidden[i], ref["hidden"][i]) for i in range(cfg.num_hidden_layers)]
    print(f"\n[oracle tiny-dense fake_quant={fake_quant}] logits rel err {rel_err(logits, ref['logits']):.3e}; "
          f"block inputs max rel err {max(errs):.3e}")
    assert rel_err(logits, ref["logits"]) <= tol
    assert max(errs) <= tol
    for role in cfg.layer_roles:
        if role.is_index_source:
            assert selection_sets(_topk(inter, role.index)) == selection_sets(ref[f"topk_{role.index}"])


def test_sparse_selection_matches_oracle_tie_free(oracle):
    """Sparse top-k (4 of up to 20 ratio-2 / 40 ratio-1 entries; 3 candidate blocks of 2) with
    the release's fake-quant on, on a config/seed whose selection boundaries hold no tie."""
    cfg, ref, logits, hidden, inter = _run(oracle, "tiny-sparse", True)
    compared = 0
    for role in cfg.layer_roles:
        if not role.is_index_source:
            continue
        scores = _scores(inter, role.index)
        gap = boundary_gap(scores, min(cfg.index_topk, scores.shape[-1]))
        assert gap.min() > TIE_GAP, f"layer {role.index}: tie at the top-k boundary (gap {gap.min():.2e})"
        compared += int(np.isfinite(gap).sum())
        if role.candidate_source:
            blocks = candidate_block_scores(scores, role.ratio, cfg.candidate_block_size)
            bgap = boundary_gap(blocks, cfg.candidate_topk_blocks)
            assert bgap.min() > TIE_GAP, f"layer {role.index}: tie at the candidate-block boundary"
            cand = np.asarray(inter[f"layers_{role.index}"]["attn"]["candidates"][0])
            np.testing.assert_array_equal(cand, ref[f"candidates_{role.index}"].astype(bool))
        assert selection_sets(_topk(inter, role.index)) == selection_sets(ref[f"topk_{role.index}"])
    assert compared > 100, "the sparse test must actually cut selections"
    err = rel_err(logits, ref["logits"])
    herr = max(rel_err(hidden[i], ref["hidden"][i]) for i in range(cfg.num_hidden_layers))
    print(f"\n[oracle tiny-sparse fake_quant=True] rows with a cut: {compared}; logits rel err {err:.3e}; "
          f"block inputs {herr:.3e}")
    assert err <= 1e-4 and herr <= 1e-4


def test_sparse_selection_sets_with_ties(oracle):
    """The oracle's own tiny config (2 index heads: many exact ReLU-zero ties). The first index
    layer sees identical inputs, so its selected sets must equal the oracle's on every row whose
    k-th and (k+1)-th scores differ; tied rows are where tie order (documented) may differ."""
    cfg, ref, logits, hidden, inter = _run(oracle, "tiny", True)
    first = next(r for r in cfg.layer_roles if r.is_index_source)
    assert rel_err(hidden[first.index], ref["hidden"][first.index]) <= 1e-4
    scores = _scores(inter, first.index)
    gap = boundary_gap(scores, min(cfg.index_topk, scores.shape[-1]))
    mine, theirs = selection_sets(_topk(inter, first.index)), selection_sets(ref[f"topk_{first.index}"])
    clear = [i for i, g in enumerate(gap) if g > TIE_GAP]
    tied = [i for i, g in enumerate(gap) if g <= TIE_GAP]
    print(f"\n[oracle tiny] layer {first.index}: {len(clear)} rows compared, {len(tied)} tied rows skipped")
    assert len(clear) >= 20
    assert all(mine[i] == theirs[i] for i in clear)


@pytest.mark.parametrize("batch,seq", [pytest.param(1, 1, marks=pytest.mark.fast), (2, 9)])
def test_short_and_batched_sequences_match_oracle(oracle, batch, seq):
    """Lengths at the edges: one token (no complete ratio-2 group yet) and a batch of 9 tokens
    (one past the window, a trailing open ratio-2 group)."""
    out = oracle.run("model", "--preset", "tiny-dense", "--fake-quant", "on", "--batch", str(batch), "--seq", str(seq))
    cfg, params, ref = load_export(out)
    logits, hidden = model.forward_with_hidden(params, cfg, ref["input_ids"])
    err = rel_err(logits, ref["logits"])
    print(f"\n[oracle tiny-dense B={batch} S={seq}] logits rel err {err:.3e}")
    assert err <= 1e-4 and rel_err(hidden, ref["hidden"]) <= 1e-4


def test_bf16_index_scores_equal_the_oracle_on_its_operands(oracle):
    """At the released dtype (BF16) the port rounds the per-head dot, the weighted ReLU and the head sum to BF16.
    On the port's own index-score operands (queries, keys, weights of every index layer of a BF16 run), the one
    selection numerics (`index_scores`) and the kernels' scan (`score_rows`, XLA reference and Pallas interpret)
    give the port's scores bit for bit, so the top-k sets are the port's on every row whose k-th and (k+1)-th
    scores differ. Scoring the same operands without the rounding differs on many entries (the test can fail)."""
    import jax.numpy as jnp

    from v41cp.kernels.indexer_topk import dense_pages, index_scan_reference, indexer_topk
    from v41cp.kernels.indexer_topk.reference import index_scores
    from v41cp.layers.indexer import topk_select

    out = oracle.run("model", "--preset", "tiny-sparse", "--fake-quant", "on", "--dtype", "bfloat16")
    cfg, _, ref = load_export(out)
    assert cfg.dtype == "bfloat16"
    bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)
    compared = unrounded_diff = scored = 0
    for role in cfg.layer_roles:
        if not role.is_index_source:
            continue
        q, k, w, want = (ref[f"index_{n}_{role.index}"] for n in ("queries", "keys", "weights", "scores"))
        assert np.array_equal(np.asarray(bf16(q), np.float32), q)           # the operands are BF16 values
        allowed = np.isfinite(want)
        got = np.where(allowed, np.asarray(index_scores(bf16(q), bf16(w), bf16(k))), -np.inf)
        np.testing.assert_array_equal(got, want, err_msg=f"layer {role.index}")
        # the kernels' scan on the same operands: the full-sequence keys as one page per request
        b, s, hi, di = q.shape
        store, pages, page_ids = dense_pages(bf16(k), k.shape[1])
        rows = lambda a: np.repeat(np.asarray(a), s, axis=0)
        visible = np.full(b * s, k.shape[1], np.int32)
        kernel_scores, _ = index_scan_reference(bf16(q).reshape(b * s, hi, di), bf16(w).reshape(b * s, hi), store,
                                                None, rows(pages), rows(page_ids), visible, None, k.shape[1], 1)
        kernel_scores = np.asarray(kernel_scores).reshape(want.shape)[..., :k.shape[1]]
        np.testing.assert_array_equal(np.where(allowed, kernel_scores, -np.inf), want,
                                      err_msg=f"layer {role.index}, kernel reference")
        if role.index == 1:       # Pallas interpret mode: the same scan as the kernel runs it (one layer: time)
            ids, vals = indexer_topk(bf16(q).reshape(b * s, hi, di), bf16(w).reshape(b * s, hi), store,
                                     rows(pages), rows(page_ids), visible, k.shape[1], epb=k.shape[1],
                                     backend="pallas")
            dense = np.full((b * s, k.shape[1] + 1), -np.inf, np.float32)
            np.put_along_axis(dense, np.where(np.asarray(ids) >= 0, np.asarray(ids), k.shape[1]), np.asarray(vals),
                              axis=1)
            np.testing.assert_array_equal(np.where(allowed, dense[:, :-1].reshape(want.shape), -np.inf), want)
        kk = min(cfg.index_topk, k.shape[1])
        gap = boundary_gap(want, kk)
        mine = selection_sets(np.asarray(topk_select(jnp.asarray(got), kk)[0]))
        theirs = selection_sets(np.asarray(topk_select(jnp.asarray(want), kk)[0]))
        clear = [i for i, g in enumerate(gap) if g > 0]
        assert all(mine[i] == theirs[i] for i in clear)
        compared += len(clear)
        unrounded = np.asarray(index_scores(jnp.asarray(q), jnp.asarray(w), jnp.asarray(k)))
        unrounded = np.asarray(bf16(unrounded), np.float32)
        unrounded_diff += int((unrounded[allowed] != want[allowed]).sum())
        scored += int(allowed.sum())
    print(f"\n[oracle tiny-sparse bf16] {scored} scores equal bit for bit, {compared} rows' sets compared; "
          f"without the intermediate rounding {unrounded_diff} scores differ")
    assert compared >= 100
    assert unrounded_diff > scored // 10
