"""Write tensors under released names in the release's storage formats (v41-architecture.md §5.1).

Used to build release-format checkpoints from unquantized weights: the embedded tiny model
(`checkpoints/make_tiny.sh`), test fixtures and the synthetic inputs of the conversion benchmark.
Storage per tensor (`release_storage`):

* ``fp8``  — dense projections (``wq_a wq_b wkv wo_a wo_b``, ``indexer.wq_b``, shared experts,
  ``engram.wkv``): e4m3 + e8m0 scales over 32×32 blocks;
* ``fp4``  — routed experts: packed e2m1 + per-row / 32-column e8m0 scales;
* ``fp8_rows`` — Engram tables: e4m3 + per-row / 32-column e8m0 scales;
* ``fp32`` — ``hc_*``, ``attn_sink``, gate biases, compressor weights, ``head``;
* ``bf16`` — everything else (embedding, norms, indexer ``wk`` / ``weights_proj``, router weight, …).

Tensors stream through: each is quantized when it arrives and shards are flushed at
``max_shard_bytes``, so writing never holds more than one shard.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

from v41cp.checkpoint.formats import quant_fp4_rows, quant_fp8_blocks, quant_fp8_rows
from v41cp.checkpoint.safetensors_io import write_safetensors
from v41cp.config import ModelConfig

__all__ = ["release_storage", "write_released"]

_FP8 = re.compile(r".*\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|engram\.wkv)\.weight$")
_FP4 = re.compile(r".*\.ffn\.experts\.\d+\.w[123]\.weight$")
_FP32 = re.compile(r"(^head\.weight$)|(.*\.(hc_(attn|ffn)_(fn|base|scale)|attn\.attn_sink|ffn\.gate\.bias(_vl)?"
                   r"|attn\.compressor\..*)$)")


def release_storage(name: str) -> str:
    """``fp8 | fp4 | fp8_rows | fp32 | bf16``: how the release stores tensor ``name``."""
    if name.endswith(".engram.embed.weight"):
        return "fp8_rows"
    if _FP4.match(name):
        return "fp4"
    if _FP8.match(name):
        return "fp8"
    if _FP32.match(name):
        return "fp32"
    return "bf16"


def _encode(name: str, value: np.ndarray, quantize: bool) -> list[tuple[str, np.ndarray]]:
    kind = release_storage(name) if quantize else "fp32"
    value = np.asarray(value, np.float32)
    if kind in ("fp8", "fp4", "fp8_rows"):
        q, s = {"fp8": quant_fp8_blocks, "fp4": quant_fp4_rows, "fp8_rows": quant_fp8_rows}[kind](value)
        return [(name, q), (name[: -len(".weight")] + ".scale", s)]
    return [(name, value if kind == "fp32" else value.astype(ml_dtypes.bfloat16))]


def write_released(dst: str | os.PathLike, cfg: ModelConfig | Mapping, tensors: Iterable[tuple[str, np.ndarray]]
                   | Mapping[str, np.ndarray], *, tokenizer: str | os.PathLike | None = None, quantize: bool = True,
                   max_shard_bytes: int = 4 * 2**30) -> dict:
    """Write ``tensors`` (released name → unquantized array) as a release-format directory ``dst``.

    ``cfg`` (a `ModelConfig` or the released config dict) goes to ``config.json``; ``tokenizer`` is
    copied to ``tokenizer.json``. With ``quantize=False`` everything is stored FP32 (the layout other
    frameworks export). Returns ``{"files", "tensors", "bytes"}``.
    """
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    text = cfg.to_dict() if isinstance(cfg, ModelConfig) else dict(cfg.get("text_config", cfg))
    (dst / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "text_config": text}, indent=1))
    if tokenizer is not None:
        shutil.copy2(tokenizer, dst / "tokenizer.json")
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    weight_map: dict[str, str] = {}
    shard: list[tuple[str, np.ndarray]] = []
    files: list[str] = []
    total = 0

    def flush():
        nonlocal shard, total
        if shard:
            fname = f"model-{len(files) + 1:05d}.safetensors"
            total += write_safetensors(dst / fname, shard)
            files.append(fname)
            weight_map.update({k: fname for k, _ in shard})
            shard = []

    size = 0
    for name, value in items:
        for k, v in _encode(name, value, quantize):
            if size and size + v.nbytes > max_shard_bytes:
                flush()
                size = 0
            shard.append((k, v))
            size += v.nbytes
    flush()
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))
    return {"files": len(files), "tensors": len(weight_map), "bytes": total}
