"""``python -m v41cp plan``: the compile-only report is the program the engine runs (abstract weights and cache
compile to the same per-device program as real ones), with its memory figures and the analytic floor."""

import json

import jax
import numpy as np
import pytest

from v41cp import model
from v41cp.config import preset
from v41cp.plan import floor_flops
from v41cp.serving.attention.dcp import DCPPlan
from v41cp.serving.capacity import Capacity
from v41cp.serving.runner.grammar import no_masks
from v41cp.serving.runner.penalties import TokenCounts
from v41cp.serving.runner.sampling import SamplingRows
from v41cp.serving.runner.steps import decode_and_sample, init_cache
from v41cp.serving.step_batch import StepBatch
from v41cp.sharding.hlo_stats import collectives, program_cost
from v41cp.sharding.topology import ParallelConfig

BATCH, CONTEXT, BLOCK = 4, 64, 16


def _shard_bytes(tree) -> int:
    return sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(tree))


def test_plan_equals_the_compiled_engine_program(capsys):
    from v41cp.__main__ import main

    assert main(["plan", "--preset", "tiny-tp8", "--mode", "decode", "--batch", str(BATCH), "--context",
                 str(CONTEXT), "--block-tokens", str(BLOCK), "--devices", "8", "--kv-parallel-size", "8",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # the same step from real weights and a real cache, as the engine builds it (weights as the release stores
    # them — FP4 experts, FP8 Engram rows — plan's default for a preset)
    cfg = preset("tiny-tp8", keep_quantized=True)
    par = ParallelConfig(tp_size=8, kv_parallel_size=8, decode_context_parallel_size=8)
    mesh = par.make_mesh()
    plan = DCPPlan.build(cfg, par, mesh)
    params = model.shard_params(model.init_params(cfg, jax.random.key(0)), cfg, mesh, par.rules())
    max_blocks = CONTEXT // BLOCK
    num_blocks = 8 * BATCH * -(-max_blocks // 8)             # the engine's: each request's pages on whole ranks
    cache = init_cache(cfg, num_blocks, BLOCK, BATCH, plan=plan)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    meta = jax.device_put(StepBatch.idle(cfg, BATCH, max_blocks), rep)
    sampling = jax.device_put(SamplingRows.build([], [], BATCH, masks=no_masks(BATCH, cfg.vocab_size)), rep)
    counts = TokenCounts.zeros(BATCH, cfg.vocab_size, mesh)
    compiled = decode_and_sample.lower(params, cache, meta, sampling, counts, cfg, plan,
                                       Capacity().max_logprobs).compile()
    cost = program_cost(compiled)                            # loop bodies counted per iteration
    mem = compiled.memory_analysis()
    assert out["flops_per_device"] == cost["flops"] and out["bytes_accessed_per_device"] == cost["bytes accessed"]
    assert out["temp_bytes_per_device"] == mem.temp_size_in_bytes
    assert out["argument_bytes_per_device"] == mem.argument_size_in_bytes
    assert out["alias_bytes_per_device"] == mem.alias_size_in_bytes
    assert out["collective_bytes_per_device"] == sum(c["bytes"] for c in collectives(compiled.as_text())) > 0
    assert out["weight_bytes_per_device"] == _shard_bytes(params)
    assert out["cache_bytes_per_device"] == _shard_bytes(cache)
    assert out["memory_needed_bytes_per_device"] == (out["argument_bytes_per_device"] + out["temp_bytes_per_device"]
                                                     + out["output_bytes_per_device"] - out["alias_bytes_per_device"])
    assert out["fits"] and out["devices"] == 8
    floor = floor_flops(cfg, "decode", BATCH, CONTEXT)
    assert np.isclose(out["floor_flops_per_device"] * 8, floor["total"])
    assert out["flops_over_floor"] == out["flops_per_device"] / out["floor_flops_per_device"]


@pytest.mark.fast
def test_floor_counts_the_rows_and_entries_the_model_defines():
    """The floor by hand for the tiny config: per decode row at position c − 1 each layer attends min(W, c)
    window rows plus min(top-k, c / ratio) entries; prefill rows see only their causal prefix and the head meets
    only the sampled row."""
    cfg = preset("tiny-tp8")
    dec, pre = floor_flops(cfg, "decode", 1, 40), floor_flops(cfg, "prefill", 1, 40)
    att = 0
    for role in cfg.layer_roles:
        att += min(cfg.sliding_window, 40) + (min(cfg.index_topk, 40 // role.ratio) if role.ratio else 0)
    assert dec["attention"] == 4 * cfg.num_attention_heads * cfg.head_dim * att
    head = 2 * cfg.hidden_size * cfg.vocab_size
    # prefill: 40 rows of the same per-row parameters, but the head once
    assert np.isclose(pre["parameters"] - head, 40 * (dec["parameters"] - head))
    assert pre["attention"] < 40 * dec["attention"] and pre["indexer"] < 40 * dec["indexer"]


@pytest.mark.fast
def test_floor_equals_an_independent_count_at_the_released_size():
    """The attention + indexer floor of one V4.1-Flash decode row at 1M tokens against the per-layer FLOPs of an
    independent analytical model of the released attention (the project's performance-limits study, written from
    the release's config and FlashMLA's absorbed-MLA form: 131,072 FLOPs per attended entry, 8,192 per scored
    index key), printed there in GFLOP to two decimals: SWA-only 0.02, C2 KV + index source 4.38, C2 reuse 0.08,
    C1 candidate source 8.67, C1 index source inside the candidates 0.22, C1 reuse 0.08."""
    cfg = preset("v41-flash")
    kinds = {"swa": 0.02, "c2_source": 4.38, "c2_reuse": 0.08, "c1_candidate_source": 8.67,
             "c1_in_candidates": 0.22, "c1_reuse": 0.08}
    count = {k: 0 for k in kinds}
    for role in cfg.layer_roles:
        if role.ratio == 0:
            count["swa"] += 1
        elif not role.is_index_source:
            count[f"c{role.ratio}_reuse"] += 1
        elif role.ratio == 2:
            count["c2_source"] += 1
        else:
            count["c1_in_candidates" if role.uses_candidates else "c1_candidate_source"] += 1
    assert count == {"swa": 2, "c2_source": 3, "c2_reuse": 15, "c1_candidate_source": 1, "c1_in_candidates": 4,
                     "c1_reuse": 15}
    want = sum(kinds[k] * n for k, n in count.items()) * 1e9
    floor = floor_flops(cfg, "decode", 1, 1 << 20)
    got = floor["attention"] + floor["indexer"]
    assert abs(got - want) <= 0.005e9 * sum(count.values())          # the study's rounding, per layer
    # a batch multiplies every term (each sequence has its own cache)
    assert np.isclose(sum(floor_flops(cfg, "decode", 64, 1 << 20)[k] for k in ("attention", "indexer")), 64 * got)


def test_v4_floor_equals_an_independent_count_at_the_released_size():
    """The attention + indexer floor of one DeepSeek-V4-Flash / V4-Pro decode row at 1M tokens, counted by layer kind
    from seed 001's table ("CSA indexer: scan all L/4 compressed index keys, then select top-k; CSA main: read the
    selected entries plus the local 128; HCA main: read all L/128 entries plus the local 128; local-only: the local
    128") at the absorbed-MQA cost (4 · heads · head_dim per attended entry, 2 · index heads · index_head_dim per
    scored key)."""
    tokens = 1 << 20
    for name, layers in (("v4-flash", {"swa": 2, "csa": 21, "hca": 20}), ("v4-pro", {"swa": 0, "csa": 30, "hca": 31})):
        cfg = preset(name)
        kinds = {"swa": 0, "csa": 0, "hca": 0}
        for role in cfg.layer_roles:
            kinds[role.kind] += 1
        assert kinds == layers, name
        per_entry, per_key = 4 * cfg.num_attention_heads * cfg.head_dim, 2 * cfg.index_n_heads * cfg.index_head_dim
        want = (layers["swa"] * 128 * per_entry
                + layers["csa"] * ((128 + cfg.index_topk) * per_entry + tokens // 4 * per_key)
                + layers["hca"] * (128 + tokens // 128) * per_entry)
        floor = floor_flops(cfg, "decode", 1, tokens)
        assert floor["attention"] + floor["indexer"] == want, name
        assert floor["indexer"] == layers["csa"] * tokens // 4 * per_key, name


def test_qcp_prefill_temporaries_grow_linearly_in_prompt_length():
    """Model-wide QCP = KVP = 8 span prefill at reduced width (tiny-tp8, 64 KiB selection / attention tiles):
    doubling the prompt at most 2.2×'s the compiled temporaries per device — no intermediate grows as rows ×
    history (the rows' scores and key copies are tiled, `v41cp.layers.tiled_select`)."""
    from v41cp.plan import plan_program

    cfg = preset("tiny-tp8")
    par = ParallelConfig(tp_size=8, query_context_parallel_size=8, kv_parallel_size=8,
                         decode_context_parallel_size=8)
    # compiled without the persistent compilation cache: nothing else uses these programs, and in a full xdist run
    # (2026-12-02) the cache write of one of them aborted the worker inside jax's compilation_cache.put_executable
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        temps = {n: plan_program(cfg, "prefill", 1, n, par, tile_bytes=64 << 10)["temp_bytes_per_device"]
                 for n in (1024, 2048)}
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
    print(f"\n[prefill temporaries] QCP = KVP = 8, 1024 → 2048 tokens: {temps[1024]:,} → {temps[2048]:,} B "
          f"({temps[2048] / temps[1024]:.3f}×)")
    assert temps[2048] <= 2.2 * temps[1024]
