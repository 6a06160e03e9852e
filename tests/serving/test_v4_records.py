"""DeepSeek-V4 with the release's cache formats (`ModelConfig.cache_formats`, the cache fake-quant on): the window rows
and every CSA / HCA entry in the 584 B record (``fp8_ds_mla``: FP8 e4m3 without RoPE, a ue8m0 scale per 64 channels,
the RoPE channels BF16), CSA's index keys MXFP4 (68 B), the indexer's queries and keys turned by the Hadamard
transform before their MXFP4 (as the release's ``rotate_activation``).

* the record: its bytes (584 B at the release's head), decoded equal to the fake-quant value for value, the FP8
  part equal to an independent ml_dtypes reference; the Hadamard rotation equal to a butterfly transform;
* the stores of a record cache hold exactly `CacheSpec`'s bytes, at the tiny size and (declared) at V4-Flash's;
* a record cache computes exactly the fake-quant values: the decode step (teacher forcing) over records equals the
  step over fake-quantized value stores bit for bit, and under KVP = DCP 2 / 8 one device's; the engine's greedy
  tokens equal the full forward's with the fake-quant (span prefill, a prefix hit — bit-identical to a cold
  prefill — and QCP 2 + KVP 2). PD with records: `tests/serving/pd/test_disaggregated.py`.

`tiny-v4` with ``head_dim`` 80: the records need whole FP8 blocks of 64 channels without RoPE (80 − 16).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import (
    FLIP,
    assert_prefix_hit_bit_identical,
    assert_rows_agree,
    decode_teacher_forcing,
    full_forward_rows,
    greedy_reference,
    greedy_rounds,
    perturbed_model,
    rel_err,
    sharded_teacher_forcing,
)

from v41cp import model
from v41cp.config import preset
from v41cp.quant import fp8_ds_mla, hadamard_rotate
from v41cp.serving.cache.device_cache import declare_cache
from v41cp.serving.cache.records import decode, encode, record_bytes, record_widths
from v41cp.serving.cache.spec import CacheSpec
from v41cp.serving.engine import Capacity, Engine, SamplingParams
from v41cp.sharding.topology import ParallelConfig

BLOCK = 8


def _cfg():
    return preset("tiny-v4", fake_quant=True, head_dim=80)


@pytest.mark.fast
def test_the_v4_record_decodes_to_the_fake_quant_values():
    rng = np.random.default_rng(3)
    x = (rng.normal(size=(6, 512)) * np.logspace(-4, 3, 6)[:, None]).astype(np.float32)
    x[0, :64] = 0.0                                                  # an all-zero block: the 1e-4 floor
    x[1, 448:] = [1 + 2.0**-8] * 64                                  # BF16 ties: round to even
    rec = encode(jnp.asarray(x), "fp8_ds_mla", 64)
    assert {k: a.shape[-1] for k, a in rec.items()} == {"q": 448, "s": 8, "r": 128} == record_widths("fp8_ds_mla",
                                                                                                     512, 64)
    assert record_bytes("fp8_ds_mla", 512, 64) == 584 and all(a.dtype == jnp.uint8 for a in rec.values())
    assert not np.asarray(rec["s"][:, 7]).any()                      # the pad byte
    got = np.asarray(decode(rec, "fp8_ds_mla", jnp.float32))
    np.testing.assert_array_equal(got, np.asarray(fp8_ds_mla(jnp.asarray(x), 64)))
    # an independent reference: per 64 channels a power-of-two scale ≥ amax / 448, e4m3 by ml_dtypes; BF16 tail
    g = x[:, :448].reshape(6, 7, 64)
    amax = np.maximum(np.abs(g).max(-1, keepdims=True), np.float32(1e-4))
    scale = np.exp2(np.ceil(np.log2(amax / np.float32(448)))).astype(np.float32)
    head = (np.clip(g / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale).reshape(6, 448)
    np.testing.assert_array_equal(got[:, :448], head)
    np.testing.assert_array_equal(got[:, 448:], x[:, 448:].astype(ml_dtypes.bfloat16).astype(np.float32))
    assert got[1, 448] == 1.0                                        # 1 + 2^-8 is a BF16 tie: to the even mantissa


@pytest.mark.fast
def test_hadamard_rotation_is_the_orthonormal_walsh_hadamard_transform():
    x = np.random.default_rng(4).normal(size=(3, 5, 128)).astype(np.float32)
    y = x.copy()                                                     # the in-place butterfly (natural order)
    h = 1
    while h < 128:
        y = y.reshape(3, 5, -1, 2, h)
        y = np.stack([y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]], axis=-2).reshape(3, 5, 128)
        h *= 2
    got = np.asarray(hadamard_rotate(jnp.asarray(x)))
    np.testing.assert_allclose(got, y / np.sqrt(128), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.einsum("abc,abc->ab", got, got[::-1]), np.einsum("abc,abc->ab", x, x[::-1]),
                               rtol=1e-5)                            # scores unchanged without a quantizer
    with pytest.raises(ValueError, match="power-of-two channel count, got 48"):
        hadamard_rotate(jnp.zeros((2, 48)))


def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.float32(np.sqrt(n))


@pytest.mark.fast
def test_v4_index_queries_are_turned_then_quantized():
    """`index_query` under V4's fake-quant: the RoPE-rotated queries times the Hadamard matrix (built here, by
    Sylvester's doubling), then MXFP4; V4.1's are not turned."""
    from v41cp.layers.indexer import index_query
    from v41cp.quant import mxfp4_block32

    cfg = _cfg()
    k = jax.random.split(jax.random.key(2), 5)
    b, s, hi, di, r = 2, 5, cfg.index_n_heads, cfg.index_head_dim, cfg.q_lora_rank
    wq_b, w_proj = jax.random.normal(k[0], (r, hi, di)), jax.random.normal(k[1], (cfg.hidden_size, hi))
    x, qr = jax.random.normal(k[2], (b, s, cfg.hidden_size)), jax.random.normal(k[3], (b, s, r))
    angles = jax.random.uniform(k[4], (b, s, cfg.qk_rope_head_dim // 2)) * 6.0
    plain, w_plain = index_query(cfg.replace(fake_quant=False), wq_b, w_proj, x, qr, angles)
    got, w_got = index_query(cfg, wq_b, w_proj, x, qr, angles)
    turned = jnp.einsum("...c,cd->...d", plain, jnp.asarray(_sylvester(di)), precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(mxfp4_block32(turned)))
    np.testing.assert_array_equal(np.asarray(w_got), np.asarray(w_plain))
    v41 = preset("tiny")
    q41, _ = index_query(v41, jax.random.normal(k[0], (v41.q_lora_rank, v41.index_n_heads, v41.index_head_dim)),
                         jax.random.normal(k[1], (v41.hidden_size, v41.index_n_heads)),
                         jax.random.normal(k[2], (b, s, v41.hidden_size)),
                         jax.random.normal(k[3], (b, s, v41.q_lora_rank)), angles[..., :v41.qk_rope_head_dim // 2])
    q41_plain, _ = index_query(v41.replace(fake_quant=False),
                               jax.random.normal(k[0], (v41.q_lora_rank, v41.index_n_heads, v41.index_head_dim)),
                               jax.random.normal(k[1], (v41.hidden_size, v41.index_n_heads)),
                               jax.random.normal(k[2], (b, s, v41.hidden_size)),
                               jax.random.normal(k[3], (b, s, v41.q_lora_rank)), angles[..., :v41.qk_rope_head_dim // 2])
    np.testing.assert_array_equal(np.asarray(q41), np.asarray(mxfp4_block32(q41_plain)))


def test_v4_index_keys_are_turned_as_the_queries_are():
    """A CSA layer fed by the embedding alone (`tiny-v4-csa-first`, layer 0: nothing quantized upstream): its index
    scores under the fake-quant stay near the unquantized scores (measured 0.19 of the largest), as they do only
    when keys and queries are turned alike — turning one side alone leaves scores unrelated to the model's (1.0)."""
    cfg = preset("tiny-v4-csa-first", fake_quant=True, head_dim=80)
    params = model.init_params(cfg, jax.random.key(0))
    seq = np.random.default_rng(3).integers(3, cfg.vocab_size, (1, 40))

    def scores(c):
        s = np.asarray(model.forward_debug(params, c, seq)[2]["layers_0"]["attn"]["index_scores"][0])[0]
        return np.where(np.isfinite(s), s, 0.0)

    plain, quantized = scores(cfg.replace(fake_quant=False)), scores(cfg)
    err = float(np.abs(quantized - plain).max() / np.abs(plain).max())
    print(f"\n[v4 index scores] fake-quant vs unquantized: {err:.2f} of the largest")
    assert 0 < err <= 0.5


@pytest.mark.fast
def test_record_cache_holds_the_spec_bytes():
    """Exact structure: the declared stores of a record cache (tiny, and V4-Flash with its 128-token pages) hold
    `CacheSpec`'s bytes per window row and per block; V4-Flash's rows are the release's 584 B / 68 B."""
    for cfg, block in ((_cfg(), BLOCK), (preset("v4-flash"), 128)):
        decl = declare_cache(cfg, num_blocks=4, block_tokens=block, max_batch=2)
        nbytes = lambda tree: sum(int(np.prod(d.shape)) * jnp.dtype(d.dtype).itemsize
                                  for d in jax.tree.leaves(tree, is_leaf=lambda a: hasattr(a, "init")))
        spec = CacheSpec(cfg, block_tokens=block)
        assert nbytes(decl.swa) == 2 * spec.swa_bytes_per_request
        assert nbytes((decl.ckv, decl.ikey)) == 4 * spec.block_bytes
    assert spec.swa_bytes_per_row == 584 and {(g.kv_bytes_per_entry, g.index_bytes_per_entry)
                                              for g in spec.groups} == {(584, 68), (584, 0)}


@pytest.fixture(scope="module")
def v4r():
    return perturbed_model("tiny-v4", fake_quant=True, head_dim=80)


SEQ_LEN = {"a": (41, 0), "b": (23, 9), "s": (5, 30)}


@pytest.fixture(scope="module")
def teacher_forced(v4r):
    """The sequences, and their one-device teacher-forced decode logits over record pages and over value stores
    holding the fake-quant values."""
    cfg, params = v4r
    rng = np.random.default_rng(7)
    seqs = {rid: rng.integers(3, cfg.vocab_size, n) for rid, (n, _) in SEQ_LEN.items()}
    start = {rid: s for rid, (_, s) in SEQ_LEN.items()}
    run = lambda records: decode_teacher_forcing(cfg, params, seqs, start, BLOCK, 4, 8, 32, 45, records=records)
    return seqs, start, run(True), run(False)


def test_record_pages_compute_exactly_the_fake_quant_values(v4r, teacher_forced):
    """Teacher forcing through every window / ratio-4 / ratio-8 / page boundary: the decode step over record pages
    gives bit for bit the logits of the step over value stores holding the fake-quant values (the records decode to
    them exactly), and the full forward's with the fake-quant within `helpers.FLIP` (see there)."""
    cfg, params = v4r
    seqs, _, records, values = teacher_forced
    for rid, seq in seqs.items():
        np.testing.assert_array_equal(records[rid], values[rid], err_msg=rid)
        full = full_forward_rows(params, cfg, seq, 48)                       # one forward program for the three
        err = rel_err(records[rid], full)
        print(f"\n[v4 records] {rid} ({len(seq)} tokens): vs the fake-quant forward {err:.2e}")
        assert err <= FLIP, rid


@pytest.mark.parametrize("name", ["kvp2-heads", "kvp8-ag_rs"])
def test_sharded_record_decode_equals_one_device(v4r, teacher_forced, name):
    """KVP = DCP: each record on its page's owner (copied, never re-encoded), the distributed C4 top-k over owned
    MXFP4 keys, HCA's partials over owned records: every stored code equals one device's or is one code step from it
    (the sharded step's FP32 values — TP's reductions summed in another order — straddled a rounding boundary), and
    with the one device reading the same codes (`helpers.sharded_teacher_forcing`) every row is within 1e-5 of one
    device's; a row that wrote a flipped code within `FLIP`."""
    cfg, params = v4r
    seqs, start, _, _ = teacher_forced
    parallel = {"kvp2-heads": ParallelConfig(tp_size=2, kv_parallel_size=2, decode_context_parallel_size=2),
                "kvp8-ag_rs": ParallelConfig(tp_size=8, kv_parallel_size=8, decode_context_parallel_size=8,
                                             dcp_merge="ag_rs")}[name]
    got, want, flips = sharded_teacher_forcing(cfg, params, seqs, start, BLOCK, 4, 8, 32, 45, parallel)
    for rid in seqs:
        errs = [rel_err(g, w) for g, w in zip(got[rid], want[rid], strict=True)]
        assert_rows_agree(f"v4 records {name} {rid}", errs, flips[rid])


NEW = 4


@pytest.fixture(scope="module")
def v4r_dense():
    """`_cfg` with every visible CSA entry selected (16 ≥ the 64-token capacity's entries): MXFP4 queries and keys
    make exact score ties common, and at a top-k boundary two programs' summation orders may order a tie
    differently (`greedy_reference` asserts no selection near-tie); the selection itself is covered above."""
    return perturbed_model("tiny-v4", fake_quant=True, head_dim=80, index_topk=16)


@pytest.fixture(scope="module")
def greedy(v4r_dense):
    cfg, params = v4r_dense
    rng = np.random.default_rng(1)
    prompts = {"r0": rng.integers(3, cfg.vocab_size, 30).tolist(), "r2": rng.integers(3, cfg.vocab_size, 41).tolist()}
    prompts["hit"] = prompts["r2"] + rng.integers(3, cfg.vocab_size, 4).tolist()         # r2 stored its state at 40
    return (prompts,) + greedy_reference(cfg, params, prompts, NEW, 64)


@pytest.mark.parametrize("name", ["one-device", "qcp2-kvp2"])
def test_record_engine_greedy_equals_the_fake_quant_forward(v4r_dense, greedy, name):
    """Span prefill (one pass; QCP 2 + KVP 2: model-wide QCP, records written by their page owners), prefix caching
    on: the hit resumes from r2's stored pages and rings; tokens equal the fake-quant forward's greedy
    continuation (no greedy near-tie), logits within `FLIP`."""
    cfg, params = v4r_dense
    prompts, want, want_logits = greedy
    parallel = ParallelConfig(tp_size=2, query_context_parallel_size=2, kv_parallel_size=2,
                              decode_context_parallel_size=2) if name == "qcp2-kvp2" else None
    eng = Engine(params, cfg, Capacity(prefill_bucket_count=1,
                                       max_batch=2, max_tokens=64, block_tokens=BLOCK), parallel=parallel,
                 record_logits=True)
    got, logits = greedy_rounds(eng, prompts, (("r0", "r2"), ("hit",)), NEW)
    assert got == want
    for rid in prompts:
        err = rel_err(logits[rid], want_logits[rid])
        print(f"\n[v4 records engine {name}] {rid}: vs the fake-quant forward {err:.2e}")
        assert err <= FLIP, rid
    assert eng.result("hit")["cached_tokens"] == 40
    eng.check()


def test_record_prefix_hit_is_bit_identical_to_a_cold_prefill(v4r_dense, greedy):
    """The hit's first-token logits and every byte of its record pages and rings equal a cold prefill's."""
    cfg, params = v4r_dense
    prompts = greedy[0]
    cap = Capacity(max_batch=2, max_tokens=64, block_tokens=BLOCK)
    sp = SamplingParams(max_new_tokens=NEW, stop_on_eos=False)

    keys = assert_prefix_hit_bit_identical(params, cfg, cap, prompts, ("r2",), "hit", sp, 40)
    assert any("'r'" in k for k in keys)                          # the records' BF16 RoPE leaves
