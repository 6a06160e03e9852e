"""The sparse MoE dispatch (`v41cp.layers.moe_dispatch`) against the dense reference: same experts, same output
(FP32 ≤ 1e-5) for ordinary and adversarial routings, plain and stored-FP4 weights, one and several chunks of
tiles; its compiled work is k / E of the dense one; loop-aware program costs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOKEN_MAP, rel_err

from v41cp import model
from v41cp.config import preset
from v41cp.kernels.stored_weights import decode_fp4
from v41cp.layers.moe import dense_route_weights, routed_output, swiglu_clamped
from v41cp.layers.moe_dispatch import DispatchShape, dispatch, sparse_routed_output
from v41cp.sharding.hlo_stats import program_cost

H, I = 64, 32
LIMIT = 7.0


def _act(g, u):
    return swiglu_clamped(g, u, LIMIT, g.dtype)


class _Cfg:                      # the fields routed_output reads
    swiglu_limit = LIMIT

    def __init__(self, e):
        self.n_routed_experts = e


def _experts(e, stored, seed=0):
    """Random experts: plain ``{w1, w3 [E,H,I], w2 [E,I,H]}`` or stored FP4 ``(packed, scale)`` pairs, with the
    plain (decoded) arrays the dense reference uses."""
    rng = np.random.default_rng(seed)
    if not stored:
        w = {n: jnp.asarray(rng.normal(0, 0.1, s), jnp.float32) for n, s in
             (("w1", (e, H, I)), ("w3", (e, H, I)), ("w2", (e, I, H)))}
        return w, (w["w1"], w["w3"], w["w2"])
    out, plain = {}, []
    for n, (o, i) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
        packed = jnp.asarray(rng.integers(0, 256, (e, o, i // 2)), jnp.uint8)
        scale = jnp.asarray(rng.integers(121, 125, (e, o, i // 32)), jnp.uint8)
        out[n] = (packed, scale)
        plain.append(jnp.swapaxes(decode_fp4(packed, scale, jnp.float32), 1, 2))
    return out, tuple(plain)


def _routing(kind, t, k, e, rng):
    if kind == "random":
        idx = np.stack([rng.choice(e, k, replace=False) for _ in range(t)])
    elif kind == "all_to_one":            # every token picks the same experts: one expert gets every token
        idx = np.tile(np.arange(k)[None], (t, 1))
    elif kind == "empty_experts":         # only the last k experts are ever chosen
        idx = np.stack([rng.permutation(np.arange(e - k, e)) for _ in range(t)])
    else:
        raise ValueError(kind)
    return jnp.asarray(idx, jnp.int32), jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)


def _dense(e, x, idx, w, plain):
    return routed_output(_Cfg(e), x, dense_route_weights(_Cfg(e), w, idx), *plain)


@pytest.mark.parametrize("stored", [False, True], ids=["plain", "fp4"])
@pytest.mark.parametrize("kind,t,k,e,chunk_bytes", [
    ("random", 24, 6, 16, 1 << 30),              # decode-like: tile 1 (pairwise, no sort)
    ("random", 24, 6, 16, 3 * H * I * 4 * 5),    # ... in chunks of 5 pairs
    ("random", 1, 6, 16, 1 << 30),               # one token
    ("all_to_one", 40, 2, 8, 1 << 30),
    ("empty_experts", 96, 3, 12, 1 << 30),
    ("random", 200, 2, 4, 1 << 30),              # many tokens per expert: tiles of several rows
    ("random", 200, 2, 4, 3 * H * I * 4 * 3),    # ... in several chunks (the fori_loop)
])
@pytest.mark.fast
def test_sparse_equals_dense(stored, kind, t, k, e, chunk_bytes):
    rng = np.random.default_rng(t + k + e)
    experts, plain = _experts(e, stored)
    x = jnp.asarray(rng.normal(0, 1, (t, H)), jnp.float32)
    idx, w = _routing(kind, t, k, e, rng)
    shape = DispatchShape.build(t, k, e, 3 * H * I * 4, chunk_bytes)
    if kind == "random" and t in (24, 200):
        assert (shape.tile > 1) == (t == 200) and (shape.chunks > 1) == (chunk_bytes < 1 << 30)
    with jax.default_matmul_precision("highest"):
        got = jax.jit(lambda x, idx, w: sparse_routed_output(x, idx, w, experts, _act, chunk_bytes))(x, idx, w)
        want = _dense(e, x, idx, w, plain)
    err = rel_err(got, want)
    assert err <= 1e-5, (kind, t, k, e, err)


@pytest.mark.fast
@pytest.mark.parametrize("kind,t,k,e", [("random", 24, 6, 16), ("empty_experts", 96, 3, 12), ("random", 200, 2, 4)])
def test_grouped_fp4_kernel_dispatch_equals_dense(kind, t, k, e):
    """``backend="pallas"``: FP4 experts through the grouped kernel (interpret mode here), tiles of ≥ 16 rows even
    for decode-like batches, empty tiles skipped — same output as the dense reference."""
    rng = np.random.default_rng(t + k + e)
    experts, plain = _experts(e, True)
    x = jnp.asarray(rng.normal(0, 1, (t, H)), jnp.float32)
    idx, w = _routing(kind, t, k, e, rng)
    with jax.default_matmul_precision("highest"):
        got = jax.jit(lambda x, idx, w: sparse_routed_output(x, idx, w, experts, _act, backend="pallas"))(x, idx, w)
        want = _dense(e, x, idx, w, plain)
    assert rel_err(got, want) <= 1e-5
    assert DispatchShape.build(t, k, e, 1, min_tile=16).tile >= 16


def _exact_experts(e, stored, rng):
    """Experts whose GEMMs are exact in FP32 for inputs in {−1, 0, 1} (integer weights, or FP4 codes at scale 1:
    every partial sum on a grid of ½ far below 2²⁴), so any order of accumulation gives the same bits."""
    if not stored:
        return {n: jnp.asarray(rng.integers(-1, 2, s), jnp.float32) for n, s in
                (("w1", (e, H, I)), ("w3", (e, H, I)), ("w2", (e, I, H)))}
    return {n: (jnp.asarray(rng.integers(0, 256, (e, o, i // 2)), jnp.uint8), jnp.full((e, o, i // 32), 127, jnp.uint8))
            for n, (o, i) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I)))}


@pytest.mark.fast
@pytest.mark.parametrize("backend,stored", [("xla", False), ("xla", True), ("pallas", True)],
                         ids=["plain", "fp4", "fp4-kernel"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_a_tokens_output_does_not_depend_on_the_pass(backend, stored, dtype):
    """Batch invariance of the dispatch: a token's routed output is bit-identical whatever else the pass holds —
    alone (decode's tiles of one slot; a kernel tile of one live row), among 200 tokens (full tiles), in
    several chunks of tiles, or beside other tokens — because each pair's output has its own row and a token's
    ``k`` rows are summed in one fixed order. (Before, tiles of several rows scatter-added each token's pairs in
    expert order and tiles of one summed them in routing order: a prefix-cache hit's shorter pass rounded a row
    differently from the cold pass.) The expert GEMMs are made exact here (integer-valued data), since whether a
    GEMM rounds a row the same at every M is the GEMM library's property, not the dispatch's: XLA:CPU's does not
    at every width (measured: a 640 × 256 FP32 dot's row differs between M = 1 and M = 2); the grouped kernel's
    fixed ``block_k`` loop does."""
    rng = np.random.default_rng(5)
    t, k, e = 200, 3, 6                                     # k ≥ 3: two orders of addition can differ
    experts = _exact_experts(e, stored, rng)
    x = jnp.asarray(rng.integers(-1, 2, (t, H)), dtype)
    idx, w = _routing("random", t, k, e, rng)
    act = lambda g, u: jnp.round(g * u / 64)
    run = lambda x, idx, w, chunk_bytes=1 << 30: np.asarray(jax.jit(
        lambda x, idx, w: sparse_routed_output(x, idx, w, experts, act, chunk_bytes, backend))(x, idx, w))
    full = run(x, idx, w)
    # the XLA path: tiles of 4 rows here, 1 alone; the kernel: 16-row tiles, full here, one live row alone
    assert DispatchShape.build(t, k, e, 1, min_tile=16 if backend == "pallas" else 1).tile == (
        16 if backend == "pallas" else 4)
    np.testing.assert_array_equal(run(x, idx, w, 3 * H * I * 4 * 3), full)           # several chunks
    for rows in ([0], [199], [3, 4, 5], list(range(150, 200))):
        r = np.asarray(rows)
        np.testing.assert_array_equal(run(x[r], idx[r], w[r]), full[r], err_msg=str(rows))


@pytest.mark.fast
@pytest.mark.parametrize("kind", ["random", "all_to_one", "empty_experts"])
def test_dispatch_places_every_pair_once_in_a_tile_of_its_expert(kind):
    rng = np.random.default_rng(3)
    t, k, e = 150, 3, 10
    idx, w = _routing(kind, t, k, e, rng)
    shape = DispatchShape.build(t, k, e, 1)
    tile_expert, slot_pair = map(np.asarray, jax.jit(lambda i: dispatch(i, shape))(idx))
    assert slot_pair.shape == (shape.tiles, shape.tile) and shape.slots >= t * k
    placed = sorted(int(p) for p in slot_pair.reshape(-1) if p >= 0)
    assert placed == list(range(t * k))                               # dropless, each pair exactly once
    for ti in range(shape.tiles):                                     # each in a tile of its expert, token order
        pairs = slot_pair[ti][slot_pair[ti] >= 0]
        assert np.all(np.asarray(idx).reshape(-1)[pairs] == tile_expert[ti])
        assert np.all(np.diff(pairs // k) > 0)


@pytest.mark.fast
def test_dispatch_geometry():
    decode = DispatchShape.build(64, 6, 384, 1)
    assert decode.tile == 1 and decode.slots == 64 * 6                # decode: exactly the pairs
    prefill = DispatchShape.build(131072, 6, 384, 1)
    assert prefill.tile == 128 and prefill.slots <= 1.0625 * 131072 * 6
    for t in (1, 7, 4096, 10000):
        s = DispatchShape.build(t, 6, 384, 3 * 5120 * 288 * 2)
        assert s.slots >= t * 6 + 0 and s.tiles * 3 * 5120 * 288 * 2 <= s.chunks * (1 << 30) + s.chunks * 3 * 5120 * 288 * 2


@pytest.mark.fast
def test_sparse_moe_flops_are_k_over_e_of_dense():
    """Compiled FLOPs at the released expert count (384, top-6) and reduced widths: the sparse routed experts do
    k / E of the dense reference's work (+ at most 10 %: the FP4-scale pass and the dispatch)."""
    e, k, t, h, i = 384, 6, 64, 128, 64
    x = jax.ShapeDtypeStruct((t, h), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((t, k), jnp.int32)
    w = jax.ShapeDtypeStruct((t, k), jnp.float32)
    stored = {n: (jax.ShapeDtypeStruct((e, o, n_in // 2), jnp.uint8), jax.ShapeDtypeStruct((e, o, n_in // 32), jnp.uint8))
              for n, (o, n_in) in (("w1", (i, h)), ("w3", (i, h)), ("w2", (h, i)))}

    def sparse(x, idx, w, experts):
        return sparse_routed_output(x, idx, w, experts, lambda g, u: swiglu_clamped(g, u, 0.0, g.dtype))

    def dense(x, idx, w, experts):
        cfg = _Cfg(e)
        cfg.swiglu_limit = 0.0
        plain = [jnp.swapaxes(decode_fp4(*experts[n], jnp.bfloat16), 1, 2) for n in ("w1", "w3", "w2")]
        return routed_output(cfg, x, dense_route_weights(cfg, w, idx), *plain)

    flops = {name: program_cost(jax.jit(f).lower(x, idx, w, stored).compile())["flops"]
             for name, f in (("sparse", sparse), ("dense", dense))}
    ratio = flops["sparse"] / flops["dense"]
    print(f"\n[moe flops] sparse {flops['sparse']:.3e} dense {flops['dense']:.3e} ratio {ratio:.4f} (k/E {k / e:.4f})")
    assert k / e <= ratio <= 1.1 * k / e


@pytest.mark.fast
def test_program_cost_counts_every_loop_iteration():
    """XLA counts a loop body once; `program_cost` counts it per iteration, nested loops too: a loop of distinct
    matmuls costs what the unrolled program costs."""
    w = jnp.asarray(np.random.default_rng(0).normal(size=(6, 32, 32)), jnp.float32)
    x = jnp.ones((32, 32), jnp.float32)

    def looped(x, w):
        inner = lambda j, a: jax.lax.fori_loop(0, 3, lambda i, b: jnp.tanh(b @ w[2 * j + i % 2]), a)
        return jax.lax.fori_loop(0, 2, inner, x)

    def unrolled(x, w):
        for j in range(2):
            for i in range(3):
                x = jnp.tanh(x @ w[2 * j + i % 2])
        return x

    got = program_cost(jax.jit(looped).lower(x, w).compile())["flops"]
    want = program_cost(jax.jit(unrolled).lower(x, w).compile())["flops"]
    assert abs(got - want) <= 0.02 * want and got >= 6 * 2 * 32 ** 3


@pytest.mark.fast
def test_flops_by_op_attributes_the_index_scores_channel_loops():
    """`flops_by_op` attributes every FLOP to its source operation: the index scores' channel loop is one multiply
    and one add per (row, head, key, channel), every iteration counted; the total is XLA's within a few per cent (XLA also counts the loops' counters)."""
    from v41cp.kernels.indexer_topk.reference import index_scores
    from v41cp.sharding.hlo_stats import flops_by_op

    b, h, d, g = 2, 8, 128, 512
    args = (jax.ShapeDtypeStruct((b, 1, h, d), jnp.bfloat16), jax.ShapeDtypeStruct((b, 1, h), jnp.float32),
            jax.ShapeDtypeStruct((b, g, d), jnp.float8_e4m3fn))
    compiled = jax.jit(index_scores).lower(*args).compile()
    got = flops_by_op(compiled.as_text())
    assert got["mul"] >= b * h * g * d and got["add"] >= b * h * g * (d - 1)
    assert abs(sum(got.values()) - program_cost(compiled)["flops"]) <= 0.05 * program_cost(compiled)["flops"]


@pytest.mark.fast
def test_a_loop_of_data_dependent_length_is_counted_once_and_listed():
    """A ``while`` loop with no known trip count (the Reindex scan's overflow tiles) is counted once, as XLA counts
    it, and `data_dependent_loops` names it; a known-count loop beside it is counted per iteration."""
    from v41cp.sharding.hlo_stats import data_dependent_loops

    x = jnp.ones((32, 32), jnp.float32)

    def f(x, n):
        x = jax.lax.fori_loop(0, 4, lambda i, a: a @ x, x)
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] @ x), (0, x))[1]

    compiled = jax.jit(f).lower(x, jnp.int32(3)).compile()
    got = program_cost(compiled)["flops"]
    assert 5 * 2 * 32 ** 3 <= got <= 1.05 * 5 * 2 * 32 ** 3
    assert len(data_dependent_loops(compiled.as_text())) == 1


def test_model_sparse_equals_dense_backend():
    """The whole tiny model (FP32) with the sparse default and with the dense reference dispatch."""
    cfg = preset("tiny", dtype="float32", engram_token_map=TOKEN_MAP)
    params = model.init_params(cfg, jax.random.key(0))
    tokens = np.random.default_rng(2).integers(3, cfg.vocab_size, (2, 21))
    assert cfg.moe_backend == "sparse"
    got = model.forward(params, cfg, tokens)
    want = model.forward(params, cfg.replace(moe_backend="dense"), tokens)
    assert rel_err(got, want) <= 1e-5
