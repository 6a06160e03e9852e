"""KVP/DCP building blocks: topology validation, ownership math, residue-class allocation, LSE merge."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from v41cp.config import preset
from v41cp.serving.cache.allocator import AllocationError, BlockAllocator
from v41cp.sharding import make_mesh
from v41cp.sharding.lse_merge import apply_sink, merge_a2a, merge_ag_rs, merge_partials, partial_attention
from v41cp.sharding.ownership import is_owned, local_row, owned_positions, owner, pages_owned
from v41cp.sharding.topology import ParallelConfig

pytestmark = pytest.mark.fast           # the developer tier (`pytest -m fast`)


@pytest.mark.parametrize("kwargs,match", [
    (dict(tp_size=8, kv_parallel_size=3, decode_context_parallel_size=3), "kv_parallel_size=3 does not divide"),
    (dict(tp_size=4, dp_size=2, kv_parallel_size=8, decode_context_parallel_size=8), "cross data-parallel"),
    (dict(tp_size=8, kv_parallel_size=4, decode_context_parallel_size=2), "decode_context_parallel_size=2 must equal"),
    (dict(tp_size=8, kv_parallel_size=4), "decode_context_parallel_size=1 must equal"),
    (dict(tp_size=8, query_context_parallel_size=4), "query_context_parallel_size=4 must be 1 or"),
    (dict(tp_size=8, query_context_parallel_size=8, kv_parallel_size=4, decode_context_parallel_size=4),
     "kv_parallel_size=4 must be 1"),
    (dict(tp_size=8, indexer_query_parallel_size=4), "indexer_query_parallel_size=4 must be 1 or"),
    (dict(tp_size=8, attention_query_parallel_size=2), "attention_query_parallel_size=2 must be 1 or"),
    (dict(tp_size=8, query_context_parallel_size=8, indexer_query_parallel_size=8),
     "indexer_query_parallel_size=8 cannot be combined with model-wide query_context_parallel_size=8"),
    (dict(tp_size=8, query_context_parallel_size=8, attention_query_parallel_size=8),
     "attention_query_parallel_size=8 cannot be combined"),
    (dict(tp_size=8, attention_query_min_tokens=0), "attention_query_min_tokens must be a positive integer"),
    (dict(tp_size=0), "tp_size must be a positive integer"),
    (dict(tp_size=8, kv_parallel_size=2.0), "kv_parallel_size must be a positive integer"),
    (dict(tp_size=8, dcp_merge="ring"), "dcp_merge='ring'"),
    (dict(tp_size=8, dcp_q="local"), "dcp_q='local'"),
])
def test_topology_errors_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)


def test_cli_merge_choices_are_the_topology_merges():
    """The CLI's `--dcp-merge` / `--dcp-q` (the topology flag group) offer exactly the topology's merges and modes."""
    import argparse

    from v41cp.cli import flags
    from v41cp.sharding.topology import DCP_MERGES, DCP_Q_MODES

    p = argparse.ArgumentParser()
    flags.add(p, flags.TopologyFlags)
    choices = {a.dest: tuple(a.choices) for a in p._actions if a.dest in ("dcp_merge", "dcp_q")}
    assert choices == {"dcp_merge": DCP_MERGES, "dcp_q": DCP_Q_MODES}


def test_topology_model_and_device_errors():
    for merge in ("a2a", "heads"):
        par = ParallelConfig(tp_size=8, kv_parallel_size=8, decode_context_parallel_size=8, dcp_merge=merge)
        with pytest.raises(ValueError, match=f"the {merge} DCP merge .* num_attention_heads=4 does not divide by "
                                             "tp_size=8"):
            par.validate_model(preset("tiny"))
        par.validate_model(preset("tiny-tp8"))
    # the default merge, auto, resolves per model: heads where the query heads split over attention TP, else ag_rs
    auto = ParallelConfig(tp_size=8, kv_parallel_size=8, decode_context_parallel_size=8)
    assert auto.dcp_merge == "auto"
    auto.validate_model(preset("tiny"))
    assert (auto.dcp_merge_for(preset("tiny")), auto.dcp_merge_for(preset("tiny-tp8"))) == ("ag_rs", "heads")
    assert ParallelConfig(tp_size=8, kv_parallel_size=8, decode_context_parallel_size=8,
                          dcp_merge="a2a").dcp_merge_for(preset("tiny-tp8")) == "a2a"
    with pytest.raises(ValueError, match="16 devices, but 8"):
        ParallelConfig(tp_size=16).make_mesh()
    mesh = ParallelConfig(tp_size=8, kv_parallel_size=4, decode_context_parallel_size=4).make_mesh()
    assert dict(mesh.shape) == {"dp": 1, "tp": 2, "cp": 4}
    # the cp group is an aligned run of consecutive attention-TP ranks: cp_rank == attn_tp_rank % cp
    ids = np.vectorize(lambda d: d.id)(mesh.devices)[0]
    assert (ids % 4 == np.arange(4)[None]).all()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_ownership_partitions_pages_and_entries(n):
    """Brute force: each virtual block has one owner and a distinct local row; a request's pages are split
    ⌈P/n⌉ / ⌊P/n⌋; owned table positions are exactly those whose block the rank owns; −1 is owned by nobody."""
    nb = 8 * n
    v = np.arange(nb)
    assert (owner(v, n) == v % n).all() and (owner(np.array(-1), n) == -1)
    for r in range(n):
        rows = local_row(v[owner(v, n) == r], n)
        assert sorted(rows) == list(range(nb // n))
        assert not is_owned(np.array(-1), n, r)
    for pages in range(0, 3 * n + 2):
        for s in range(n):
            table = np.array([(i + s) % n + n * i for i in range(pages)] + [-1] * 3)
            counts = [pages_owned(pages, s, r, n) for r in range(n)]
            assert sum(counts) == pages and max(counts) - min(counts) <= 1
            assert max(counts) == -(-pages // n)
            for r in range(n):
                pos = owned_positions(np.array([table[0] if pages else -1]), r, n, len(table))[0]
                pos = [int(p) for p in pos if p < len(table) and table[p] >= 0]
                want = [i for i in range(len(table)) if is_owned(table[i], n, r)]
                if pages:
                    assert pos == want


def test_allocator_residue_classes_and_clear_errors():
    n = 4
    a = BlockAllocator(16, 4, 4, 8, kv_parallel_size=n)
    a.admit("x", 4 * 5)                        # 5 pages → ranks hold 2,1,1,1
    a.admit("y", 4 * 3)
    a.check()
    for rid in ("x", "y"):
        blocks = a.blocks(rid)
        per_rank = np.bincount(np.asarray(blocks) % n, minlength=n)
        assert per_rank.max() == -(-len(blocks) // n)
    # residue balance: y started on the rank with most free pages, not on x's first rank
    assert a.blocks("y")[0] % n != a.blocks("x")[0] % n
    b = BlockAllocator(8, 4, 8, 8, kv_parallel_size=n)
    for rid in "xywv":
        b.admit(rid, 2 * 4)                    # 2 pages each: residues (0,1), (2,3), (0,1), (2,3)
    b.release("x")
    b.release("w")                             # free pages per rank: (2, 2, 0, 0)
    assert b.free_blocks == 4 and not b.can_admit(3 * 4)
    with pytest.raises(AllocationError, match=r"per rank: \[2, 2, 0, 0\]"):
        b.admit("z", 3 * 4)                    # 3 consecutive residues cannot avoid an empty rank
    b.check()
    with pytest.raises(ValueError, match="num_blocks=10 must be a multiple of kv_parallel_size=4"):
        BlockAllocator(10, 4, 4, 8, kv_parallel_size=4)


def _dense(q, k, valid):
    o, lse = partial_attention(q, k, valid)
    return np.asarray(o), np.asarray(lse)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("backend", ["ag_rs", "a2a", "ag_ar"])
def test_merge_over_a_cp_mesh_equals_dense_attention(n, backend):
    """Keys split r::n over the ranks (ranks 1 and n−1 own nothing of row 0), partials merged by the backend
    (a2a / ag_rs scatter heads, ag_ar all-reduces) == one softmax over all keys, sink applied once."""
    rng = np.random.default_rng(n)
    b, h, d, L = 3, 8, 16, 24
    q = rng.normal(size=(b, h, d)).astype(np.float32)
    # skewed keys: the merge weights are far from uniform, so the LSE is load-bearing
    k = (rng.normal(size=(b, L, d)) + np.where(np.arange(L) % 2, 1.5, -1.5)[None, :, None]).astype(np.float32)
    valid = rng.random((b, L)) < 0.8
    valid[0] = np.arange(L) % n == 0                  # row 0: only rank 0 has keys
    sink = rng.normal(size=h).astype(np.float32)
    want_o, want_lse = _dense(q, k, valid)
    want = np.asarray(apply_sink(jnp.asarray(want_o), jnp.asarray(want_lse), jnp.asarray(sink)))
    mesh = make_mesh(tp=n, devices=jax.devices()[:n], cp=n)
    kr = np.stack([k[:, r::n] for r in range(n)])
    vr = np.stack([valid[:, r::n] for r in range(n)])

    def body(q, k, v, sink):
        o, lse = partial_attention(q, k[0], v[0])
        if backend == "a2a":
            o, lse = merge_a2a(o, lse, "cp", n)
        else:
            o, lse = merge_ag_rs(o, lse, "cp", scatter=backend == "ag_rs")
        return apply_sink(o, lse, sink), lse

    head = P(None, "cp") if backend != "ag_ar" else P()
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("cp"), P("cp"), P(*head[1:2])),
                              out_specs=(head, head)))
    got, lse = f(q, kr, vr, sink)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-6)


def test_merge_edge_cases():
    """Empty ranks (lse −inf, o NaN) contribute exactly 0; NaN / +inf peer LSE is treated as −inf; all
    empty → output 0 and LSE −inf; the sink on an empty merge gives 0, never NaN."""
    rng = np.random.default_rng(0)
    o = rng.normal(size=(4, 2, 3, 5)).astype(np.float32)
    lse = rng.normal(size=(4, 2, 3)).astype(np.float32)
    two, two_lse = merge_partials(jnp.asarray(o[:2]), jnp.asarray(lse[:2]))
    o_bad, lse_bad = o.copy(), lse.copy()
    o_bad[2:] = np.nan
    lse_bad[2], lse_bad[3] = -np.inf, np.nan
    got, got_lse = merge_partials(jnp.asarray(o_bad), jnp.asarray(lse_bad))
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(two), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got_lse), np.asarray(two_lse), rtol=1e-6)
    lse_bad[3] = np.inf
    got, _ = merge_partials(jnp.asarray(o_bad), jnp.asarray(lse_bad))
    np.testing.assert_allclose(np.asarray(got), np.asarray(two), rtol=1e-6)
    empty, empty_lse = merge_partials(jnp.full_like(o, np.nan), jnp.full_like(lse, -np.inf))
    assert (np.asarray(empty) == 0).all() and (np.asarray(empty_lse) == -np.inf).all()
    sunk = apply_sink(empty, empty_lse, jnp.zeros(3))
    assert (np.asarray(sunk) == 0).all()


@pytest.mark.parametrize("n", [2, 8])
def test_gather_history_copies_packed_pages_from_owners(n):
    """A request's pages come back in table order, byte for byte, from a cp-split pool (ranks that own none
    of its pages included); padding positions are zeros."""
    from v41cp.serving.attention.dcp import DCPPlan, gather_history
    from v41cp.serving.cache.device_cache import pool_sharding

    mesh = make_mesh(tp=8, cp=n)
    plan = DCPPlan(mesh)
    nb, epb = 4 * n, 2
    a = BlockAllocator(nb, 4, 2, 5, kv_parallel_size=n)
    a.admit("other", 4)
    a.admit("req", 4 * 3)                      # 3 pages: with n = 8, five ranks own none of them
    rng = np.random.default_rng(n)
    # rows of rank r's pool hold virtual blocks l·n + r: build the global array in that order
    virt = rng.integers(0, 256, (nb, epb, 6), dtype=np.uint8)
    lb = nb // n
    glob = np.stack([virt[l * n + r] for r in range(n) for l in range(lb)])
    pool = {"q": jax.device_put(glob, pool_sharding(mesh)), "s": jax.device_put(glob[..., :2], pool_sharding(mesh))}
    table = np.full(5, -1, np.int32)
    table[:3] = a.blocks("req")
    got = gather_history(plan, pool, jnp.asarray(table))
    want = np.zeros((5, epb, 6), np.uint8)
    want[:3] = virt[table[:3]]
    np.testing.assert_array_equal(np.asarray(got["q"]), want)
    np.testing.assert_array_equal(np.asarray(got["s"]), want[..., :2])


def test_hlo_collective_accounting():
    """Result bytes per op (async starts: results only, u32 contexts dropped; multi-output all-reduce: all)
    and device groups in the explicit, iota and empty (= all devices) formats."""
    from v41cp.sharding.hlo_stats import ALL_DEVICES, collective_bytes, collectives, mesh_axis_groups

    text = """  %a = (f32[4,8]{1,0}, f32[16]{0}) all-reduce-start(%x, %y), replica_groups={{0,1},{2,3}}, to_apply=%add
  %b = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%z), source_target_pairs={{0,1}}
  %c = (f32[2,4]{1,0}, f32[8,4]{1,0}) all-gather-start(%w), replica_groups={}, dimensions={0}
  %d = f32[8,4]{1,0} all-gather(%w), replica_groups=[2,4]<=[8], dimensions={0}
  %e = bf16[2]{0} all-reduce(%q), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add"""
    got = collectives(text)
    assert [c["bytes"] for c in got] == [192, 32, 128, 128, 4]
    assert got[2]["groups"] == ALL_DEVICES
    assert got[4]["groups"] == frozenset(frozenset(g) for g in ({0, 4}, {1, 5}, {2, 6}, {3, 7}))
    mesh = make_mesh(tp=8, cp=4)                      # (dp 1, tp 2, cp 4): cp groups {0..3}, {4..7}
    assert collective_bytes(text, mesh_axis_groups(mesh, "cp")) == 128
    assert collective_bytes(text) == 192 + 32 + 128 + 128 + 4
