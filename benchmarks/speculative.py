"""DSpark speculative decoding vs plain decoding, side by side in one run on the embedded tiny checkpoint.

Three engines on the same weights, prompts and greedy settings, each timed over its decode rounds (after a
warm-up run that compiles every program):

* ``plain`` — one token per request per step;
* ``ideal`` — speculative with injected always-right proposals (the target's own greedy continuation, computed
  by the plain run): every draft is accepted, the ideal target steps per token is 1 / (n + 1); no drafter runs;
* ``dspark`` — speculative with the checkpoint's drafter (``mtp.*``; the tiny model's drafter is an untrained
  seeded initialisation, so its acceptance says nothing about a trained one).

Reported: target steps per emitted token, mean accepted drafts per step, CPU seconds per emitted token and
their ratio to plain; the draft step's own time per round. CPU timings are noisy: the ratios are the result.
Checks that both speculative runs emit the plain run's tokens.

    python benchmarks/speculative.py [--draft-tokens 3] [--batch 3] [--new-tokens 24] [--devices 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft-tokens", type=int, default=3)
    p.add_argument("--batch", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=9)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine (the median is reported)")
    args = p.parse_args(argv)

    import numpy as np

    from v41cp.checkpoint import default_checkpoint, load, open_drafter
    from v41cp.serving.engine import Capacity, Engine, SamplingParams
    from v41cp.serving.runner.speculative import Speculative

    cfg, params = load(default_checkpoint())
    drafter = open_drafter(default_checkpoint(), cfg)
    n = args.draft_tokens
    cap = Capacity(max_batch=args.batch, max_tokens=-(-(args.prompt_tokens + args.new_tokens + n) // 16) * 16,
                   block_tokens=16, prefill_chunk=16)
    rng = np.random.default_rng(0)
    prompts = {i: rng.integers(3, cfg.vocab_size, args.prompt_tokens).tolist() for i in range(args.batch)}
    sp = SamplingParams(max_new_tokens=args.new_tokens, stop_on_eos=False)
    truth: dict = {}

    def propose(rid, history, k):
        cont = truth[rid][len(history):len(history) + k]
        return cont + [3] * (k - len(cont))

    makers = {"plain": lambda: Engine(params, cfg, cap),
              "ideal": lambda: Engine(params, cfg, cap, speculative=Speculative(None, n, proposer=propose)),
              "dspark": lambda: Engine(params, cfg, cap, speculative=Speculative(drafter, n))}
    out = {"checkpoint": os.path.basename(default_checkpoint()), "draft_tokens": n, "batch": args.batch,
           "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens, "engines": {}}
    outputs = {}
    for name, make in makers.items():
        times, stats = [], None
        for rep in range(args.repeats + 1):                  # run 0 compiles
            eng = make()
            for rid, prompt in prompts.items():
                eng.submit(rid, prompt, sp)
            eng.step()                                       # the prefill round (and the first decode round)
            tokens0 = eng.stats["decode_tokens"]
            t0 = time.perf_counter()
            res = eng.run()
            wall = time.perf_counter() - t0
            emitted = eng.stats["decode_tokens"] - tokens0
            if rep:
                times.append(wall / emitted)
            stats = eng.speculative_stats() if eng.speculative is not None else None
            outputs[name] = {r["id"]: r["output_ids"] for r in res}
        if name == "plain":
            truth.update({rid: prompts[rid] + outputs["plain"][rid] for rid in prompts})
        row = {"seconds_per_token": float(np.median(times)), "steps": eng.stats["decode_steps"]}
        if stats is not None:
            row.update({k: stats[k] for k in ("target_steps_per_token", "mean_accepted_length", "drafts_proposed",
                                              "drafts_accepted")})
        out["engines"][name] = row
    plain = out["engines"]["plain"]["seconds_per_token"]
    for name in ("ideal", "dspark"):
        out["engines"][name]["time_per_token_vs_plain"] = round(out["engines"][name]["seconds_per_token"] / plain, 3)
    out["ideal_target_steps_per_token"] = 1 / (n + 1)
    out["tokens_equal_plain"] = {k: outputs[k] == outputs["plain"] for k in ("ideal", "dspark")}
    # the draft step alone, per round (the "ideal" engine does not run it)
    import jax
    import jax.numpy as jnp

    from v41cp.model import embedding_and_head
    from v41cp.serving.cache.device_cache import init_draft_cache
    from v41cp.serving.runner.speculative import draft_step

    dcache = init_draft_cache(cfg, args.batch)
    call = lambda: draft_step(drafter, *embedding_and_head(params), cfg, dcache, jnp.arange(args.batch),
                              jnp.full(args.batch, 5), jnp.full(args.batch, args.prompt_tokens), n)
    jax.block_until_ready(call())
    t0 = time.perf_counter()
    for _ in range(20):
        jax.block_until_ready(call())
    out["draft_step_seconds"] = (time.perf_counter() - t0) / 20
    print(json.dumps(out, indent=1))
    return 0 if all(out["tokens_equal_plain"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
