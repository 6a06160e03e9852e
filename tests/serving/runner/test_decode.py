"""Decode step over the paged caches == the full-sequence forward (teacher forcing), one compile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import decode_teacher_forcing, full_forward_rows, rel_err

from v41cp.checkpoint import default_checkpoint, load
from v41cp.serving.cache.allocator import AllocationError, BlockAllocator
from v41cp.serving.runner.steps import decode_step, init_cache
from v41cp.serving.step_batch import StepBatch

BLOCK, MAX_BATCH, MAX_BLOCKS, NUM_BLOCKS = 4, 4, 12, 40


def _meta(cfg, alloc, rows, max_batch=MAX_BATCH, max_blocks=MAX_BLOCKS):
    """rows: list of (rid, history) whose last token is this step's input."""
    return StepBatch.for_histories(cfg, [h for _, h in rows], [alloc.slot(r) for r, _ in rows],
                                   [alloc.blocks(r) for r, _ in rows], max_batch, max_blocks)


@pytest.mark.parametrize("fake_quant,tol", [(False, 1e-5), (True, 1e-4)], ids=["fq-off", "fq-on"])
def test_decode_teacher_forcing_matches_full_forward(fake_quant, tol):
    """Two requests of different lengths, started at different steps, token by token through every
    window (8), compression-group (2), candidate-block (2 entries), block (4 tokens) boundary.
    Tolerances as for the oracle: with the cache fake-quant on, a value within float rounding of a
    quantization boundary may land in the neighbouring bin (seen once, at position 33: 6e-6)."""
    cfg, params = load(default_checkpoint(), fake_quant=fake_quant)
    rng = np.random.default_rng(7)
    seqs = {"a": rng.integers(3, cfg.vocab_size, 41), "b": rng.integers(3, cfg.vocab_size, 23)}
    got = decode_teacher_forcing(cfg, params, seqs, {"a": 0, "b": 9}, BLOCK, MAX_BATCH, MAX_BLOCKS, NUM_BLOCKS, 45)
    for rid, seq in seqs.items():
        err = rel_err(got[rid], full_forward_rows(params, cfg, seq, 48))         # one forward program for both
        print(f"\n[decode teacher forcing] request {rid} ({len(seq)} tokens): logits rel err {err:.2e}")
        assert err <= tol


def test_one_compile_over_1000_steps_with_changing_batches():
    """A fresh bucket (max_batch 3, 6 blocks of 4 tokens): requests come and go at random for 1000 steps."""
    cfg, params = load(default_checkpoint())
    max_batch, max_blocks, num_blocks = 3, 6, 12
    alloc = BlockAllocator(num_blocks, BLOCK, max_batch, max_blocks)
    cache = init_cache(cfg, num_blocks, BLOCK, max_batch)
    rng = np.random.default_rng(0)
    hist: dict[int, list[int]] = {}
    before = decode_step._cache_size()
    next_id, steps, sizes = 0, 0, set()
    while steps < 1000:
        if rng.random() < 0.3 and alloc.can_admit(1):
            alloc.admit(next_id, 1)
            hist[next_id] = [int(rng.integers(3, cfg.vocab_size))]
            next_id += 1
        for rid in [r for r in hist if len(hist[r]) >= alloc.capacity_tokens or rng.random() < 0.02]:
            alloc.cancel(rid)
            del hist[rid]
        if not hist:
            continue
        rows = list(hist.items())
        meta = _meta(cfg, alloc, rows, max_batch, max_blocks)
        logits, cache = decode_step(params, cache, meta, cfg)
        nxt = np.asarray(jnp.argmax(logits, -1))
        for i, (rid, h) in enumerate(rows):
            h.append(int(nxt[i]))
            try:
                alloc.extend(rid, len(h))
            except AllocationError:                      # out of blocks: this request is preempted
                alloc.cancel(rid)
                del hist[rid]
        sizes.add(len(rows))
        steps += 1
    assert decode_step._cache_size() - before == 1
    assert sizes == {1, 2, 3}
    alloc.check()



@pytest.mark.fast
def test_records_decode_to_the_fake_quant_values():
    from v41cp.quant import fake_quant
    from v41cp.serving.cache.records import decode, encode, record_bytes

    x = jnp.asarray(np.random.default_rng(1).normal(size=(5, 64)).astype(np.float32)
                    * np.logspace(-3, 3, 5)[:, None].astype(np.float32))
    x = x.at[0, :32].set(0.0).at[1, :16].set(jnp.asarray([6.0] + [0.25 * k for k in range(15)]))
    for fmt, block in (("fp8", 32), ("nvfp4", 16), ("mxfp4", 32)):
        rec = encode(x, fmt)
        assert set(rec) == {"q", "s"} and all(a.dtype == jnp.uint8 for a in rec.values())
        assert sum(a.shape[-1] for a in rec.values()) == record_bytes(fmt, 64)
        np.testing.assert_array_equal(np.asarray(decode(rec, fmt, jnp.float32)),
                                      np.asarray(fake_quant(x, fmt, block)))
    assert (record_bytes("fp8", 512), record_bytes("nvfp4", 512), record_bytes("mxfp4", 128)) == (528, 288, 68)


@pytest.mark.fast
def test_cache_bytes_equal_the_spec():
    """Exact structure: the record cache of the tiny model holds CacheSpec's bytes per row / block."""
    from v41cp.serving.cache.spec import CacheSpec

    cfg, _ = load(default_checkpoint())
    cache = init_cache(cfg, NUM_BLOCKS, BLOCK, MAX_BATCH)
    spec = CacheSpec(cfg, block_tokens=BLOCK)
    swa = sum(a.nbytes for a in jax.tree.leaves(cache.swa))
    assert swa == MAX_BATCH * spec.swa_bytes_per_request
    glob = sum(a.nbytes for part in ("ckv", "ikey") for a in jax.tree.leaves(cache.pool(part)))
    assert glob == NUM_BLOCKS * spec.block_bytes
