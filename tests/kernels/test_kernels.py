"""Kernels (`v41cp.kernels`) in Pallas interpret mode == their jnp references; every GPU kernel lowers for CUDA.

Shapes use the V4.1-Flash head counts (64 heads × 512 for attention; 32 index heads × 128, top-512 for the
indexer) with few rows, and include ragged lengths, all-padding rows and pages with a single valid entry.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err

from v41cp.config import ConfigError, preset
from v41cp.kernel_bench import SWEEP
from v41cp.kernels import check_backend
from v41cp.kernels.dequant import e2m1, e4m3, e8m0, load_rows_split, merge_channels
from v41cp.kernels.grouped_matmul import grouped_fp4_matmul
from v41cp.kernels.indexer_topk import index_block_maxima, indexer_topk
from v41cp.kernels.sparse_attention import gather_keys, sparse_attention
from v41cp.kernels.sparse_attention.reference import sink_attention
from v41cp.quant import FP4_TABLE, mxfp4_block32
from v41cp.serving.cache.records import decode, encode


@pytest.mark.fast
def test_in_kernel_decoders_equal_the_record_decoder():
    b = jnp.arange(256, dtype=jnp.int32)
    finite = (b & 0x7F) != 0x7F                                     # e4m3fn NaN codes are never written
    want = jax.lax.bitcast_convert_type(b.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(e4m3(b))[finite], np.asarray(want)[finite])
    assert np.array_equal(np.signbit(e4m3(b))[finite], np.signbit(want)[finite])
    want8 = np.ldexp(1.0, np.arange(255) - 127).astype(np.float32)
    want8[0] = 0.0                                                   # byte 0 reads as 0, as records.decode does
    np.testing.assert_array_equal(e8m0(b[:255]), want8)
    np.testing.assert_array_equal(e2m1(jnp.arange(16, dtype=jnp.int32)), FP4_TABLE)
    x = jax.random.normal(jax.random.key(0), (7, 64)) * 3
    for fmt in ("fp8", "nvfp4", "mxfp4"):
        rec = encode(x, fmt)
        even, odd = load_rows_split((rec["q"], rec["s"]), fmt, jnp.arange(7), 64)
        np.testing.assert_array_equal(merge_channels(even, odd), decode(rec, fmt, jnp.float32))


def _attention_case(dtype, h=64, d=512, rows=3):
    rng = np.random.default_rng(1)
    q = jax.random.normal(jax.random.key(1), (rows, h, d)).astype(dtype)
    win = encode(jax.random.normal(jax.random.key(2), (40, d)), "fp8")
    comp = encode(jax.random.normal(jax.random.key(3), (90, d)), "nvfp4")
    values = jax.random.normal(jax.random.key(4), (30, d)).astype(dtype)
    stores = (win, comp, values)
    idx = [jnp.asarray(rng.integers(-1, n, (rows, k)), jnp.int32) for n, k in ((40, 8), (90, 40), (30, 5))]
    idx = [i.at[1].set(-1) for i in idx]                            # row 1: nothing valid anywhere
    idx[1] = idx[1].at[2].set(-1).at[2, 0].set(17)                   # row 2: one compressed entry ...
    idx[0] = idx[0].at[2].set(-1)                                     # ... and no window
    lengths = (jnp.array([8, 8, 3]), jnp.array([40, 40, 1]), jnp.array([5, 5, 0]))
    return q, stores, tuple(idx), lengths


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_sparse_attention_kernel_equals_reference(dtype, tol):
    q, stores, idx, lengths = _attention_case(dtype)
    o, lse = sparse_attention(q, stores, idx, lengths, backend="pallas")
    o_ref, lse_ref = sparse_attention(q, stores, idx, lengths, backend="xla")
    assert rel_err(o, o_ref) <= tol
    fin = np.isfinite(lse_ref)
    assert np.array_equal(np.isfinite(lse), fin) and not fin[1].any() and fin[2].all()
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(lse_ref)[fin], rtol=tol, atol=tol)
    assert np.all(np.asarray(o)[1] == 0)
    # natural-log LSE, without the sink: row 0 by hand
    keys = [gather_keys(s, f, i[:1, :n], 512) for s, f, i, n in
            zip(stores, ("fp8", "nvfp4", None), idx, (8, 40, 5))]
    keys = jnp.concatenate(keys, axis=1)[0]
    ok = np.concatenate([np.asarray(i[0, :n]) >= 0 for i, n in zip(idx, (8, 40, 5))])
    logits = np.asarray(q[0].astype(jnp.float32) @ keys.T, np.float64)[:, ok] / np.sqrt(512)
    np.testing.assert_allclose(np.asarray(lse_ref)[0], np.log(np.exp(logits).sum(-1)), rtol=1e-5)


def test_sink_is_an_output_epilogue_that_leaves_the_lse_alone():
    q, stores, idx, lengths = _attention_case("float32", h=16, d=64)
    sink = jnp.linspace(-2.0, 2.0, 16)
    o, lse = sparse_attention(q, stores, idx, lengths, sink=sink, backend="pallas")
    _, lse_nosink = sparse_attention(q, stores, idx, lengths, backend="pallas")
    np.testing.assert_array_equal(lse, lse_nosink)
    keys, valid = [], []
    for s, f, i, n in zip(stores, ("fp8", "nvfp4", None), idx, lengths):
        keys.append(gather_keys(s, f, i, 64))
        valid.append((i >= 0) & (jnp.arange(i.shape[1]) < n[:, None]))
    want = sink_attention(q[:, None], jnp.concatenate(keys, 1)[:, None], jnp.concatenate(valid, 1)[:, None], sink)
    assert rel_err(o, want[:, 0]) <= 1e-5


def _indexer_case(dtype, values=False):
    r, hi, di, epb, npg = 3, 32, 128, 32, 40
    rng = np.random.default_rng(2)
    keys = jax.random.normal(jax.random.key(5), (r * npg * epb, di))
    store = keys.astype(dtype) if values else encode(keys, "mxfp4")
    q = mxfp4_block32(jax.random.normal(jax.random.key(6), (r, hi, di))).astype(dtype)
    w = jax.random.normal(jax.random.key(7), (r, hi))
    pages = jnp.asarray(np.stack([b * npg + rng.permutation(npg) for b in range(r)]), jnp.int32)
    pages = pages.at[1, 30:].set(-1)
    page_ids = jnp.broadcast_to(jnp.arange(npg, dtype=jnp.int32), (r, npg))
    # row 0: every entry; row 1: ends one entry into page 20 (a page with a single valid entry); row 2: none
    visible = jnp.array([npg * epb, 20 * epb + 1, 0])
    return q, w, store, pages, page_ids, visible, epb


@pytest.mark.parametrize("dtype,values", [("float32", False), ("bfloat16", False), ("float32", True)])
def test_indexer_topk_kernel_ids_equal_reference(dtype, values):
    q, w, store, pages, page_ids, visible, epb = _indexer_case(dtype, values)
    mask = jnp.asarray(np.random.default_rng(3).random((3, 40 * epb // 8)) < 0.4)
    for kw in ({}, {"block_mask": mask, "cbs": 8}):
        ids, vals = indexer_topk(q, w, store, pages, page_ids, visible, 512, epb=epb, backend="pallas", **kw)
        ids_ref, vals_ref = indexer_topk(q, w, store, pages, page_ids, visible, 512, epb=epb, backend="xla", **kw)
        np.testing.assert_array_equal(ids, ids_ref)
        assert np.all(np.asarray(ids)[2] == -1) and np.all(np.asarray(ids)[1] < visible[1])
        fin = np.isfinite(vals_ref)
        assert rel_err(np.asarray(vals)[fin], np.asarray(vals_ref)[fin]) <= 1e-5


def test_bf16_index_scores_round_inside_jitted_programs():
    """XLA drops an f32 → bf16 → f32 convert pair in a jitted program (excess precision), which left the XLA
    path's BF16 index scores unrounded under `jax.jit` and its top-k ids unlike the kernel's (every row of an
    H200 bench at 128K × 64). The rounding survives compilation: jitted scores and ids equal eager ones, and
    every score is a BF16 value."""
    q, w, store, pages, page_ids, visible, epb = _indexer_case("bfloat16")
    topk = lambda q, w: indexer_topk(q, w, store, pages, page_ids, visible, 512, epb=epb, backend="xla")
    ids, vals = topk(q, w)
    ids_jit, vals_jit = jax.jit(topk)(q, w)
    np.testing.assert_array_equal(ids_jit, ids)
    np.testing.assert_array_equal(vals_jit, vals)
    fin = np.isfinite(np.asarray(vals_jit))
    v = np.asarray(vals_jit)[fin]
    np.testing.assert_array_equal(v, v.astype(jnp.bfloat16).astype(np.float32))


def test_indexer_ties_resolve_by_ascending_logical_id_on_a_scattered_page_list():
    """Identical keys tie everywhere: the top-k is the k lowest visible logical ids, whatever the page order;
    page ids as under KVP (every 3rd logical page owned)."""
    q, w, _, _, _, _, _ = _indexer_case("float32")
    n, epb = 12, 8
    store = jnp.broadcast_to(jax.random.normal(jax.random.key(8), (1, 128)), (3 * n * epb, 128))
    pages = jnp.asarray(np.stack([b * n + np.random.default_rng(b).permutation(n) for b in range(3)]), jnp.int32)
    page_ids = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) * 3 + 1, (3, n))
    visible = jnp.array([200, 60, 9])
    for backend in ("pallas", "xla"):
        ids, _ = indexer_topk(q, w, store, pages, page_ids, visible, 20, epb=epb, backend=backend)
        lid = (np.arange(n) * 3 + 1)[:, None] * epb + np.arange(epb)
        for row in range(3):
            want = np.sort(lid[lid < int(visible[row])])[:20]
            got = np.asarray(ids[row])
            np.testing.assert_array_equal(got[:len(want)], want)
            assert np.all(got[len(want):] == -1)


def test_index_block_maxima_kernel_equals_reference():
    q, w, store, pages, page_ids, visible, epb = _indexer_case("float32")
    m, blk = index_block_maxima(q, w, store, pages, page_ids, visible, epb=epb, cbs=8, backend="pallas")
    m_ref, blk_ref = index_block_maxima(q, w, store, pages, page_ids, visible, epb=epb, cbs=8, backend="xla")
    np.testing.assert_array_equal(blk, blk_ref)
    fin = np.isfinite(m_ref)
    assert np.array_equal(np.isfinite(m), fin)
    assert rel_err(np.asarray(m)[fin], np.asarray(m_ref)[fin]) <= 1e-5


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 1e-2)])
def test_grouped_fp4_matmul_kernel_equals_reference(dtype, tol):
    """Tiles of 1 (decode), 5 and 16 rows; an expert used by two tiles; a dead tile (output 0, weights unread);
    an e8m0 byte 0 (the weights' subnormal 2^-127, not the caches' zero)."""
    rng = np.random.default_rng(0)
    e, o, n = 5, 128, 256
    packed = jnp.asarray(rng.integers(0, 256, (e, o, n // 2)), jnp.uint8)
    scale = jnp.asarray(rng.integers(118, 130, (e, o, n // 32)), jnp.uint8).at[3, 0, 0].set(0)
    tiles = jnp.asarray([0, 3, 3, 1, 4, 2], jnp.int32)
    live = jnp.asarray([1, 1, 0, 1, 1, 1])
    for g in (1, 5, 16):
        x = jax.random.normal(jax.random.key(g), (6, g, n)).astype(dtype)
        want = np.array(grouped_fp4_matmul(x, tiles, packed, scale, backend="xla").astype(jnp.float32))
        got = np.asarray(grouped_fp4_matmul(x, tiles, packed, scale, live=live, backend="pallas").astype(jnp.float32))
        assert np.all(got[2] == 0)
        want[2] = 0
        assert rel_err(got, want) <= tol
    with pytest.raises(ValueError, match="output width 120"):
        grouped_fp4_matmul(x, tiles, packed[:, :120], scale[:, :120], backend="pallas")
    with pytest.raises(ValueError, match="input width 256 .* blocks of 96"):
        grouped_fp4_matmul(x, tiles, packed, scale, backend="pallas", block_k=96)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_kernel_lowers_for_cuda(dtype):
    """Pallas → Triton lowering on this CPU host (nothing runs): catches a kernel that no longer lowers."""
    s = jax.ShapeDtypeStruct
    u8, i32 = jnp.uint8, jnp.int32

    def lower(fn, *avals):
        text = jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text

    for kw in SWEEP["attention"]:                         # the defaults and the benchmark's alternatives
        lower(lambda q, wq, ws, cq, cs, v, i, j, k, kw=kw: sparse_attention(
            q, ({"q": wq, "s": ws}, {"q": cq, "s": cs}, v), (i, j, k), backend="pallas", interpret=False, **kw),
            s((16, 64, 512), dtype), s((2048, 512), u8), s((2048, 16), u8), s((4096, 256), u8), s((4096, 32), u8),
            s((100, 512), dtype), s((16, 128), i32), s((16, 512), i32), s((16, 7), i32))
    for mask, kw in [(None, kw) for kw in SWEEP["indexer"]] + [(s((16, 128), jnp.bool_), {})]:
        lower(lambda q, w, sq, ss, t, p, v, m=None, kw=kw: indexer_topk(
            q, w, {"q": sq, "s": ss}, t, p, v, 512, epb=32, block_mask=m, cbs=8, backend="pallas", interpret=False,
            **kw),
            s((16, 32, 128), dtype), s((16, 32), jnp.float32), s((4096, 64), u8), s((4096, 4), u8),
            s((16, 32), i32), s((16, 32), i32), s((16,), i32), *([mask] if mask else []))
    lower(lambda q, w, k, t, p, v: index_block_maxima(q, w, k, t, p, v, epb=32, cbs=8, backend="pallas",
                                                      interpret=False),
          s((16, 32, 128), dtype), s((16, 32), jnp.float32), s((4096, 128), dtype), s((16, 32), i32),
          s((16, 32), i32), s((16,), i32))
    for kw in SWEEP["experts"]:                  # V4.1-Flash w1 / w3: [E, 2304, 5120] as stored (8 of 384 experts)
        lower(lambda x, t, lv, p, sc, kw=kw: grouped_fp4_matmul(x, t, p, sc, live=lv, backend="pallas",
                                                                  interpret=False, **kw),
              s((24, 16, 5120), dtype), s((24,), i32), s((24,), i32), s((8, 2304, 2560), u8), s((8, 2304, 160), u8))
    lower(lambda x, t, p, sc: grouped_fp4_matmul(x, t, p, sc, backend="pallas", interpret=False),   # TP-8 w2 slice
          s((24, 1, 288), dtype), s((24,), i32), s((8, 5120, 144), u8), s((8, 5120, 9), u8))


@pytest.mark.fast
def test_backend_names_are_validated():
    with pytest.raises(ConfigError, match="attention_backend"):
        preset("tiny", attention_backend="triton")
    with pytest.raises(ConfigError, match="indexer_backend.*'cuda'"):
        preset("tiny", indexer_backend="cuda")
    with pytest.raises(ConfigError, match="expert_backend.*'triton'"):
        preset("tiny", expert_backend="triton")
    with pytest.raises(ValueError, match="attention_backend.*'mosaic'"):
        check_backend("mosaic", "attention_backend")
    assert "attention_backend" not in preset("tiny", attention_backend="pallas").to_dict()


def test_forward_with_kernel_backends_equals_the_xla_path():
    """The full-sequence model (prefill rows as kernel rows) with both kernel backends. Chunked prefill + decode
    with the kernels: `test_cli` (one device, greedy tokens) and `test_dcp_decode` (KVP 4, logits)."""
    from v41cp import model
    from v41cp.checkpoint import default_checkpoint, load

    cfg, params = load(default_checkpoint())
    tokens = np.random.default_rng(1).integers(3, cfg.vocab_size, (1, 48))    # test_engine's compiled shape
    want = np.asarray(model.forward(params, cfg, tokens))
    got = np.asarray(model.forward(params, cfg.replace(attention_backend="pallas", indexer_backend="pallas"), tokens))
    assert rel_err(got, want) <= 1e-5
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
