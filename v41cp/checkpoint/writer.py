"""Write tensors under released names in the release's storage formats (docs/architecture.md).

Used to build release-format checkpoints from unquantized weights: the embedded tiny model
(`checkpoints/make_tiny.sh`), test fixtures and the synthetic inputs of the conversion benchmark.
Storage per tensor (`release_storage`):

* ``fp8``  — dense projections (``wq_a wq_b wkv wo_a wo_b``, ``indexer.wq_b``, shared experts,
  ``engram.wkv``, DSpark's ``main_proj``, V4 MTP's ``e_proj`` / ``h_proj``): e4m3 + e8m0 scales over the
  config's ``weight_block_size``² blocks (V4.1 32, V4 128);
* ``fp4``  — routed experts: packed e2m1 + per-row / 32-column e8m0 scales;
* ``fp8_rows`` — Engram tables: e4m3 + per-row / 32-column e8m0 scales;
* ``fp32`` — ``hc_*`` (V4 MTP's ``hc_head_*`` too), ``attn_sink``, gate biases, compressor weights (V4: the
  indexer's compressor and the position biases ``ape`` too), ``head``, DSpark's confidence head;
* ``int``  — V4's hash-routing tables ``ffn.gate.tid2eid`` (int32);
* ``bf16`` — everything else (embedding, norms, indexer ``wk`` / ``weights_proj``, router weight, …).

Tensors stream through: each is quantized when it arrives and shards are flushed at
``max_shard_bytes``, so writing never holds more than one shard. `released_tensors` names a model's own parameter
tree (and its drafter's) the release's way — the inverse of the loader's layouts — so a model made here can be
written as a release.
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
from v41cp.checkpoint.names import drafter_to_tree, released_to_tree
from v41cp.checkpoint.safetensors_io import write_safetensors
from v41cp.config import LayerRole, ModelConfig

__all__ = ["release_storage", "released_shapes", "released_tensors", "write_released"]

_FP8 = re.compile(r"(^mtp\.0\.[eh]_proj\.weight$)|(.*\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                  r"|ffn\.shared_experts\.w[123]|engram\.wkv|main_proj)\.weight$)")
_FP4 = re.compile(r".*\.ffn\.experts\.\d+\.w[123]\.weight$")
_FP32 = re.compile(r"(^head\.weight$)|(^(mtp\.0\.)?hc_head_(fn|base|scale)$)"
                   r"|(.*\.(hc_(attn|ffn)_(fn|base|scale)|attn\.attn_sink|ffn\.gate\.bias(_vl)?"
                   r"|attn\.(indexer\.)?compressor\..*|confidence_head\.proj\.weight)$)")


def release_storage(name: str) -> str:
    """``fp8 | fp4 | fp8_rows | fp32 | int | bf16``: how the release stores tensor ``name``."""
    if name.endswith(".ffn.gate.tid2eid"):
        return "int"
    if name.endswith(".engram.embed.weight"):
        return "fp8_rows"
    if _FP4.match(name):
        return "fp4"
    if _FP8.match(name):
        return "fp8"
    if _FP32.match(name):
        return "fp32"
    return "bf16"


def released_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every backbone tensor's released name → its logical (unquantized) shape, from the config; with DeepSeek-V4's
    MTP layer (``cfg.has_mtp``) its ``mtp.0.*`` tensors too."""
    h, hc = cfg.hidden_size, cfg.hc_mult
    out: dict[str, tuple[int, ...]] = {"embed.weight": (cfg.vocab_size, h), "head.weight": (cfg.vocab_size, h),
                                       "norm.weight": (h,)}
    if cfg.is_v4:
        out.update({"hc_head_fn": (hc, hc * h), "hc_head_base": (hc,), "hc_head_scale": (1,)})
    for role in cfg.layer_roles:
        out.update(_layer_shapes(cfg, role, f"layers.{role.index}."))
    if cfg.has_mtp:
        out.update(_layer_shapes(cfg, LayerRole.swa_only(cfg.num_hidden_layers), "mtp.0."))
        out.update({"mtp.0.e_proj.weight": (h, h), "mtp.0.h_proj.weight": (h, h), "mtp.0.enorm.weight": (h,),
                    "mtp.0.hnorm.weight": (h,), "mtp.0.norm.weight": (h,), "mtp.0.hc_head_fn": (hc, hc * h),
                    "mtp.0.hc_head_base": (hc,), "mtp.0.hc_head_scale": (1,)})
    return out


def _layer_shapes(cfg: ModelConfig, role: LayerRole, p: str) -> dict[str, tuple[int, ...]]:
    """One layer's released tensors under prefix ``p`` → their logical shapes."""
    h, nh, d, g = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
    ih, idim, e, i_ = cfg.index_n_heads, cfg.index_head_dim, cfg.n_routed_experts, cfg.moe_intermediate_size
    hc = cfg.hc_mult
    out: dict[str, tuple[int, ...]] = {}
    out.update({p + "attn_norm.weight": (h,), p + "ffn_norm.weight": (h,)})
    for site in ("attn", "ffn"):
        out.update({p + f"hc_{site}_fn": (cfg.hc_mix_width, hc * h), p + f"hc_{site}_base": (cfg.hc_mix_width,),
                    p + f"hc_{site}_scale": (3,)})
    out.update({p + "attn.wq_a.weight": (cfg.q_lora_rank, h), p + "attn.q_norm.weight": (cfg.q_lora_rank,),
                p + "attn.wq_b.weight": (nh * d, cfg.q_lora_rank), p + "attn.wkv.weight": (d, h),
                p + "attn.kv_norm.weight": (d,), p + "attn.wo_a.weight": (g * cfg.o_lora_rank, nh * d // g),
                p + "attn.wo_b.weight": (h, g * cfg.o_lora_rank), p + "attn.attn_sink": (nh,)})

    def compressor(name: str, dim: int, overlap: bool) -> None:
        width = dim * (2 if overlap else 1)
        out.update({p + f"{name}.wkv.weight": (width, h), p + f"{name}.norm.weight": (dim,)})
        if role.ratio > 1:
            out[p + f"{name}.wgate.weight"] = (width, h)
        if cfg.is_v4:
            out[p + f"{name}.ape"] = (role.ratio, width)

    if role.is_kv_source:
        compressor("attn.compressor", d, role.overlapping)
        if not cfg.is_v4:
            out.update({p + "attn.indexer.wk.weight": (idim, d), p + "attn.indexer.k_norm.weight": (idim,)})
    if role.is_index_source:
        out.update({p + "attn.indexer.wq_b.weight": (ih * idim, cfg.q_lora_rank),
                    p + "attn.indexer.weights_proj.weight": (ih, h)})
        if cfg.is_v4:
            compressor("attn.indexer.compressor", idim, True)
    out[p + "ffn.gate.weight"] = (e, h)
    if cfg.hash_routed(role.index):
        out[p + "ffn.gate.tid2eid"] = (cfg.vocab_size, cfg.num_experts_per_tok)
    else:
        out[p + "ffn.gate.bias"] = (e,)
    if not cfg.is_v4:
        out[p + "ffn.gate.bias_vl"] = (e,)
    for w, shape in (("w1", (i_, h)), ("w3", (i_, h)), ("w2", (h, i_))):
        out[p + f"ffn.shared_experts.{w}.weight"] = shape
        out.update({p + f"ffn.experts.{x}.{w}.weight": shape for x in range(e)})
    if role.engram_slot >= 0:
        out.update({p + "engram.embed.weight": (cfg.engram_num_embeddings[role.engram_slot], cfg.engram_head_dim),
                    p + "engram.wkv.weight": ((hc + 1) * h, cfg.engram_hash_heads * cfg.engram_head_dim),
                    p + "engram.q_weight": (hc, h), p + "engram.k_weight": (hc, h)})
    return out


def _encode(name: str, value: np.ndarray, quantize: bool, block: int = 32) -> list[tuple[str, np.ndarray]]:
    if release_storage(name) == "int":
        return [(name, np.asarray(value).astype(np.int32))]
    kind = release_storage(name) if quantize else "fp32"
    value = np.asarray(value, np.float32)
    if kind in ("fp8", "fp4", "fp8_rows"):
        fp8 = lambda v: quant_fp8_blocks(v, block)
        q, s = {"fp8": fp8, "fp4": quant_fp4_rows, "fp8_rows": quant_fp8_rows}[kind](value)
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
    if isinstance(cfg, Mapping) and cfg.get("model_type") == "deepseek_v4":
        cfg = ModelConfig.from_dict(cfg)          # V4: the flat config and its FP8 block
    if isinstance(cfg, ModelConfig):
        config, block = cfg.config_json(), cfg.weight_block_size
    else:                                         # a released V4.1 config dict, as given (32×32 FP8 blocks)
        config, block = {"model_type": "deepseek_v41", "text_config": dict(cfg.get("text_config", cfg))}, 32
    (dst / "config.json").write_text(json.dumps(config, indent=1))
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
        for k, v in _encode(name, value, quantize, block):
            if size and size + v.nbytes > max_shard_bytes:
                flush()
                size = 0
            shard.append((k, v))
            size += v.nbytes
    flush()
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))
    return {"files": len(files), "tensors": len(weight_map), "bytes": total}


def released_tensors(cfg: ModelConfig, params, drafter=None) -> dict[str, np.ndarray]:
    """A parameter tree (``params``; ``drafter``: the drafter's, or None) → its released-name tensors, unquantized
    (`write_released` stores them in the release's formats). Each parameter's `Layout` is a permutation of its stored
    elements (reshapes, transposes, stacking), so it is inverted by applying it to the stored elements' indices; a
    parameter the layout cannot give back exactly (values in padding rows) is an error naming it."""
    shapes = released_shapes(cfg)
    out: dict[str, np.ndarray] = {}
    trees = [(released_to_tree(cfg), params)] + ([(drafter_to_tree(cfg), drafter)] if drafter is not None else [])
    for mapping, tree in trees:
        for path, (keys, fn, _) in mapping.items():
            value = tree
            for p in path:
                value = value[p]
            value = np.asarray(value)
            sizes = [int(np.prod(shapes[k])) for k in keys]
            starts = np.cumsum([0] + sizes)
            ids = fn(*[np.arange(a, a + n, dtype=np.int64).reshape(shapes[k])
                       for k, a, n in zip(keys, starts, sizes)])
            if tuple(ids.shape) != value.shape:
                raise ValueError(f"parameter {'/'.join(path)} has shape {value.shape}, the release's layout of "
                                 f"{list(keys)} gives {tuple(ids.shape)}")
            flat = np.zeros(starts[-1], value.dtype)
            flat[np.asarray(ids).reshape(-1)] = value.reshape(-1)
            stored = [flat[a:a + n].reshape(shapes[k]) for k, a, n in zip(keys, starts, sizes)]
            if not np.array_equal(np.asarray(fn(*stored)), value):     # a layout that pads (Engram's table rows)
                raise ValueError(f"parameter {'/'.join(path)} holds values its released layout cannot store")
            out.update(zip(keys, stored))
    return out
