"""A/B step times of two source trees side by side: the decode step and the span prefill, on this machine.

``python benchmarks/step_time_ab.py --baseline DIR`` where ``DIR`` is another checkout of v41cp (e.g.
``git worktree add /tmp/v41cp-old <rev>``). Each tree runs in its own worker process (its own ``PYTHONPATH``);
the workers alternate ``--rounds`` times, each timing ``--steps`` decode steps in 10 batches (tiny checkpoint, 4
batch rows, one compile excluded; the fastest batch counts) and ``--prefills`` span prefills of 4 ragged prompts
(37 / 12 / 29 / 5 tokens; the fastest counts). The least-disturbed run is the estimate on a shared host. Prints
JSON: per tree the median of those over the rounds, and the ratios new / baseline (CPU timings are noisy: only the side-by-side
ratio means something here; absolute times count on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r'''
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from v41cp.checkpoint import default_checkpoint, load
from v41cp.serving.runner.steps import decode_step, init_cache
from v41cp.serving.step_batch import StepBatch
from v41cp.serving.runner.span_batch import build_span_batch
from v41cp.serving.runner.span_prefill import prefill_span

steps, prefills = int(sys.argv[1]), int(sys.argv[2])
cfg, params = load(default_checkpoint())
B, MB, BT = 4, 16, 4
cache = init_cache(cfg, B * MB, BT, B)
n_eng = len(cfg.engram_layer_ids)
tables = np.arange(B * MB, dtype=np.int32).reshape(B, MB)
rng = np.random.default_rng(0)

def meta(t):
    return StepBatch.decode(rng.integers(3, cfg.vocab_size, B), np.full(B, t), np.arange(B), tables, np.ones(B, bool),
                            np.zeros((B, n_eng, cfg.engram_hash_heads), np.int32))

logits, cache = decode_step(params, cache, meta(0), cfg)
logits.block_until_ready()
decode_s, t = [], 0
for _ in range(10):                             # 10 batches of steps / 10: the fastest batch (least disturbed)
    t0 = time.perf_counter()
    for _ in range(max(steps // 10, 1)):
        t += 1
        logits, cache = decode_step(params, cache, meta(t % (MB * BT)), cfg)
    logits.block_until_ready()
    decode_s.append((time.perf_counter() - t0) / max(steps // 10, 1))

prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (37, 12, 29, 5)]
span_meta = build_span_batch(cfg, prompts, 1, slots=np.arange(B), block_tables=tables)
cache = init_cache(cfg, B * MB, BT, B)
logits, cache = prefill_span(params, cache, span_meta, cfg)
logits.block_until_ready()
span_s = []
for _ in range(prefills):
    t0 = time.perf_counter()
    logits, cache = prefill_span(params, cache, span_meta, cfg)
    logits.block_until_ready()
    span_s.append(time.perf_counter() - t0)
print(json.dumps({"decode_step_s": min(decode_s), "span_prefill_s": min(span_s)}))
'''


def _run(tree: Path, steps: int, prefills: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", WORKER, str(steps), str(prefills)], env=env, cwd=tree,
                         capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise SystemExit(f"worker in {tree} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, type=Path, help="another checkout of v41cp (the 'old' tree)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prefills", type=int, default=20)
    args = ap.parse_args(argv)
    trees = {"new": Path(__file__).resolve().parents[1], "baseline": args.baseline.resolve()}
    got = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():                      # alternate: drift hits both trees alike
            got[name].append(_run(tree, args.steps, args.prefills))
    med = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in got.items()}
    print(json.dumps({"median_s": med, "ratio_new_over_baseline": {k: med["new"][k] / med["baseline"][k]
                                                                   for k in med["new"]},
                      "rounds": args.rounds, "steps": args.steps, "prefills": args.prefills}, indent=1))


if __name__ == "__main__":
    main()
