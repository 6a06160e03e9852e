"""``v41cp plan``: compile (never run) the decode step or the prefill with abstract weights and print its
per-device structure — FLOPs, memory, collective bytes vs the analytic floor (`v41cp.plan`)."""

from __future__ import annotations

import json

from v41cp.cli import flags
from v41cp.plan import plan_program


def add_arguments(parser) -> None:
    flags.add(parser, flags.ModelFlags, "preset", "checkpoint",
              help={"checkpoint": "a checkpoint directory (its config.json; no weights are read)"})
    parser.add_argument("--mode", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--batch", type=int, default=1, help="decode: batch rows; prefill: prompts")
    parser.add_argument("--context", type=int, default=4096,
                        help="decode: history capacity per request (tokens); prefill: prompt length")
    flags.add(parser, flags.CapacityFlags, "block_tokens", titled=False)
    flags.add(parser, flags.ModelFlags, "keep_quantized", "dequantize")
    flags.add(parser, flags.PrefillFlags, "ced", help={"ced": "prefill with CED narrowing"})
    parser.add_argument("--device-memory-gb", type=float, default=141.0,
                        help="device memory for 'fits' (GB, 10^9 B)")
    flags.add(parser, flags.ModelFlags, "no_fake_quant")
    flags.add(parser, flags.OutputFlags)
    flags.add(parser, flags.TopologyFlags)
    flags.add(parser, flags.QueryParallelFlags)
    flags.add(parser, flags.BackendFlags)
    flags.add(parser, flags.CompileCacheFlags)


def run(args) -> int:
    flags.CompileCacheFlags.from_args(args).start()
    if args.preset and args.checkpoint:
        raise ValueError("plan: give --preset or --checkpoint, not both")
    cfg = flags.ModelFlags.from_args(args).config()          # weights as stored (a preset: as the release)
    cfg = cfg.replace(**flags.BackendFlags.from_args(args).overrides())
    out = plan_program(cfg, args.mode, args.batch, args.context, flags.parallel_config(args),
                       block_tokens=args.block_tokens, ced=args.ced, device_memory_gb=args.device_memory_gb)
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0
