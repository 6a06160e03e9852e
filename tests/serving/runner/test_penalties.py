"""Presence, frequency and repetition penalties (`v41cp.serving.runner.penalties`): the penalized logits against an
independent float64 reference written from vLLM's definition (`tests.helpers.penalized_reference`), on one device
and vocab-split over attention TP 8; the counts a step keeps equal to the bincount of what it emitted; a penalty
changes the sampled distribution exactly as defined; a verification row counts the drafts before it; and the
engine's greedy tokens are the argmax of the reference-penalized logits that produced them, round after round —
with a speculative proposer whose drafts are kept and rejected, and next to unpenalized requests that stay as they
were."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import penalized_reference, run_recording_logits, top_gap
from jax.sharding import NamedSharding, PartitionSpec

from v41cp.checkpoint import default_checkpoint, load
from v41cp.serving.engine import Capacity, Engine, RequestError, SamplingParams
from v41cp.serving.runner.penalties import TokenCounts, count_tokens, reset_slot
from v41cp.serving.runner.sampling import (
    ReplicateOn,
    SamplingRows,
    accept_rows,
    adjusted_logits,
    sample_rows,
    token_distribution,
)
from v41cp.serving.runner.speculative import Speculative
from v41cp.sharding.topology import ParallelConfig


V, L = 16, 12                           # vocabulary (split over 8 devices), history length
PARAMS = [SamplingParams(frequency_penalty=0.8), SamplingParams(presence_penalty=-1.5, repetition_penalty=1.7),
          SamplingParams(), SamplingParams(repetition_penalty=0.6, frequency_penalty=-0.4, presence_penalty=2.0)]


def _histories(rng):
    """(prompt, outputs) of each row, ids repeating."""
    return [(rng.integers(0, V, 5).tolist(), rng.integers(0, V, n).tolist()) for n in (4, 0, 3, 6)]


def _counts(hist, slots, mesh=None):
    counts = TokenCounts.zeros(6, V, mesh)
    for (prompt, out), slot in zip(hist, slots):
        ids = np.full(L, -1, np.int32)
        ids[:len(prompt) + len(out)] = prompt + out
        counts = reset_slot(counts, np.int32(slot), ids, np.int32(len(prompt)), mesh=mesh)
    return counts


@pytest.mark.fast
def test_penalized_logits_equal_the_definition_on_one_device_and_split_over_tp():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(4, V)).astype(np.float32)
    hist = _histories(rng)
    slots = [4, 0, 2, 5]
    rows = SamplingRows.build(PARAMS, [len(o) for _, o in hist], 4, slots=slots)
    want = np.stack([penalized_reference(logits[i], p, o, sp.presence_penalty, sp.frequency_penalty,
                                         sp.repetition_penalty) for i, ((p, o), sp) in enumerate(zip(hist, PARAMS))])
    assert np.array_equal(want[2], logits[2])                        # the unpenalized row as it was
    got = adjusted_logits(jnp.asarray(logits), rows, counts=_counts(hist, slots))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    assert np.array_equal(np.asarray(got)[2], logits[2])

    mesh = ParallelConfig(tp_size=8).make_mesh(jax.devices()[:8])
    counts = _counts(hist, slots, mesh)
    assert counts.output.sharding.spec == PartitionSpec(None, "tp")             # each device its slice
    split = jax.device_put(logits, NamedSharding(mesh, PartitionSpec(None, ("tp", "cp"))))
    on_mesh = jax.jit(adjusted_logits, static_argnames="whole")(split, rows, whole=ReplicateOn(mesh), counts=counts)
    np.testing.assert_allclose(np.asarray(on_mesh), np.asarray(got), rtol=0, atol=0)
    # the tokens sampled (greedy rows) count for penalized rows only, in their slots
    tokens = sample_rows(split, rows, ReplicateOn(mesh), counts)
    assert np.asarray(tokens).tolist() == want.argmax(-1).tolist()
    after = count_tokens(counts, rows, tokens[:, None], mesh)
    for i, ((p, o), slot) in enumerate(zip(hist, slots)):
        added = [int(tokens[i])] if i != 2 else []
        assert np.asarray(after.output)[slot].tolist() == np.bincount(o + added, minlength=V).tolist(), i
        assert np.asarray(after.prompt)[slot].tolist() == np.isin(np.arange(V), p).tolist(), i


@pytest.mark.fast
def test_a_penalty_changes_the_distribution_as_defined():
    """At temperature T the row samples softmax(penalized / T): frequencies of 40,000 seeded draws within 5σ."""
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1.5, V).astype(np.float32)
    prompt, out = [1, 2, 3], [int(logits.argmax())] * 2 + [4]
    sp = SamplingParams(temperature=0.8, frequency_penalty=0.9, presence_penalty=0.3, repetition_penalty=1.4)
    z = penalized_reference(logits, prompt, out, 0.3, 0.9, 1.4) / 0.8
    want = np.exp(z - z.max())
    want /= want.sum()
    n = 40_000
    ids = np.full(L, -1, np.int32)
    ids[:6] = prompt + out
    one = reset_slot(TokenCounts.zeros(1, V), np.int32(0), ids, np.int32(3))
    counts = TokenCounts(jnp.broadcast_to(one.output, (n, V)), jnp.broadcast_to(one.prompt, (n, V)))
    params = [SamplingParams(**{**vars(sp), "seed": s}) for s in range(n)]
    rows = SamplingRows.build(params, [3] * n, n, slots=range(n))
    dist = np.asarray(token_distribution(jnp.broadcast_to(jnp.asarray(logits), (n, V)), rows, counts=counts))
    np.testing.assert_allclose(dist[0], want, rtol=2e-5, atol=1e-7)
    drawn = np.asarray(sample_rows(jnp.broadcast_to(jnp.asarray(logits), (n, V)), rows, counts=counts))
    freq = np.bincount(drawn, minlength=V) / n
    assert (np.abs(freq - want) <= 5 * np.sqrt(want * (1 - want) / n) + 1e-12).all(), (freq, want)
    plain = np.exp(logits / 0.8 - (logits / 0.8).max())
    assert np.abs(plain / plain.sum() - want).max() > 0.05                # the penalty moved the distribution


@pytest.mark.fast
def test_a_verification_row_counts_the_drafts_before_it():
    """Greedy acceptance of drafts that repeat one id: with a frequency penalty the later rows see the earlier
    drafts counted, so the argmax moves exactly where the reference says."""
    rng = np.random.default_rng(5)
    base = rng.normal(size=V).astype(np.float32)
    top, second = np.argsort(-base, kind="stable")[:2]
    gap = float(base[top] - base[second])
    f = gap / 1.5                                 # one occurrence keeps `top` first, two push it below `second`
    r = 4
    logits = np.broadcast_to(base, (1, r, V)).copy()
    drafts = np.array([[top, top, top]], np.int32)
    sp = SamplingParams(frequency_penalty=f)
    counts = TokenCounts.zeros(2, V)
    emitted, kept = accept_rows(jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray([r], np.int32),
                                SamplingRows.build([sp], [0], 1, slots=[1]), counts=counts)
    # row 0: nothing counted → top (kept); row 1: top once → still top (kept); row 2: top twice → second
    assert int(kept[0]) == 2 and np.asarray(emitted)[0].tolist() == [top, top, second, -1]
    assert np.asarray(count_tokens(counts, SamplingRows.build([sp], [0], 1, slots=[1]), emitted).output)[1].tolist() \
        == np.bincount([top, top, second], minlength=V).tolist()


CAP = Capacity(max_batch=3, max_tokens=40, block_tokens=4, max_logprobs=0, prefill_tokens=16)
NEW = 14


@pytest.fixture(scope="module")
def tiny():
    return load(default_checkpoint())


def _penalized_run(eng, requests):
    """``(outputs, logits)`` of ``requests`` run round by round (`run_recording_logits`)."""
    logits = run_recording_logits(eng, requests)
    return {rid: eng.result(rid)["output_ids"] for rid in requests}, logits


def test_the_engines_greedy_tokens_are_the_argmax_of_the_penalized_logits(tiny):
    """Each greedy output token of a penalized request is the argmax of the reference-penalized logits that produced
    it (outputs before it counted, its prompt seen), with a margin; an unpenalized request in the same batches keeps
    the tokens it has alone; a speculative proposer whose drafts are the expected tokens (kept) or not (rejected)
    gives the same tokens; bad penalties are refused naming the field."""
    cfg, params = tiny
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 256, n).tolist() for n in (6, 11, 9)]
    sps = {"freq": SamplingParams(max_new_tokens=NEW, stop_on_eos=False, frequency_penalty=1.2),
           "rep": SamplingParams(max_new_tokens=NEW, stop_on_eos=False, repetition_penalty=1.8, presence_penalty=0.6),
           "plain": SamplingParams(max_new_tokens=NEW, stop_on_eos=False)}
    requests = {rid: (p, sp) for (rid, sp), p in zip(sps.items(), prompts)}
    eng = Engine(params, cfg, CAP, record_logits=True)
    out, logits = _penalized_run(eng, requests)
    for rid in ("freq", "rep"):
        sp = sps[rid]
        assert len(logits[rid]) == NEW
        for i, row in enumerate(logits[rid]):
            z = penalized_reference(row, requests[rid][0], out[rid][:i], sp.presence_penalty, sp.frequency_penalty,
                                    sp.repetition_penalty)
            assert top_gap(z) > 1e-4, (rid, i)                          # no near-tie decides a token
            assert out[rid][i] == int(z.argmax()), (rid, i)
        unpenalized = [int(np.argmax(row)) for row in logits[rid]]
        assert unpenalized != out[rid]                                  # the penalty changed something
    alone, _ = _penalized_run(eng, {"plain-alone": requests["plain"]})
    assert alone["plain-alone"] == out["plain"]

    # drafts: the expected tokens, with a wrong one every third position (rejected: the target's token replaces it)
    def propose(rid, history, n):
        want = out[rid.split(":")[0]]
        done = len(history) - len(requests[rid.split(":")[0]][0])
        d = [want[done + j] if done + j < len(want) else 0 for j in range(n)]
        return [t if (done + j) % 3 else (t + 1) % cfg.vocab_size for j, t in enumerate(d)]
    spec = Engine(params, cfg, CAP, speculative=Speculative(None, 3, proposer=propose))
    got, _ = _penalized_run(spec, {f"{rid}:spec": requests[rid] for rid in ("freq", "rep")})
    assert got == {f"{rid}:spec": out[rid] for rid in ("freq", "rep")}
    assert spec.speculative_stats()["drafts_accepted"] > 0

    for field, bad in (("presence_penalty", 2.5), ("frequency_penalty", float("nan")), ("repetition_penalty", 0.0),
                       ("repetition_penalty", float("inf")), ("presence_penalty", True)):
        with pytest.raises(RequestError) as e:
            eng.submit("bad", [5, 6], SamplingParams(**{field: bad}))
        assert e.value.field == field
