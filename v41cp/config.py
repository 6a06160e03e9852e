"""DeepSeek-V4.1 text-model configuration: parsing, validation, per-layer roles and presets.

`ModelConfig` is a frozen, hashable dataclass so it can be a static argument of jitted
functions. It is parsed from the released ``config.json`` (the composite config with a
``text_config`` entry, or the text config alone) and validated with the rules of
`docs/architecture.md`; every error names the offending field.

Per-layer roles:

* ``swa``     compress ratio 0, sliding window only;
* ``full``    KV source: owns a compressor, publishes compressed KV + index keys + top-k;
* ``reindex`` index source that is not a KV source: recomputes the top-k only;
* ``reuse``   consumes the latest compressed KV and top-k unchanged.

DeepSeek-V4 (``model_type="deepseek_v4"``: V4-Flash, V4-Pro) has no sharing: every compressed layer owns its
compressor and caches.

* ``csa``     compress ratio 4: an overlapping compressor (windows of 2·4 rows, stride 4) and its own indexer
              (with its own overlapping compressor at the index head dim) selecting the top-k entries;
* ``hca``     any other ratio (the release: 128): a non-overlapping compressor; attention dense over every
              visible entry.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

import numpy as np

__all__ = ["CacheFormats", "ConfigError", "ModelConfig", "LayerRole", "PRESETS", "preset", "ENGRAM_ROW_ALIGN"]

ENGRAM_ROW_ALIGN = 64
# fields that describe how to run the model, not the model: never written to a checkpoint's config
RUNTIME_FIELDS = ("engram_token_map", "attention_backend", "indexer_backend", "moe_backend", "expert_backend")
# config.json's model_type → the family (V4.1's composite config and its text config; V4's flat config)
MODEL_TYPES = {"deepseek_v41": "deepseek_v41", "deepseek_v41_text": "deepseek_v41", "deepseek_v4": "deepseek_v4"}
V4_SCHEDULE_DEFAULTS = dict(kv_source_layer_ids=(), index_source_layer_ids=(), candidate_source_layer_id=-1,
                            candidate_topk_blocks=0, candidate_block_size=1, weight_block_size=128,
                            rms_norm_eps=1e-6)


class CacheFormats(NamedTuple):
    """A model's cache formats (`ModelConfig.cache_formats`): the window rows', the compressed entries', the index
    keys' (names of `v41cp.quant.CACHE_FORMATS`)."""

    window: str
    entries: str
    index: str


class ConfigError(ValueError):
    """A config field is missing, malformed or inconsistent; the message names the field."""


@dataclass(frozen=True)
class LayerRole:
    """Static description of one backbone layer, derived from the config.

    Attributes:
      index: layer id.
      ratio: compress ratio (0 = SWA only, 1 = unpooled decoder source, 2 = pooled; V4: 4 = CSA, else HCA).
      kind: ``"swa" | "full" | "reindex" | "reuse"`` (V4.1), ``"swa" | "csa" | "hca"`` (V4).
      kv_source: id of the KV source whose compressed cache this layer reads (-1 for SWA).
      index_source: id of the index source whose selection this layer uses (-1 for SWA).
      candidate_source: this layer produces the two-level candidate mask.
      uses_candidates: this layer's indexer scores only inside the candidate mask.
      engram_slot: position in ``engram_layer_ids`` (-1 when the layer has no Engram).
    """

    index: int
    ratio: int
    kind: str
    kv_source: int
    index_source: int
    candidate_source: bool
    uses_candidates: bool
    engram_slot: int

    @classmethod
    def swa_only(cls, index: int) -> "LayerRole":
        """A sliding-window-only layer at ``index`` (the drafters' layers: DSpark stages, V4's MTP layer)."""
        return cls(index=index, ratio=0, kind="swa", kv_source=-1, index_source=-1, candidate_source=False,
                   uses_candidates=False, engram_slot=-1)

    @property
    def is_kv_source(self) -> bool:
        """The layer compresses its own rows into entries (V4.1 Full; every V4 compressed layer)."""
        return self.kind in ("full", "csa", "hca")

    @property
    def is_index_source(self) -> bool:
        """The layer selects with its own indexer (V4.1 Full / Reindex; V4 CSA)."""
        return self.kind in ("full", "reindex", "csa")

    @property
    def overlapping(self) -> bool:
        """V4 CSA: an entry pools the previous window's low halves with its own window's high halves."""
        return self.kind == "csa"

    @property
    def window_rows(self) -> int:
        """V4: the rows one entry pools, which each compressor keeps in its ring (`device_cache.declare_cache`):
        ``r``, or ``2r`` on an overlapping (CSA) layer — the previous window's rows too."""
        return self.ratio * (2 if self.overlapping else 1)

    @property
    def dense_history(self) -> bool:
        """V4 HCA: attention reads every visible entry (no indexer)."""
        return self.kind == "hca"


def _default_rope_scaling() -> dict:
    return {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
            "original_max_position_embeddings": 65536}


# Released DeepSeek-V4.1-Flash text config (docs/architecture.md).
_FLASH: dict[str, Any] = dict(
    vocab_size=129280, hidden_size=5120, num_hidden_layers=40, num_attention_heads=64,
    num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1280, o_groups=8,
    o_lora_rank=1024, sliding_window=128, compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0),
    kv_source_layer_ids=(2, 8, 14, 20), index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36),
    candidate_source_layer_id=20, candidate_topk_blocks=2048, candidate_block_size=8,
    index_n_heads=32, index_head_dim=128, index_topk=512, rope_theta=10000.0,
    compress_rope_theta=160000.0, max_position_embeddings=1048576, n_routed_experts=384,
    num_experts_per_tok=6, n_shared_experts=1, moe_intermediate_size=2304,
    scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True,
    routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    rms_norm_eps=1e-20, engram_layer_ids=(1, 14), engram_num_embeddings=(384006168, 384016682),
    engram_vocab_size=16000000, engram_max_ngram_size=4, engram_n_heads=8, engram_head_dim=256,
    engram_pad_token_id=2, engram_compressed_vocab_size=99092, num_nextn_predict_layers=3,
    dspark_block_size=5, dspark_noise_token_id=128799, dspark_target_layer_ids=(37, 38, 39), dspark_markov_rank=256,
    dspark_n_routed_experts=128, dspark_num_experts_per_tok=3, bos_token_id=0, eos_token_id=1, pad_token_id=2, dtype="bfloat16",
)

# The oracle's tiny config (docs/architecture.md): every layer kind + Engram.
# 0 SWA | 1 ratio-2 Full (+Engram) | 2 Reuse | 3 Reindex (+Engram) | 4 ratio-1 Full + candidate source
# | 5 ratio-1 Reindex inside the candidates.
_TINY: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=1, head_dim=64, qk_rope_head_dim=16, q_lora_rank=32,
    o_lora_rank=32, o_groups=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    sliding_window=8, compress_ratios=(0, 2, 2, 2, 1, 1), kv_source_layer_ids=(1, 4),
    index_source_layer_ids=(1, 3, 4, 5), candidate_source_layer_id=4, candidate_topk_blocks=2,
    candidate_block_size=2, index_n_heads=2, index_head_dim=32, index_topk=4,
    engram_layer_ids=(1, 3), engram_num_embeddings=(2000, 2000), engram_vocab_size=97,
    engram_n_heads=2, engram_head_dim=32, engram_max_ngram_size=3, engram_compressed_vocab_size=136,
    engram_pad_token_id=2, num_nextn_predict_layers=0, rope_theta=10000.0,
    compress_rope_theta=160000.0, max_position_embeddings=1048576, scoring_func="sqrtsoftplus",
    topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=1.5, swiglu_limit=10.0,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-20, bos_token_id=0,
    eos_token_id=1, pad_token_id=2, dtype="float32",
)

# DeepSeek-V4-Flash and V4-Pro (docs/architecture.md, "DeepSeek-V4"):
# compress_ratios per layer plus the MTP layer's 0. Every compressed layer owns its compressor (and CSA its
# indexer); the first 3 layers route by a token-id table.
_V4_FLASH: dict[str, Any] = dict(
    model_type="deepseek_v4", vocab_size=129280, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64,
    num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
    sliding_window=128, compress_ratios=(0, 0) + (4, 128) * 20 + (4, 0), kv_source_layer_ids=(),
    index_source_layer_ids=(), candidate_source_layer_id=-1, candidate_topk_blocks=0, candidate_block_size=1,
    index_n_heads=64, index_head_dim=128, index_topk=512, rope_theta=10000.0, compress_rope_theta=160000.0,
    max_position_embeddings=1048576, n_routed_experts=256, num_experts_per_tok=6, n_shared_experts=1,
    moe_intermediate_size=2048, scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True,
    routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
    num_hash_layers=3, num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1, dtype="bfloat16",
    fake_quant=True, weight_block_size=128,
)
# V4-Pro: routed_scaling_factor 2.5 is from a secondary source (v41-architecture.md §1.3 marks it unverified); the
# plans do not depend on it
_V4_PRO: dict[str, Any] = {
    **_V4_FLASH, "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128, "q_lora_rank": 1536,
    "o_groups": 16, "compress_ratios": (128, 128) + (4, 128) * 29 + (4, 0), "index_topk": 1024,
    "n_routed_experts": 384, "moe_intermediate_size": 3072, "routed_scaling_factor": 2.5,
}
# The V4 oracle's tiny model (tests/oracle/transformers_v4_oracle.py): every V4 layer kind —
# SWA | HCA (ratio 8) | CSA | CSA, MLPs hash | hash | routed | routed; 8 index heads make exact ReLU-zero score
# ties at the top-k boundary rare (the oracle test asserts there are none).
_TINY_V4: dict[str, Any] = dict(
    model_type="deepseek_v4", vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=1, head_dim=64, qk_rope_head_dim=16, q_lora_rank=32, o_lora_rank=32,
    o_groups=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, sliding_window=8,
    compress_ratios=(0, 8, 4, 4), kv_source_layer_ids=(), index_source_layer_ids=(), candidate_source_layer_id=-1,
    candidate_topk_blocks=0, candidate_block_size=1, index_n_heads=8, index_head_dim=32, index_topk=4,
    num_hash_layers=2, num_nextn_predict_layers=0, rope_theta=10000.0, compress_rope_theta=160000.0,
    max_position_embeddings=1048576, scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True,
    routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
    bos_token_id=0, eos_token_id=1, pad_token_id=2, dtype="float32", fake_quant=False, weight_block_size=128,
)

PRESETS: dict[str, dict[str, Any]] = {
    "v41-flash": _FLASH,
    "v4-flash": _V4_FLASH,
    "v4-pro": _V4_PRO,
    "tiny-v4": _TINY_V4,
    # the other order of kinds: CSA first (its indexer before any HCA), an HCA between, SWA last; one hash layer
    "tiny-v4-csa-first": {**_TINY_V4, "compress_ratios": (4, 8, 4, 0), "num_hash_layers": 1},
    # tiny-v4 with the MTP layer (compress_ratios' trailing 0 is its)
    "tiny-v4-mtp": {**_TINY_V4, "compress_ratios": (0, 8, 4, 4, 0), "num_nextn_predict_layers": 1},
    # the oracle's tiny model, sparse selection (top-4 of the compressed entries, 2 candidate blocks)
    "tiny": _TINY,
    # same shape, selection complete (every visible entry selected): no top-k tie effects
    "tiny-dense": {**_TINY, "index_topk": 64, "candidate_topk_blocks": 64},
    # sparse selection with no score tie at any top-k / candidate-block boundary (asserted by the
    # oracle test): 8 index heads make exact ReLU-zero ties rare, 3 candidate blocks > index_topk
    "tiny-sparse": {**_TINY, "index_n_heads": 8, "candidate_topk_blocks": 3},
    # tiny-sparse with DSpark stages: 3 SWA-only draft stages over the attention inputs of layers 3 (after its
    # Engram), 4 and 5; blocks of 4; Markov rank 16; 4 experts top-2
    "tiny-dspark": {**_TINY, "index_n_heads": 8, "candidate_topk_blocks": 3, "num_nextn_predict_layers": 3,
                    "compress_ratios": _TINY["compress_ratios"] + (0, 0, 0), "dspark_block_size": 4,
                    "dspark_noise_token_id": 255, "dspark_target_layer_ids": (3, 4, 5), "dspark_markov_rank": 16,
                    "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2},
    # 8 heads / 8 experts / 8 index heads so that every TP axis divides 8 simulated devices
    "tiny-tp8": {**_TINY, "num_attention_heads": 8, "o_groups": 8, "n_routed_experts": 8,
                 "index_n_heads": 8, "engram_layer_ids": (1, 3)},
}


@dataclass(frozen=True)
class ModelConfig:
    """Validated DeepSeek-V4.1 text config (field names follow the released ``config.json``).

    ``fake_quant`` switches the release's cache fake-quantisation (`cache_formats`: V4.1 FP8 window KV, NVFP4
    compressed KV, MXFP4 indexer Q/K; V4 its 584 B records' FP8 + BF16 window rows and entries, Hadamard-rotated
    MXFP4 indexer Q/K) on or off. ``dtype`` is the activation/weight dtype of
    the backbone (``float32`` or ``bfloat16``); FP32-critical parts (mHC, sink, router, compressor
    pooling, logits) are always FP32.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    # "deepseek_v41" (Full / Reindex / Reuse sharing, CED, Engram, DSpark) or "deepseek_v4" (CSA / HCA layers each
    # owning their compressor, hash-routed MoE in the first ``num_hash_layers`` layers, one MTP layer)
    model_type: str = "deepseek_v41"
    num_hash_layers: int = 0
    num_key_value_heads: int = 1
    n_shared_experts: int = 1
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: tuple[tuple[str, Any], ...] = tuple(sorted(_default_rope_scaling().items()))
    max_position_embeddings: int = 1048576
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-20
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_vocab_size: int = 16000000
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    num_nextn_predict_layers: int = 0
    # DSpark drafter (`v41cp.drafter`; stored as ``mtp.0 … mtp.{num_nextn_predict_layers − 1}``): the block
    # [anchor, noise × (block − 1)], the target layers whose attention-input streams feed it, its Markov head rank
    # and MoE. ``dspark_confidence_input``: "residual" (the release feeds the pre-norm state to the confidence
    # head) or "normed" (NeMo-trained drafts feed the final-norm output).
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    dspark_confidence_input: str = "residual"
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    dtype: str = "bfloat16"
    fake_quant: bool = True
    # Storage of the two largest weight groups: False = dequantized to `dtype`; True = as released
    # (routed experts packed FP4 + e8m0 scales, Engram tables FP8 rows + e8m0 scales), decoded inside
    # the jitted forward. At the released size only the latter fits one 8xH200 node. Loaders keep what a
    # checkpoint stores unless asked otherwise (`v41cp.checkpoint.open_checkpoint`).
    keep_quantized: bool = False
    # The release's dense FP8 weights: e4m3 with one e8m0 scale per ``weight_block_size``² block (config.json's
    # ``quantization_config.weight_block_size``: V4.1 [32, 32], V4 [128, 128])
    weight_block_size: int = 32
    # Kernel backends (runtime options, not checkpoint fields: `to_dict` leaves them out): "xla" (the jnp
    # reference paths) or "pallas" (`v41cp.kernels`; Pallas Triton on a GPU, interpret mode elsewhere) for
    # the sparse attention and for the indexer scan + top-k, honoured by the decode step, chunked prefill
    # and the DCP path alike.
    attention_backend: str = "xla"
    indexer_backend: str = "xla"
    # Routed-expert dispatch (runtime option): "sparse" (each token runs only its k experts, dropless, static
    # shapes; `v41cp.layers.moe_dispatch`) or "dense" (every expert on every token: the reference).
    moe_backend: str = "sparse"
    # Expert GEMMs of the sparse dispatch with FP4 experts (runtime option): "xla" (gather + decode per tile) or
    # "pallas" (the grouped FP4 kernel, `v41cp.kernels.grouped_matmul`).
    expert_backend: str = "xla"
    # Engram compressed-token map (token id -> compressed id), derived from the tokenizer.
    # Used only by host-side hashing, never inside jitted code, hence excluded from eq/hash.
    engram_token_map: tuple[int, ...] | None = field(default=None, compare=False, repr=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], **overrides: Any) -> "ModelConfig":
        """Build from a released config dict (composite with ``text_config`` or text-only).

        Unknown keys (vision, quantization, DSpark extras, HF metadata) are ignored.
        ``overrides`` replace parsed fields (e.g. ``fake_quant=False``, ``dtype="float32"``).
        """
        if not isinstance(d, Mapping):
            raise ConfigError(f"config must be a mapping, got {type(d).__name__}")
        if "text_config" in d:
            text = d["text_config"]
            if not isinstance(text, Mapping):
                raise ConfigError(f"text_config must be a mapping, got {type(text).__name__}")
        else:
            text = d
        names = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        kind = text.get("model_type", d.get("model_type"))
        if kind is not None:
            if kind not in MODEL_TYPES:
                raise ConfigError(f"model_type {kind!r} is not supported; expected one of {sorted(MODEL_TYPES)}")
            kwargs["model_type"] = MODEL_TYPES[kind]
            if kwargs["model_type"] == "deepseek_v4":
                kwargs.update(V4_SCHEDULE_DEFAULTS)   # no sharing fields in a V4 config.json
        for key, value in text.items():
            if key == "torch_dtype" and "dtype" not in text:
                key = "dtype"
            if key == "engram_pad_id" and "engram_pad_token_id" not in text:   # the HF port's name
                key = "engram_pad_token_id"
            if key not in names or key == "model_type":
                continue
            kwargs[key] = value
        quant = text.get("quantization_config", d.get("quantization_config"))
        if isinstance(quant, Mapping) and "weight_block_size" in quant:
            block = quant["weight_block_size"]
            if not (isinstance(block, (list, tuple)) and len(block) == 2 and block[0] == block[1]):
                raise ConfigError(f"quantization_config.weight_block_size must be a square block [b, b], got {block!r}")
            kwargs["weight_block_size"] = block[0]
        if "rope_scaling" in kwargs and kwargs["rope_scaling"] is None:
            kwargs.pop("rope_scaling")
        kwargs.update(overrides)
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   and f.name not in kwargs]
        if missing:
            raise ConfigError(f"config is missing required field(s): {', '.join(missing)}")
        for key in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids",
                    "engram_layer_ids", "engram_num_embeddings", "engram_token_map", "dspark_target_layer_ids"):
            if key in kwargs and kwargs[key] is not None:
                if not isinstance(kwargs[key], (list, tuple)):
                    raise ConfigError(f"{key} must be a list of integers, got {kwargs[key]!r}")
                kwargs[key] = tuple(kwargs[key])
        if "rope_scaling" in kwargs:
            rs = kwargs["rope_scaling"]
            if isinstance(rs, Mapping):
                kwargs["rope_scaling"] = tuple(sorted(rs.items()))
            elif not isinstance(rs, tuple):
                raise ConfigError(f"rope_scaling must be a mapping, got {rs!r}")
        if isinstance(kwargs.get("dtype"), str):
            kwargs["dtype"] = {"bf16": "bfloat16", "fp32": "float32"}.get(kwargs["dtype"], kwargs["dtype"])
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    @classmethod
    def from_json(cls, path: str | os.PathLike, **overrides: Any) -> "ModelConfig":
        """Parse a ``config.json`` file (see `from_dict`)."""
        with open(path, "r", encoding="utf-8") as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(d, **overrides)

    def to_dict(self) -> dict[str, Any]:
        """The text config as a JSON-serialisable dict (released field names)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in RUNTIME_FIELDS:
                continue
            v = getattr(self, f.name)
            if f.name == "rope_scaling":
                v = dict(v)
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out

    def config_json(self) -> dict[str, Any]:
        """The ``config.json`` a release-format checkpoint of this model carries: V4.1's composite (``model_type``
        and a ``text_config``), V4's flat text config with its ``quantization_config`` (the FP8 block)."""
        text = self.to_dict()
        if not self.is_v4:
            return {"model_type": "deepseek_v41", "text_config": text}
        b = self.weight_block_size
        return {**text, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                                "weight_block_size": [b, b]}}

    def out_of_vocabulary(self, ids) -> str | None:
        """The one vocabulary check of token ids (any iterable or array of integers): the error text naming the
        first id outside ``[0, vocab_size)``, or None when every id is inside."""
        if hasattr(ids, "shape"):
            a = np.asarray(ids)
            outside = (a < 0) | (a >= self.vocab_size)
            bad = int(a[outside][0]) if outside.any() else None
        else:
            bad = next((int(t) for t in ids if not 0 <= t < self.vocab_size), None)
        return None if bad is None else f"token id {bad} is outside the vocabulary [0, {self.vocab_size})"

    def replace(self, **changes: Any) -> "ModelConfig":
        """A validated copy with some fields changed."""
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise `ConfigError` naming the first offending field."""
        def pos_int(name: str) -> None:
            v = getattr(self, name)
            if type(v) is not int or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
                     "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts",
                     "num_experts_per_tok", "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters",
                     "max_position_embeddings"):
            pos_int(name)
        if self.num_key_value_heads != 1:
            raise ConfigError(f"num_key_value_heads must be 1 (one shared K=V latent), got {self.num_key_value_heads!r}")
        if self.n_shared_experts != 1:
            raise ConfigError(f"n_shared_experts must be 1, got {self.n_shared_experts!r}")
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                              f"o_groups ({self.o_groups})")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ConfigError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even and at most "
                              f"head_dim ({self.head_dim}) and index_head_dim ({self.index_head_dim})")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts "
                              f"({self.n_routed_experts})")
        for name in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "routed_scaling_factor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"{name} must be a finite positive number, got {v!r}")
        if not isinstance(self.swiglu_limit, (int, float)) or self.swiglu_limit < 0:
            raise ConfigError(f"swiglu_limit must be a non-negative number, got {self.swiglu_limit!r}")
        if self.scoring_func != "sqrtsoftplus":
            raise ConfigError(f"scoring_func must be 'sqrtsoftplus' for V4.1, got {self.scoring_func!r}")
        if self.topk_method != "noaux_tc":
            raise ConfigError(f"topk_method must be 'noaux_tc' for V4.1, got {self.topk_method!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        for name in ("attention_backend", "indexer_backend", "expert_backend"):
            if getattr(self, name) not in ("xla", "pallas"):
                raise ConfigError(f"{name} must be 'xla' or 'pallas', got {getattr(self, name)!r}")
        if self.moe_backend not in ("sparse", "dense"):
            raise ConfigError(f"moe_backend must be 'sparse' or 'dense', got {self.moe_backend!r}")
        if type(self.weight_block_size) is not int or self.weight_block_size <= 0:
            raise ConfigError(f"weight_block_size must be a positive integer, got {self.weight_block_size!r}")
        for name in ("fake_quant", "keep_quantized"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.keep_quantized and not self.storable_quantized:
            raise ConfigError("keep_quantized needs hidden_size, moe_intermediate_size and engram_head_dim to be "
                              "multiples of 32 (whole FP4 / FP8 scale blocks)")
        rs = dict(self.rope_scaling)
        if rs:
            if rs.get("rope_type", rs.get("type")) != "yarn":
                raise ConfigError(f"rope_scaling.rope_type must be 'yarn', got {rs.get('rope_type')!r}")
            for k in ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings"):
                if k not in rs:
                    raise ConfigError(f"rope_scaling is missing field {k!r}")
        self._validate_schedule()
        self._validate_engram()
        self._validate_dspark()

    def _validate_schedule(self) -> None:
        n = self.num_hidden_layers
        ratios = self.compress_ratios
        if len(ratios) < n:
            raise ConfigError(f"compress_ratios has {len(ratios)} entries but num_hidden_layers is {n}")
        if self.model_type not in ("deepseek_v41", "deepseek_v4"):
            raise ConfigError(f"model_type must be 'deepseek_v41' or 'deepseek_v4', got {self.model_type!r}")
        if type(self.num_hash_layers) is not int or not 0 <= self.num_hash_layers <= n:
            raise ConfigError(f"num_hash_layers must be an integer in [0, num_hidden_layers={n}], got "
                              f"{self.num_hash_layers!r}")
        if self.is_v4:
            self._validate_v4_schedule()
            return
        if self.num_hash_layers:
            raise ConfigError(f"num_hash_layers={self.num_hash_layers}: V4.1 has no hash-routed MoE layers")
        for i, r in enumerate(ratios):
            if type(r) is not int or r not in (0, 1, 2):
                raise ConfigError(f"compress_ratios[{i}] must be 0, 1 or 2 for V4.1, got {r!r}")
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            ids = getattr(self, name)
            if any(type(i) is not int or i < 0 for i in ids):
                raise ConfigError(f"{name} must contain non-negative integer layer ids, got {list(ids)}")
            if list(ids) != sorted(set(ids)):
                raise ConfigError(f"{name} must be strictly increasing, got {list(ids)}")
            if any(i >= n for i in ids):
                raise ConfigError(f"{name} refers to layer(s) {[i for i in ids if i >= n]} beyond "
                                  f"num_hidden_layers={n}")
        if not set(self.kv_source_layer_ids) <= set(self.index_source_layer_ids):
            extra = sorted(set(self.kv_source_layer_ids) - set(self.index_source_layer_ids))
            raise ConfigError(f"kv_source_layer_ids {extra} must also be in index_source_layer_ids")
        owner_ratio = None
        for i in range(n):
            r = ratios[i]
            if r == 0:
                if i in self.kv_source_layer_ids or i in self.index_source_layer_ids:
                    raise ConfigError(f"layer {i} has compress_ratios[{i}]=0 (SWA-only) and cannot be a KV or "
                                      f"index source (kv_source_layer_ids / index_source_layer_ids)")
                continue
            if i in self.kv_source_layer_ids:
                owner_ratio = r
            if owner_ratio != r:
                raise ConfigError(f"layer {i} (compress_ratios[{i}]={r}) has no KV source with the same ratio "
                                  f"at or before it in kv_source_layer_ids={list(self.kv_source_layer_ids)}")
        c = self.candidate_source_layer_id
        if type(c) is not int or c < -1:
            raise ConfigError(f"candidate_source_layer_id must be -1 (off) or a layer id, got {c!r}")
        if c >= 0:
            if c not in self.kv_source_layer_ids:
                raise ConfigError(f"candidate_source_layer_id={c} must be one of kv_source_layer_ids="
                                  f"{list(self.kv_source_layer_ids)}")
            late = [i for i in self.kv_source_layer_ids if i > c]
            if late:
                raise ConfigError(f"kv_source_layer_ids {late} come after candidate_source_layer_id={c}: a KV source "
                                  f"after the candidate source would invalidate its candidate mask")
            for name in ("candidate_topk_blocks", "candidate_block_size"):
                v = getattr(self, name)
                if type(v) is not int or v <= 0:
                    raise ConfigError(f"{name} must be a positive integer when candidates are on, got {v!r}")
        for name, dim in (("head_dim", self.head_dim), ("index_head_dim", self.index_head_dim)):
            if self.fake_quant and dim % 32:
                raise ConfigError(f"{name}={dim} must be a multiple of 32 for the block-32 cache fake-quant "
                                  f"(or set fake_quant=false)")
        if self.fake_quant and self.head_dim % 16:
            raise ConfigError(f"head_dim={self.head_dim} must be a multiple of 16 for NVFP4 compressed KV")

    def _validate_v4_schedule(self) -> None:
        """V4: ratios 0 (SWA), 4 (CSA) or more (HCA); no sharing, CED, Engram or DSpark fields; under the cache
        fake-quant, the release's record shapes (whole FP8 blocks of 64 without RoPE, MXFP4 blocks of 32 and a
        power-of-two index head for the Hadamard rotation)."""
        for i, r in enumerate(self.compress_ratios[:self.num_hidden_layers]):
            if type(r) is not int or not (r == 0 or r >= 4):
                raise ConfigError(f"compress_ratios[{i}] must be 0 (SWA), 4 (CSA) or above 4 (HCA) for V4, got {r!r}")
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids", "dspark_target_layer_ids"):
            if getattr(self, name):
                raise ConfigError(f"{name} must be empty for V4 (every compressed layer owns its compressor and "
                                  f"indexer; no Engram, no DSpark), got {list(getattr(self, name))}")
        if self.candidate_source_layer_id != -1:
            raise ConfigError(f"candidate_source_layer_id must be -1 for V4, got {self.candidate_source_layer_id!r}")
        k, n = self.num_nextn_predict_layers, self.num_hidden_layers
        if k not in (0, 1):
            raise ConfigError(f"num_nextn_predict_layers must be 0 or 1 for V4 (one MTP layer, mtp.0), got {k!r}")
        if k and len(self.compress_ratios) > n and self.compress_ratios[n] != 0:
            raise ConfigError(f"compress_ratios[{n}] (the MTP layer's) must be 0 (SWA-only), got "
                              f"{self.compress_ratios[n]!r}")
        if self.fake_quant:
            nope = self.head_dim - self.qk_rope_head_dim
            if nope % 64:
                raise ConfigError(f"head_dim - qk_rope_head_dim = {nope} must be a multiple of 64 for V4's FP8 "
                                  f"entries (a scale per 64 channels; or set fake_quant=false)")
            di = self.index_head_dim
            if di % 32 or di & (di - 1):
                raise ConfigError(f"index_head_dim={di} must be a power of two and a multiple of 32 for V4's "
                                  f"Hadamard-rotated MXFP4 index keys (or set fake_quant=false)")

    def _validate_engram(self) -> None:
        if len(self.engram_layer_ids) != len(self.engram_num_embeddings):
            raise ConfigError(f"engram_num_embeddings has {len(self.engram_num_embeddings)} entries but "
                              f"engram_layer_ids has {len(self.engram_layer_ids)}")
        if not self.engram_layer_ids:
            return
        for name in ("engram_n_heads", "engram_head_dim", "engram_vocab_size", "engram_compressed_vocab_size"):
            v = getattr(self, name)
            if type(v) is not int or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if type(self.engram_max_ngram_size) is not int or self.engram_max_ngram_size < 2:
            raise ConfigError(f"engram_max_ngram_size must be an integer >= 2, got {self.engram_max_ngram_size!r}")
        if not 0 <= self.engram_pad_token_id < self.vocab_size:
            raise ConfigError(f"engram_pad_token_id={self.engram_pad_token_id} is outside [0, vocab_size="
                              f"{self.vocab_size})")
        if any(type(r) is not int or r <= 0 for r in self.engram_num_embeddings):
            raise ConfigError(f"engram_num_embeddings must be positive integers, got {list(self.engram_num_embeddings)}")
        tm = self.engram_token_map
        if tm is not None:
            if len(tm) != self.vocab_size:
                raise ConfigError(f"engram_token_map has {len(tm)} entries, expected vocab_size={self.vocab_size}")
            if max(tm) + 1 != self.engram_compressed_vocab_size:
                raise ConfigError(f"engram_token_map has {max(tm) + 1} compressed ids but "
                                  f"engram_compressed_vocab_size={self.engram_compressed_vocab_size}")

    def _validate_dspark(self) -> None:
        k = self.num_nextn_predict_layers
        if type(k) is not int or k < 0:
            raise ConfigError(f"num_nextn_predict_layers must be a non-negative integer, got {k!r}")
        if not self.has_dspark:
            return
        n, ids = self.num_hidden_layers, self.dspark_target_layer_ids
        if any(type(i) is not int for i in ids) or list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= n:
            raise ConfigError(f"dspark_target_layer_ids must be strictly increasing layer ids in [0, "
                              f"num_hidden_layers={n}), got {list(ids)}")
        draft = self.compress_ratios[n:n + k]
        if len(draft) != k or any(draft):
            raise ConfigError(f"compress_ratios must end with {k} zeros for the DSpark stages (SWA-only), got "
                              f"{list(self.compress_ratios[n:])}")
        for name in ("dspark_block_size", "dspark_markov_rank", "dspark_n_routed_experts",
                     "dspark_num_experts_per_tok"):
            v = getattr(self, name)
            if type(v) is not int or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if self.dspark_num_experts_per_tok > self.dspark_n_routed_experts:
            raise ConfigError(f"dspark_num_experts_per_tok={self.dspark_num_experts_per_tok} exceeds "
                              f"dspark_n_routed_experts={self.dspark_n_routed_experts}")
        if self.dspark_block_size > self.sliding_window:
            raise ConfigError(f"dspark_block_size={self.dspark_block_size} exceeds sliding_window="
                              f"{self.sliding_window} (a verification step must not overwrite its own window rows)")
        if not 0 <= self.dspark_noise_token_id < self.vocab_size:
            raise ConfigError(f"dspark_noise_token_id={self.dspark_noise_token_id} is outside [0, vocab_size="
                              f"{self.vocab_size})")
        if self.dspark_confidence_input not in ("residual", "normed"):
            raise ConfigError(f"dspark_confidence_input must be 'residual' or 'normed', got "
                              f"{self.dspark_confidence_input!r}")

    # ------------------------------------------------------------------ derived
    @property
    def is_v4(self) -> bool:
        """DeepSeek-V4 (V4-Flash, V4-Pro): CSA / HCA layers, hash-routed MoE, the per-site mHC with ``hc_head``."""
        return self.model_type == "deepseek_v4"

    def hash_routed(self, layer: int) -> bool:
        """Layer ``layer``'s MoE picks its experts from the token id (``tid2eid``), not the router's top-k."""
        return layer < self.num_hash_layers

    @property
    def cache_formats(self) -> CacheFormats:
        """The cache formats (`v41cp.quant.CACHE_FORMATS`) of the window rows, compressed entries and index keys:
        V4.1 FP8 / NVFP4 / MXFP4; DeepSeek-V4 its 584 B record (``fp8_ds_mla``) for window rows and entries alike,
        MXFP4 index keys. The stores hold them as byte records or fake-quantized values under ``fake_quant``."""
        if self.is_v4:
            return CacheFormats(window="fp8_ds_mla", entries="fp8_ds_mla", index="mxfp4")
        return CacheFormats(window="fp8", entries="nvfp4", index="mxfp4")

    @property
    def page_tokens(self) -> int:
        """The default cache page: 16 tokens, or the least multiple of 16 that every layer's compression ratio
        divides (a page holds whole entries of every pool): 16 for V4.1, 128 for DeepSeek-V4 (its HCA ratio)."""
        return math.lcm(16, *(r for r in self.compress_ratios if r > 0))

    @property
    def storable_quantized(self) -> bool:
        """The shapes hold whole FP4 / FP8 scale blocks (``hidden_size``, ``moe_intermediate_size`` and
        ``engram_head_dim`` multiples of 32), so ``keep_quantized`` may keep the release's bytes."""
        return not (self.hidden_size % 32 or self.moe_intermediate_size % 32 or self.engram_head_dim % 32)

    @property
    def has_dspark(self) -> bool:
        """The config describes DSpark stages (``num_nextn_predict_layers > 0`` with target layers)."""
        return self.num_nextn_predict_layers > 0 and len(self.dspark_target_layer_ids) > 0

    @property
    def has_mtp(self) -> bool:
        """The config describes DeepSeek-V4's MTP layer (``num_nextn_predict_layers = 1``; `v41cp.mtp`)."""
        return self.is_v4 and self.num_nextn_predict_layers > 0

    @property
    def has_drafter(self) -> bool:
        """The checkpoint holds a drafter (``mtp.*``): DSpark stages (V4.1) or the MTP layer (V4)."""
        return self.has_dspark or self.has_mtp

    def draft_stage_config(self) -> "ModelConfig":
        """The config a DSpark stage runs its MoE and mHC with: the backbone's, with the drafter's experts."""
        return dataclasses.replace(self, n_routed_experts=self.dspark_n_routed_experts,
                                   num_experts_per_tok=self.dspark_num_experts_per_tok)

    @property
    def layer_roles(self) -> tuple[LayerRole, ...]:
        """Role of every backbone layer (see the module docstring)."""
        roles = []
        kv_src, idx_src = -1, -1
        for i in range(self.num_hidden_layers):
            r = self.compress_ratios[i]
            if self.is_v4:
                kind = "swa" if r == 0 else "csa" if r == 4 else "hca"
                roles.append(LayerRole(index=i, ratio=r, kind=kind, kv_source=i if r else -1,
                                       index_source=i if kind == "csa" else -1, candidate_source=False,
                                       uses_candidates=False, engram_slot=-1))
                continue
            if r == 0:
                kind = "swa"
            elif i in self.kv_source_layer_ids:
                kind, kv_src = "full", i
            elif i in self.index_source_layer_ids:
                kind = "reindex"
            else:
                kind = "reuse"
            if kind in ("full", "reindex"):
                idx_src = i
            c = self.candidate_source_layer_id
            roles.append(LayerRole(
                index=i, ratio=r, kind=kind,
                kv_source=kv_src if r else -1, index_source=idx_src if r else -1,
                candidate_source=(i == c),
                uses_candidates=kind in ("full", "reindex") and 0 <= c < i,
                engram_slot=self.engram_layer_ids.index(i) if i in self.engram_layer_ids else -1))
        return tuple(roles)

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    @property
    def engram_hash_heads(self) -> int:
        """Hash heads per Engram layer: (max n-gram − 1) · heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def engram_table_rows(self, slot: int) -> int:
        """Rows of Engram table ``slot`` as stored in the parameter tree: the released row count padded
        with zero rows to a multiple of `ENGRAM_ROW_ALIGN`, so the table splits evenly over any TP size
        up to 64 (hash ids never reach the padding). Layer 14's 384016682 rows are not divisible by 8."""
        rows = self.engram_num_embeddings[slot]
        return -(-rows // ENGRAM_ROW_ALIGN) * ENGRAM_ROW_ALIGN

    @property
    def hc_mix_width(self) -> int:
        """Width of an mHC mixer output: pre (hc) + post (hc) + comb (hc²)."""
        return self.hc_mult * (self.hc_mult + 2)


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A named preset (`PRESETS`): ``v41-flash``, ``tiny``, ``tiny-dense``, ``tiny-tp8``."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return ModelConfig.from_dict(PRESETS[name], **overrides)
