"""Conversion throughput and peak host memory on a synthetic release-format checkpoint (>= 1 GB).

Writes a synthetic DeepSeek-V4.1-shaped checkpoint in the release's formats (FP8 32x32-block dense
weights, FP4 experts, FP8 Engram rows, e8m0 scales, BF16 / FP32 rest; random payloads written directly
in the stored formats, one shard per layer), then runs ``python -m v41cp convert`` in a child process
and reads the child's peak RSS (serially, and with ``--workers`` processes side by side); then restores the
result onto 8 simulated devices (tp=8) in another child and times it; then loads the released directory
straight onto the 8 devices (each device reading its own shards; dequantized BF16, and ``keep_quantized``)
with its throughput and peak RSS. Prints one JSON object. The bound checked:
peak RSS < 3 x largest tensor + 1 GiB.

    python benchmarks/convert_memory.py [--workdir DIR] [--dtype bf16|fp32] [--workers N] [--keep]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

SYNTHETIC = dict(
    vocab_size=32768, hidden_size=2048, num_hidden_layers=6, num_attention_heads=16, head_dim=512,
    qk_rope_head_dim=64, q_lora_rank=1024, o_groups=4, o_lora_rank=1024, sliding_window=128,
    compress_ratios=[0, 2, 2, 2, 1, 1], kv_source_layer_ids=[1, 4], index_source_layer_ids=[1, 3, 4, 5],
    candidate_source_layer_id=4, candidate_topk_blocks=16, candidate_block_size=8, index_n_heads=8,
    index_head_dim=128, index_topk=64, n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=1024,
    engram_layer_ids=[1, 3], engram_num_embeddings=[500000, 500000], engram_vocab_size=97, engram_n_heads=8,
    engram_head_dim=256, engram_max_ngram_size=4, engram_compressed_vocab_size=32768, engram_pad_token_id=2,
    dtype="bfloat16",
)


def synthetic_tensors(name: str, shape, rng):
    """(name, array) pairs of one tensor in its release storage format, with random payloads."""
    from v41cp.checkpoint.formats import block_scale_shape, row_scale_shape
    from v41cp.checkpoint.writer import release_storage

    kind = release_storage(name)
    scale_name = name[: -len(".weight")] + ".scale"
    if kind in ("fp8", "fp8_rows"):
        raw = rng.integers(0, 256, shape, dtype=np.uint8)
        raw[(raw & 0x7F) == 0x7F] = 0                              # no NaN codes
        sshape = block_scale_shape(shape) if kind == "fp8" else row_scale_shape(shape)
        scale = rng.integers(117, 124, sshape, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
        return [(name, raw.view(ml_dtypes.float8_e4m3fn)), (scale_name, scale)]
    if kind == "fp4":
        packed = rng.integers(-128, 128, (shape[0], shape[1] // 2), dtype=np.int8)
        scale = rng.integers(117, 124, row_scale_shape(shape), dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
        return [(name, packed), (scale_name, scale)]
    value = (rng.standard_normal(shape, dtype=np.float32) * 0.02)
    return [(name, value if kind == "fp32" else value.astype(ml_dtypes.bfloat16))]


def write_synthetic(dst: Path) -> dict:
    from tokenizers import Tokenizer, models

    from v41cp.checkpoint.safetensors_io import write_safetensors
    from v41cp.checkpoint.writer import released_shapes
    from v41cp.config import ModelConfig

    cfg = ModelConfig.from_dict(SYNTHETIC)
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps({"text_config": SYNTHETIC}))
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(cfg.vocab_size)}, unk_token="t0")).save(
        str(dst / "tokenizer.json"))
    rng = np.random.default_rng(0)
    groups: dict[str, list] = {}
    for name, shape in released_shapes(cfg).items():
        key = name.split(".")[1] if name.startswith("layers.") else "top"
        groups.setdefault(key, []).append((name, shape))
    weight_map, total, largest = {}, 0, 0
    for key, items in groups.items():
        fname = f"model-{key}.safetensors"
        tensors = [t for name, shape in items for t in synthetic_tensors(name, shape, rng)]
        total += write_safetensors(dst / fname, tensors)
        largest = max([largest] + [a.nbytes for _, a in tensors])
        weight_map.update({n: fname for n, _ in tensors})
        del tensors
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return {"bytes": total, "largest_tensor_bytes": largest, "tensors": len(weight_map)}


RESTORE = """
import json, os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax
from v41cp.checkpoint import load
from v41cp.sharding import make_mesh
t0 = time.perf_counter()
cfg, params = load(sys.argv[1], mesh=make_mesh(tp=8))
jax.block_until_ready(params)
dt = time.perf_counter() - t0
sharded = sum(1 for x in jax.tree.leaves(params) if any(a is not None for a in x.sharding.spec))
print(json.dumps({"restore_s": round(dt, 2), "sharded": sharded}))
"""


LOAD_RELEASED = """
import json, os, resource, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax
from v41cp.checkpoint import load_released_dir
from v41cp.sharding import make_mesh
mesh = make_mesh(tp=8)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
cfg, params, report = load_released_dir(sys.argv[1], mesh=mesh, report=True, keep_quantized=sys.argv[2] == "1",
                                        dtype="bfloat16")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({**report.to_dict(), "baseline_rss_bytes": base, "peak_rss_bytes": peak,
                  "peak_rss_above_baseline_bytes": peak - base}))
"""


def _load_released(path: Path, keep_quantized: bool) -> dict:
    """Load the released-layout checkpoint straight onto an 8-device (simulated) tp mesh in a fresh process: each
    device reads its own shards. On CPU the devices' memory is the process's: the peak RSS above the runtime's
    baseline is the placed device bytes (replicas may share one host buffer) plus the loader's own overhead."""
    res = subprocess.run([sys.executable, "-c", LOAD_RELEASED, str(path), "1" if keep_quantized else "0"],
                         capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"released load failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _time_restore(path: Path) -> dict:
    """Restore the converted checkpoint onto an 8-device (simulated) tp mesh in a fresh process."""
    res = subprocess.run([sys.executable, "-c", RESTORE, str(path)], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"restore failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", help="where to write (default: a temporary directory, removed afterwards)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--keep", action="store_true")
    p.add_argument("--workers", type=int, default=2, help="conversion worker processes for the parallel run")
    args = p.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="v41cp-bench-"))
    try:
        src, dst = work / "released", work / "converted"
        t0 = time.perf_counter()
        info = write_synthetic(src)
        t_write = time.perf_counter() - t0
        runs = {}
        for workers in (1, args.workers):
            out = dst.with_name(f"converted-w{workers}")
            t0 = time.perf_counter()
            res = subprocess.run([sys.executable, "-m", "v41cp", "convert", str(src), str(out), "--dtype", args.dtype,
                                  "--workers", str(workers), "--json"], capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if res.returncode:
                raise SystemExit(f"convert failed:\n{res.stderr[-3000:]}")
            summary = json.loads(res.stdout.strip().splitlines()[-1])
            runs[workers] = {"wall_s": round(wall, 2), "reported_s": summary["seconds"],
                             "throughput_source_MBps": round(info["bytes"] / 1e6 / summary["seconds"], 1),
                             "peak_rss_bytes": summary["peak_rss_bytes"],
                             "peak_worker_rss_bytes": summary["peak_worker_rss_bytes"]}
            if workers != 1:
                shutil.rmtree(out, ignore_errors=True)
        dst = dst.with_name("converted-w1")
        serial = runs[1]
        peak = max(serial["peak_rss_bytes"], serial["peak_worker_rss_bytes"])
        restore = _time_restore(dst)
        direct = {kq: _load_released(src, kq) for kq in (False, True)}
        bound = 3 * info["largest_tensor_bytes"] + 2**30
        print(json.dumps({
            "source_bytes": info["bytes"], "source_tensors": info["tensors"],
            "largest_tensor_bytes": info["largest_tensor_bytes"], "dtype": args.dtype,
            "converted_bytes": summary["bytes_written"], "convert_wall_s": serial["wall_s"],
            "convert_reported_s": serial["reported_s"], "throughput_source_MBps": serial["throughput_source_MBps"],
            "peak_rss_bytes": peak, "peak_rss_GiB": round(peak / 2**30, 3),
            "bound_bytes": bound, "within_bound": peak < bound, "synthetic_write_s": round(t_write, 2),
            f"convert_workers_{args.workers}": runs[args.workers],
            "convert_parallel_speedup": round(serial["reported_s"] / runs[args.workers]["reported_s"], 2),
            "restore_8dev_s": restore["restore_s"], "restore_8dev_sharded_params": restore["sharded"],
            "released_direct_8dev": direct[False], "released_direct_8dev_keep_quantized": direct[True],
        }))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
