"""Exact prefix caching on a shared-prefix workload, cold and warm side by side in one run (embedded tiny checkpoint).

The workload: ``--questions`` requests that share a ``--system-tokens`` prefix (a system prompt / few-shot block),
each with its own ``--question-tokens``, submitted ``--batch`` at a time, twice over (the second round repeats the
questions, as a client retrying). Two engines on the same weights: ``cold`` (no prefix caching) and ``warm``
(``Capacity(prefix_caching=True)``), each run once to compile and then timed.

Reported: the prefix cache's hit rate (reused / prompt tokens), prefill tokens saved, lookups and hits, stored states
and their bytes per device against the page bytes of the blocks they make reusable (exact accounting), prefill CPU
seconds and their warm / cold ratio (CPU timings are noisy: the ratio is the result), and the stored-state size of
V4.1-Flash at 256-token blocks (`CacheSpec.prefix_state_bytes`). Checks that both engines emit the same tokens.

    python benchmarks/prefix_cache.py [--system-tokens 61] [--question-tokens 7] [--questions 6] [--batch 3]
"""

from __future__ import annotations

import argparse
import json


def _run(engine_factory, prompts, batch, new_tokens):
    from v41cp.serving.engine import SamplingParams

    eng = engine_factory()
    sp = SamplingParams(max_new_tokens=new_tokens, stop_on_eos=False)
    ids = list(prompts)
    for start in range(0, len(ids), batch):
        for rid in ids[start:start + batch]:
            eng.submit(rid, prompts[rid], sp)
        eng.run()
    return eng, {rid: eng.result(rid)["output_ids"] for rid in ids}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system-tokens", type=int, default=61)
    p.add_argument("--question-tokens", type=int, default=7)
    p.add_argument("--questions", type=int, default=6)
    p.add_argument("--batch", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--block-tokens", type=int, default=8)
    args = p.parse_args(argv)

    import numpy as np

    from v41cp.checkpoint import default_checkpoint, load
    from v41cp.config import preset
    from v41cp.serving.cache.spec import CacheSpec
    from v41cp.serving.engine import Capacity, Engine

    cfg, params = load(default_checkpoint())
    rng = np.random.default_rng(0)
    system = rng.integers(3, cfg.vocab_size, args.system_tokens).tolist()
    questions = [rng.integers(3, cfg.vocab_size, args.question_tokens).tolist() for _ in range(args.questions)]
    prompts = {(r, i): system + q for r in range(2) for i, q in enumerate(questions)}
    bt = args.block_tokens
    longest = args.system_tokens + args.question_tokens + args.new_tokens
    cap = Capacity(max_batch=args.batch, max_tokens=-(-longest // bt) * bt, block_tokens=bt, prefill_chunk=16)
    engines = {"cold": lambda: Engine(params, cfg, Capacity(**{**cap.__dict__, "prefix_caching": False})),
               "warm": lambda: Engine(params, cfg, Capacity(**{**cap.__dict__, "prefix_caching": True}))}
    out, tokens = {}, {}
    for name, factory in engines.items():
        _run(factory, {k: v for k, v in list(prompts.items())[:args.batch]}, args.batch, args.new_tokens)  # compile
        eng, tokens[name] = _run(factory, prompts, args.batch, args.new_tokens)
        out[name] = {"prefill_tokens": eng.stats["prefill_tokens"], "prefill_s": round(eng.stats["prefill_s"], 4)}
        if eng.prefix is not None:
            out[name]["prefix_cache"] = eng.prefix_stats()
    if tokens["warm"] != tokens["cold"]:
        raise SystemExit("the warm engine's tokens differ from the cold engine's")
    st = out["warm"]["prefix_cache"]
    spec = CacheSpec(cfg, bt, quantized=cfg.fake_quant)
    flash = CacheSpec(preset("v41-flash"), 256)
    result = {
        "workload": {"requests": len(prompts), "system_tokens": args.system_tokens,
                     "question_tokens": args.question_tokens, "block_tokens": bt, "batch": args.batch},
        "hit_rate": round(st["hit_rate"], 4), "prefill_tokens_saved": st["prefill_tokens_saved"],
        "hits": st["hits"], "lookups": st["queries"],
        "prefill_tokens": {"cold": out["cold"]["prefill_tokens"], "warm": out["warm"]["prefill_tokens"]},
        "prefill_s": {"cold": out["cold"]["prefill_s"], "warm": out["warm"]["prefill_s"],
                      "warm_over_cold": round(out["warm"]["prefill_s"] / out["cold"]["prefill_s"], 3)},
        "stored_states": st["states"], "state_bytes_per_device": st["state_bytes"],
        "state_bytes_each": spec.prefix_state_bytes, "block_bytes": spec.block_bytes,
        "cached_blocks": st["cached_blocks"],
        "v41_flash": {"state_bytes_each": flash.prefix_state_bytes, "block_bytes_256_tokens": flash.block_bytes,
                      "state_in_blocks": round(flash.prefix_state_bytes / flash.block_bytes, 2)},
        "same_tokens": True,
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
