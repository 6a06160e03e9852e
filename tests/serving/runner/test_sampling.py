"""On-device sampling (`v41cp.serving.runner.sampling`): each filter's distribution against an independent NumPy
(float64) reference over 40,000 seeds, every frequency within 5 standard deviations (a false failure has
probability < 1e-5 per frequency); greedy limits; determinism per (seed, output index) whatever the batch row; the
speculative acceptance lossless and, greedy, exactly the longest matching prefix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41cp.serving.runner.sampling import SamplingRows, accept_rows, sample_rows, token_distribution
from v41cp.serving.scheduler.request import SamplingParams

pytestmark = pytest.mark.fast           # the developer tier (`pytest -m fast`)

TRIALS = 40_000
V = 10
LOGITS = np.random.default_rng(0).normal(0, 1.5, V).astype(np.float32)


def reference(logits, temperature, top_p=1.0, top_k=0, min_p=0.0):
    """The sampling distribution in float64, written from the definitions: tempered softmax; the top-k tokens; of
    those, the most likely ones until their renormalised mass reaches top_p; of those, the tokens at least min_p
    times as likely as the most likely one. Also the smallest distance of a mass or ratio to its threshold."""
    z = np.asarray(logits, np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")[: top_k or len(p)]
    q = p[order] / p[order].sum()
    before = np.cumsum(q) - q
    keep = (before < top_p) | (np.arange(len(q)) == 0) if top_p < 1 else np.ones(len(q), bool)
    keep &= q >= min_p * q[0]
    margin = min(np.abs(before - top_p).min() if top_p < 1 else 1.0,
                 np.abs(q - min_p * q[0]).min() if min_p > 0 else 1.0)
    out = np.zeros(len(p))
    out[order[keep]] = p[order[keep]]
    return out / out.sum(), margin


def _rows(sp: SamplingParams, n: int, index: int = 0, seeds=None) -> SamplingRows:
    seeds = range(n) if seeds is None else seeds
    return SamplingRows.build([SamplingParams(**{**vars(sp), "seed": int(s)}) for s in seeds], [index] * n, n)


def _assert_frequencies(tokens, want):
    counts = np.bincount(np.asarray(tokens), minlength=len(want)) / len(tokens)
    sd = np.sqrt(want * (1 - want) / len(tokens))
    assert (np.abs(counts - want) <= 5 * sd + 1e-12).all(), (counts, want)
    assert (counts[want == 0] == 0).all()                         # nothing outside the support, ever


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8),
                                      dict(temperature=1.3, top_k=3), dict(temperature=1.0, min_p=0.15),
                                      dict(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05)])
def test_sampled_frequencies_equal_the_reference_distribution(settings):
    want, margin = reference(LOGITS, **settings)
    assert margin > 1e-3                                          # no mass within float rounding of a threshold
    sp = SamplingParams(**settings)
    rows = _rows(sp, TRIALS)
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (TRIALS, V))
    tokens = jax.jit(sample_rows)(logits, rows)
    _assert_frequencies(tokens, want)
    np.testing.assert_allclose(np.asarray(token_distribution(logits[:1], rows.take(np.arange(1))))[0], want,
                               rtol=1e-5, atol=1e-7)


def test_greedy_limits_and_determinism():
    logits = jnp.asarray(np.stack([LOGITS, -LOGITS, LOGITS[::-1].copy()]))
    best = np.argmax(np.asarray(logits), -1)
    for sp in (SamplingParams(), SamplingParams(temperature=1e-30), SamplingParams(temperature=2.0, top_k=1),
               SamplingParams(temperature=2.0, top_p=1e-6)):
        np.testing.assert_array_equal(sample_rows(logits, _rows(sp, 3)), best, err_msg=str(sp))
    # a request's token depends on its seed and output index only: not on its batch row or the batch size
    sp = SamplingParams(temperature=1.0, top_p=0.95)
    seeds = [7, 2**40 + 3, 2**63 - 1, 11, 12]
    alone = [int(sample_rows(logits[:1], _rows(sp, 1, 5, [s]))[0]) for s in seeds]
    batched = sample_rows(jnp.broadcast_to(logits[:1], (5, V)), _rows(sp, 5, 5, seeds))
    reversed_ = sample_rows(jnp.broadcast_to(logits[:1], (5, V)), _rows(sp, 5, 5, seeds[::-1]))
    assert alone == np.asarray(batched).tolist() == np.asarray(reversed_).tolist()[::-1]
    # the output index and the seed's high word both change the draw
    many = lambda index, seeds: np.asarray(sample_rows(jnp.broadcast_to(logits[:1], (256, V)),
                                                       _rows(sp, 256, index, seeds)))
    assert (many(0, range(256)) != many(1, range(256))).any()
    assert (many(0, range(256)) != many(0, [s + 2**32 for s in range(256)])).any()


def test_rejection_sampling_is_lossless():
    """The acceptance rule against a point-mass proposal emits tokens distributed as the target: the first token
    ~ p₀ whatever the draft, and (after an accepted draft) the second ~ p₁; top-k / top-p filtered targets too."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.5, (2, V)).astype(np.float32)
    for settings in (dict(temperature=1.0), dict(temperature=0.8, top_k=5, top_p=0.9)):
        p = [reference(logits[j], **settings)[0] for j in range(2)]
        for draft in (int(np.argmax(p[0])), int(np.argsort(p[0])[-3]), int(np.argmin(p[0]))):
            emitted, kept = jax.jit(accept_rows)(jnp.broadcast_to(jnp.asarray(logits), (TRIALS, 2, V)),
                                                 jnp.full((TRIALS, 1), draft, jnp.int32),
                                                 jnp.full(TRIALS, 2, jnp.int32),
                                                 _rows(SamplingParams(**settings), TRIALS))
            emitted, kept = np.asarray(emitted), np.asarray(kept)
            _assert_frequencies(emitted[:, 0], p[0])
            accepted = kept == 1
            assert (emitted[accepted, 0] == draft).all() and (emitted[~accepted, 1] == -1).all()
            if p[0][draft] > 0.05:
                _assert_frequencies(emitted[accepted, 1], p[1])   # the bonus token follows exactly the kept drafts
            assert abs(accepted.mean() - p[0][draft]) <= 5 * np.sqrt(p[0][draft] * (1 - p[0][draft]) / TRIALS)


def test_greedy_acceptance_keeps_the_matching_prefix():
    rng = np.random.default_rng(3)
    r = 4
    logits = rng.normal(size=(5, r, V)).astype(np.float32)
    best = logits.argmax(-1)
    drafts = best[:, :r - 1].copy()
    drafts[1, 0] = (best[1, 0] + 1) % V             # rejected at once
    drafts[2, 2] = (best[2, 2] + 1) % V             # two kept
    lengths = np.array([4, 4, 4, 2, 0], np.int32)   # row 3 verifies one draft; row 4 is idle
    emitted, kept = accept_rows(jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray(lengths),
                                SamplingRows.build([SamplingParams()] * 5, [0] * 5, 5))
    emitted, kept = np.asarray(emitted), np.asarray(kept)
    assert kept[:4].tolist() == [3, 0, 2, 1]
    assert emitted[0].tolist() == best[0].tolist()
    assert emitted[1].tolist() == [best[1, 0], -1, -1, -1]
    assert emitted[2].tolist() == [*best[2, :3], -1]
    assert emitted[3].tolist() == [*best[3, :2], -1, -1]


def test_logit_bias_and_min_tokens_change_what_rows_sample():
    """The bias is added before sampling (greedy too): +100 makes a token the argmax, −100 bans one; ``min_tokens``
    holds the EOS and stop ids back while the output index is below it (also in the verification rows); vocab-sharded
    logits (attention TP 8) give the same tokens as one device."""
    import jax

    from v41cp.serving.runner.sampling import ReplicateOn
    from v41cp.sharding.topology import ParallelConfig

    rng = np.random.default_rng(4)
    v = 16                                                             # (split over 8 devices)
    logits = rng.normal(size=(4, v)).astype(np.float32)
    best = logits.argmax(-1)
    second = np.argsort(-logits, axis=-1, kind="stable")[:, 1]
    params = [SamplingParams(logit_bias=((7, 100.0),)), SamplingParams(logit_bias=((int(best[1]), -100.0),)),
              SamplingParams(min_tokens=2, stop_token_ids=(int(best[2]),)),
              SamplingParams(min_tokens=2, temperature=1.0, seed=3, logit_bias=tuple((t, -100.0) for t in range(v)
                                                                                  if t not in (int(best[3]), 9)))]
    mesh = ParallelConfig(tp_size=8).make_mesh(jax.devices()[:8])
    for index, want in ((0, [7, second[1], second[2], None]), (2, [7, second[1], best[2], None])):
        rows = SamplingRows.build(params, [index] * 4, 4, eos=int(best[3]))
        got = np.asarray(sample_rows(jnp.asarray(logits), rows))
        assert got[:3].tolist() == [int(w) for w in want[:3]], (index, got)
        # row 3: EOS (= best[3]) held back at index 0 → only token 9 is left; at index 2 both are allowed
        assert got[3] == 9 if index == 0 else got[3] in (9, int(best[3]))
        sharded = jax.device_put(logits, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, ("tp",
                                                                                                         "cp"))))
        on_mesh = jax.jit(sample_rows, static_argnames="whole")(sharded, rows, whole=ReplicateOn(mesh))
        assert np.asarray(on_mesh).tolist() == got.tolist()
    # verification rows: row j of a request is output index + j — the stop id is held back at j < 2 only
    r = 3
    vlogits = np.repeat(logits[2:3, None], r, axis=1)                     # [1, R, V]: best[2] is every row's argmax
    drafts = np.array([[second[2], second[2]]], np.int32)
    emitted, kept = accept_rows(jnp.asarray(vlogits), jnp.asarray(drafts), jnp.asarray([r], np.int32),
                                SamplingRows.build([params[2]], [0], 1))
    assert np.asarray(kept).tolist() == [2] and np.asarray(emitted)[0].tolist() == [second[2], second[2], best[2]]


def test_a_temperature_that_leaves_nothing_finite_is_greedy():
    """``logits / T`` of negative logits at a tiny temperature is −inf everywhere: the row is greedy (not NaN)."""
    logits = -np.abs(np.random.default_rng(1).normal(size=(2, V))).astype(np.float32) - 1.0
    rows = SamplingRows.build([SamplingParams(temperature=1e-39, seed=s) for s in (1, 2)], [0, 0], 2)
    assert np.asarray(sample_rows(jnp.asarray(logits), rows)).tolist() == logits.argmax(-1).tolist()


def test_grammar_masks_forbid_ids_on_one_device_and_split_over_tp():
    """``SamplingRows.mask`` (bit ``i % 32`` of word ``i // 32``): the ids whose bit is clear are −inf for every row
    that has a grammar, greedy picks the best allowed id, a row with every bit set is untouched; the same bits on
    logits split over attention TP 8 (each device its 32-id slice of 256, one word) give the same values."""
    from jax.sharding import NamedSharding, PartitionSpec

    from v41cp.serving.runner.grammar import mask_words
    from v41cp.serving.runner.sampling import ReplicateOn, adjusted_logits
    from v41cp.sharding.topology import ParallelConfig

    rng = np.random.default_rng(6)
    v, b = 256, 3
    logits = rng.normal(size=(b, v)).astype(np.float32)
    allowed = rng.random((b, v)) < 0.1
    allowed[2] = True                                                   # row 2: no grammar
    allowed[1, :200] = False                                            # row 1: only ids in the last words
    bits = np.zeros((b, mask_words(v) * 32), np.uint32)
    bits[:, :v] = allowed
    mask = (bits.reshape(b, -1, 32) << np.arange(32, dtype=np.uint32)).sum(-1).astype(np.uint32).view(np.int32)
    rows = SamplingRows.build([SamplingParams()] * b, [0] * b, b, masks=mask)
    want = np.where(allowed, logits, -np.inf)
    got = np.asarray(adjusted_logits(jnp.asarray(logits), rows))
    assert np.array_equal(got, want) and np.array_equal(got[2], logits[2])
    assert np.asarray(sample_rows(jnp.asarray(logits), rows)).tolist() == want.argmax(-1).tolist()
    mesh = ParallelConfig(tp_size=8).make_mesh(jax.devices()[:8])
    split = jax.device_put(logits, NamedSharding(mesh, PartitionSpec(None, "tp")))
    on_mesh = jax.jit(adjusted_logits, static_argnames="whole")(split, rows, whole=ReplicateOn(mesh))
    assert np.array_equal(np.asarray(on_mesh), want)


def test_min_tokens_holds_the_end_back_only_where_the_grammar_lets_the_output_go_on():
    """A grammar row below ``min_tokens``: its EOS is held back while the grammar allows other ids (greedy takes the
    best of those), but where the grammar allows nothing but EOS (complete) the EOS stays — the grammar ends the
    output; the same on logits split over attention TP 8."""
    from jax.sharding import NamedSharding, PartitionSpec

    from v41cp.serving.runner.grammar import mask_words
    from v41cp.serving.runner.sampling import ReplicateOn
    from v41cp.sharding.topology import ParallelConfig

    rng = np.random.default_rng(8)
    v, eos = 256, 1
    logits = rng.normal(size=(2, v)).astype(np.float32)
    logits[:, eos] = 10.0                                               # EOS the argmax of both rows
    allowed = np.zeros((2, v), bool)
    allowed[:, eos] = True
    allowed[0, [40, 200]] = True                                        # row 0 may go on; row 1 only end
    bits = np.zeros((2, mask_words(v) * 32), np.uint32)
    bits[:, :v] = allowed
    mask = (bits.reshape(2, -1, 32) << np.arange(32, dtype=np.uint32)).sum(-1).astype(np.uint32).view(np.int32)
    rows = SamplingRows.build([SamplingParams(min_tokens=3)] * 2, [0, 0], 2, eos=eos, masks=mask)
    want = [40 if logits[0, 40] > logits[0, 200] else 200, eos]
    assert np.asarray(sample_rows(jnp.asarray(logits), rows)).tolist() == want
    past = SamplingRows.build([SamplingParams(min_tokens=3)] * 2, [3, 3], 2, eos=eos, masks=mask)
    assert np.asarray(sample_rows(jnp.asarray(logits), past)).tolist() == [eos, eos]       # min_tokens reached
    mesh = ParallelConfig(tp_size=8).make_mesh(jax.devices()[:8])
    split = jax.device_put(logits, NamedSharding(mesh, PartitionSpec(None, ("tp", "cp"))))
    on_mesh = jax.jit(sample_rows, static_argnames="whole")(split, rows, whole=ReplicateOn(mesh))
    assert np.asarray(on_mesh).tolist() == want
