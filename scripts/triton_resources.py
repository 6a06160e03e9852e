"""Registers, spills, shared memory and global loads of every Pallas kernel configuration, on a host without a GPU.

Each kernel op is lowered at V4.1-Flash shapes exactly as the library calls it, for every ``SWEEP`` configuration
(`v41cp.kernel_bench.SWEEP`), and compiled for an H200 (or H100) by jaxlib's own compiler — the Triton inside
XLA that compiles the kernels on a real GPU — through JAX's compile-only CUDA topology
(`v41cp.targets.kernel_resources`); ``ptxas -v`` from the nvcc wheel reports each kernel's registers and spills.
Needs the gpu-plan extra (``pip install -e ".[gpu-plan]"``). Prints one JSON line per kernel (and writes them to
``--out`` if given).

Usage: ``python scripts/triton_resources.py [--target h200] [--ops sparse_attention,...] [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from v41cp.targets import use_cpu_host  # noqa: E402

use_cpu_host()                                 # before JAX starts its backends

from v41cp.kernel_bench import SWEEP  # noqa: E402
from v41cp.targets.kernel_resources import OPS, kernel_resources  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", choices=("h100", "h200"), default="h200")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {sorted(OPS)}")
    ap.add_argument("--out", help="also write the JSON lines here")
    a = ap.parse_args(argv)
    lines = []
    for op in a.ops.split(","):
        if op not in OPS:
            ap.error(f"--ops: unknown kernel op {op!r} (one of {sorted(OPS)})")
        for config in SWEEP[OPS[op]]:
            try:
                rows = kernel_resources(a.target, configs={OPS[op]: config}, ops=(op,))
            except ValueError as e:                 # blocks that do not divide these widths
                rows = [{"op": op, "error": str(e)}]
            for row in rows:
                line = json.dumps({"config": config, **row})
                print(line, flush=True)
                lines.append(line)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
