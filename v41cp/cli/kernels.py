"""``v41cp bench kernels``: the Pallas kernels vs the XLA paths vs the HBM roofline (`v41cp.kernel_bench`); the
``kernels`` kind of ``v41cp bench`` (`v41cp.cli.bench`), whose flags are its "bench kernels" group."""

from __future__ import annotations

import json
import sys

from v41cp.kernel_bench import run as run_kernel_bench


def add_arguments(parser) -> None:
    k = parser.add_argument_group("bench kernels")
    k.add_argument("--shapes", choices=("flash", "tiny"), default="flash", help="V4.1-Flash shapes or toy ones")
    k.add_argument("--contexts", default="8192,131072,1048576", help="context lengths in tokens")
    k.add_argument("--batches", default="1,16,64", help="batch sizes")
    k.add_argument("--kernels", default="indexer,attention,experts", help="which kernels")
    k.add_argument("--expert-tokens", default="64,4096", help="token counts of the grouped FP4 expert GEMM")
    k.add_argument("--reps", type=int, default=10, help="timed calls per case (median reported)")
    k.add_argument("--no-xla", action="store_true", help="skip the XLA reference paths")
    k.add_argument("--sweep", action="store_true", help="also time alternative kernel parameters (block sizes, warps)")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def run(args) -> int:
    out = run_kernel_bench(args.shapes, _ints(args.contexts), _ints(args.batches), tuple(args.kernels.split(",")),
                           args.reps, not args.no_xla, args.sweep, progress=sys.stderr.isatty(),
                           expert_tokens=_ints(args.expert_tokens))
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0
