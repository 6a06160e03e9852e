"""The test suite's profile: runs pytest (by default the README's suite command, from this checkout) with the probe
of ``benchmarks/suite_probe`` in every process, samples the resident memory of the run's Python processes every 2 s,
and prints JSON: pytest's wall time and outcome line, the XLA backend compiles (every program XLA compiled, in
every process: a program compiled in two processes counts twice) and persistent-cache loads (count, seconds),
trace and lowering seconds, the functions that took the most compile time, the slowest tests with what each compiled (its
own process and its children), and the peak memory (resident, summed over pytest's process tree, and the largest
process).

``python benchmarks/suite_profile.py [--top N] [--log FILE] [-- PYTEST ARGS]`` runs the README's suite command
(`tests/run_suite.py`: the fast tier, then the rest; PYTEST ARGS are passed to both). Run it from a fresh clone with
nothing else running for figures that compare. The run's compilation cache is a fresh folder of this script's (an
earlier run's is not used): the files in it at the end are the distinct programs the run compiled (one per XLA
cache key, however many processes compiled or loaded it), reported as ``distinct_programs``."""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).resolve().parent / "suite_probe"


def _tree_rss_kb(root: int) -> tuple[int, int]:
    """(sum, max) resident kB over ``root`` and its descendants (the run's pytest, workers and their children)."""
    parent, rss = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/status") as f:
                rss[int(pid)] = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
        except (OSError, ValueError, IndexError):
            continue
    children = collections.defaultdict(list)
    for pid, ppid in parent.items():
        children[ppid].append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children[pid])
    sizes = [rss.get(pid, 0) for pid in tree]
    return sum(sizes), max(sizes, default=0)


def _sample_memory(root: int, stop: threading.Event, peak: dict) -> None:
    while not stop.wait(2.0):
        total, largest = _tree_rss_kb(root)
        peak["sum_kb"] = max(peak["sum_kb"], total)
        peak["largest_kb"] = max(peak["largest_kb"], largest)


HEAVY_S = 1.0                                       # a compile this long is an engine-sized program


def summarize(log: Path, top: int, durations: dict[str, float]) -> dict:
    """The probe's lines → figures (see the module docstring)."""
    pending = collections.Counter()
    compiles = collections.Counter()
    compile_s = collections.Counter()
    loads = collections.Counter()
    load_s = collections.Counter()
    trace_s = lower_s = 0.0
    by_fun = collections.Counter()
    by_fun_n = collections.Counter()
    by_test = collections.defaultdict(collections.Counter)          # test -> {function: compiles}
    test_s = collections.Counter()                                    # test -> compile seconds
    users = collections.defaultdict(set)                            # cache key -> test files compiling / loading it
    compiled_keys = collections.Counter()                            # cache key -> backend compiles of it
    heavy_keys = {}                                                  # cache key -> seconds, compiles over HEAVY_S
    layouts = collections.defaultdict(set)                           # engine layout -> test files building it
    for line in log.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) not in (5, 6):
            continue
        pid, kind, name, sec, test = parts[0], parts[1], parts[2], float(parts[3]), parts[4]
        if kind == "runner":                                         # (the name column holds the layout)
            layouts[name].add(test.split("::")[0])
            continue
        key = parts[5] if len(parts) == 6 and parts[5] != "-" else None
        if key is not None and kind in ("hit", "compile") and test != "-":      # (outside any test: not a file)
            users[key].add(test.split("::")[0])
        if kind == "compile" and key is not None and not pending[pid]:
            compiled_keys[key] += 1
            if sec > HEAVY_S:
                heavy_keys[key] = heavy_keys.get(key, 0.0) + sec
        if kind == "hit":
            pending[pid] += 1
        elif kind == "trace":
            trace_s += sec
        elif kind == "lower":
            lower_s += sec
        elif kind == "compile" and pending[pid]:
            pending[pid] -= 1
            loads[pid] += 1
            load_s[pid] += sec
        elif kind == "compile":
            compiles[pid] += 1
            compile_s[pid] += sec
            by_fun[name] += sec
            by_fun_n[name] += 1
            by_test[test][name] += 1
            test_s[test] += sec
    slowest = sorted(durations.items(), key=lambda kv: -kv[1])[:top]

    def what(test: str) -> dict:
        c = by_test.get(test, collections.Counter())
        return {"compiles": sum(c.values()), "compile_s": round(test_s[test], 1), "programs": dict(c.most_common())}

    return {
        "processes": len(set(compiles) | set(loads)),
        "backend_compiles": sum(compiles.values()),
        "backend_compile_s": round(sum(compile_s.values()), 1),
        "cache_loads": sum(loads.values()),
        "cache_load_s": round(sum(load_s.values()), 1),
        "trace_s": round(trace_s, 1),
        "lower_s": round(lower_s, 1),
        "functions_compiled": len(by_fun_n),
        # from the probe's cache keys (absent from a log without them): distinct programs compiled, those compiled
        # in more than one process, and those used (compiled or loaded) by more than one test file
        "distinct_programs_compiled": len(compiled_keys),
        "programs_compiled_twice_or_more": sum(1 for n in compiled_keys.values() if n > 1),
        "programs_shared_across_files": sum(1 for files in users.values() if len(files) > 1),
        # the engine-sized programs (a compile over HEAVY_S seconds): how many distinct ones, their compile seconds
        "heavy_programs": len(heavy_keys),
        "heavy_compile_s": round(sum(heavy_keys.values()), 1),
        # distinct engine layouts (model config, capacity, topology, options: `ModelRunner`s built), and those built
        # by more than one test file
        "engine_layouts": len(layouts),
        "engine_layouts_shared_across_files": sum(1 for files in layouts.values() if len(files) > 1),
        "compile_s_per_process_top": sorted((round(v, 1) for v in compile_s.values()), reverse=True)[:6],
        "top_functions": [{"function": f, "compiles": by_fun_n[f], "seconds": round(s, 1)}
                          for f, s in by_fun.most_common(top)],
        "slowest_tests": [{"test": t, "seconds": round(s, 2), **what(t.rsplit(" ", 1)[0])} for t, s in slowest],
    }


def _durations(stdout: str) -> dict[str, float]:
    """pytest's ``--durations`` lines → {"nodeid (phase)": seconds} (setup and call kept apart)."""
    out = {}
    for m in re.finditer(r"^([\d.]+)s (call|setup|teardown)\s+(\S+)", stdout, re.M):
        out[f"{m.group(3)} {m.group(2)}"] = float(m.group(1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=3 * 3600, help="stop the suite after this many seconds")
    ap.add_argument("--log", help="keep the probe's raw lines here (default: a temporary file)")
    ap.add_argument("pytest_args", nargs="*", default=[])
    args = ap.parse_args()
    log = Path(args.log or tempfile.mkstemp(prefix="v41cp-suite-probe-", suffix=".tsv")[1])
    log.write_text("")
    cache = tempfile.mkdtemp(prefix="v41cp-suite-profile-jax-cache-")
    env = {**os.environ, "V41CP_SUITE_PROBE_LOG": str(log), "JAX_COMPILATION_CACHE_DIR": cache,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(PROBE), os.environ.get("PYTHONPATH")]))}
    peak = {"sum_kb": 0, "largest_kb": 0}
    stop = threading.Event()
    t0 = time.perf_counter()
    # its own session: a timeout stops run_suite.py, both pytest runs and their workers and children together
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "run_suite.py"), *args.pytest_args, "--durations=0"],
                            cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = threading.Thread(target=_sample_memory, args=(proc.pid, stop, peak), daemon=True)
    sampler.start()
    try:
        try:
            stdout, _ = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise SystemExit(f"the suite ran past --timeout {args.timeout} s: stopped")
        finally:
            stop.set()
        wall = time.perf_counter() - t0
        outcomes = [line.strip("= ") for line in stdout.splitlines()
                    if " in " in line and ("passed" in line or "failed" in line)]       # one per tier
        distinct = sum(1 for f in Path(cache).rglob("*-cache") if f.is_file())      # jax lru_cache: <key>-cache
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    result = {"pytest_args": args.pytest_args, "returncode": proc.returncode, "wall_s": round(wall, 1),
              "outcome": outcomes, "distinct_programs": distinct,
              "peak_rss_sum_gb": round(peak["sum_kb"] / 2**20, 2),
              "peak_rss_largest_gb": round(peak["largest_kb"] / 2**20, 2),
              **summarize(log, args.top, _durations(stdout))}
    if not args.log:
        log.unlink()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
