"""Oracle harness: drives NVIDIA NeMo AutoModel 0.7.0's DeepSeek-V4.1 port on CPU.

Runs in its own virtual environment (torch 2.13.0 CPU, transformers 5.18.0,
``nemo-automodel==0.7.0 --no-deps``; `.ci/run` and `tests/oracle/setup_venv.sh` build it) and
writes plain files that the JAX test-suite reads (no pickle anywhere):

``model`` sub-command, into ``--out DIR``:
  config.json            the text config (released field names)
  tokenizer.json         the synthetic word-level tokenizer (Engram needs a tokenizer)
  weights.safetensors    every weight under its *released* checkpoint name (state_dict_adapter.to_hf), FP32
  reference.safetensors  input_ids [B,S], logits [B,S,V], hidden [L,B,S,hc,H] (block inputs),
                         engram_hashes [B,S,n_engram,heads], token_map [vocab],
                         topk_<layer> [B,S,K] (selected compressed positions, ascending, -1 = none),
                         candidates_<layer> [B,S,G] (candidate source only),
                         index_{queries,keys,weights,scores}_<layer> the index-score operands
                         [B,S,H,D] / [B,G,D] / [B,S,H] and the masked scores [B,S,G] it selects from
                         (values of the run's dtype, stored as FP32)
  timing.json            forward wall time (first and steady-state)

``model --dtype bfloat16`` runs the port in BF16 (the released dtype).

``quant`` sub-command: quantize_cache of random tensors incl. e2m1 rounding ties and zero blocks,
into ``quant.safetensors`` (input_<fmt>, output_<fmt>).

``model --weights DIR`` loads a released-layout checkpoint through the port's ``from_hf`` (its own
dequantization) instead of seeded weights, and also writes ``dequantized.safetensors``.
``dequant --src FILE`` writes the port's dequantization of every (weight, scale) pair in FILE;
``rope`` writes the port's RoPE inverse frequencies for the released and tiny shapes.

The model config comes from the project's presets (``v41cp/config.py`` is plain Python and
importable here); ``--set key=value`` overrides fields; ``--fake-quant off`` replaces the port's
cache quantizer with the identity.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from safetensors.torch import save_file

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, REPO)

from v41cp.config import PRESETS  # noqa: E402  (pure Python, no jax)

NEMO = "nemo_automodel.components.models.deepseek_v41"


def synthetic_tokenizer(vocab: int):
    """A word-level tokenizer whose ids have case variants, so the Engram compressed vocabulary
    (normalised, lower-cased text) is smaller than the raw vocabulary, as in the release."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<bos>", "<eos>", "<pad>"]
    i = 0
    while len(words) < vocab - 1 and i < 120:
        words += [f"w{i}", f"W{i}"]
        i += 1
    while len(words) < vocab:
        words.append(f"x{len(words)}")
    tok = Tokenizer(models.WordLevel(vocab={w: j for j, w in enumerate(words[:vocab])}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # declared special (as a released tokenizer declares its own): "<eos>" encodes as its one id, never split by
    # the pre-tokenizer into "<", "eos", ">", and the saved tokenizer.json lists them in added_tokens
    tok.add_special_tokens([AddedToken(w, special=True, normalized=False) for w in words[:3]])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    return tok, fast


class _EinsumRecorder:
    """Stands in for the ``torch`` module inside the port's attention module: records the operands of the
    index-score einsum (queries ``[B,S,H,D]``, keys ``[B,G,D]``) into ``rec`` and otherwise is ``torch``."""

    def __init__(self, rec):
        self._rec = rec

    def __getattr__(self, name):
        return getattr(torch, name)

    def einsum(self, equation, *operands):
        if equation == "bshd,btd->bsht":
            self._rec["queries"], self._rec["keys"] = (o.detach().clone() for o in operands)
        return torch.einsum(equation, *operands)


def parse_overrides(items):
    out = {}
    for item in items or []:
        key, _, value = item.partition("=")
        out[key] = json.loads(value)
    return out


def build_model(text: dict, seed: int, tokenizer, dtype: str = "float32"):
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config, DeepseekV41TextConfig
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    kw = {k: (list(v) if isinstance(v, tuple) else v) for k, v in text.items()}
    kw.update(dtype=dtype, dspark_target_layer_ids=kw.get("dspark_target_layer_ids", []),
              rope_scaling={"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                            "original_max_position_embeddings": 65536})
    cfg = DeepseekV41Config(text_config=DeepseekV41TextConfig(**kw), vision_config={"num_hidden_layers": 0},
                            dtype=dtype)
    backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch",
                            dispatcher="torch", enable_hf_state_dict_adapter=True)
    torch.manual_seed(seed)
    model = DeepseekV41ForCausalLM(cfg, backend=backend, tokenizer=tokenizer)
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=getattr(torch, dtype))
    _perturb_constants(model, seed + 17)
    model.eval()
    return model


def seeded_target(text: dict, args):
    """The port's target model of config ``text`` (``--set`` overrides applied, its dtype from ``--dtype``; the
    Engram compressed vocabulary of the synthetic tokenizer written into ``text``), seeded by ``--seed``:
    ``(model, tokenizer, token_map or None)``."""
    text.update(parse_overrides(args.set))
    text.pop("dtype", None)
    tok, fast = synthetic_tokenizer(text["vocab_size"])
    token_map = None
    if text.get("engram_layer_ids"):
        from nemo_automodel.components.models.deepseek_v41.engram import _compressed_token_map
        token_map, compressed = _compressed_token_map(fast)
        text["engram_compressed_vocab_size"] = compressed
    return build_model(text, args.seed, fast, args.dtype), tok, token_map


def load_released_weights(model, directory):
    """Load a released-layout checkpoint (quantized or not) through the port's own adapter
    (``from_hf``: its dequantization, renaming and expert merging). Returns the port's dequantized
    tensors under released names (FP32) for bit-exact comparison."""
    import glob

    from safetensors.torch import load_file

    hf = {}
    for f in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        hf.update(load_file(f))
    adapter = model.state_dict_adapter
    dequantized = adapter._dequantize(dict(hf))
    dequantized = {k: v.float().contiguous() for k, v in dequantized.items() if not k.startswith("mtp.")}
    native = adapter.from_hf(dict(hf))
    state = model.state_dict()
    missing = sorted(set(state) - set(native))
    unexpected = sorted(set(native) - set(state))
    if missing or unexpected:
        raise SystemExit(f"oracle: checkpoint does not fit the port: missing {missing[:3]} unexpected {unexpected[:3]}")
    model.load_state_dict({k: v.to(state[k].dtype) for k, v in native.items()}, strict=True)
    return dequantized


def cmd_model(args):
    from importlib import import_module

    attention = import_module(f"{NEMO}.attention")
    if args.fake_quant == "off":
        attention.quantize_cache = lambda values, **_: values
    if args.weights:
        with open(os.path.join(args.weights, "config.json")) as f:
            loaded = json.load(f)
        text = dict(loaded.get("text_config", loaded))
        for k in ("fake_quant", "engram_token_map"):
            text.pop(k, None)
    else:
        text = dict(PRESETS[args.preset])
    model, tok, token_map = seeded_target(text, args)
    dequantized = None
    if args.weights:
        dequantized = load_released_weights(model, args.weights)

    captured, scoring = {}, {}
    original = attention._Indexer.forward

    def spy(self, *a, **kw):
        # the port's own index-score operands and scores, seen without changing its code: its module-level
        # `torch` is a proxy that records the einsum's operands, `Tensor.topk` records the tensor it selects
        # from (the last call is the selection over the masked scores), `weights_proj`'s output is hooked
        rec = {}
        topk, module_torch = torch.Tensor.topk, attention.torch

        def recording_topk(t, *ta, **tkw):
            rec["scores"] = t.detach().clone()
            return topk(t, *ta, **tkw)

        hook = self.weights_proj.register_forward_hook(lambda _m, _i, out: rec.__setitem__("proj", out.detach().clone()))
        attention.torch, torch.Tensor.topk = _EinsumRecorder(rec), recording_topk
        try:
            state = original(self, *a, **kw)
        finally:
            attention.torch, torch.Tensor.topk = module_torch, topk
            hook.remove()
        captured[self._layer] = (state.topk_indices.clone(), None if state.candidates is None
                                 else state.candidates.clone())
        if "queries" in rec:
            # the port scales the projection by this factor in its own dtype right after the projection
            rec["weights"] = rec.pop("proj") * (self.head_dim ** -0.5 * self.num_heads ** -0.5)
            scoring[self._layer] = rec
        return state

    for name, module in model.named_modules():
        if isinstance(module, attention._Indexer):
            module._layer = int(name.split(".")[2])
    attention._Indexer.forward = spy

    ids = torch.randint(3, text["vocab_size"], (args.batch, args.seq), generator=torch.Generator().manual_seed(args.seed + 1))
    with torch.no_grad():
        t0 = time.perf_counter()
        logits = model(ids).logits
        first = time.perf_counter() - t0
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            logits = model(ids).logits
            times.append(time.perf_counter() - t0)
        _, hidden = model.model(ids, output_hidden_states=True)
        hashes = model.model.engram_hash(ids) if model.model.engram_hash is not None else torch.zeros(0)
    os.makedirs(args.out, exist_ok=True)
    ref = {"input_ids": ids.to(torch.int64), "logits": logits.float(),
           "hidden": torch.stack(list(hidden)).float(), "engram_hashes": hashes.to(torch.int64)}
    if text.get("engram_layer_ids"):
        ref["token_map"] = torch.tensor(token_map, dtype=torch.int64)
    for layer, (topk, cand) in captured.items():
        ref[f"topk_{layer}"] = topk.to(torch.int64)
        for name, value in scoring.get(layer, {}).items():
            ref[f"index_{name}_{layer}"] = value.float()
        if cand is not None and layer == text["candidate_source_layer_id"]:
            ref[f"candidates_{layer}"] = cand.to(torch.uint8)
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(args.out, "reference.safetensors"))
    hf = model.state_dict_adapter.to_hf(dict(model.state_dict()))
    save_file({k: v.float().contiguous() for k, v in hf.items()}, os.path.join(args.out, "weights.safetensors"))
    if dequantized is not None:
        save_file(dequantized, os.path.join(args.out, "dequantized.safetensors"))
    cfg_out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in text.items()}
    cfg_out["dtype"] = args.dtype
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump({"model_type": "deepseek_v41", "text_config": cfg_out}, f, indent=1)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "timing.json"), "w") as f:
        json.dump({"first_forward_s": first, "steady_forward_s": sorted(times)[len(times) // 2] if times else first,
                   "batch": args.batch, "seq": args.seq}, f)
    print(f"oracle: wrote {args.out} (logits {tuple(logits.shape)}, first forward {first:.3f}s)")


def _perturb_constants(module, seed):
    """Non-trivial values where the port initialises constants (sinks 0, norms 1, biases 0), so that the
    comparison exercises them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("sinks_param.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("norm.weight") or name.endswith("q_weight") or name.endswith("k_weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".base") or name.endswith(".scale"):
                p.add_(0.1 * torch.randn(p.shape, generator=g))
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias") or name.endswith("bias_vl"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def cmd_dspark(args):
    """The DSpark drafter (the port's cache-free backbone, `dspark.DeepseekV41DSparkBackbone`) on the target's
    own features: a tiny target with DSpark stages (seeded like ``model``), its features at the attention input of
    ``dspark_target_layer_ids`` (the port's capture points, mean over the hc streams), and blocks anchored at
    ``--anchors`` of every batch row with the given previous tokens (the sequence's own: teacher forcing).
    Writes config.json, tokenizer.json, weights.safetensors (target + ``mtp.*`` under released names, FP32) and
    reference.safetensors: input_ids [B,S], target_features [B,S,n·H], anchors [B,A], block_ids /
    previous_ids [B,A,N], normalized [B,A,N,H], draft_logits [B,A,N,V] (head on the normalized state + Markov),
    markov_logits [B,A,N,V], confidence [B,A,N] (the port's: from the normalized state)."""
    from importlib import import_module

    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkBackbone
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import DeepseekV41DSparkStateDictAdapter

    attention = import_module(f"{NEMO}.attention")
    if args.fake_quant == "off":
        attention.quantize_cache = lambda values, **_: values
        import_module(f"{NEMO}.dspark").quantize_cache = lambda values, **_: values
    text = dict(PRESETS[args.preset])
    model, tok, _ = seeded_target(text, args)
    tcfg = model.config.text_config
    backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch")
    torch.manual_seed(args.seed + 3)
    drafter = DeepseekV41DSparkBackbone(tcfg, backend)
    drafter.initialize_weights(torch.device("cpu"))
    _perturb_constants(drafter, args.seed + 29)
    drafter.eval()

    ids = torch.randint(3, text["vocab_size"], (args.batch, args.seq), generator=torch.Generator().manual_seed(args.seed + 1))
    captured = {}
    modules = model.get_dspark_target_feature_modules(list(tcfg.dspark_target_layer_ids))
    hooks = [m.register_forward_pre_hook(lambda _m, inp, i=i: captured.__setitem__(i, inp[0].detach().clone()))
             for i, m in zip(tcfg.dspark_target_layer_ids, modules)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    features = torch.cat([captured[i].mean(dim=2) for i in tcfg.dspark_target_layer_ids], dim=-1)

    anchors = torch.tensor(json.loads(args.anchors), dtype=torch.long)           # [B, A]
    n = tcfg.dspark_block_size
    offsets = torch.arange(n).view(1, 1, -1)
    block_ids = torch.full((*anchors.shape, n), tcfg.dspark_noise_token_id, dtype=torch.long)
    block_ids[..., 0] = torch.gather(ids, 1, anchors)
    previous = torch.gather(ids.unsqueeze(1).expand(-1, anchors.shape[1], -1), 2, (anchors.unsqueeze(-1) + offsets)
                            .clamp(max=args.seq - 1))
    embed = model.get_input_embeddings()
    with torch.no_grad():
        out = drafter(embed(block_ids.reshape(args.batch, -1)), features,
                      position_ids=drafter.build_position_ids(anchors, args.seq),
                      attention_mask=drafter.build_attention_mask(anchors, torch.ones_like(anchors, dtype=torch.bool),
                                                                  args.seq, features.dtype),
                      previous_token_ids=previous.reshape(args.batch, -1))
        normalized = out.normalized_hidden_states.reshape(*anchors.shape, n, -1)
        markov = out.transition_logits.reshape(*anchors.shape, n, -1).float()
        logits = torch.nn.functional.linear(normalized.float(), model.lm_head.weight.float()) + markov
    ref = {"input_ids": ids, "target_features": features.float(), "anchors": anchors, "block_ids": block_ids,
           "previous_ids": previous, "normalized": normalized.float(), "draft_logits": logits,
           "markov_logits": markov, "confidence": out.confidence_pred.reshape(*anchors.shape, n).float()}
    os.makedirs(args.out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(args.out, "reference.safetensors"))
    hf = model.state_dict_adapter.to_hf(dict(model.state_dict()))
    adapter = DeepseekV41DSparkStateDictAdapter(tcfg, drafter.moe_config, backend, dtype=getattr(torch, args.dtype))
    hf.update(adapter.to_hf(dict(drafter.state_dict())))
    save_file({k: v.float().contiguous() for k, v in hf.items()}, os.path.join(args.out, "weights.safetensors"))
    cfg_out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in text.items()}
    cfg_out["dtype"] = args.dtype
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump({"model_type": "deepseek_v41", "text_config": cfg_out}, f, indent=1)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    print(f"oracle: wrote {args.out} (draft logits {tuple(logits.shape)})")


def cmd_quant(args):
    from nemo_automodel.components.models.deepseek_v41.quantization import quantize_cache

    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-3, 2, 64).unsqueeze(1)
    x[3] = 0.0                                             # zero rows / blocks
    x[4, :32] = 0.0
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.5])
    # Rows whose block maximum is exactly 6 (scale 1 for mxfp4) so the tie values land exactly.
    for r in range(8, 16):
        row = torch.cat([ties, -ties]).repeat(3) * (2.0 ** (r - 12))
        x[r] = row
    x[16, :16] = torch.tensor([6.0] + [0.25 * k for k in range(15)])
    x[17] = torch.randn(96, generator=g) * 1e-30           # subnormal-range magnitudes
    x[18] = torch.randn(96, generator=g) * 1e4             # fp8 clipping range
    out = {}
    for fmt, block in (("fp8", 32), ("nvfp4", 16), ("mxfp4", 32)):
        out[f"input_{fmt}"] = x.clone()
        out[f"output_{fmt}"] = quantize_cache(x, format=fmt, block_size=block)
    # A ragged channel count exercises the zero padding of a trailing partial block.
    y = torch.randn(8, 40, generator=g)
    out["input_ragged"] = y
    out["output_ragged_mxfp4"] = quantize_cache(y, format="mxfp4", block_size=32)
    os.makedirs(args.out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(args.out, "quant.safetensors"))
    print(f"oracle: wrote {args.out}/quant.safetensors")


def cmd_greedy(args):
    """Greedy continuation by full re-forward (the port has no KV cache), timed, for prompts in --prompts
    (a JSON list of token-id lists), on the released-layout checkpoint --weights."""
    with open(args.prompts) as f:
        prompts = json.load(f)
    with open(os.path.join(args.weights, "config.json")) as f:
        loaded = json.load(f)
    text = {k: v for k, v in loaded.get("text_config", loaded).items() if k not in ("fake_quant", "engram_token_map",
                                                                                   "dtype", "keep_quantized")}
    _, fast = synthetic_tokenizer(text["vocab_size"])
    model = build_model(text, 0, fast)
    load_released_weights(model, args.weights)
    out = []
    with torch.no_grad():
        model(torch.tensor([prompts[0][:8]]))               # warm-up: the first call is much slower
        for prompt in prompts:
            seq = torch.tensor([prompt])
            t0 = time.perf_counter()
            for _ in range(args.n):
                nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
                seq = torch.cat([seq, nxt], 1)
            out.append({"prompt_len": len(prompt), "output_ids": seq[0, len(prompt):].tolist(),
                        "seconds": time.perf_counter() - t0})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "greedy.json"), "w") as f:
        json.dump(out, f)


def cmd_dequant(args):
    """The port's own dequantization (dequantize_checkpoint_weight) of every (W, W.scale) pair in --src."""
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import dequantize_checkpoint_weight
    from safetensors.torch import load_file

    src = load_file(args.src)
    out = {}
    for key, weight in src.items():
        if key.endswith(".scale"):
            continue
        scale = src[key[: -len(".weight")] + ".scale"]
        out[key] = dequantize_checkpoint_weight(weight, scale, dtype=torch.float32, rowwise=".engram.embed." in key)
    os.makedirs(args.out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(args.out, "dequant.safetensors"))


def cmd_rope(args):
    """The port's RoPE inverse frequencies (main and compress tables) at the released shape and the tiny one."""
    from nemo_automodel.components.models.deepseek_v41.attention import _RotaryEmbedding
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig

    out = {}
    for name in ("v41-flash", "tiny"):
        text = {k: (list(v) if isinstance(v, tuple) else v) for k, v in PRESETS[name].items()}
        text.pop("dtype", None)
        cfg = DeepseekV41TextConfig(**text, dtype="float32")
        for compressed in (False, True):
            angles = _RotaryEmbedding(cfg, compressed=compressed)(torch.tensor([[1]]))[0, 0]
            out[f"{name}_{'compress' if compressed else 'main'}"] = angles.contiguous()
    os.makedirs(args.out, exist_ok=True)
    save_file(out, os.path.join(args.out, "rope.safetensors"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model", help="tiny model: weights, logits, hidden states, selections")
    m.add_argument("--out", required=True)
    m.add_argument("--preset", default="tiny")
    m.add_argument("--weights", help="load this released-layout checkpoint directory (config.json + safetensors) "
                                     "through the port's from_hf instead of the seeded random weights")
    m.add_argument("--set", action="append", help="override a config field: key=<json value>")
    m.add_argument("--fake-quant", choices=("on", "off"), default="on")
    m.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the port's dtype (bfloat16: the released one, FP32 islands as the port keeps them)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--batch", type=int, default=1)
    m.add_argument("--seq", type=int, default=40)
    m.add_argument("--repeats", type=int, default=0, help="extra timed forwards")
    ds = sub.add_parser("dspark", help="tiny target + DSpark drafter: features, draft logits, Markov, confidence")
    ds.add_argument("--out", required=True)
    ds.add_argument("--preset", default="tiny-dspark")
    ds.add_argument("--set", action="append", help="override a config field: key=<json value>")
    ds.add_argument("--fake-quant", choices=("on", "off"), default="on")
    ds.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ds.add_argument("--seed", type=int, default=0)
    ds.add_argument("--batch", type=int, default=2)
    ds.add_argument("--seq", type=int, default=40)
    ds.add_argument("--anchors", default="[[0, 13, 30], [5, 20, 36]]", help="JSON [batch][anchors] block anchors")
    q = sub.add_parser("quant", help="quantizer vectors")
    q.add_argument("--out", required=True)
    q.add_argument("--seed", type=int, default=0)
    d = sub.add_parser("dequant", help="the port's dequantization of (weight, scale) pairs")
    d.add_argument("--src", required=True)
    d.add_argument("--out", required=True)
    r = sub.add_parser("rope", help="the port's RoPE frequencies")
    r.add_argument("--out", required=True)
    gr = sub.add_parser("greedy", help="timed greedy continuation by full re-forward")
    gr.add_argument("--out", required=True)
    gr.add_argument("--weights", required=True)
    gr.add_argument("--prompts", required=True)
    gr.add_argument("--n", type=int, default=16)
    args = p.parse_args(argv)
    {"model": cmd_model, "dspark": cmd_dspark, "quant": cmd_quant, "dequant": cmd_dequant, "rope": cmd_rope,
     "greedy": cmd_greedy}[args.cmd](args)


if __name__ == "__main__":
    main()
