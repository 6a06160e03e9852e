"""Compile-only plans of the serving programs (``python -m v41cp plan``): a step of a config and topology,
compiled — never run — with abstract weights and an abstract cache on the visible devices (on a CPU host:
simulated ones), measured from XLA's own cost and memory analysis of the per-device program.

`plan_program(cfg, mode, batch, context, parallel, ...)` → the report (a dict):

* ``mode="decode"``: the engine's decode step (`v41cp.serving.runner.steps.decode_and_sample`: the model and the
  sampling of each row) of ``batch`` rows whose requests each hold ``context`` tokens of history capacity (the cache: ``batch · ⌈context / block_tokens⌉`` pages, split over the
  KVP group; DCP under KVP);
* ``mode="prefill"``: one `v41cp.serving.runner.span_prefill` pass of ``batch`` prompts of ``context`` tokens in the
  topology's layout (model-wide QCP, KVP, operator-local QCP, CED).

Per device, from the compiled program: ``flops``, ``bytes_accessed`` (XLA's cost analysis, each ``while`` loop
counted once per iteration: `v41cp.sharding.hlo_stats.program_cost`), ``argument`` / ``output`` / ``alias`` /
``temp`` bytes, the bytes of its collectives (`v41cp.sharding.hlo_stats`); the weights' and the cache's
bytes; the analytic floor (`floor_flops`) and the ratio; whether weights + cache + temporaries (+ outputs that
are not aliased) fit the device memory; the dot FLOPs by source operation (loop-aware; where the FLOPs go).

With ``target="h100" | "h200"`` the program is compiled for that GPU on this host without one (`v41cp.targets`), and
the report adds what the GPU executes: its kernels and their launches per step (loop trips counted), the loops and
conditionals the host drives, collectives, each Pallas kernel's grid / shared memory / registers / spills, and a
roofline prediction of the step's time (`v41cp.targets.roofline`; docs/gpu-plan.md).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil

import flax.linen as nn
import jax
import numpy as np

from v41cp.ced import ced_boundary, ced_rows
from v41cp.config import ModelConfig
from v41cp.model import abstract_params
from v41cp.serving.attention.dcp import DCPPlan
from v41cp.serving.cache.device_cache import cache_layout
from v41cp.serving.capacity import Capacity
from v41cp.serving.runner.grammar import mask_words
from v41cp.serving.runner.penalties import TokenCounts
from v41cp.serving.runner.sampling import SamplingRows
from v41cp.serving.runner.span_batch import build_span_batch
from v41cp.serving.runner.span_prefill import SpanLayout, lower_prefill_span
from v41cp.serving.runner.steps import decode_and_sample
from v41cp.serving.step_batch import StepBatch
from v41cp.sharding.hlo_stats import collectives, data_dependent_loops, dot_flops_by_op, flops_by_op, program_cost
from v41cp.sharding.rules import param_shardings
from v41cp.targets import compile_devices, get_target
from v41cp.targets.gpu_program import analyse, compile_with_dump
from v41cp.targets.roofline import predict

__all__ = ["plan_program", "floor_flops", "abstract_sharded_params"]

_LOOKUPS = ("embed", "embed_fp8", "embed_scale")          # gathered rows, no multiply-adds


def abstract_sharded_params(cfg: ModelConfig, mesh, rules, device=None):
    """The unboxed parameter tree as ``jax.ShapeDtypeStruct`` leaves with their shardings (``mesh`` None: on
    ``device``, default the first device)."""
    boxed = abstract_params(cfg)
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, nn.unbox(boxed))
    else:
        shardings = param_shardings(boxed, mesh, rules)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(boxed), shardings)


def _per_device_bytes(tree) -> int:
    """Bytes one device holds of an abstract tree (the largest shard of each leaf)."""
    total = 0
    for a in jax.tree.leaves(tree):
        shape = a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape
        total += int(np.prod(shape)) * np.dtype(a.dtype).itemsize
    return total


def _layer_macs(cfg: ModelConfig) -> tuple[np.ndarray, int]:
    """Multiply-adds per token of each layer's parameters a token uses (``[L]``: every dense weight, the router,
    the shared expert and ``k`` of the ``E`` routed experts; lookups excluded) and of the head."""
    tree = nn.unbox(abstract_params(cfg))
    per_layer = np.zeros(cfg.num_hidden_layers, np.int64)
    for path, a in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [getattr(k, "key", str(k)) for k in path]
        m = re.fullmatch(r"layers_(\d+)", keys[0])
        if m is None or keys[-1] in _LOOKUPS or keys[-1].startswith("experts_") or keys[-1].startswith("gate_bias"):
            continue
        per_layer[int(m.group(1))] += int(np.prod(a.shape))
    routed = cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return per_layer + routed, cfg.hidden_size * cfg.vocab_size


def floor_flops(cfg: ModelConfig, mode: str, batch: int, context: int, ced: bool = False) -> dict:
    """The work the model defines, in FLOPs (all devices together): 2 per multiply-add of the parameters each row
    uses (`_layer_macs`; the head on every decode row, at prefill only on each prompt's sampled row), the
    attention products over the entries each row attends (``4 · heads · head_dim`` per entry: the window rows
    and, on compressed layers, ``min(index_topk, entries)`` — every visible entry on V4's HCA layers) and the
    indexer scores (``2 · index_heads · index_head_dim`` per scored key: every entry of the source, or on
    candidate-restricted layers at most ``candidate_topk_blocks · candidate_block_size``). Decode: ``batch`` rows at
    position ``context − 1``; prefill: ``batch`` prompts of positions ``0 … context − 1`` (with ``ced``, the layers
    from the CED boundary on only for each prompt's last `ced_rows` rows)."""
    layer_macs, head_macs = _layer_macs(cfg)
    pos = np.array([context - 1]) if mode == "decode" else np.arange(context)
    seen = pos + 1                                                       # tokens visible to each row
    boundary = ced_boundary(cfg) if (ced and mode == "prefill") else None
    out = {"parameters": 0.0, "attention": 0.0, "indexer": 0.0}
    for role in cfg.layer_roles:
        rows = seen if boundary is None or role.index < boundary else seen[-min(ced_rows(cfg), len(seen)):]
        out["parameters"] += 2.0 * layer_macs[role.index] * len(rows) * batch
        entries = np.minimum(cfg.sliding_window, rows).astype(np.float64)
        if role.ratio > 0:
            avail = rows // role.ratio
            entries += avail if role.dense_history else np.minimum(cfg.index_topk, avail)
            if role.is_index_source:
                keys = avail
                if role.uses_candidates:
                    keys = np.minimum(avail, cfg.candidate_topk_blocks * cfg.candidate_block_size)
                out["indexer"] += 2.0 * cfg.index_n_heads * cfg.index_head_dim * float(keys.sum()) * batch
        out["attention"] += 4.0 * cfg.num_attention_heads * cfg.head_dim * float(entries.sum()) * batch
    head_rows = batch * (len(pos) if mode == "decode" else 1)
    out["parameters"] += 2.0 * head_macs * head_rows
    out["total"] = sum(out.values())
    return out


def _decode_program(cfg, batch, context, block_tokens, parallel, mesh, params, device):
    import jax.numpy as jnp

    plan = DCPPlan.build(cfg, parallel, mesh) if parallel is not None and parallel.kv_parallel_size > 1 else None
    n = plan.n if plan is not None else 1
    max_blocks = -(-context // block_tokens)
    num_blocks = n * batch * -(-max_blocks // n)
    one = jax.sharding.SingleDeviceSharding(device)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if mesh is not None else None
    cache = cache_layout(cfg, num_blocks, block_tokens, batch, None if plan else (rep or one), plan=plan)
    if plan is None and mesh is not None and mesh.shape["tp"] * mesh.shape["cp"] > 1:
        plan = DCPPlan.split_selection(mesh)            # plain TP: the engine's selection split (replicated pages)
    n_eng = len(cfg.engram_layer_ids)
    arg = lambda shape, dt=jnp.int32: jax.ShapeDtypeStruct(shape, dt, sharding=rep or one)
    meta = StepBatch(arg((batch, 1)), arg((batch,)), arg((batch,)), arg((batch,)), arg((batch, max_blocks)),
                     arg((batch, 1, n_eng, cfg.engram_hash_heads if n_eng else 0)), batch, max_blocks, 1)
    sampling = SamplingRows.abstract(batch, rep or one, mask_words(cfg.vocab_size))  # with the engine's grammar masks
    # with the log-probability work a server's engine compiles in (run only when a request asks)
    counts = TokenCounts.abstract(batch, cfg.vocab_size, mesh, one)  # the penalties' token counts
    return decode_and_sample.lower(params, cache, meta, sampling, counts, cfg, plan, Capacity().max_logprobs), cache


def _prefill_program(cfg, batch, context, block_tokens, parallel, mesh, params, ced, device, tile_bytes=None):
    layout = SpanLayout.from_parallel(parallel, mesh) if parallel is not None else SpanLayout()
    if tile_bytes is not None:
        layout = dataclasses.replace(layout, tile_bytes=tile_bytes)
    plan = DCPPlan.build(cfg, parallel, mesh) if layout.kv_parallel > 1 else None
    n = layout.kv_parallel
    max_blocks = -(-context // block_tokens)
    num_blocks = n * batch * -(-max_blocks // n)
    tables = np.arange(num_blocks, dtype=np.int32)[:batch * max_blocks].reshape(batch, max_blocks)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if mesh is not None else \
        jax.sharding.SingleDeviceSharding(device)
    cache = cache_layout(cfg, num_blocks, block_tokens, batch, None if plan else rep, plan=plan)
    prompts = [[3 + (i * 7919 + b) % (cfg.vocab_size - 3) for i in range(context)] for b in range(batch)]
    # a synthetic prompt: without the checkpoint's tokenizer its Engram ids are hashed from a stand-in token map
    # (their values are data; the compiled program is the same)
    host = cfg if cfg.engram_token_map is not None or not cfg.engram_layer_ids else cfg.replace(
        engram_token_map=tuple(i % cfg.engram_compressed_vocab_size for i in range(cfg.vocab_size)))
    batch = build_span_batch(host, prompts, layout.n, query_parallel=layout.query_parallel, block_tables=tables,
                             ced=ced)
    return lower_prefill_span(params, cache, batch, cfg, layout), cache


def plan_program(cfg: ModelConfig, mode: str, batch: int, context: int, parallel=None, *,
                 block_tokens: int | None = None, ced: bool = False, device_memory_gb: float | None = None,
                 top_ops: int = 20, tile_bytes: int | None = None, target: str | None = None,
                 dump_dir: str | None = None) -> dict:
    """Compile the ``mode`` step (see the module docstring) and report its per-device structure. ``parallel``: a
    `v41cp.sharding.topology.ParallelConfig` (None: one device); ``block_tokens``: the cache page (default the model's,
    `ModelConfig.page_tokens`). ``top_ops``: how many source operations the
    dot-FLOP and all-FLOP breakdowns list (`v41cp.sharding.hlo_stats.dot_flops_by_op` / `flops_by_op`, largest first); ``tile_bytes``: the
    prefill's selection / attention tile budget (default `v41cp.layers.tiled_select.ROW_TILE_BYTES`).

    ``target`` (``h100`` / ``h200``, `v41cp.targets`): compile for that GPU instead of this host's devices — on a
    host without one — and add what the GPU program executes (`_gpu_report`); ``dump_dir``: keep XLA's dump of that
    compile there (default: a temporary folder, removed). ``device_memory_gb``: the memory ``fits`` is judged
    against (default: the target's, else an H200's 141 GB)."""
    if mode not in ("decode", "prefill"):
        raise ValueError(f"plan: mode must be 'decode' or 'prefill', got {mode!r}")
    block_tokens = cfg.page_tokens if block_tokens is None else block_tokens
    for name, v in (("batch", batch), ("context", context), ("block_tokens", block_tokens)):
        if type(v) is not int or v <= 0:
            raise ValueError(f"plan: {name} must be a positive integer, got {v!r}")
    if dump_dir is not None and os.path.isdir(dump_dir) and os.listdir(dump_dir):
        raise ValueError(f"plan: dump_dir {dump_dir!r} is not empty (give a new or empty folder)")
    gpu = None
    if target is not None:
        gpu = get_target(target)
        devices = compile_devices(gpu, parallel.num_devices if parallel is not None else 1)
    else:
        devices = jax.devices()[:parallel.num_devices if parallel is not None else 1]
    if device_memory_gb is None:
        device_memory_gb = gpu.memory_bytes / 1e9 if gpu is not None else 141.0
    mesh = parallel.make_mesh(devices) if parallel is not None else None
    n_devices = 1 if mesh is None else mesh.devices.size
    params = abstract_sharded_params(cfg, mesh, parallel.rules() if parallel is not None else None, devices[0])
    with jax.default_matmul_precision("highest" if cfg.dtype == "float32" else "default"):
        if mode == "decode":
            lowered, cache = _decode_program(cfg, batch, context, block_tokens, parallel, mesh, params, devices[0])
        else:
            lowered, cache = _prefill_program(cfg, batch, context, block_tokens, parallel, mesh, params, ced,
                                              devices[0], tile_bytes)
    dump = None
    if gpu is not None:
        compiled, dump = compile_with_dump(lowered, dump_dir)
    else:
        compiled = lowered.compile()
    try:
        report = _report(cfg, mode, batch, context, block_tokens, ced, parallel, n_devices, compiled, params, cache,
                         device_memory_gb, top_ops)
        report["target"] = gpu.name if gpu is not None else None
        if gpu is not None:
            report.update(_gpu_report(gpu, compiled, dump, n_devices, report))
    finally:
        if dump is not None and dump_dir is None:
            shutil.rmtree(dump, ignore_errors=True)
    return report


def _report(cfg, mode, batch, context, block_tokens, ced, parallel, devices, compiled, params, cache,
            device_memory_gb, top_ops) -> dict:
    cost = program_cost(compiled)                    # loop bodies counted once per iteration
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    coll = collectives(text)
    dots = dot_flops_by_op(text)
    every = flops_by_op(text)
    once = data_dependent_loops(text)
    floor = floor_flops(cfg, mode, batch, context, ced)
    per = {
        "flops_per_device": float(cost.get("flops", 0.0)),
        "bytes_accessed_per_device": float(cost.get("bytes accessed", 0.0)),
        "argument_bytes_per_device": int(mem.argument_size_in_bytes),
        "output_bytes_per_device": int(mem.output_size_in_bytes),
        "alias_bytes_per_device": int(mem.alias_size_in_bytes),
        "temp_bytes_per_device": int(mem.temp_size_in_bytes),
        "collective_bytes_per_device": int(sum(c["bytes"] for c in coll)),
        "weight_bytes_per_device": _per_device_bytes(params),
        "cache_bytes_per_device": _per_device_bytes(cache),
    }
    need = per["argument_bytes_per_device"] + per["temp_bytes_per_device"] + per["output_bytes_per_device"] - \
        per["alias_bytes_per_device"]
    floor_dev = floor["total"] / devices
    return {
        "mode": mode, "batch": batch, "context": context, "devices": devices, "block_tokens": block_tokens,
        "ced": ced, "parallel": ({**dataclasses.asdict(parallel), "dcp_merge": parallel.dcp_merge_for(cfg)}
                                 if parallel is not None else None), **per,
        "collectives": {op: sum(c["bytes"] for c in coll if c["op"] == op) for op in sorted({c["op"] for c in coll})},
        # while loops of data-dependent length (the Reindex scan's overflow tiles): their bodies counted once
        "loops_counted_once": {name: once.count(name) for name in sorted(set(once))},
        "dot_flops_per_device": sum(dots.values()),
        "dot_flops_per_device_by_op": dict(list(dots.items())[:top_ops]),
        # every FLOP (dots, elementwise, reductions) by source operation: where the FLOPs above the floor go
        "flops_per_device_by_op": dict(list(every.items())[:top_ops]),
        "floor_flops_per_device": floor_dev,
        "floor_parts_per_device": {k: v / devices for k, v in floor.items() if k != "total"},
        "flops_over_floor": per["flops_per_device"] / floor_dev if floor_dev else None,
        "memory_needed_bytes_per_device": need,
        "device_memory_bytes": int(device_memory_gb * 1e9),                  # GB = 10⁹ bytes (H200: 141 GB)
        "fits": need <= device_memory_gb * 1e9,
    }


def _gpu_report(gpu, compiled, dump: str, devices: int, report: dict) -> dict:
    """What the GPU program executes (`v41cp.targets.gpu_program`) and its roofline prediction
    (`v41cp.targets.roofline`): ``bytes_accessed_per_device`` becomes the kernels' own (slice-aware; XLA's model,
    which counts a gather's whole operand, stays as ``xla_bytes_accessed_per_device``)."""
    kernels = analyse(dump, compiled.as_text())
    prediction = predict(kernels, collectives(compiled.as_text()), gpu, devices)
    counted = [k for k in kernels.kernels if k.bytes is not None]
    spilling = sorted({k.name for k in kernels.kernels if k.spill_bytes})
    return {
        "target_figures": gpu.describe(),
        "xla_bytes_accessed_per_device": report["bytes_accessed_per_device"],
        "bytes_accessed_per_device": float(sum(k.launches * k.bytes for k in counted)),
        # the kernels' dot FLOPs, the Pallas kernels' recorded counts included (XLA's model counts a custom call
        # as nothing: `flops_per_device` leaves them out)
        "kernel_flops_per_device": float(sum(k.launches * (k.flops or 0.0) for k in counted)),
        "kernel_launches_per_step": kernels.launches,
        "kernel_launches_outside_graphs": sum(k.launches for k in kernels.kernels if not k.in_graph),
        "graph_launches": kernels.graph_launches,
        # while loops outside command buffers (the host launches each trip); of them, those of unknown trip count
        # (the host also reads the condition back every trip)
        "host_driven_loops": kernels.host_driven_loops,
        "host_synchronizing_loops": kernels.host_synchronizing_loops,
        "host_driven_conditionals": kernels.host_driven_conditionals,
        "command_buffers": kernels.command_buffers,
        # the Pallas (Triton) kernels, merged by name; every kernel that spills; the most registers any uses
        "kernels": kernels.by_name("v41cp_"),
        "kernels_spilling": spilling,
        "max_registers": max((k.registers or 0 for k in kernels.kernels), default=0),
        "predicted_step_s": prediction.pop("predicted_step_s"),
        "prediction": prediction,
    }
