"""``v41cp serve``: the OpenAI-compatible HTTP server (`v41cp.serving.api.server`) over the serving engine; with
``--nnodes > 1`` rank 0 serves HTTP and the other ranks follow its broadcast commands (one global mesh, or with
``--prefill-devices`` PD across processes: the prefill role in process 0, the decode role in process 1)."""

from __future__ import annotations

import sys
from pathlib import Path

from v41cp.cli import flags
from v41cp.cli.engine import open_engine, text_codec
from v41cp.serving.api.server import run_follower, run_server
from v41cp.serving.multihost.control_plane import ControlPlane


def add_arguments(parser) -> None:
    flags.add(parser, flags.ModelFlags, "checkpoint")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="the model name clients send (default: the checkpoint folder)")
    parser.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    parser.add_argument("--follower-timeout", type=float, default=60.0,
                        help="across processes: seconds rank 0 waits for the followers at an iteration's exchange "
                             "before it ends the requests in flight and exits (a dead follower is seen at once); a "
                             "follower that hears nothing from rank 0 at an exchange for as long exits too (a hang "
                             "inside a step's collectives is not watched)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on the /v1 routes, /tokenize and "
                                           "/detokenize (401 otherwise); /health and /metrics stay open")
    # 4,096 tokens per request: an evaluation harness asks for 256 new tokens after prompts of up to 3,840
    flags.add(parser, flags.CapacityFlags, defaults={"max_batch": 8, "max_context": 4096})
    for group in (flags.TopologyFlags, flags.QueryParallelFlags, flags.DisaggregationFlags, flags.DistributedFlags,
                  flags.BackendFlags, flags.PrefillFlags, flags.SpeculativeFlags):
        flags.add(parser, group)
    flags.add(parser, flags.ModelFlags, "no_fake_quant", "keep_quantized", "dequantize")
    flags.add(parser, flags.CompileCacheFlags)


def run(args) -> int:
    if not args.follower_timeout > 0:
        raise ValueError(f"--follower-timeout must be positive, got {args.follower_timeout}")
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key: an empty key would accept every request; give a key or leave the flag out")
    flags.DistributedFlags.from_args(args).start()
    flags.CompileCacheFlags.from_args(args).start()
    model = flags.ModelFlags.from_args(args)
    codec = text_codec(model.path, required=False)
    cap = flags.CapacityFlags.from_args(args).capacity(flags.PrefillFlags.from_args(args), args.max_context,
                                                       page=model.page_tokens())
    cfg, eng = open_engine(args, cap)
    control = None
    if args.nnodes > 1:                           # rank 0 serves HTTP, the others follow its broadcast commands
        control = ControlPlane()
        if not control.leader:
            run_follower(eng, control, args.follower_timeout)
            return 0
    name = args.served_model_name or Path(model.path).name
    run_server(eng, codec, name, args.host, args.port, progress=sys.stderr.isatty(), log_level=args.log_level,
               control=control, api_key=args.api_key, follower_timeout=args.follower_timeout)
    return 0
