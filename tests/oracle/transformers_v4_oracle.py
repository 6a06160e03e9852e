"""Oracle harness: drives transformers' DeepSeek-V4 port (``DeepseekV4ForCausalLM``, eager attention) on CPU.

Runs in the oracle's own virtual environment (`tests/oracle/setup_venv.sh`: torch 2.13.0 CPU, transformers
5.18.0, which ships ``deepseek_v4`` with interleaved RoPE pairs) and writes plain files the JAX suite reads (no
pickle anywhere). transformers' V4 has no cache fake-quant and no MTP; the project's V4 configs run with
``fake_quant`` off.

``model --preset NAME --out DIR [--seed N]``:
  weights.safetensors    every parameter and buffer under transformers' module names (``model.layers.{i}.self_attn
                         .q_a_proj.weight``, ``model.layers.{i}.mlp.gate.tid2eid``, …), FP32 (tid2eid int64)
  released.safetensors   the same tensors under the release's names (``layers.{i}.attn.wq_a.weight``, the experts
                         split per expert), unquantized
  reference.safetensors  input_ids [1,S]; logits [1,S,V] (one forward, no cache); chunked_logits [1,S,V] (the
                         prompt in two chunks through transformers' cache: its C4 overlap / open-window state);
                         generated [1,S+6] (greedy, cached); topk_<layer> [1,S,K] (each CSA layer's indexer picks,
                         −1 = none) and index_scores_<layer> [1,S,G] (the scores it ranks, future entries −inf)

The config comes from the project's presets (``v41cp/config.py`` is plain Python and importable here). Random
weights: transformers' own initialisation (normal 0.02), then the parameters it initialises to constants (norm
weights, sinks, mHC bases and scales, compressor position biases, the router's correction bias) are drawn too, so
every one of them matters; each hash layer's ``tid2eid`` gives every token ``k`` distinct random experts.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from safetensors.torch import save_file

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, REPO)

from v41cp.config import PRESETS  # noqa: E402  (pure Python, no jax)

LAYER_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention"}


def v4_config(name: str):
    """transformers' ``DeepseekV4Config`` of preset ``name`` (layer types from its compress ratios: 0 SWA, 4 CSA,
    any other HCA — one HCA ratio per model, as transformers' ``compress_rates`` holds)."""
    from transformers import DeepseekV4Config

    p = PRESETS[name]
    n = p["num_hidden_layers"]
    ratios = p["compress_ratios"][:n]
    hca = sorted({r for r in ratios if r not in LAYER_TYPE})
    if len(hca) > 1:
        raise SystemExit(f"preset {name}: transformers' V4 holds one HCA ratio, the preset has {hca}")
    types = [LAYER_TYPE.get(r, "heavily_compressed_attention") for r in ratios]
    rope = dict(p.get("rope_scaling") or {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                                          "original_max_position_embeddings": 65536})
    return DeepseekV4Config(
        vocab_size=p["vocab_size"], hidden_size=p["hidden_size"], num_hidden_layers=n,
        num_attention_heads=p["num_attention_heads"], head_dim=p["head_dim"], q_lora_rank=p["q_lora_rank"],
        partial_rotary_factor=p["qk_rope_head_dim"] / p["head_dim"], sliding_window=p["sliding_window"],
        layer_types=types,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca[0] if hca else 128},
        mlp_layer_types=["hash_moe"] * p["num_hash_layers"] + ["moe"] * (n - p["num_hash_layers"]),
        index_n_heads=p["index_n_heads"], index_head_dim=p["index_head_dim"], index_topk=p["index_topk"],
        o_groups=p["o_groups"], o_lora_rank=p["o_lora_rank"], moe_intermediate_size=p["moe_intermediate_size"],
        n_routed_experts=p["n_routed_experts"], num_experts_per_tok=p["num_experts_per_tok"],
        routed_scaling_factor=p["routed_scaling_factor"], swiglu_limit=p["swiglu_limit"], hc_mult=p["hc_mult"],
        hc_sinkhorn_iters=p["hc_sinkhorn_iters"], hc_eps=p["hc_eps"], rms_norm_eps=p["rms_norm_eps"],
        rope_theta=p["rope_theta"], compress_rope_theta=p["compress_rope_theta"], rope_parameters=rope,
        max_position_embeddings=p["max_position_embeddings"], num_nextn_predict_layers=0,
        bos_token_id=p["bos_token_id"], eos_token_id=p["eos_token_id"], pad_token_id=None)


def randomize(model, cfg, seed: int) -> None:
    """Draw the constant-initialised parameters (see the module docstring) and each hash layer's table."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name and leaf == "weight":
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif leaf in ("sinks", "position_bias", "base", "hc_base"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif leaf in ("scale", "hc_scale"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if getattr(layer.mlp, "is_hash", False):
                table = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok]
                                     for _ in range(cfg.vocab_size)])
                gate.tid2eid.copy_(table)
            else:
                gate.e_score_correction_bias.copy_(0.1 * torch.randn(gate.e_score_correction_bias.shape,
                                                                     generator=g))


# transformers' module names → the release's (v41-architecture.md §5.2: V4.1's tree plus ``hc_head_*``,
# ``ffn.gate.tid2eid``, ``compressor.ape`` and the indexer's own ``compressor``), per layer and at the top
_LAYER_NAMES = (
    ("self_attn.q_a_proj.weight", "attn.wq_a.weight"), ("self_attn.q_a_norm.weight", "attn.q_norm.weight"),
    ("self_attn.q_b_proj.weight", "attn.wq_b.weight"), ("self_attn.kv_proj.weight", "attn.wkv.weight"),
    ("self_attn.kv_norm.weight", "attn.kv_norm.weight"), ("self_attn.o_a_proj.weight", "attn.wo_a.weight"),
    ("self_attn.o_b_proj.weight", "attn.wo_b.weight"), ("self_attn.sinks", "attn.attn_sink"),
    ("self_attn.compressor.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"),
    ("self_attn.compressor.indexer.scorer.weights_proj.weight", "attn.indexer.weights_proj.weight"),
    ("input_layernorm.weight", "attn_norm.weight"), ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("mlp.gate.weight", "ffn.gate.weight"), ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
    ("mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight"),
    ("mlp.shared_experts.up_proj.weight", "ffn.shared_experts.w3.weight"),
    ("mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight"),
) + tuple((f"{site}_hc.{p}", f"hc_{site}_{p}") for site in ("attn", "ffn") for p in ("fn", "base", "scale")) + tuple(
    (f"self_attn.compressor.{ix}{a}", f"attn.{'indexer.' if ix else ''}compressor.{b}")
    for ix in ("", "indexer.")
    for a, b in (("kv_proj.weight", "wkv.weight"), ("gate_proj.weight", "wgate.weight"),
                 ("kv_norm.weight", "norm.weight"), ("position_bias", "ape")))
_TOP_NAMES = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
              "model.norm.weight": "norm.weight", "model.hc_head.hc_fn": "hc_head_fn",
              "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}


def released_names(state: dict, cfg) -> dict:
    """transformers' state dict → the release's names (unquantized); the experts' fused ``gate_up_proj [E, 2I, H]``
    and ``down_proj [E, H, I]`` split into ``ffn.experts.{e}.w1 / w3 / w2``. Every tensor is placed exactly once."""
    out, left = {}, dict(state)
    for hf, rel in _TOP_NAMES.items():
        out[rel] = left.pop(hf)
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        for hf, rel in _LAYER_NAMES:
            if pre + hf in left:
                out[f"layers.{i}.{rel}"] = left.pop(pre + hf)
        gate_up, down = left.pop(pre + "mlp.experts.gate_up_proj"), left.pop(pre + "mlp.experts.down_proj")
        width = cfg.moe_intermediate_size
        for e in range(cfg.n_routed_experts):
            out[f"layers.{i}.ffn.experts.{e}.w1.weight"] = gate_up[e, :width]
            out[f"layers.{i}.ffn.experts.{e}.w3.weight"] = gate_up[e, width:]
            out[f"layers.{i}.ffn.experts.{e}.w2.weight"] = down[e]
    if left:
        raise SystemExit(f"transformers V4 tensors with no released name: {sorted(left)}")
    return {k: v.contiguous() for k, v in out.items()}


def run_model(args) -> None:
    import transformers
    from transformers import DeepseekV4ForCausalLM, DynamicCache

    torch.manual_seed(args.seed)
    cfg = v4_config(args.preset)
    model = DeepseekV4ForCausalLM(cfg).eval()
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    randomize(model, cfg, args.seed)
    s = args.length
    prompt = torch.randint(3, cfg.vocab_size, (1, s), generator=torch.Generator().manual_seed(args.seed + 1))

    picks, scores = {}, {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        comp = layer.self_attn.compressor
        if comp is not None and hasattr(comp, "indexer"):
            hooks.append(comp.indexer.register_forward_hook(
                lambda m, inp, out, i=i: picks.__setitem__(i, out.detach().clone())))
            hooks.append(comp.indexer.scorer.register_forward_hook(
                lambda m, inp, out, i=i: scores.__setitem__(i, out.detach().clone())))
    with torch.no_grad():
        logits = model(prompt, use_cache=False).logits
        ref = {"input_ids": prompt, "logits": logits.float()}
        for i in picks:
            ref[f"topk_{i}"] = picks[i]
            g = scores[i].shape[-1]
            visible = torch.arange(g)[None, None, :] < ((torch.arange(s) + 1) // 4)[None, :, None]
            ref[f"index_scores_{i}"] = scores[i].float().masked_fill(~visible, float("-inf"))
        for h in hooks:
            h.remove()
        cache = DynamicCache(config=model.config)
        cut = args.chunk
        a = model(prompt[:, :cut], past_key_values=cache, use_cache=True).logits
        b = model(prompt[:, cut:], past_key_values=cache, use_cache=True).logits
        ref["chunked_logits"] = torch.cat([a, b], 1).float()
        ref["generated"] = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
    os.makedirs(args.out, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}
    save_file(state, os.path.join(args.out, "weights.safetensors"))
    save_file(released_names(state, cfg), os.path.join(args.out, "released.safetensors"))
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(args.out, "reference.safetensors"))
    print(f"transformers {transformers.__version__}: {args.preset}, {len(state)} tensors, prompt {s}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model")
    m.add_argument("--out", required=True)
    m.add_argument("--preset", default="tiny-v4")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--length", type=int, default=40)
    m.add_argument("--chunk", type=int, default=23)
    args = ap.parse_args()
    torch.set_num_threads(2)
    run_model(args)


if __name__ == "__main__":
    main()
