"""Forward wall time of the tiny model: v41cp (jitted JAX, CPU) vs the NeMo oracle (eager torch, CPU),
side by side in one run, on the same weights and prompt. Prints one JSON object.

    python benchmarks/forward_vs_oracle.py [--preset tiny] [--seq 40] [--batch 1] [--repeats 20]

CPU timings are noisy; the ratio measured in one run is what to compare, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny-sparse")
    p.add_argument("--seq", type=int, default=40)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    py = os.environ.get("V41CP_ORACLE_PYTHON") or str(REPO / ".oracle-venv" / "bin" / "python")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([py, str(REPO / "tests/oracle/nemo_oracle.py"), "model", "--out", tmp, "--preset",
                        args.preset, "--seq", str(args.seq), "--batch", str(args.batch), "--repeats",
                        str(args.repeats)], check=True, capture_output=True)
        oracle = json.loads((Path(tmp) / "timing.json").read_text())
        import numpy as np
        from helpers import load_export, rel_err

        from v41cp import model

        cfg, params, ref = load_export(Path(tmp))
        t0 = time.perf_counter()
        logits = np.asarray(model.forward(params, cfg, ref["input_ids"]))
        first = time.perf_counter() - t0
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            np.asarray(model.forward(params, cfg, ref["input_ids"]))
            times.append(time.perf_counter() - t0)
    steady = sorted(times)[len(times) // 2]
    print(json.dumps({
        "preset": args.preset, "batch": args.batch, "seq": args.seq, "repeats": args.repeats,
        "v41cp_first_forward_incl_compile_s": round(first, 4), "v41cp_steady_forward_s": round(steady, 5),
        "oracle_first_forward_s": round(oracle["first_forward_s"], 4),
        "oracle_steady_forward_s": round(oracle["steady_forward_s"], 5),
        "oracle_over_v41cp_steady": round(oracle["steady_forward_s"] / steady, 2),
        "logits_rel_err_vs_oracle": rel_err(logits, ref["logits"]),
    }))


if __name__ == "__main__":
    main()
