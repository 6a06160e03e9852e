"""``v41cp generate``: generate tokens with the serving engine for token-id or text prompts (with ``--chat``, in
the checkpoint's chat format); text streams to the terminal for one prompt, ``--json`` prints every request."""

from __future__ import annotations

import json
import time

from v41cp.cli import flags
from v41cp.cli.engine import open_engine, text_codec
from v41cp.serving.engine import SamplingParams

DEFAULT_PROMPT = [5, 17, 42, 99, 3]


def add_arguments(parser) -> None:
    flags.add(parser, flags.ModelFlags, "checkpoint")
    parser.add_argument("--prompt", action="append", help="prompt text (the checkpoint's tokenizer.json); repeat for "
                        "a batch. Without --json the text streams to the terminal (one prompt) as it is generated")
    parser.add_argument("--prompt-ids", action="append", help="comma-separated token ids; repeat for a batch")
    parser.add_argument("--chat", action="store_true", help="each --prompt is a user message, put into the "
                        "checkpoint's chat format (tokenizer_config.json chat_template or chat_template.jinja)")
    parser.add_argument("--system", help="system message for --chat")
    parser.add_argument("--thinking", action="store_true", help="with --chat: the chat format's thinking mode "
                        "(the DeepSeek-V4 encoding's; a template gets thinking=true)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating after the EOS token")
    for group in (flags.CapacityFlags, flags.TopologyFlags, flags.QueryParallelFlags, flags.DisaggregationFlags,
                  flags.DistributedFlags, flags.BackendFlags, flags.PrefillFlags, flags.SpeculativeFlags):
        flags.add(parser, group)
    flags.add(parser, flags.ModelFlags, "no_fake_quant", "keep_quantized", "dequantize")
    flags.add(parser, flags.OutputFlags)
    flags.add(parser, flags.CompileCacheFlags)


def check(args) -> str | None:
    if args.max_new_tokens <= 0:
        return f"--max-new-tokens must be positive, got {args.max_new_tokens}"
    return None


def prompts(args, codec) -> list[list[int]]:
    """The prompts (token-id lists) of --prompt (through the checkpoint's tokenizer; with --chat, through its chat
    format) then --prompt-ids; a default prompt when neither is given."""
    out = []
    for text in args.prompt or []:
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": text}]
            ids = codec.chat_ids(messages, options={"thinking": True} if args.thinking else None)
        else:
            ids = codec.encode(text)
        if not ids:
            raise ValueError(f"--prompt {text!r} encodes to no tokens")
        out.append(ids)
    for p in args.prompt_ids or []:
        try:
            ids = [int(t) for t in p.replace(",", " ").split()]
        except ValueError:
            raise ValueError(f"--prompt-ids {p!r}: token ids must be integers separated by commas")
        if not ids:
            raise ValueError(f"--prompt-ids {p!r} is empty")
        out.append(ids)
    return out or [list(DEFAULT_PROMPT)]


def run(args) -> int:
    flags.DistributedFlags.from_args(args).start()
    flags.CompileCacheFlags.from_args(args).start()
    if (args.chat or args.system) and not args.prompt:
        raise ValueError("--chat / --system need --prompt TEXT (the user message)")
    codec = text_codec(flags.ModelFlags.from_args(args).path, required=bool(args.prompt))
    batch = prompts(args, codec)
    cap = flags.CapacityFlags.from_args(args).capacity(flags.PrefillFlags.from_args(args),
                                                 max(len(p) for p in batch) + args.max_new_tokens,
                                                 page=flags.ModelFlags.from_args(args).page_tokens(),
                                                 max_batch=args.max_batch or len(batch))
    t0 = time.perf_counter()
    cfg, eng = open_engine(args, cap)
    t_load = time.perf_counter() - t0
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        seed=args.seed, stop_on_eos=not args.ignore_eos)
    for i, p in enumerate(batch):
        eng.submit(i, p, sp)
    hidden = (cfg.eos_token_id,) if sp.stop_on_eos else ()
    streams = {i: codec.stream(hidden=hidden) for i in range(len(batch))} if codec is not None else {}
    live = not args.json and codec is not None and len(batch) == 1    # stream one request's text as it comes
    t0 = time.perf_counter()
    seen = {i: 0 for i in range(len(batch))}
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
    results = [eng.release(i) for i in range(len(batch))]          # as a server does: every page back
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
    timings["engine_load"] = eng.load()                            # after the releases: what is left held
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
