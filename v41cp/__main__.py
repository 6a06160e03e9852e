"""Command line: ``python -m v41cp {info,forward} [...]`` (prints JSON with ``--json``).

* ``info``    config summary and the per-layer role table.
* ``forward`` next-token predictions for a prompt of token ids (full-sequence forward).
* ``convert SRC DST [--dtype bf16|fp32] [--keep-quantized] [--workers N]`` released layout → orbax in the model's tree.
* ``generate [--prompt-ids 1,2,3 ...] [--max-new-tokens N] [--devices N] [--json]`` the serving engine.
  ``forward``, ``generate`` and ``bench decode|prefill`` take ``--attention-backend`` / ``--indexer-backend``
  / ``--expert-backend`` (``xla`` | ``pallas``), ``--moe-backend`` (``sparse`` | ``dense``) and the topology flags; ``forward`` runs operator-local indexer / attention QCP
  (``--deepseek-v41-{indexer,attention}-query-parallel-size``); ``generate`` / ``bench`` run them, or model-wide
  QCP (``--query-context-parallel-size``), in the engine's span prefill (``--span-prefill``, ``--ced``).
  ``generate --prompt TEXT [--chat]`` takes text (the checkpoint's tokenizer) and streams text back.
* ``serve [--host 127.0.0.1] [--port 8000]`` the OpenAI-compatible HTTP server (`v41cp.serving.api.server`).
* ``bench decode|prefill [--lengths 64,512,2048] --json`` engine step latency, tokens/s, compile counts.
* ``plan --preset v41-flash --mode decode|prefill --batch B --context T [topology flags] --json`` compiles (never
  runs) the step with abstract weights: per-device FLOPs / memory / collective bytes vs the analytic floor
  (`v41cp.plan`).
* ``bench kernels [--shapes flash|tiny] [--contexts ...] [--batches ...] [--expert-tokens ...] --json`` the Pallas
  kernels vs the XLA paths vs the HBM roofline (`v41cp.kernel_bench`).

``info`` and ``forward`` default to the embedded tiny checkpoint (``checkpoints/tiny-v41``); their
``--checkpoint`` takes a converted or a released-layout directory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _load_cfg(args):
    from v41cp.config import ModelConfig, preset

    if args.preset:
        return preset(args.preset, fake_quant=not args.no_fake_quant)
    from pathlib import Path

    from v41cp.checkpoint import default_checkpoint

    return ModelConfig.from_json(Path(args.checkpoint or default_checkpoint()) / "config.json",
                                 fake_quant=not args.no_fake_quant)


def cmd_info(args) -> int:
    cfg = _load_cfg(args)
    roles = cfg.layer_roles
    summary = {
        "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
        "head_dim": cfg.head_dim, "window": cfg.sliding_window, "experts": f"{cfg.n_routed_experts} top-"
        f"{cfg.num_experts_per_tok} + 1 shared", "index": f"{cfg.index_n_heads} heads x {cfg.index_head_dim}, "
        f"top-{cfg.index_topk}", "candidates": (f"layer {cfg.candidate_source_layer_id}: {cfg.candidate_topk_blocks} "
        f"blocks x {cfg.candidate_block_size}" if cfg.candidate_source_layer_id >= 0 else "off"),
        "engram_layers": list(cfg.engram_layer_ids), "dtype": cfg.dtype, "fake_quant": cfg.fake_quant,
    }
    table = [{"layer": r.index, "ratio": r.ratio, "role": r.kind, "kv_source": r.kv_source,
              "index_source": r.index_source, "candidates": "source" if r.candidate_source else
              ("masked" if r.uses_candidates else ""), "engram": r.engram_slot >= 0} for r in roles]
    if args.json:
        print(json.dumps({"config": summary, "layers": table}, indent=1))
        return 0
    for k, v in summary.items():
        print(f"{k:>14}: {v}")
    print(f"\n{'layer':>5} {'ratio':>5} {'role':>8} {'kv_src':>6} {'idx_src':>7} {'candidates':>10} engram")
    for t in table:
        print(f"{t['layer']:>5} {t['ratio']:>5} {t['role']:>8} {t['kv_source']:>6} {t['index_source']:>7} "
              f"{t['candidates']:>10} {'yes' if t['engram'] else ''}")
    return 0


def _parse_tokens(text: str, vocab: int):
    import numpy as np

    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError as e:
        raise SystemExit(f"error: --tokens must be integers separated by spaces or commas ({e})")
    if not ids:
        raise SystemExit("error: --tokens is empty")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise SystemExit(f"error: token id {bad[0]} is outside the vocabulary [0, {vocab})")
    return np.asarray([ids], np.int32)


def cmd_forward(args) -> int:
    import numpy as np

    from v41cp import model
    from v41cp.checkpoint import default_checkpoint, open_checkpoint

    t0 = time.perf_counter()
    parallel = _parallel(args)
    if parallel is not None and (parallel.kv_parallel_size > 1 or parallel.query_context_parallel_size > 1):
        raise ValueError("topology: forward runs the full-sequence model: KVP / DCP are decode options and "
                         "model-wide QCP a prefill option of the engine (generate, bench)")
    mesh = parallel.make_mesh() if parallel is not None else None
    cfg, params = open_checkpoint(args.checkpoint or default_checkpoint(), mesh=mesh,
                                  rules=parallel.rules() if parallel is not None else None,
                                  fake_quant=not args.no_fake_quant, **_backends(args))
    shard = parallel.sharding_context(mesh) if parallel is not None else None
    t_load = time.perf_counter() - t0
    if args.tokens is None:
        rng = np.random.default_rng(args.seed)
        tokens = rng.integers(3, cfg.vocab_size, (1, args.length)).astype(np.int32)
    else:
        tokens = _parse_tokens(args.tokens, cfg.vocab_size)
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


def cmd_convert(args) -> int:
    from v41cp.checkpoint import convert

    summary = convert(args.src, args.dst, dtype=args.dtype, progress=not args.json, overwrite=args.overwrite,
                      keep_quantized=args.keep_quantized, workers=args.workers)
    if args.json:
        print(json.dumps(summary))
    else:
        mb = summary["bytes_read"] / 2**20
        print(f"converted {summary['tensors']} tensors in {len(summary['subtrees'])} subtrees: read {mb:.1f} MiB "
              f"(release format), wrote {summary['bytes_written'] / 2**20:.1f} MiB ({summary['dtype']}) in "
              f"{summary['seconds']:.2f}s ({mb / max(summary['seconds'], 1e-9):.1f} MiB/s) -> {args.dst}")
    return 0


def _engine(args, capacity):
    from v41cp.checkpoint import default_checkpoint, open_checkpoint
    from v41cp.serving.engine import Engine

    if getattr(args, "prefill_devices", None) is not None:
        return _disaggregated_engine(args, capacity)
    parallel = _parallel(args)
    mesh = parallel.make_mesh() if parallel is not None else None
    # straight onto the mesh: each device reads only its own shard of every parameter
    cfg, params = open_checkpoint(args.checkpoint or default_checkpoint(), mesh=mesh,
                                  rules=parallel.rules() if parallel is not None else None,
                                  fake_quant=not args.no_fake_quant, progress=_progress(args), **_backends(args))
    return cfg, Engine(params, cfg, capacity, mesh=mesh, parallel=parallel, speculative=_speculative(args, cfg))


def _disaggregated_engine(args, capacity):
    """Prefill on the first ``--prefill-devices`` devices (their attention TP, with the QCP flags and
    ``--prefill-kv-parallel-size``), decode on the rest (``--kv-parallel-size`` = DCP)."""
    from v41cp.checkpoint import default_checkpoint, open_checkpoint
    from v41cp.serving.pd.engines import DisaggregatedEngine
    from v41cp.sharding.topology import ParallelConfig

    p, devices = args.prefill_devices, _global_devices(args)
    if not 0 < p < devices:
        raise ValueError(f"topology: --prefill-devices {p} must be at least 1 and leave decode devices of the "
                         f"{devices} devices")
    if args.tp_size is not None:
        raise ValueError("topology: --tp-size does not apply with --prefill-devices (each role's attention TP is its "
                         "device count)")
    if getattr(args, "speculative_algorithm", None) is not None:
        raise ValueError("speculative decoding with --prefill-devices is not supported yet")
    d = devices - p
    kvp = args.kv_parallel_size
    dcp = args.decode_context_parallel_size or kvp
    pre_kvp = args.prefill_kv_parallel_size
    if pre_kvp is None:
        pre_kvp = kvp if p % kvp == 0 else 1
    qcp = {k: getattr(args, k) for k in ("query_context_parallel_size", "indexer_query_parallel_size",
                                         "attention_query_parallel_size", "indexer_query_min_tokens",
                                         "attention_query_min_tokens", "attention_query_swa_min_tokens")}
    prefill = ParallelConfig(tp_size=p, kv_parallel_size=pre_kvp, decode_context_parallel_size=pre_kvp, **qcp)
    decode = ParallelConfig(tp_size=d, kv_parallel_size=kvp, decode_context_parallel_size=dcp,
                            dcp_merge=args.dcp_merge, dcp_q=args.dcp_q)
    cfg, params = open_checkpoint(args.checkpoint or default_checkpoint(), fake_quant=not args.no_fake_quant,
                                  progress=_progress(args), **_backends(args))
    if getattr(args, "nnodes", 1) > 1:            # prefill in process 0, decode in process 1
        from v41cp.serving.pd.processes import CrossProcessDisaggregatedEngine

        return cfg, CrossProcessDisaggregatedEngine(params, cfg, capacity, prefill, decode)
    return cfg, DisaggregatedEngine(params, cfg, capacity, prefill, decode)


def _global_devices(args) -> int:
    """Devices of the global mesh: ``--devices`` per process times ``--nnodes``."""
    return args.devices * getattr(args, "nnodes", 1)


def _distributed_flags(p) -> None:
    d = p.add_argument_group("multi-host (jax.distributed; SGLang's names)")
    d.add_argument("--nnodes", type=int, default=1, help="processes (hosts) in the program; --devices counts each "
                   "one's local devices, the topology flags describe the global mesh")
    d.add_argument("--node-rank", type=int, default=0, help="this process's rank in [0, --nnodes); rank 0 prints")
    d.add_argument("--dist-init-addr", help="HOST:PORT of rank 0's coordinator (required with --nnodes > 1)")


def _start_distributed(args) -> None:
    """``jax.distributed.initialize`` for ``--nnodes > 1`` (gloo collectives between CPU processes); ranks > 0 print
    nothing on stdout."""
    import os

    n, rank, addr = args.nnodes, args.node_rank, args.dist_init_addr
    if type(n) is not int or n < 1:
        raise ValueError(f"--nnodes must be a positive integer, got {n!r}")
    if n == 1:
        return
    if not 0 <= rank < n:
        raise ValueError(f"--node-rank {rank} is outside [0, --nnodes {n})")
    host, _, port = (addr or "").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--dist-init-addr must be HOST:PORT with --nnodes {n}, got {addr!r}")
    import jax

    # native libraries (gloo) log on file descriptor 1: send it to stderr, keep Python's stdout for the results
    sys.stdout.flush()
    results = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(results, "w") if rank == 0 else open(os.devnull, "w")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")     # CPU processes; GPUs use NCCL
    jax.distributed.initialize(coordinator_address=addr, num_processes=n, process_id=rank)


def _pd_flags(p) -> None:
    d = p.add_argument_group("prefill / decode disaggregation (one program, disjoint devices)")
    d.add_argument("--prefill-devices", type=int,
                   help="prefill on the first N of --devices (attention TP N, with the QCP flags), decode on the rest "
                        "(KVP = DCP from --kv-parallel-size); requests move by page-owner transfer plans")
    d.add_argument("--prefill-kv-parallel-size", type=int,
                   help="the prefill's KVP: 1 (relayout to the decode owners) or equal to the decode's (rank-matched); "
                        "default: the decode's when it divides --prefill-devices, else 1")


def _speculative(args, cfg):
    """The `Speculative` settings of ``--speculative-algorithm`` / ``--speculative-num-draft-tokens`` (None: off);
    the drafter's weights come from the checkpoint's ``mtp.*`` tensors."""
    if getattr(args, "speculative_algorithm", None) is None:
        if getattr(args, "speculative_num_draft_tokens", None) is not None:
            raise ValueError("--speculative-num-draft-tokens needs --speculative-algorithm dspark")
        return None
    from v41cp.checkpoint import default_checkpoint, open_drafter
    from v41cp.serving.runner.speculative import Speculative, check_speculative

    n = args.speculative_num_draft_tokens
    spec = Speculative(None, cfg.dspark_block_size if n is None else n, args.speculative_algorithm)
    check_speculative(cfg, spec)                      # the settings first: a clear error before any weight is read
    return Speculative(open_drafter(args.checkpoint or default_checkpoint(), cfg), spec.num_draft_tokens,
                       args.speculative_algorithm)


def _progress(args) -> bool:
    """Progress bars on stderr: when it is a terminal and the output is not JSON."""
    return sys.stderr.isatty() and not getattr(args, "json", False)


def _codec(args, required: bool):
    """The checkpoint's `TextCodec` (tokenizer + chat format); None when it has no tokenizer.json and text is
    not required."""
    from v41cp.checkpoint import default_checkpoint
    from v41cp.serving.api.text import ChatFormatError, TextCodec

    try:
        return TextCodec.from_checkpoint(args.checkpoint or default_checkpoint())
    except ChatFormatError:
        if required:
            raise
        return None


def _capacity(args, longest: int, **fixed):
    """`Capacity` of the capacity flags; unset ones fit ``longest`` tokens per request and the batch."""
    from v41cp.serving.engine import Capacity

    block = args.block_tokens
    fields = {"max_batch": args.max_batch, "max_tokens": args.max_context or -(-longest // block) * block,
              "block_tokens": block, "num_blocks": args.num_blocks, "prefill_chunk": args.prefill_chunk,
              "max_waiting": args.max_waiting, **_prefill_options(args)}
    fields.update({k: v for k, v in fixed.items() if v is not None})
    return Capacity(**{k: v for k, v in fields.items() if v is not None})


def _capacity_flags(p, max_batch=None, max_context=None) -> None:
    c = p.add_argument_group("capacity (the compiled bucket; `v41cp.serving.engine.Capacity`)")
    c.add_argument("--max-batch", type=int, default=max_batch,
                   help="batch rows of the decode step (requests served at once)"
                        + (f"; default {max_batch}" if max_batch else "; default: the number of prompts"))
    c.add_argument("--max-context", type=int, default=max_context,
                   help="tokens per request, prompt + output (Capacity.max_tokens); default "
                        + (str(max_context) if max_context else "the longest request rounded up to a block"))
    c.add_argument("--block-tokens", type=int, default=16, help="tokens per cache page")
    c.add_argument("--num-blocks", type=int, help="cache pages in all (default: max-batch full requests)")
    c.add_argument("--prefill-chunk", type=int, default=32, help="rows per token-serial prefill chunk")
    c.add_argument("--max-waiting", type=int, default=64, help="queued requests beyond this are rejected")


def _backends(args) -> dict:
    """The backend overrides of ``--attention-backend`` / ``--indexer-backend`` / ``--expert-backend`` /
    ``--moe-backend``."""
    return {"attention_backend": args.attention_backend, "indexer_backend": args.indexer_backend,
            "expert_backend": args.expert_backend, "moe_backend": args.moe_backend}


def _prefill_options(args) -> dict:
    """Engine prefill options of ``--span-prefill`` / ``--span-chunk`` / ``--ced``."""
    return {"span_prefill": args.span_prefill or args.span_chunk is not None, "ced": args.ced,
            "span_chunk": args.span_chunk, "prefix_caching": args.enable_prefix_caching,
            "prefix_states": args.prefix_states}


def _prefill_flags(p) -> None:
    p.add_argument("--span-prefill", action="store_true",
                   help="prefill each round's prompts in one pass (always on with --query-context-parallel-size > 1)")
    p.add_argument("--span-chunk", type=int, help="span prefill in passes of this many rows per prompt "
                   "(later passes continue from the cached history; implies --span-prefill)")
    p.add_argument("--ced", action="store_true", help="CED narrowing of prefill (exact)")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="reuse the cached pages and stored state of a prompt's longest cached whole-block prefix "
                        "(exact: bit-identical to a cold prefill; token-serial prefill only)")
    p.add_argument("--prefix-states", type=int,
                   help="slot states the prefix cache stores at most (default: 4 per batch row)")


def _speculative_flags(p) -> None:
    p.add_argument("--speculative-algorithm", choices=("dspark",),
                   help="speculative decoding with the checkpoint's DSpark drafter (mtp.*): exact (greedy tokens as "
                        "without it; sampling lossless)")
    p.add_argument("--speculative-num-draft-tokens", type=int,
                   help="drafts verified per step, 1 … dspark_block_size (default: the block size)")


def _backend_flags(p) -> None:
    for name, what in (("attention", "sparse attention"), ("indexer", "indexer scan + top-k"),
                       ("expert", "FP4 expert GEMMs of the sparse MoE (checkpoints converted with --keep-quantized)")):
        p.add_argument(f"--{name}-backend", choices=("xla", "pallas"), default="xla",
                       help=f"{what}: the XLA path, or the Pallas kernel (interpret mode off the GPU)")
    p.add_argument("--moe-backend", choices=("sparse", "dense"), default="sparse",
                   help="routed experts: each token runs only its top-k experts (dropless, static shapes), or "
                        "every expert on every token (the reference)")


def _parallel(args, kv_parallel_size=None):
    """The `ParallelConfig` of the topology flags (None: one device, no mesh)."""
    from v41cp.sharding.topology import ParallelConfig

    kvp = args.kv_parallel_size if kv_parallel_size is None else kv_parallel_size
    dcp = kvp if kv_parallel_size is not None or args.decode_context_parallel_size is None \
        else args.decode_context_parallel_size
    devices = _global_devices(args)
    tp = args.tp_size or devices
    if devices % tp:
        nodes = getattr(args, "nnodes", 1)
        raise ValueError(f"topology: --tp-size {tp} does not divide --devices {args.devices}"
                         + (f" x --nnodes {nodes} = {devices}" if nodes > 1 else ""))
    qcp = {k: getattr(args, k) for k in ("query_context_parallel_size", "indexer_query_parallel_size",
                                         "attention_query_parallel_size", "indexer_query_min_tokens",
                                         "attention_query_min_tokens", "attention_query_swa_min_tokens")}
    if devices == 1 and kvp == 1 and dcp == 1:
        return None
    return ParallelConfig(tp_size=tp, dp_size=devices // tp, kv_parallel_size=kvp,
                          decode_context_parallel_size=dcp, dcp_merge=args.dcp_merge, dcp_q=args.dcp_q, **qcp)


def _generate_prompts(args, codec):
    """The prompts (token-id lists) of --prompt (through the checkpoint's tokenizer; with --chat, through its chat
    format) then --prompt-ids; a default prompt when neither is given."""
    prompts = []
    for text in args.prompt or []:
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": text}]
            ids = codec.chat_ids(messages)
        else:
            ids = codec.encode(text)
        if not ids:
            raise ValueError(f"--prompt {text!r} encodes to no tokens")
        prompts.append(ids)
    for p in args.prompt_ids or []:
        try:
            ids = [int(t) for t in p.replace(",", " ").split()]
        except ValueError:
            raise ValueError(f"--prompt-ids {p!r}: token ids must be integers separated by commas")
        if not ids:
            raise ValueError(f"--prompt-ids {p!r} is empty")
        prompts.append(ids)
    return prompts or [[5, 17, 42, 99, 3]]


def cmd_generate(args) -> int:
    from v41cp.serving.engine import SamplingParams

    if (args.chat or args.system) and not args.prompt:
        raise ValueError("--chat / --system need --prompt TEXT (the user message)")
    codec = _codec(args, required=bool(args.prompt))
    prompts = _generate_prompts(args, codec)
    cap = _capacity(args, max(len(p) for p in prompts) + args.max_new_tokens, max_batch=args.max_batch or len(prompts))
    t0 = time.perf_counter()
    cfg, eng = _engine(args, cap)
    t_load = time.perf_counter() - t0
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        seed=args.seed, stop_on_eos=not args.ignore_eos)
    for i, p in enumerate(prompts):
        eng.submit(i, p, sp)
    hidden = (cfg.eos_token_id,) if sp.stop_on_eos else ()
    streams = {i: codec.stream(hidden=hidden) for i in range(len(prompts))} if codec is not None else {}
    live = not args.json and codec is not None and len(prompts) == 1    # stream one request's text as it comes
    t0 = time.perf_counter()
    seen = {i: 0 for i in range(len(prompts))}
    while eng.pending:
        eng.step()
        for i in streams:
            req = eng.requests[i]
            for t in req.output[seen[i]:]:
                delta = streams[i].push(t)
                if live and delta:
                    print(delta, end="", flush=True)
            seen[i] = len(req.output)
    wall = time.perf_counter() - t0
    for i in streams:
        rest = streams[i].finish()                # what was held back (a partial character)
        if live and rest:
            print(rest, end="", flush=True)
    texts = {i: streams[i].text for i in streams}
    results = [eng.result(i) for i in range(len(prompts))]
    st = eng.stats
    timings = {"load_s": round(t_load, 3), "generate_s": round(wall, 3), "prefill_tokens": st["prefill_tokens"],
               "prefill_s": round(st["prefill_s"], 3), "decode_steps": st["decode_steps"],
               "decode_tokens": st["decode_tokens"], "decode_s": round(st["decode_s"], 3),
               "compiles": eng.compile_counts()}
    if eng.speculative is not None:
        timings["speculative"] = eng.speculative_stats()
    if eng.prefix is not None:
        timings["prefix_cache"] = eng.prefix_stats()
    if hasattr(eng, "transfer_stats"):
        timings["transfers"] = eng.transfer_stats()
    if args.json:
        out = []
        for i, r in enumerate(results):
            row = {"prompt_ids": r["prompt_ids"], "output_ids": r["output_ids"], "finish_reason": r["finish_reason"],
                   "cached_tokens": r["cached_tokens"]}
            if "speculative" in r:
                row["speculative"] = r["speculative"]
            if codec is not None:
                row["text"] = texts[i]
            out.append(row)
        print(json.dumps({"requests": out, "timings": timings}))
    elif live:
        print(f"\n[{results[0]['finish_reason']}; {len(results[0]['output_ids'])} tokens] timings: {timings}")
    else:
        for i, r in enumerate(results):
            shown = repr(texts[i]) if codec is not None else r["output_ids"]
            print(f"prompt {r['prompt_ids']} -> {shown} ({r['finish_reason']})")
        print(f"timings: {timings}")
    return 0


def cmd_serve(args) -> int:
    from pathlib import Path

    from v41cp.checkpoint import default_checkpoint
    from v41cp.serving.api.server import run_server

    codec = _codec(args, required=False)
    cap = _capacity(args, args.max_context)
    cfg, eng = _engine(args, cap)
    control = None
    if getattr(args, "nnodes", 1) > 1:            # rank 0 serves HTTP, the others follow its broadcast commands
        from v41cp.serving.api.server import run_follower
        from v41cp.serving.multihost.control_plane import ControlPlane

        control = ControlPlane()
        if not control.leader:
            run_follower(eng, control)
            return 0
    name = args.served_model_name or Path(args.checkpoint or default_checkpoint()).name
    run_server(eng, codec, name, args.host, args.port, progress=sys.stderr.isatty(), log_level=args.log_level,
               control=control)
    return 0


def _bench_rows(eng, cfg, lengths, args) -> list[dict]:
    import numpy as np

    from v41cp.serving.engine import SamplingParams

    rng = np.random.default_rng(0)
    rows = []
    for n in lengths:
        for i in range(args.batch):
            eng.submit((n, i), rng.integers(3, cfg.vocab_size, n).tolist(),
                       SamplingParams(max_new_tokens=args.steps + 1, stop_on_eos=False))
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
        row = {"context": n, "batch": args.batch, "prefill_tokens_per_s": round(n * args.batch / prefill_s, 1),
               "decode_step_ms_p50": round(float(np.percentile(lat, 50)) * 1e3, 3),
               "decode_step_ms_p90": round(float(np.percentile(lat, 90)) * 1e3, 3),
               "decode_step_ms_p99": round(float(np.percentile(lat, 99)) * 1e3, 3),
               "decode_tokens_per_s": round(args.batch / float(np.median(lat)), 1)}
        if eng.speculative is not None:         # several tokens per step: the rate of the tokens emitted
            row["decode_tokens_per_s"] = round(float(emitted.sum() / lat.sum()), 1)
            row["tokens_per_step"] = round(float(emitted.mean()), 3)
        rows.append(row)
    return rows


def _kvp_structure(eng, cfg, cap, budget_bytes: int) -> dict:
    """Per-rank cache bytes, collective bytes of the compiled step and the context capacity at a fixed
    per-device page budget (exact accounting, not timings). ``cp_group``: bytes of the step's collectives
    over the cp groups — the DCP payload (``cp_group_analytic``) plus any layout collective GSPMD happens to
    run over cp (e.g. when ``o_groups`` does not divide attention TP)."""
    from v41cp.config import preset
    from v41cp.serving.attention.dcp import collective_plan
    from v41cp.serving.cache.spec import CacheSpec
    from v41cp.sharding.hlo_stats import collective_bytes, mesh_axis_groups

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


def cmd_bench(args) -> int:
    if args.kind == "kernels":
        from v41cp.kernel_bench import run

        ints = lambda text: tuple(int(x) for x in text.split(","))
        out = run(args.shapes, ints(args.contexts), ints(args.batches), tuple(args.kernels.split(",")), args.reps,
                  not args.no_xla, args.sweep, progress=sys.stderr.isatty(), expert_tokens=ints(args.expert_tokens))
        print(json.dumps(out) if args.json else json.dumps(out, indent=1))
        return 0
    from v41cp.serving.engine import Capacity

    lengths = [int(x) for x in args.lengths.split(",")]
    block = 16
    cap = Capacity(max_batch=args.batch, max_tokens=-(-(max(lengths) + args.steps + 1) // block) * block,
                   block_tokens=block, prefill_chunk=64, **_prefill_options(args))
    cfg, eng = _engine(args, cap)
    rows = _bench_rows(eng, cfg, lengths, args)
    out = {"bench": args.kind, "capacity": {"max_batch": cap.max_batch, "max_tokens": cap.max_tokens,
                                             "block_tokens": cap.block_tokens},
           "topology": {"devices": _global_devices(args), "tp_size": args.tp_size or _global_devices(args),
                        "kv_parallel_size": args.kv_parallel_size, "dcp_merge": args.dcp_merge, "dcp_q": args.dcp_q},
           "rows": rows, "compiles": eng.compile_counts()}
    if eng.speculative is not None:
        out["speculative"] = eng.speculative_stats()
    if eng.prefix is not None:
        out["prefix_cache"] = eng.prefix_stats()
    if args.kind == "prefill":
        for r in out["rows"]:
            for k in [k for k in r if k.startswith("decode")]:
                r.pop(k)
    else:
        out.update(_kvp_structure(eng, cfg, cap, args.cache_budget_mib * 2**20))
        if args.kv_parallel_size > 1:           # KVP = 1 on the same mesh, side by side, for the step-time ratio
            from v41cp.serving.engine import Engine

            base = Engine(eng.params, cfg, cap, parallel=_parallel(args, kv_parallel_size=1))
            base_rows = _bench_rows(base, cfg, lengths, args)
            base_struct = _kvp_structure(base, cfg, cap, args.cache_budget_mib * 2**20)
            out["kvp1"] = {"rows": base_rows, "per_rank_cache_bytes": base_struct["per_rank_cache_bytes"],
                           "collective_bytes_per_step": base_struct["collective_bytes_per_step"],
                           "max_resident_tokens": base_struct["max_resident_tokens"]}
            out["step_time_vs_kvp1"] = [round(r["decode_step_ms_p50"] / b["decode_step_ms_p50"], 3)
                                        for r, b in zip(rows, base_rows)]
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0


def cmd_plan(args) -> int:
    """Compile (never run) the decode step or the prefill with abstract weights and print its per-device
    structure (`v41cp.plan`)."""
    from v41cp.plan import plan_program

    if args.preset and args.checkpoint:
        raise ValueError("plan: give --preset or --checkpoint, not both")
    cfg = _load_cfg(args)
    if args.keep_quantized:
        cfg = cfg.replace(keep_quantized=True)
    cfg = cfg.replace(**_backends(args))
    out = plan_program(cfg, args.mode, args.batch, args.context, _parallel(args), block_tokens=args.block_tokens,
                       ced=args.ced, device_memory_gb=args.device_memory_gb)
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0


def _topology_flags(p) -> None:
    p.add_argument("--devices", type=int, default=1,
                   help="devices to use (on a CPU host: simulated CPU devices); tp x dp must equal it")
    p.add_argument("--tp-size", type=int, help="attention tensor-parallel size (default: --devices)")
    p.add_argument("--kv-parallel-size", type=int, default=1, help="KVP: ranks sharing one request's global pages")
    p.add_argument("--decode-context-parallel-size", type=int,
                   help="DCP group size (must equal --kv-parallel-size; default: equal to it)")
    # the values of v41cp.sharding.topology.DCP_MERGES (not imported here: jax must start after --devices is read)
    p.add_argument("--dcp-merge", choices=("ag_rs", "a2a", "heads"), default="ag_rs",
                   help="DCP decode attention: ag_rs / a2a merge partials over owned entries; heads gathers the "
                        "selected records and splits the query heads (attention work / N)")
    p.add_argument("--dcp-q", choices=("gather", "replicate"), default="gather",
                   help="DCP queries: all-gather heads per layer, or replicated query projections")
    q = p.add_argument_group("query context parallelism (prefill; 1 = off, else the attention TP size)")
    q.add_argument("--query-context-parallel-size", type=int, default=1,
                   help="model-wide QCP of the engine's prefill (per-request zigzag rows over attention TP; "
                        "KVP 1 or equal to it); generate / bench")
    q.add_argument("--deepseek-v41-indexer-query-parallel-size", dest="indexer_query_parallel_size", type=int,
                   default=1, help="operator-local indexer QCP (forward; the engine's span prefill)")
    q.add_argument("--deepseek-v41-attention-query-parallel-size", dest="attention_query_parallel_size", type=int,
                   default=1, help="operator-local attention QCP (forward; the engine's span prefill)")
    q.add_argument("--deepseek-v41-indexer-query-min-tokens", dest="indexer_query_min_tokens", type=int,
                   default=1024, help="indexer QCP applies from this many query rows")
    q.add_argument("--deepseek-v41-attention-query-min-tokens", dest="attention_query_min_tokens", type=int,
                   default=1024, help="attention QCP applies from this many rows (global layers)")
    q.add_argument("--deepseek-v41-attention-query-swa-min-tokens", dest="attention_query_swa_min_tokens", type=int,
                   default=4096, help="attention QCP applies from this many rows (SWA-only layers)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="v41cp", description="DeepSeek-V4.1 in JAX with context parallelism")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("info", "config summary and per-layer roles"),
                        ("forward", "next-token predictions for a prompt of token ids")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--checkpoint", help="released-layout checkpoint directory (default: embedded tiny model)")
        s.add_argument("--no-fake-quant", action="store_true", help="switch the cache fake-quant off")
        s.add_argument("--json", action="store_true", help="print JSON")
        if name == "info":
            s.add_argument("--preset", help="show a named preset instead (v41-flash, tiny, ...)")
        else:
            s.add_argument("--tokens", help='prompt token ids, e.g. "5 17 42" (default: a seeded random prompt)')
            s.add_argument("--length", type=int, default=40, help="length of the random prompt")
            s.add_argument("--seed", type=int, default=1)
            s.add_argument("--top", type=int, default=5)
            _backend_flags(s)
            _topology_flags(s)
    c = sub.add_parser("convert", help="convert a released-layout checkpoint to an orbax checkpoint")
    c.add_argument("src", help="released-layout directory (config.json, tokenizer.json, safetensors)")
    c.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    c.add_argument("--dtype", choices=("bf16", "fp32"), help="storage dtype of the backbone (default: the config's)")
    c.add_argument("--keep-quantized", action="store_true",
                   help="keep routed experts FP4 and Engram tables FP8 (decoded inside the forward)")
    c.add_argument("--workers", type=int, default=1, help="subtrees converted at once, each in its own process "
                   "(host memory grows about linearly with it)")
    c.add_argument("--overwrite", action="store_true")
    c.add_argument("--json", action="store_true", help="print the summary as JSON (no progress bar)")
    g = sub.add_parser("generate", help="generate tokens with the serving engine")
    g.add_argument("--checkpoint")
    g.add_argument("--prompt", action="append", help="prompt text (the checkpoint's tokenizer.json); repeat for a "
                   "batch. Without --json the text streams to the terminal (one prompt) as it is generated")
    g.add_argument("--prompt-ids", action="append", help="comma-separated token ids; repeat for a batch")
    g.add_argument("--chat", action="store_true", help="each --prompt is a user message, put into the checkpoint's "
                   "chat format (tokenizer_config.json chat_template or chat_template.jinja)")
    g.add_argument("--system", help="system message for --chat")
    g.add_argument("--max-new-tokens", type=int, default=8)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true", help="keep generating after the EOS token")
    _capacity_flags(g)
    _topology_flags(g)
    _pd_flags(g)
    _distributed_flags(g)
    _backend_flags(g)
    _prefill_flags(g)
    _speculative_flags(g)
    g.add_argument("--no-fake-quant", action="store_true")
    g.add_argument("--json", action="store_true")
    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    v.add_argument("--checkpoint")
    v.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--served-model-name", help="the model name clients send (default: the checkpoint folder)")
    v.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    _capacity_flags(v, max_batch=8, max_context=256)
    _topology_flags(v)
    _pd_flags(v)
    _distributed_flags(v)
    _backend_flags(v)
    _prefill_flags(v)
    _speculative_flags(v)
    v.add_argument("--no-fake-quant", action="store_true")
    b = sub.add_parser("bench", help="decode / prefill benchmark of the engine, or of the kernels (prints JSON)")
    b.add_argument("kind", choices=("decode", "prefill", "kernels"))
    b.add_argument("--checkpoint")
    b.add_argument("--lengths", default="64,512,2048", help="context lengths")
    b.add_argument("--batch", type=int, default=1)
    b.add_argument("--steps", type=int, default=32, help="decode steps per length")
    _topology_flags(b)
    _distributed_flags(b)
    _backend_flags(b)
    _prefill_flags(b)
    _speculative_flags(b)
    b.add_argument("--cache-budget-mib", type=int, default=64,
                   help="per-device global-page budget for max_resident_tokens (decode)")
    b.add_argument("--no-fake-quant", action="store_true")
    b.add_argument("--json", action="store_true")
    k = b.add_argument_group("bench kernels")
    k.add_argument("--shapes", choices=("flash", "tiny"), default="flash", help="V4.1-Flash shapes or toy ones")
    k.add_argument("--contexts", default="8192,131072,1048576", help="context lengths in tokens")
    k.add_argument("--batches", default="1,16,64", help="batch sizes")
    k.add_argument("--kernels", default="indexer,attention,experts", help="which kernels")
    k.add_argument("--expert-tokens", default="64,4096", help="token counts of the grouped FP4 expert GEMM")
    k.add_argument("--reps", type=int, default=10, help="timed calls per case (median reported)")
    k.add_argument("--no-xla", action="store_true", help="skip the XLA reference paths")
    k.add_argument("--sweep", action="store_true", help="also time alternative kernel parameters (block sizes, warps)")
    n = sub.add_parser("plan", help="compile (never run) a step with abstract weights: per-device FLOPs, memory, "
                       "collective bytes vs the analytic floor (prints JSON)")
    n.add_argument("--preset", help="a named preset (v41-flash, tiny, ...)")
    n.add_argument("--checkpoint", help="a checkpoint directory (its config.json; no weights are read)")
    n.add_argument("--mode", choices=("decode", "prefill"), default="decode")
    n.add_argument("--batch", type=int, default=1, help="decode: batch rows; prefill: prompts")
    n.add_argument("--context", type=int, default=4096,
                   help="decode: history capacity per request (tokens); prefill: prompt length")
    n.add_argument("--block-tokens", type=int, default=16, help="tokens per cache page")
    n.add_argument("--keep-quantized", action="store_true", help="FP4 experts / FP8 Engram as stored")
    n.add_argument("--ced", action="store_true", help="prefill with CED narrowing")
    n.add_argument("--device-memory-gb", type=float, default=141.0, help="device memory for 'fits' (GB, 10^9 B)")
    n.add_argument("--no-fake-quant", action="store_true")
    n.add_argument("--json", action="store_true")
    _topology_flags(n)
    _backend_flags(n)
    args = p.parse_args(argv)
    if getattr(args, "nnodes", 1) > 1 and getattr(args, "prefill_devices", None) is not None and args.cmd != "generate":
        p.error(f"{args.cmd} with --prefill-devices across processes (--nnodes > 1) is not supported yet: PD across "
                "processes runs `generate` (prefill in process 0, decode in process 1)")
    if getattr(args, "devices", 1) > 1 and "jax" not in sys.modules:
        import os

        flags = os.environ.get("XLA_FLAGS", "")
        if "--xla_force_host_platform_device_count" not in flags:     # keep the user's other XLA flags
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()
    if args.cmd in ("generate", "bench") and (getattr(args, "max_new_tokens", 1) <= 0):
        p.error(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.cmd == "forward":
        args.preset = None
        if args.length <= 0:
            p.error(f"--length must be positive, got {args.length}")
    from v41cp.checkpoint import CheckpointError
    from v41cp.config import ConfigError

    try:
        if hasattr(args, "nnodes"):
            _start_distributed(args)
        return {"info": cmd_info, "forward": cmd_forward, "convert": cmd_convert, "generate": cmd_generate,
                "serve": cmd_serve, "bench": cmd_bench, "plan": cmd_plan}[args.cmd](args)
    except (ConfigError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
