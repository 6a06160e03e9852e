"""DeepSeek-V4 parameters from transformers' module names (``DeepseekV4ForCausalLM.state_dict()``, as the V4 oracle
writes them): the model's parameter tree for a ``deepseek_v4`` config.

transformers names its modules its own way (``model.layers.{i}.self_attn.q_a_proj.weight``,
``mlp.experts.gate_up_proj [E, 2I, H]``, ``self_attn.compressor.indexer.position_bias``, …) and stores linear weights
``[out, in]``; the model's tree holds ``[in, out]`` and stacks its experts ``[E, in, out]``. Every expected key must
be present with the expected shape: a missing key, an extra key or a wrong shape is an error that names it.
(The release's own names — ``layers.{i}.attn.wq_a.weight`` with FP8 block scales — are another layout, not this
module's.)
"""

from __future__ import annotations

from typing import Mapping

import flax.linen as nn
import jax
import numpy as np

from v41cp.config import ModelConfig
from v41cp.model import abstract_params

__all__ = ["params_from_transformers_v4"]


def _linear(w: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(w).T)


def _layer(cfg: ModelConfig, i: int, take) -> dict:
    """Layer ``i``'s subtree; ``take(name)`` pops ``model.layers.{i}.{name}``."""
    role = cfg.layer_roles[i]
    nh, d, g = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
    heads_in = nh * d // g
    attn = {
        "wq_a": _linear(take("self_attn.q_a_proj.weight")),
        "q_norm": {"weight": take("self_attn.q_a_norm.weight")},
        "wq_b": _linear(take("self_attn.q_b_proj.weight")).reshape(cfg.q_lora_rank, nh, d),
        "wkv": _linear(take("self_attn.kv_proj.weight")),
        "kv_norm": {"weight": take("self_attn.kv_norm.weight")},
        "wo_a": np.asarray(take("self_attn.o_a_proj.weight")).reshape(g, cfg.o_lora_rank, heads_in).transpose(0, 2, 1),
        "wo_b": _linear(take("self_attn.o_b_proj.weight")).reshape(g, cfg.o_lora_rank, cfg.hidden_size),
        "attn_sink": take("self_attn.sinks"),
    }

    def compressor(prefix: str) -> dict:
        return {"wkv": _linear(take(f"{prefix}.kv_proj.weight")), "wgate": _linear(take(f"{prefix}.gate_proj.weight")),
                "ape": take(f"{prefix}.position_bias"), "norm": {"weight": take(f"{prefix}.kv_norm.weight")}}

    if role.is_kv_source:
        attn["compressor"] = compressor("self_attn.compressor")
    if role.is_index_source:
        ix = "self_attn.compressor.indexer"
        attn["indexer"] = {
            "compressor": compressor(ix),
            "wq_b": _linear(take(f"{ix}.q_b_proj.weight")).reshape(cfg.q_lora_rank, cfg.index_n_heads,
                                                                   cfg.index_head_dim),
            "weights_proj": _linear(take(f"{ix}.scorer.weights_proj.weight")),
        }
    gate_up = np.asarray(take("mlp.experts.gate_up_proj"))                      # [E, 2I, H]: gate rows, then up
    width = cfg.moe_intermediate_size
    ffn = {
        "gate_weight": _linear(take("mlp.gate.weight")),
        "experts_w1": np.ascontiguousarray(gate_up[:, :width].transpose(0, 2, 1)),
        "experts_w3": np.ascontiguousarray(gate_up[:, width:].transpose(0, 2, 1)),
        "experts_w2": np.ascontiguousarray(np.asarray(take("mlp.experts.down_proj")).transpose(0, 2, 1)),
        "shared_w1": _linear(take("mlp.shared_experts.gate_proj.weight")),
        "shared_w3": _linear(take("mlp.shared_experts.up_proj.weight")),
        "shared_w2": _linear(take("mlp.shared_experts.down_proj.weight")),
    }
    if cfg.hash_routed(i):
        table = np.asarray(take("mlp.gate.tid2eid"))
        bad = (table < 0) | (table >= cfg.n_routed_experts)
        if bad.any():
            raise ValueError(f"transformers V4 state: layer {i}'s mlp.gate.tid2eid routes to expert "
                             f"{int(table[bad][0])}, outside [0, {cfg.n_routed_experts})")
        ffn["gate_tid2eid"] = table.astype(np.int32)
    else:
        ffn["gate_bias"] = take("mlp.gate.e_score_correction_bias")
    mix = lambda site: {"fn": take(f"{site}.fn"), "base": take(f"{site}.base"), "scale": take(f"{site}.scale")}
    return {"attn": attn, "attn_norm": {"weight": take("input_layernorm.weight")},
            "ffn": ffn, "ffn_norm": {"weight": take("post_attention_layernorm.weight")},
            "hc_attn": mix("attn_hc"), "hc_ffn": mix("ffn_hc")}


def params_from_transformers_v4(cfg: ModelConfig, state: Mapping[str, np.ndarray]) -> dict:
    """The parameter tree of ``cfg`` (a ``deepseek_v4`` config, ``keep_quantized`` off) from a transformers V4 state
    dict (NumPy arrays by module name). Floating arrays keep their dtype; cast the tree as needed."""
    if not cfg.is_v4:
        raise ValueError(f"params_from_transformers_v4 needs a deepseek_v4 config, got model_type={cfg.model_type!r}")
    if cfg.keep_quantized:
        raise ValueError("params_from_transformers_v4: transformers' V4 weights are plain; use keep_quantized=False")
    left = dict(state)

    def pop(key: str) -> np.ndarray:
        if key not in left:
            raise KeyError(f"transformers V4 state: missing {key!r}")
        return np.asarray(left.pop(key))

    params = {"embed": pop("model.embed_tokens.weight"), "head": _linear(pop("lm_head.weight")),
              "norm": {"weight": pop("model.norm.weight")},
              "hc_head": {"fn": pop("model.hc_head.hc_fn"), "base": pop("model.hc_head.hc_base"),
                          "scale": pop("model.hc_head.hc_scale")}}
    for i in range(cfg.num_hidden_layers):
        params[f"layers_{i}"] = _layer(cfg, i, lambda name, i=i: pop(f"model.layers.{i}.{name}"))
    if left:
        raise KeyError(f"transformers V4 state: unexpected keys {sorted(left)[:8]} ({len(left)} in all)")
    _check_shapes(cfg, params)
    return params


def _check_shapes(cfg: ModelConfig, params: dict) -> None:
    """Every array of ``params`` has the shape the model declares (the message names the first that does not)."""
    want = nn.unbox(abstract_params(cfg))
    got_paths = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    for path, spec in jax.tree_util.tree_flatten_with_path(want)[0]:
        name = "/".join(str(getattr(p, "key", p)) for p in path)
        if path not in got_paths:
            raise KeyError(f"transformers V4 state: nothing maps to parameter {name}")
        if tuple(got_paths[path].shape) != tuple(spec.shape):
            raise ValueError(f"transformers V4 state: parameter {name} has shape {tuple(got_paths[path].shape)}, "
                             f"the config declares {tuple(spec.shape)}")
    if len(got_paths) != len(jax.tree_util.tree_flatten_with_path(want)[0]):
        raise KeyError("transformers V4 state: the mapped tree has parameters the config does not declare")
