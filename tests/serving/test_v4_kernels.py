"""DeepSeek-V4 on the kernels (``attention_backend`` / ``indexer_backend`` = ``"pallas"``; interpret mode here): the
sparse-attention kernel reads V4's window rows and CSA / HCA entries in place — values, or the release's 584 B
records (``fp8_ds_mla``, decoded in the kernel by per-channel index arithmetic) — and the indexer kernel scans CSA's
MXFP4 index keys (V4.1's format); HCA's selection is every visible entry.

* the in-kernel decoder of the 584 B record equals `records.decode` (FP32 and BF16); the kernel over such a store
  equals its reference;
* the full forward with the kernels equals the XLA forward;
* the engine with the kernels (span prefill, decode, a prefix hit) gives the XLA engine's tokens, logits within 1e-5
  (value stores); the KVP = DCP 2 decode with the kernels, over values and over records, equals one device's XLA
  step to 1e-5.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import decode_teacher_forcing, greedy_rounds, perturbed_model, rel_err

from v41cp import model
from v41cp.kernels.dequant import load_rows_split, merge_channels, record_refs
from v41cp.kernels.sparse_attention import sparse_attention, store_format
from v41cp.serving.cache.records import decode, encode
from v41cp.serving.engine import Capacity, Engine
from v41cp.sharding.topology import ParallelConfig

KERNELS = dict(attention_backend="pallas", indexer_backend="pallas")


@pytest.mark.fast
def test_the_kernel_decodes_the_v4_record_and_attends_over_it():
    x = jax.random.normal(jax.random.key(0), (40, 512)) * 3
    rec = encode(x, "fp8_ds_mla", 64)
    assert store_format(rec, 512) == "fp8_ds_mla"
    want = np.asarray(decode(rec, "fp8_ds_mla", jnp.float32))
    for dtype in (jnp.float32, jnp.bfloat16):                        # every record value is exact in BF16
        even, odd = load_rows_split(record_refs(rec, "fp8_ds_mla"), "fp8_ds_mla", jnp.arange(40), 512, dtype)
        np.testing.assert_array_equal(np.asarray(merge_channels(even, odd).astype(jnp.float32)), want)
    q = jax.random.normal(jax.random.key(1), (3, 16, 512))
    idx = jnp.asarray(np.random.default_rng(0).integers(-1, 40, (3, 12)), jnp.int32).at[1].set(-1)
    (o_x, lse_x), (o_p, lse_p) = (sparse_attention(q, [rec], [idx], backend=b) for b in ("xla", "pallas"))
    assert rel_err(np.asarray(o_p), np.asarray(o_x)) <= 1e-5
    np.testing.assert_allclose(np.asarray(lse_p), np.asarray(lse_x), atol=1e-5)


@pytest.fixture(scope="module")
def v4():
    return perturbed_model("tiny-v4")


def test_forward_with_the_kernels_equals_xla(v4):
    cfg, params = v4
    seq = np.random.default_rng(3).integers(3, cfg.vocab_size, (1, 41))
    want = np.asarray(model.forward(params, cfg, seq))
    assert rel_err(np.asarray(model.forward(params, cfg.replace(**KERNELS), seq)), want) <= 1e-5


def _prompts(cfg):
    rng = np.random.default_rng(1)
    prompts = {"r0": rng.integers(3, cfg.vocab_size, 30).tolist(), "r2": rng.integers(3, cfg.vocab_size, 41).tolist()}
    prompts["hit"] = prompts["r2"] + rng.integers(3, cfg.vocab_size, 4).tolist()         # r2 stored its state at 40
    return prompts


def test_engine_with_the_kernels_equals_xla(v4):
    """Value stores (records: `test_dcp_decode_with_the_kernels_equals_one_device`, the decoder test above)."""
    cfg, params = v4
    prompts, out = _prompts(cfg), {}
    for backend in ("xla", "pallas"):
        c = cfg.replace(attention_backend=backend, indexer_backend=backend)
        eng = Engine(params, c, Capacity(prefill_bucket_count=1,
                                         max_batch=2, max_tokens=64, block_tokens=8), record_logits=True)
        out[backend] = greedy_rounds(eng, prompts, (("r0", "r2"), ("hit",)), 4)
        assert eng.result("hit")["cached_tokens"] == 40
    assert out["pallas"][0] == out["xla"][0]
    for rid in prompts:
        err = rel_err(out["pallas"][1][rid], out["xla"][1][rid])
        print(f"\n[v4 kernels] {rid}: vs XLA {err:.2e}")
        assert err <= 1e-5, rid


@pytest.mark.parametrize("records", [False, True], ids=["values", "records"])
def test_dcp_decode_with_the_kernels_equals_one_device(v4, records):
    """KVP = DCP 2: the attention kernel over each rank's owned CSA entries (records: the selected 584 B records
    gathered as stored, decoded in the kernel; HCA: its owned visible entries, the XLA partials), merged by LSE;
    teacher forcing equals the one-device XLA step."""
    cfg, params = v4
    if records:
        cfg, params = perturbed_model("tiny-v4", fake_quant=True, head_dim=80)
    rng = np.random.default_rng(7)
    seqs = {"a": rng.integers(3, cfg.vocab_size, 33), "s": rng.integers(3, cfg.vocab_size, 5)}
    start = {"a": 0, "s": 20}
    want = decode_teacher_forcing(cfg, params, seqs, start, 8, 2, 8, 16, 33)
    parallel = ParallelConfig(tp_size=2, kv_parallel_size=2, decode_context_parallel_size=2)
    got = decode_teacher_forcing(cfg.replace(**KERNELS), params, seqs, start, 8, 2, 8, 16, 33, parallel=parallel)
    for rid in seqs:
        assert rel_err(got[rid], want[rid]) <= 1e-5, rid
