"""``v41cp convert SRC DST``: a released-layout checkpoint → an orbax checkpoint in the model's own tree."""

from __future__ import annotations

import json

from v41cp.checkpoint import convert
from v41cp.cli import flags


def add_arguments(parser) -> None:
    parser.add_argument("src", help="released-layout directory (config.json, tokenizer.json, safetensors)")
    parser.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"),
                        help="storage dtype of the backbone (default: the config's)")
    flags.add(parser, flags.ModelFlags, "keep_quantized", "dequantize")
    parser.add_argument("--workers", type=int, default=1, help="subtrees converted at once, each in its own process "
                        "(host memory grows about linearly with it)")
    parser.add_argument("--overwrite", action="store_true")
    flags.add(parser, flags.OutputFlags, help={"json": "print the summary as JSON (no progress bar)"})


def run(args) -> int:
    summary = convert(args.src, args.dst, dtype=args.dtype, progress=not args.json, overwrite=args.overwrite,
                      workers=args.workers, **flags.ModelFlags.from_args(args).storage())
    if args.json:
        print(json.dumps(summary))
    else:
        mb = summary["bytes_read"] / 2**20
        print(f"converted {summary['tensors']} tensors in {len(summary['subtrees'])} subtrees: read {mb:.1f} MiB "
              f"(release format), wrote {summary['bytes_written'] / 2**20:.1f} MiB ({summary['dtype']}) in "
              f"{summary['seconds']:.2f}s ({mb / max(summary['seconds'], 1e-9):.1f} MiB/s) -> {args.dst}")
    return 0
