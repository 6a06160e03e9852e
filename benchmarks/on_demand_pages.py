"""Pages on demand vs reserving each request's whole output budget, side by side in one run (embedded tiny checkpoint).

The workload: ``--requests`` requests with a large output budget (``--max-tokens``, as clients send) whose outputs
end much earlier — after ``--min-output``..``--max-output`` tokens each, where the driver cancels them as a stop
string would — on an engine whose cache holds ``--num-blocks`` blocks. Two engines on the same weights:
``on_demand`` (the default: a request takes blocks as it grows, the newest is preempted when they run out) and
``reserved`` (``Capacity(reserve_output=True)``: admission reserves prompt + the whole budget), each warmed up
(`Engine.warm_up`) and then timed over the same workload.

Reported per engine: output tokens per second (CPU timings are noisy: the ratio is the result), engine steps, the
mean and largest number of requests running at once, preemptions. Checks that both emit the same tokens.

    python benchmarks/on_demand_pages.py [--requests 24] [--max-tokens 192] [--num-blocks 48]
"""

from __future__ import annotations

import argparse
import json
import time


def _run(eng, work, stop_after) -> dict:
    from v41cp.serving.engine import SamplingParams

    for rid, prompt in work.items():
        eng.submit(rid, prompt, SamplingParams(max_new_tokens=eng.capacity.max_tokens - len(prompt),
                                               stop_on_eos=False))
    running, steps = [], 0
    t0 = time.perf_counter()
    while eng.pending:
        eng.step()
        steps += 1
        running.append(eng.load()["running"])
        for rid, n in stop_after.items():                     # a stop string reached: the server cancels it
            req = eng.requests[rid]
            if req.active and len(req.output) >= n:
                eng.cancel(rid)
    seconds = time.perf_counter() - t0
    outputs = {rid: eng.requests[rid].output[:stop_after[rid]] for rid in work}
    tokens = sum(len(o) for o in outputs.values())
    return {"outputs": outputs, "seconds": seconds, "output_tokens": tokens, "steps": steps,
            "output_tokens_per_s": round(tokens / seconds, 1), "mean_running": round(sum(running) / steps, 2),
            "max_running": max(running), "preemptions": eng.load()["preemptions"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=192, help="tokens per request: prompt + output budget")
    p.add_argument("--min-output", type=int, default=8)
    p.add_argument("--max-output", type=int, default=40)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=48)
    p.add_argument("--block-tokens", type=int, default=16)
    a = p.parse_args(argv)

    import numpy as np

    from v41cp.checkpoint import default_checkpoint, load
    from v41cp.serving.capacity import Capacity
    from v41cp.serving.engine import Engine

    cfg, params = load(default_checkpoint())
    rng = np.random.default_rng(0)
    work = {i: rng.integers(3, cfg.vocab_size, a.prompt_tokens).tolist() for i in range(a.requests)}
    stop_after = {i: int(rng.integers(a.min_output, a.max_output + 1)) for i in range(a.requests)}
    cap = Capacity(max_batch=a.max_batch, max_tokens=a.max_tokens, block_tokens=a.block_tokens,
                   num_blocks=a.num_blocks)
    out = {"workload": {"requests": a.requests, "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens,
                        "outputs": [a.min_output, a.max_output], "max_batch": a.max_batch,
                        "num_blocks": a.num_blocks, "block_tokens": a.block_tokens}}
    for name, reserve in (("on_demand", False), ("reserved", True)):
        eng = Engine(params, cfg, Capacity(**{**cap.__dict__, "reserve_output": reserve}))
        eng.warm_up()
        out[name] = _run(eng, work, stop_after)
    same = out["on_demand"].pop("outputs") == out["reserved"].pop("outputs")
    out["same_tokens"] = same
    out["tokens_per_s_on_demand_over_reserved"] = round(out["on_demand"]["output_tokens_per_s"]
                                                        / out["reserved"]["output_tokens_per_s"], 2)
    print(json.dumps(out, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
