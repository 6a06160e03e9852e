"""DeepSeek-V4 on every topology (`tiny-v4`: SWA | HCA ratio 8 | CSA | CSA, pages of 8 tokens = one HCA entry, two
CSA entries): every sharded path equals the one-device path on the same inputs.

* KVP: each CSA / HCA layer's entries (and CSA's index keys) on their page's owner; the compressor rings, like the
  window rings, replicated;
* DCP decode: CSA's exact distributed top-k over each rank's owned index keys (`dcp.select`, the same as V4.1's),
  HCA's partial attention over every visible entry each rank owns (`dcp.attend_visible`), merged by LSE with the
  window counted on one rank and the sink once; plain TP splits only the CSA selection's scoring;
* model-wide QCP: each rank's rows pool their compression windows from the gathered span (a window straddling a
  rank boundary is pooled from complete rows), continuing passes from the compressor rings; operator-local QCP of
  the indexer and attention;
* ranks that own nothing: a 5-token request has no HCA entry and one CSA entry, and under KVP = 8 most ranks own
  none of any request's pages early on;
* the distributed C4 top-k equals the replicated selection, exact ties included (`lax.top_k` order: the lower
  logical id first).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import decode_teacher_forcing, full_forward_rows, greedy_reference, greedy_rounds, perturbed, rel_err
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from v41cp import model
from v41cp.config import preset
from v41cp.layers.indexer import select_scored
from v41cp.serving.attention import dcp
from v41cp.serving.cache import paged as pc
from v41cp.serving.engine import Capacity, Engine
from v41cp.sharding.mesh import CP
from v41cp.sharding.topology import ParallelConfig

BLOCK = 8                                        # the ratios' LCM: one HCA entry, two CSA entries per page
# id → (tokens, joining step): every window (8) / ratio-4 / ratio-8 / page boundary crossed; "s" shorter than one
# HCA entry and joining late (its pages land on ranks that own nothing of the others)
SEQ_LEN = {"a": (41, 0), "b": (23, 9), "s": (5, 30)}

TOPOLOGIES = {
    "tp2": ParallelConfig(tp_size=2),                                           # plain TP: split selection
    "kvp2-heads": ParallelConfig(tp_size=2, kv_parallel_size=2, decode_context_parallel_size=2),
    "kvp8-heads": ParallelConfig(tp_size=8, kv_parallel_size=8, decode_context_parallel_size=8),
    "kvp2-heads-replicate": ParallelConfig(tp_size=2, kv_parallel_size=2, decode_context_parallel_size=2,
                                           dcp_q="replicate"),
    "kvp4-ag_rs-replicate": ParallelConfig(tp_size=4, kv_parallel_size=4, decode_context_parallel_size=4,
                                           dcp_merge="ag_rs", dcp_q="replicate"),
    "dp2-kvp2-a2a": ParallelConfig(tp_size=4, dp_size=2, kv_parallel_size=2, decode_context_parallel_size=2,
                                   dcp_merge="a2a"),
}
PREFILL_TOPOLOGIES = {
    "qcp2": ParallelConfig(tp_size=2, query_context_parallel_size=2),
    "qcp8-kvp8": ParallelConfig(tp_size=8, query_context_parallel_size=8, kv_parallel_size=8,
                                decode_context_parallel_size=8),
    "operator-qcp2": ParallelConfig(tp_size=2, indexer_query_parallel_size=2, attention_query_parallel_size=2,
                                    indexer_query_min_tokens=1, attention_query_min_tokens=1,
                                    attention_query_swa_min_tokens=1),
}


@pytest.fixture(scope="module")
def v4():
    cfg = preset("tiny-v4")
    return cfg, perturbed(model.init_params(cfg, jax.random.key(0)))


@pytest.fixture(scope="module")
def single_device(v4):
    """The sequences and their one-device teacher-forced decode logits."""
    cfg, params = v4
    rng = np.random.default_rng(7)
    seqs = {rid: rng.integers(3, cfg.vocab_size, n) for rid, (n, _) in SEQ_LEN.items()}
    start = {rid: s for rid, (_, s) in SEQ_LEN.items()}
    return seqs, start, decode_teacher_forcing(cfg, params, seqs, start, BLOCK, 4, 8, 32, 45)


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_sharded_decode_equals_one_device(v4, single_device, name):
    """Teacher forcing through the sharded decode step (one compile) equals the one-device step on every row, and
    both the full forward."""
    cfg, params = v4
    seqs, start, want = single_device
    got = decode_teacher_forcing(cfg, params, seqs, start, BLOCK, 4, 8, 32, 45, parallel=TOPOLOGIES[name])
    for rid, seq in seqs.items():
        full = full_forward_rows(params, cfg, seq, 64)                       # the greedy fixture's program
        err, err_full = rel_err(got[rid], want[rid]), rel_err(got[rid], full)
        print(f"\n[v4 {name}] {rid} ({len(seq)} tokens): vs one device {err:.2e}, vs full forward {err_full:.2e}")
        assert err <= 1e-5 and err_full <= 1e-5


@pytest.mark.fast
@pytest.mark.parametrize("ties", ["none", "heavy"])
@pytest.mark.parametrize("n", [2, 8])
def test_distributed_c4_topk_equals_replicated(v4, n, ties):
    """A CSA layer's selection over KVP-split index keys (each rank its own pages, the exact distributed top-k) equals
    `select_scored` over the gathered keys: ids and order, exact ties included (integer-valued keys and queries make
    most scores equal), for rows at every position of a 64-token history (16 entries over 8 pages, so under KVP = 8
    a short row's later pages are owned by ranks with nothing visible)."""
    cfg, _ = v4
    cfg = cfg.replace(index_topk=6)
    role = next(r for r in cfg.layer_roles if r.is_index_source)
    epb, mb, b, hi, di = BLOCK // role.ratio, 8, 4, cfg.index_n_heads, cfg.index_head_dim
    rng = np.random.default_rng(n)
    draw = (lambda *s: rng.integers(0, 2, s).astype(np.float32)) if ties == "heavy" else (
        lambda *s: rng.normal(size=s).astype(np.float32))
    num_blocks = b * mb
    by_virtual = draw(num_blocks, epb, di)                              # the pool indexed by virtual block id
    lb = num_blocks // n                 # rank r holds virtual blocks l·n + r at its rows r·lb + l
    # page-cyclic tables as the allocator builds them: position i's page has residue (first + i) mod n, local rows
    # drawn without repeats per residue
    free = [list(rng.permutation(lb)) for _ in range(n)]
    tables = np.zeros((b, mb), np.int32)
    for row in range(b):
        first = int(rng.integers(n))
        for i in range(mb):
            r = (first + i) % n
            tables[row, i] = free[r].pop() * n + r
    tables[1, 5:] = -1                                                  # a shorter table
    positions = np.array([63, 37, 3, 20], np.int32)
    q, weights = draw(b, hi, di), np.abs(draw(b, hi)) + (ties == "heavy")
    mesh = ParallelConfig(tp_size=n, kv_parallel_size=n, decode_context_parallel_size=n).make_mesh()
    plan = dcp.DCPPlan(mesh)
    layout = by_virtual[np.arange(lb)[None, :] * n + np.arange(n)[:, None]].reshape(num_blocks, epb, di)
    pool = jax.device_put(layout, NamedSharding(mesh, P(CP)))
    read = lambda a, f: pc.read(a, "mxfp4", jnp.float32, f)
    got, _ = jax.jit(lambda pool, q, w, t, p: dcp.select(plan, cfg, role, read, pool, q, w, t, p, None))(
        pool, q, weights, tables, positions)
    keys = pc.gather_pages(jnp.asarray(by_virtual), jnp.asarray(tables))
    want, _, scores = select_scored(cfg, role, q[:, None], weights[:, None], keys, positions[:, None], None)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want)[:, 0])
    if ties == "heavy":                  # ties at the boundary do occur
        s = -np.sort(-np.asarray(scores)[:, 0], axis=-1)
        assert (s[:, cfg.index_topk - 1] == s[:, cfg.index_topk]).any()


@pytest.fixture(scope="module")
def greedy(v4):
    """Prompts (two, then one extending the second past its stored state at 40 tokens, one of 5 tokens) and the full
    forward's greedy continuations with their logits."""
    cfg, params = v4
    rng = np.random.default_rng(1)
    prompts = {"r0": rng.integers(3, cfg.vocab_size, 30).tolist(), "r2": rng.integers(3, cfg.vocab_size, 41).tolist()}
    prompts["hit"] = prompts["r2"] + rng.integers(3, cfg.vocab_size, 4).tolist()
    prompts["short"] = rng.integers(3, cfg.vocab_size, 5).tolist()
    return (prompts,) + greedy_reference(cfg, params, prompts, NEW, 64)


NEW = 4


@pytest.mark.parametrize("name,prefill", [("kvp8-heads", "span"), ("tp2", "span"), ("kvp2-heads", "token-serial"),
                                          ("qcp2", "span-16-row-passes"), ("qcp8-kvp8", "span"),
                                          ("operator-qcp2", "span")])
def test_sharded_engine_greedy_equals_full_forward(v4, greedy, name, prefill):
    """The engine under a topology (span prefill passes — one, or passes of 16 rows continuing from the rings — or
    the token-serial prefill; prefix caching on: "hit" reuses the pages and state "r2" stored) gives the full
    forward's greedy tokens, each output token's logits within 1e-5."""
    cfg, params = v4
    prompts, want, want_logits = greedy
    cap = Capacity(prefill_bucket_count=1,
                   max_batch=2, max_tokens=64, block_tokens=BLOCK, span_prefill=prefill != "token-serial",
                   prefill_tokens=16 if prefill == "span-16-row-passes" else None)
    eng = Engine(params, cfg, cap, parallel={**TOPOLOGIES, **PREFILL_TOPOLOGIES}[name], record_logits=True)
    got, logits = greedy_rounds(eng, prompts, (("r0", "r2"), ("hit", "short")), NEW)
    assert got == want
    for rid in prompts:
        assert rel_err(logits[rid], want_logits[rid]) <= 1e-5, rid
    assert eng.result("hit")["cached_tokens"] == 40
    eng.check()


@pytest.mark.parametrize("merge", ["heads", "ag_rs"])
def test_compiled_step_structure(v4, merge):
    """KVP = 2 inside TP = 4: the V4 decode step's collective bytes are identical for history capacities 8 and 64
    blocks (no history is gathered: HCA's partials are merged, not its records moved, in the ``heads`` mode too);
    the DCP islands' bytes over the cp groups equal `collective_plan` (CSA: query gather or records, top-k
    candidates, merge; HCA: query gather and merge); each device holds exactly half of every CSA / HCA pool."""
    from v41cp.serving.runner.steps import decode_step, init_cache
    from v41cp.serving.step_batch import StepBatch
    from v41cp.sharding.hlo_stats import collective_bytes, mesh_axis_groups

    cfg, params = v4
    par = ParallelConfig(tp_size=4, kv_parallel_size=2, decode_context_parallel_size=2, dcp_merge=merge)
    mesh = par.make_mesh()
    plan = dcp.DCPPlan.build(cfg, par, mesh)
    sharded = model.shard_params(params, cfg, mesh, par.rules())
    b, totals = 4, []
    for mb in (8, 64):
        cache = init_cache(cfg, b * mb, BLOCK, b, plan=plan)
        text = decode_step.lower(sharded, cache, StepBatch.idle(cfg, b, mb), cfg, plan).compile().as_text()
        totals.append(collective_bytes(text))
        want = dcp.collective_plan(cfg, plan, b, mb, BLOCK)
        assert collective_bytes(text, mesh_axis_groups(mesh, "cp"), within="shard_map") == want["total"], want
        for group in ("ckv", "ikey"):
            for leaf in jax.tree.leaves(cache.pool(group)):
                shard = leaf.addressable_shards[0].data
                assert shard.shape[0] == b * mb // 2 and shard.nbytes * 2 == leaf.nbytes
    print(f"\n[v4 dcp structure] {merge}: step collective bytes {totals} (8 vs 64 blocks); cp-group bytes {want}")
    assert totals[0] == totals[1]
