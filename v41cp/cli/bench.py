"""``v41cp bench decode|prefill|kernels``: the engine's offline benchmark (`v41cp.serving.offline_bench`: step
latency, tokens/s, compile counts, the exact KVP structure), or the kernels' (`v41cp.cli.kernels`); prints JSON."""

from __future__ import annotations

import json

import jax

from v41cp.cli import flags, kernels
from v41cp.cli.engine import open_engine
from v41cp.serving.offline_bench import bench_capacity, offline_bench


def add_arguments(parser) -> None:
    parser.add_argument("kind", choices=("decode", "prefill", "kernels"))
    flags.add(parser, flags.ModelFlags, "checkpoint")
    parser.add_argument("--lengths", default="64,512,2048", help="context lengths")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per length")
    for group in (flags.TopologyFlags, flags.QueryParallelFlags, flags.DisaggregationFlags, flags.DistributedFlags,
                  flags.BackendFlags, flags.PrefillFlags, flags.SpeculativeFlags):
        flags.add(parser, group)
    parser.add_argument("--cache-budget-mib", type=int, default=64,
                        help="per-device global-page budget for max_resident_tokens (decode)")
    flags.add(parser, flags.ModelFlags, "no_fake_quant", "keep_quantized", "dequantize")
    flags.add(parser, flags.OutputFlags)
    kernels.add_arguments(parser)
    flags.add(parser, flags.CompileCacheFlags)


def run(args) -> int:
    flags.DistributedFlags.from_args(args).start()
    flags.CompileCacheFlags.from_args(args).start()
    if args.kind == "kernels":
        return kernels.run(args)
    lengths = [int(x) for x in args.lengths.split(",")]
    cap = bench_capacity(lengths, args.batch, args.steps, flags.ModelFlags.from_args(args).page_tokens(),
                         **flags.PrefillFlags.from_args(args).options())
    cfg, eng = open_engine(args, cap)
    devices = flags.global_devices(args)
    topology = {"devices": devices, "tp_size": args.tp_size or devices, "kv_parallel_size": args.kv_parallel_size,
                "dcp_merge": flags.parallel_config(args).dcp_merge_for(cfg) if args.kv_parallel_size > 1 else None,
                "dcp_q": args.dcp_q}
    pd = flags.DisaggregationFlags.from_args(args).prefill_devices
    if pd is not None:
        topology.update(prefill_devices=pd, tp_size=None)
    kvp1 = None
    if args.kind == "decode" and args.kv_parallel_size > 1 and pd is None:  # KVP 1 on the same mesh, side by side
        kvp1 = flags.parallel_config(args, kv_parallel_size=1)
    out = offline_bench(eng, cfg, cap, args.kind, lengths, batch=args.batch, steps=args.steps,
                        cache_budget_bytes=args.cache_budget_mib * 2**20, topology=topology, kvp1_parallel=kvp1)
    if jax.process_index() == 0:                 # across processes: one report (process 0 prefills and sees both)
        print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0
