"""``v41cp plan``: compile (never run) the decode step or the prefill with abstract weights and print its
per-device structure — FLOPs, memory, collective bytes vs the analytic floor (`v41cp.plan`). ``--target h100|h200``
compiles it for that GPU on a host without one (the gpu-plan extra; `v41cp.targets`) and adds its kernels, launches,
loops and a roofline prediction of the step."""

from __future__ import annotations

import json

from v41cp.cli import flags
from v41cp.plan import plan_program
from v41cp.targets import use_cpu_host


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
    parser.add_argument("--device-memory-gb", type=float, default=None,
                        help="device memory for 'fits' (GB, 10^9 B; default: the target's, else 141)")
    parser.add_argument("--target", choices=("h100", "h200"), default=None,
                        help="compile for this GPU (8 per host; --devices of them) on this host without one: "
                             "kernels, launches, host-driven loops, roofline prediction (pip install -e \".[gpu-plan]\")")
    parser.add_argument("--dump-dir", default=None,
                        help="with --target: keep XLA's dump of the compile (HLO, PTX, thunk sequence) here")
    flags.add(parser, flags.ModelFlags, "no_fake_quant")
    flags.add(parser, flags.OutputFlags)
    flags.add(parser, flags.TopologyFlags)
    flags.add(parser, flags.QueryParallelFlags)
    flags.add(parser, flags.BackendFlags)
    flags.add(parser, flags.CompileCacheFlags)


def check(args) -> str | None:
    if args.dump_dir and not args.target:
        return "--dump-dir needs --target"
    return None


def run(args) -> int:
    if args.target:
        use_cpu_host()                       # before anything starts JAX's backends (the CUDA plugin must not)
    else:                                    # (a compile-only GPU program cannot be cached: nothing to load it into)
        flags.CompileCacheFlags.from_args(args).start()
    if args.preset and args.checkpoint:
        raise ValueError("plan: give --preset or --checkpoint, not both")
    cfg = flags.ModelFlags.from_args(args).config()          # weights as stored (a preset: as the release)
    cfg = cfg.replace(**flags.BackendFlags.from_args(args).overrides())
    out = plan_program(cfg, args.mode, args.batch, args.context, flags.parallel_config(args),
                       block_tokens=args.block_tokens, ced=args.ced, device_memory_gb=args.device_memory_gb,
                       target=args.target, dump_dir=args.dump_dir)
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0
