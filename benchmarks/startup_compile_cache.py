"""Start-up of `python -m v41cp generate` with the persistent compilation cache, side by side in one run: a cold run
(a fresh cache folder: every program compiled and stored), a warm run (the same command again: every program loaded)
and a run with ``--no-compilation-cache``. Prints JSON: each run's wall time (process start to exit) and its own
``timings`` (``load_s``, ``generate_s``), and the ratios warm / cold and warm / no cache. CPU timings are noisy:
the ratios measured side by side are what the numbers mean here.

``python benchmarks/startup_compile_cache.py [--devices N] [--max-new-tokens K] [--rounds R]`` (extra generate flags
after ``--``); the median over ``--rounds`` rounds of the three runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def _generate(flags: list[str], env: dict) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "v41cp", "generate", "--json", *flags], capture_output=True,
                         text=True, env=env, timeout=1200)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"generate failed:\n{out.stderr[-4000:]}")
    t = json.loads(out.stdout)["timings"]
    return {"wall_s": wall, "load_s": t["load_s"], "generate_s": t["generate_s"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("extra", nargs="*", help="more generate flags (after --)")
    a = ap.parse_args(argv)
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.setdefault("JAX_PLATFORMS", "cpu")
    flags = ["--devices", str(a.devices), "--prompt-ids", "5,17,42", "--max-new-tokens", str(a.max_new_tokens),
             *a.extra]
    runs = {"cold": [], "warm": [], "no_cache": []}
    for _ in range(a.rounds):
        folder = tempfile.mkdtemp(prefix="v41cp-cache-bench-")
        try:
            cached = flags + ["--compilation-cache-dir", folder]
            runs["cold"].append(_generate(cached, env))
            runs["warm"].append(_generate(cached, env))
            runs["no_cache"].append(_generate(flags + ["--no-compilation-cache"], env))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    print(json.dumps({"median": med, "rounds": a.rounds, "flags": flags,
                      "ratio_wall_warm_over_cold": med["warm"]["wall_s"] / med["cold"]["wall_s"],
                      "ratio_wall_warm_over_no_cache": med["warm"]["wall_s"] / med["no_cache"]["wall_s"]}, indent=1))


if __name__ == "__main__":
    main()
