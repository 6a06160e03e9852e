"""The engine's offline benchmark (``v41cp bench decode|prefill``): random prompts per context length, the prefill
throughput and the decode step latency (p50 / p90 / p99) and tokens/s, the compile counts, and for decode the exact
KVP structure (per-rank cache bytes, collective bytes of the compiled step, resident capacity at a page budget),
with KVP 1 on the same mesh side by side.

* `bench_capacity` — the benchmark's compiled bucket;
* `bench_rows` — one row of timings per context length;
* `kvp_structure` — the exact accounting (no timings);
* `offline_bench` — the whole report.
"""

from __future__ import annotations

import time

import numpy as np

from v41cp.config import ModelConfig, preset
from v41cp.serving.attention.dcp import collective_plan
from v41cp.serving.cache.spec import CacheSpec
from v41cp.serving.engine import Capacity, Engine, SamplingParams
from v41cp.sharding.hlo_stats import collective_bytes, mesh_axis_groups

PREFILL_CHUNK = 64


def bench_capacity(lengths, batch: int, steps: int, page: int, **prefill_options) -> Capacity:
    """``batch`` rows, each fitting the longest length plus ``steps + 1`` tokens, in whole pages of ``page`` tokens
    (the model's: `ModelConfig.page_tokens`)."""
    max_tokens = -(-(max(lengths) + steps + 1) // page) * page
    return Capacity(max_batch=batch, max_tokens=max_tokens, block_tokens=page, prefill_chunk=PREFILL_CHUNK,
                    **prefill_options)


def bench_rows(eng, cfg: ModelConfig, lengths, batch: int, steps: int) -> list[dict]:
    """For each context length: ``batch`` random prompts of that length, one prefill round, then ``steps`` decode
    rounds (+1 emitted by the prefill round) timed one by one (the first may compile and is dropped)."""
    rng = np.random.default_rng(0)
    rows = []
    for n in lengths:
        for i in range(batch):
            eng.submit(f"{n}-{i}", rng.integers(3, cfg.vocab_size, n).tolist(),
                       SamplingParams(max_new_tokens=steps + 1, stop_on_eos=False))
        before = dict(eng.stats)
        eng.step()                                              # prefill round (+ first decode round)
        prefill_s = eng.stats["prefill_s"] - before["prefill_s"]
        lat, emitted = [], []
        while eng.pending:
            done = sum(len(r.output) for r in eng.requests.values())
            t0 = time.perf_counter()
            eng.step()
            lat.append(time.perf_counter() - t0)
            emitted.append(sum(len(r.output) for r in eng.requests.values()) - done)
        lat, emitted = np.asarray(lat[1:] or lat), np.asarray(emitted[1:] or emitted)   # the first round may compile
        # (PD across processes: the decode process prefills nothing, its prefill rate is the prefill process's)
        row = {"context": n, "batch": batch, "prefill_tokens_per_s": round(n * batch / prefill_s, 1) if prefill_s else None,
               "decode_step_ms_p50": round(float(np.percentile(lat, 50)) * 1e3, 3),
               "decode_step_ms_p90": round(float(np.percentile(lat, 90)) * 1e3, 3),
               "decode_step_ms_p99": round(float(np.percentile(lat, 99)) * 1e3, 3),
               "decode_tokens_per_s": round(batch / float(np.median(lat)), 1)}
        if eng.speculative is not None:         # several tokens per step: the rate of the tokens emitted
            row["decode_tokens_per_s"] = round(float(emitted.sum() / lat.sum()), 1)
            row["tokens_per_step"] = round(float(emitted.mean()), 3)
        rows.append(row)
    return rows


def kvp_structure(eng, cfg: ModelConfig, cap: Capacity, budget_bytes: int) -> dict:
    """Per-rank cache bytes, collective bytes of the compiled step and the context capacity at a fixed
    per-device page budget (exact accounting, not timings). ``cp_group``: bytes of the step's collectives
    over the cp groups — the DCP payload (``cp_group_analytic``) plus any layout collective GSPMD happens to
    run over cp (e.g. when ``o_groups`` does not divide attention TP)."""
    n = eng.plan.n if eng.plan else 1
    spec = CacheSpec(cfg, cap.block_tokens, quantized=cfg.fake_quant)
    pages_per_device = budget_bytes // spec.block_bytes
    text = eng.compiled_decode_text()
    coll = {"total": collective_bytes(text)}
    if eng.plan:
        if eng.mesh.shape["tp"] > 1:
            coll["cp_group"] = collective_bytes(text, mesh_axis_groups(eng.mesh, "cp"))
        else:   # KVP = attention TP = all devices: the cp groups are the TP groups too, not separable
            coll["cp_group"] = None
        coll["cp_group_analytic"] = collective_plan(cfg, eng.plan, cap.max_batch, cap.max_blocks, cap.block_tokens)
    flash = CacheSpec(preset("v41-flash"), 256)
    return {
        "kv_parallel_size": n,
        "per_rank_cache_bytes": eng.cache_bytes_per_device(),
        "collective_bytes_per_step": coll,
        "context_capacity": {"bucket_tokens_per_request": cap.max_tokens,
                             "cache_budget_bytes_per_device": budget_bytes,
                             "block_bytes": spec.block_bytes, "pages_per_device_at_budget": pages_per_device},
        "max_resident_tokens": pages_per_device * n * cap.block_tokens,
        "v41_flash_max_resident_tokens_at_budget": budget_bytes // flash.block_bytes * n * flash.block_tokens,
    }


def offline_bench(eng, cfg: ModelConfig, cap: Capacity, kind: str, lengths, *, batch: int, steps: int,
                  cache_budget_bytes: int, topology: dict, kvp1_parallel=None) -> dict:
    """The report of ``kind`` (``decode`` | ``prefill``; prefill rows drop the decode timings) for ``eng`` built on
    ``cap`` (`bench_capacity`); ``topology`` is reported as given. Decode adds `kvp_structure` and, with
    ``kvp1_parallel`` (the same mesh at KVP 1), a KVP 1 engine's rows and structure and the step-time ratios."""
    rows = bench_rows(eng, cfg, lengths, batch, steps)
    out = {"bench": kind, "capacity": {"max_batch": cap.max_batch, "max_tokens": cap.max_tokens,
                                       "block_tokens": cap.block_tokens},
           "topology": topology, "rows": rows, "compiles": eng.compile_counts()}
    if eng.speculative is not None:
        out["speculative"] = eng.speculative_stats()
    if eng.prefix is not None:
        out["prefix_cache"] = eng.prefix_stats()
    if hasattr(eng, "transfer_stats"):          # PD: the requests' pages moved from the prefill role to the decode role
        out["transfers"] = eng.transfer_stats()
    if kind == "prefill":
        for r in out["rows"]:
            for k in [k for k in r if k.startswith("decode")]:
                r.pop(k)
        return out
    if not isinstance(eng, Engine):             # PD: two roles, each its own layout (`transfers` above)
        return out
    out.update(kvp_structure(eng, cfg, cap, cache_budget_bytes))
    if kvp1_parallel is not None:               # KVP = 1 on the same mesh, side by side, for the step-time ratio
        base = Engine(eng.params, cfg, cap, parallel=kvp1_parallel)
        base_rows = bench_rows(base, cfg, lengths, batch, steps)
        base_struct = kvp_structure(base, cfg, cap, cache_budget_bytes)
        out["kvp1"] = {"rows": base_rows, "per_rank_cache_bytes": base_struct["per_rank_cache_bytes"],
                       "collective_bytes_per_step": base_struct["collective_bytes_per_step"],
                       "max_resident_tokens": base_struct["max_resident_tokens"]}
        out["step_time_vs_kvp1"] = [round(r["decode_step_ms_p50"] / b["decode_step_ms_p50"], 3)
                                    for r, b in zip(rows, base_rows)]
    return out
