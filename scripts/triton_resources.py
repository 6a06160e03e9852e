"""Registers, spills and shared memory of every Pallas Triton kernel configuration, on a host without a GPU.

Each kernel is lowered at V4.1-Flash shapes exactly as the library calls it (`v41cp.kernels`, every
``SWEEP`` configuration); the Triton module each ``pallas_call`` produces is captured as text, compiled for
sm_90a (H200) by the ``triton`` package and assembled by the ``ptxas`` that ships with it (``-v``), which
reports the resources one program needs; the PTX's global loads are counted by width (static instruction
counts: ``v4.b32`` = 16-byte vector loads, ``b8`` / ``u8`` = single bytes, ``cp.async.NB`` = asynchronous
global → shared copies of N bytes, which Triton's software pipelining issues for loads inside loops). Prints one JSON line per kernel call (and writes them to
``--out`` if given).

Caveat: this is the ``triton`` package's compiler (``pip install triton`` — not a dependency of v41cp; pass
``--triton-python`` for an interpreter that has it), not the Triton fork inside jaxlib that compiles the
kernels on a real GPU, so its figures are close to but not the same as what an H200 run uses. Spills and
register pressure are structural: they show which block shapes cannot keep their accumulators in registers.

Usage: ``python scripts/triton_resources.py [--triton-python /path/to/python] [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COMPILE = r'''
import json, os, re, subprocess, sys, tempfile, warnings
warnings.filterwarnings("ignore")
import triton
from triton.backends.compiler import GPUTarget
path, warps, stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = triton.compile(path, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ptxas = next(os.path.join(bindir, n) for n in ("ptxas-blackwell", "ptxas") if os.path.exists(os.path.join(bindir, n)))
with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
    f.write(k.asm["ptx"])
r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True)
os.unlink(f.name)
num = lambda pat: int(m.group(1)) if (m := re.search(pat, r.stderr)) else None
loads = {}
for m in re.finditer(r"\bld\.global((?:\.[a-z0-9]+)*)", k.asm["ptx"]):
    loads[m.group(1).lstrip(".")] = loads.get(m.group(1).lstrip("."), 0) + 1
for m in re.finditer(r"cp\.async\.c[ag]\.shared\.global\s+\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-f]+|\d+)", k.asm["ptx"]):
    key = f"cp.async.{int(m.group(1), 0)}B"
    loads[key] = loads.get(key, 0) + 1
print(json.dumps({"global_loads_in_ptx": loads, "registers": num(r"Used (\d+) registers"), "spill_store_bytes": num(r"(\d+) bytes spill stores"),
                  "spill_load_bytes": num(r"(\d+) bytes spill loads"), "stack_bytes": num(r"(\d+) bytes stack frame"),
                  "shared_bytes": k.metadata.shared, "triton": triton.__version__,
                  "ptxas_error": r.stderr[-300:] if r.returncode else None}))
'''


def capture(fn, *avals):
    """Lower ``fn`` for CUDA; → [(kernel name, Triton module text, grid, num_warps, num_stages)] per pallas_call."""
    import jax
    from jax._src.pallas.triton import pallas_call_registration as reg

    modules = []
    original = reg.lowering.lower_jaxpr_to_triton_module

    def hook(*args, **kwargs):
        res = original(*args, **kwargs)
        modules.append(res.module.operation.get_asm())
        return res

    reg.lowering.lower_jaxpr_to_triton_module = hook
    try:
        text = jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = original
    pattern = (r'grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+) : i32, ir = ".*?", '
               r'name = "([^"]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32')
    configs = [(m.group(4), [int(m.group(i)) for i in (1, 2, 3)], int(m.group(6)), int(m.group(5)))
               for m in re.finditer(pattern, text, flags=re.DOTALL)]
    if len(configs) != len(modules):
        raise RuntimeError(f"{len(modules)} Triton modules but {len(configs)} kernel calls in the lowered program")
    return [(name, mod, grid, w, s) for (name, grid, w, s), mod in zip(configs, modules)]


def cases():
    """(kernel, config, fn, avals) at V4.1-Flash shapes: decode attention at batch 64 (128 window + 512 selected),
    the indexer at 128K context × batch 16, the expert gate GEMM at decode (tiles of 16) and prefill (128)."""
    import jax
    import jax.numpy as jnp

    from v41cp.kernel_bench import SWEEP
    from v41cp.kernels.grouped_matmul import grouped_fp4_matmul
    from v41cp.kernels.indexer_topk import indexer_topk
    from v41cp.kernels.sparse_attention import sparse_attention

    s = jax.ShapeDtypeStruct
    u8, i32, bf16 = jnp.uint8, jnp.int32, jnp.bfloat16
    for kw in SWEEP["attention"]:
        yield "sparse_attention", kw, (lambda q, wq, ws, cq, cs, i, j, kw=kw: sparse_attention(
            q, ({"q": wq, "s": ws}, {"q": cq, "s": cs}), (i, j), backend="pallas", interpret=False, **kw)), (
            s((64, 64, 512), bf16), s((8192, 512), u8), s((8192, 16), u8), s((1 << 20, 256), u8),
            s((1 << 20, 32), u8), s((64, 128), i32), s((64, 512), i32))
    pages = 65536 // 32
    for kw in SWEEP["indexer"]:
        yield "indexer_topk", kw, (lambda q, w, kq, ks, t, p, v, kw=kw: indexer_topk(
            q, w, {"q": kq, "s": ks}, t, p, v, 512, epb=32, backend="pallas", interpret=False, **kw)), (
            s((16, 32, 128), bf16), s((16, 32), jnp.float32), s((16 * pages * 32, 64), u8),
            s((16 * pages * 32, 4), u8), s((16, pages), i32), s((16, pages), i32), s((16,), i32))
    for rows, tiles in ((16, 384), (128, 224)):
        for kw in SWEEP["experts"]:
            yield f"grouped_fp4_matmul_rows{rows}", kw, (lambda x, t, lv, p, sc, kw=kw: grouped_fp4_matmul(
                x, t, p, sc, live=lv, backend="pallas", interpret=False, **kw)), (
                s((tiles, rows, 5120), bf16), s((tiles,), i32), s((tiles,), i32), s((384, 2304, 2560), u8),
                s((384, 2304, 160), u8))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--triton-python", default=sys.executable, help="a Python interpreter with `triton` installed")
    ap.add_argument("--out", help="also write the JSON lines here")
    a = ap.parse_args(argv)
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for kernel, config, fn, avals in cases():
            for n, (name, module, grid, warps, stages) in enumerate(capture(fn, *avals)):
                path = os.path.join(tmp, f"{name}_{len(lines)}.ttir")
                with open(path, "w") as f:
                    f.write(module)
                r = subprocess.run([a.triton_python, "-c", COMPILE, path, str(warps), str(stages)],
                                   capture_output=True, text=True, env={**os.environ, "TRITON_DEFAULT_FP_FUSION": "1"})
                row = {"kernel": kernel, "config": config, "call": name, "grid": grid, "num_warps": warps,
                       "num_stages": stages}
                try:
                    row.update(json.loads(r.stdout.strip().splitlines()[-1]))
                except (IndexError, json.JSONDecodeError):
                    row["error"] = r.stderr.strip()[-600:]
                line = json.dumps(row)
                print(line, flush=True)
                lines.append(line)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
