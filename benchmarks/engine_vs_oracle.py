"""Decode tokens/s of the v41cp engine vs the NeMo oracle producing greedy tokens by full recompute, side
by side in one run, at several prompt lengths on the embedded tiny model. Prints one JSON object.

    python benchmarks/engine_vs_oracle.py [--lengths 64,512,2048] [--new 16]

The oracle re-runs the whole sequence for every new token (it has no KV cache); the engine prefills
once and then runs its jitted decode step. CPU timings are noisy: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="64,512,2048")
    p.add_argument("--new", type=int, default=16)
    args = p.parse_args()
    from v41cp.checkpoint import default_checkpoint, default_released_checkpoint, load
    from v41cp.serving.engine import Capacity, Engine, SamplingParams

    lengths = [int(x) for x in args.lengths.split(",")]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in lengths]
    py = os.environ.get("V41CP_ORACLE_PYTHON") or str(REPO / ".oracle-venv" / "bin" / "python")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "prompts.json").write_text(json.dumps(prompts))
        subprocess.run([py, str(REPO / "tests/oracle/nemo_oracle.py"), "greedy", "--out", tmp, "--weights",
                        default_released_checkpoint(), "--prompts", str(Path(tmp) / "prompts.json"), "--n",
                        str(args.new)], check=True, capture_output=True)
        oracle = json.loads((Path(tmp) / "greedy.json").read_text())
    cfg, params = load(default_checkpoint())
    block = 64
    cap = Capacity(max_batch=1, max_tokens=-(-(max(lengths) + args.new) // block) * block, block_tokens=block,
                   prefill_chunk=256)
    eng = Engine(params, cfg, cap)
    eng.submit("warmup", prompts[0][:8], SamplingParams(max_new_tokens=3, stop_on_eos=False))
    eng.run()                                                   # compile the step and the prefill chunk
    rows = []
    for prompt, ref in zip(prompts, oracle):
        before = dict(eng.stats)
        eng.submit(len(prompt), prompt, SamplingParams(max_new_tokens=args.new, stop_on_eos=False))
        out = eng.run()[-1]["output_ids"]
        decode_s = eng.stats["decode_s"] - before["decode_s"]
        steps = eng.stats["decode_tokens"] - before["decode_tokens"]
        prefill_s = eng.stats["prefill_s"] - before["prefill_s"]
        match = sum(a == b for a, b in zip(out, ref["output_ids"]))
        rows.append({"prompt_len": len(prompt), "new_tokens": args.new, "greedy_tokens_equal": match,
                     "engine_prefill_s": round(prefill_s, 3), "engine_decode_tokens_per_s": round(steps / decode_s, 1),
                     "engine_decode_step_ms": round(decode_s / steps * 1e3, 3),
                     "oracle_tokens_per_s": round(args.new / ref["seconds"], 2),
                     "decode_speedup_vs_oracle": round((steps / decode_s) / (args.new / ref["seconds"]), 1)})
    print(json.dumps({"model": "embedded tiny (tiny-sparse)", "rows": rows, "compiles": eng.compile_counts()}))


if __name__ == "__main__":
    main()
