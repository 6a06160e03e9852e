"""``v41cp forward``: next-token predictions of the full-sequence forward for a prompt of token ids, on one device
or a mesh (attention TP, operator-local indexer / attention QCP)."""

from __future__ import annotations

import json
import time

import numpy as np

from v41cp import model
from v41cp.checkpoint import open_checkpoint
from v41cp.cli import flags


def add_arguments(parser) -> None:
    flags.add(parser, flags.ModelFlags, "checkpoint", "no_fake_quant", "keep_quantized", "dequantize",
              help=flags.ModelFlags.DESCRIBED)
    flags.add(parser, flags.OutputFlags, help=flags.OutputFlags.DESCRIBED)
    parser.add_argument("--tokens", help='prompt token ids, e.g. "5 17 42" (default: a seeded random prompt)')
    parser.add_argument("--length", type=int, default=40, help="length of the random prompt")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--top", type=int, default=5)
    flags.add(parser, flags.BackendFlags)
    flags.add(parser, flags.TopologyFlags)
    flags.add(parser, flags.QueryParallelFlags)
    flags.add(parser, flags.CompileCacheFlags)


def check(args) -> str | None:
    if args.length <= 0:
        return f"--length must be positive, got {args.length}"
    return None


def parse_tokens(text: str, cfg) -> np.ndarray:
    """``[1, T]`` int32 token ids of ``"5 17 42"`` / ``"5,17,42"``; exits with a message naming a bad id."""
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError as e:
        raise SystemExit(f"error: --tokens must be integers separated by spaces or commas ({e})")
    if not ids:
        raise SystemExit("error: --tokens is empty")
    bad = cfg.out_of_vocabulary(ids)
    if bad:
        raise SystemExit(f"error: {bad}")
    return np.asarray([ids], np.int32)


def run(args) -> int:
    flags.CompileCacheFlags.from_args(args).start()
    t0 = time.perf_counter()
    parallel = flags.parallel_config(args)
    if parallel is not None and (parallel.kv_parallel_size > 1 or parallel.query_context_parallel_size > 1):
        raise ValueError("topology: forward runs the full-sequence model: KVP / DCP are decode options and "
                         "model-wide QCP a prefill option of the engine (generate, bench)")
    mesh = parallel.make_mesh() if parallel is not None else None
    spec = flags.ModelFlags.from_args(args)
    cfg, params = open_checkpoint(spec.path, mesh=mesh, rules=parallel.rules() if parallel is not None else None,
                                  **spec.quant(), **spec.storage(),
                                  **flags.BackendFlags.from_args(args).overrides())
    shard = parallel.sharding_context(mesh) if parallel is not None else None
    t_load = time.perf_counter() - t0
    if args.tokens is None:
        rng = np.random.default_rng(args.seed)
        tokens = rng.integers(3, cfg.vocab_size, (1, args.length)).astype(np.int32)
    else:
        tokens = parse_tokens(args.tokens, cfg)
    t0 = time.perf_counter()
    logits = np.asarray(model.forward(params, cfg, tokens, shard=shard))
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    np.asarray(model.forward(params, cfg, tokens, shard=shard))
    t_steady = time.perf_counter() - t0
    last = logits[0, -1]
    top = np.argsort(-last, kind="stable")[: args.top]
    greedy = logits[0].argmax(-1)
    result = {"prompt": tokens[0].tolist(), "next_token": int(top[0]),
              "top": [{"id": int(i), "logit": float(last[i])} for i in top],
              "greedy_per_position": greedy.tolist(),
              "seconds": {"load": round(t_load, 3), "first_forward_incl_compile": round(t_first, 3),
                          "steady_forward": round(t_steady, 4)}}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"prompt ({tokens.shape[1]} tokens): {' '.join(map(str, tokens[0]))}")
        print(f"next token: {result['next_token']}")
        for t in result["top"]:
            print(f"  {t['id']:>6}  logit {t['logit']:+.5f}")
        print(f"load {t_load:.2f}s, first forward (with compile) {t_first:.2f}s, steady {t_steady * 1e3:.1f} ms")
    return 0
