"""Released DeepSeek-V4.1 (and DeepSeek-V4) tensor names → the model's own parameter tree.

`params_from_released(cfg, tensors)` builds the (unboxed) parameter tree from a mapping of
released checkpoint names (docs/architecture.md; no ``model.`` prefix) to unquantized arrays
(BF16/FP32, as other frameworks export them). Quantized FP8/FP4 tensors with ``.scale``
companions are read by `v41cp.checkpoint.released`, not here.

Every error names the offending key and, for shape/dtype problems, the expected and given values.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, NamedTuple

import flax.linen as nn
import numpy as np

from v41cp.checkpoint.layouts import (
    Flattened,
    GroupsIn,
    GroupsOut,
    HeadsOut,
    Layout,
    PaddedRows,
    Same,
    Stacked,
    Transposed,
)
from v41cp.config import LayerRole, ModelConfig
from v41cp.drafter import abstract_drafter_params
from v41cp.model import abstract_params
from v41cp.mtp import abstract_mtp_params

__all__ = ["CheckpointError", "Source", "params_from_released", "released_to_tree", "drafter_to_tree",
           "drafter_params_from_released", "IGNORED_PREFIXES", "insert", "check_expert_table"]

log = logging.getLogger(__name__)

IGNORED_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline", "mtp.")


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, unexpected, or has the wrong shape / dtype (message names the key)."""


class Source(NamedTuple):
    """Where a parameter comes from: released tensor ``keys``, combined by ``fn`` (a `Layout`: whole arrays or one
    shard's region). ``raw`` sources take the stored bytes (FP4 / FP8 payloads and e8m0 scales, as uint8) instead
    of decoded values (``keep_quantized``)."""

    keys: tuple[str, ...]
    fn: Layout
    raw: bool = False


def released_to_tree(cfg: ModelConfig) -> dict[tuple[str, ...], Source]:
    """Target path in the parameter tree → its `Source` (released keys and the function combining them)."""
    m: dict[tuple[str, ...], Source] = {
        ("embed",): Source(("embed.weight",), Same()),
        ("head",): Source(("head.weight",), Transposed()),
        ("norm", "weight"): Source(("norm.weight",), Same()),
    }
    if cfg.is_v4:                                 # V4's final stream mixer
        m.update({("hc_head", part): Source((f"hc_head_{part}",), Same()) for part in ("fn", "base", "scale")})
    for role in cfg.layer_roles:
        m.update(_layer_sources(cfg, role, f"layers_{role.index}", f"layers.{role.index}"))
    return m


def drafter_to_tree(cfg: ModelConfig) -> dict[tuple[str, ...], Source]:
    """The drafter's parameter paths → their `Source` in the release. DSpark (`v41cp.drafter.Drafter`,
    ``mtp.{k}.*``): each stage named as a SWA-only backbone layer with the drafter's experts, plus
    ``mtp.0.main_proj`` / ``main_norm`` and the last stage's ``norm``, Markov and confidence heads. DeepSeek-V4's
    MTP layer (`v41cp.mtp`, ``mtp.0.*``): a SWA-only V4 layer (routed MoE) plus ``e_proj`` / ``h_proj``,
    ``enorm`` / ``hnorm`` / ``norm`` and ``hc_head_{fn,base,scale}``."""
    if cfg.is_v4:
        m = _layer_sources(cfg, LayerRole.swa_only(cfg.num_hidden_layers), "mtp_0", "mtp.0")
        for name, fn in (("e_proj", Transposed()), ("h_proj", Transposed())):
            m[("mtp_0", name)] = Source((f"mtp.0.{name}.weight",), fn)
        for name in ("enorm", "hnorm", "norm"):
            m[("mtp_0", name, "weight")] = Source((f"mtp.0.{name}.weight",), Same())
        for part in ("fn", "base", "scale"):
            m[("mtp_0", "hc_head", part)] = Source((f"mtp.0.hc_head_{part}",), Same())
        return m
    stage_cfg = cfg.draft_stage_config()
    m: dict[tuple[str, ...], Source] = {}
    last = cfg.num_nextn_predict_layers - 1
    for k in range(cfg.num_nextn_predict_layers):
        L, R = f"mtp_{k}", f"mtp.{k}"
        m.update(_layer_sources(stage_cfg, LayerRole.swa_only(cfg.num_hidden_layers + k), L, R))
        extra = []
        if k == 0:
            extra += [(("main_proj",), "main_proj.weight", Transposed()),
                      (("main_norm", "weight"), "main_norm.weight", Same())]
        if k == last:
            extra += [(("norm", "weight"), "norm.weight", Same()),
                      (("markov_embed",), "markov_head.embed.weight", Same()),
                      (("markov_head",), "markov_head.head.weight", Transposed()),
                      (("confidence",), "confidence_head.proj.weight", Flattened())]
        for path, key, fn in extra:
            m[(L, *path)] = Source((f"{R}.{key}",), fn)
    return m


def _layer_sources(cfg: ModelConfig, role: LayerRole, L: str, R: str) -> dict[tuple[str, ...], Source]:
    """One layer's parameters under tree prefix ``L`` from the released tensors under ``R``."""
    nh, d, g = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
    ih, idim = cfg.index_n_heads, cfg.index_head_dim
    m: dict[tuple[str, ...], Source] = {}
    add = lambda path, keys, fn, raw=False: m.__setitem__((L, *path), Source(tuple(f"{R}.{k}" for k in keys), fn, raw))
    for site in ("attn", "ffn"):
        add((f"{site}_norm", "weight"), (f"{site}_norm.weight",), Same())
        for part in ("fn", "base", "scale"):
            add((f"hc_{site}", part), (f"hc_{site}_{part}",), Same())
    add(("attn", "wq_a"), ("attn.wq_a.weight",), Transposed())
    add(("attn", "q_norm", "weight"), ("attn.q_norm.weight",), Same())
    add(("attn", "wq_b"), ("attn.wq_b.weight",), HeadsOut(nh, d))
    add(("attn", "wkv"), ("attn.wkv.weight",), Transposed())
    add(("attn", "kv_norm", "weight"), ("attn.kv_norm.weight",), Same())
    add(("attn", "wo_a"), ("attn.wo_a.weight",), GroupsIn(g, cfg.o_lora_rank))
    add(("attn", "wo_b"), ("attn.wo_b.weight",), GroupsOut(g, cfg.o_lora_rank))
    add(("attn", "attn_sink"), ("attn.attn_sink",), Same())
    def compressor(path: tuple[str, ...], name: str) -> None:
        add((*path, "wkv"), (f"{name}.wkv.weight",), Transposed())
        add((*path, "norm", "weight"), (f"{name}.norm.weight",), Same())
        if role.ratio > 1:
            add((*path, "wgate"), (f"{name}.wgate.weight",), Transposed())
        if cfg.is_v4:                             # V4: the gate's position bias
            add((*path, "ape"), (f"{name}.ape",), Same())

    if role.is_kv_source:
        compressor(("attn", "compressor"), "attn.compressor")
        if not cfg.is_v4:                         # V4.1 KV sources derive their index keys from the latent
            add(("attn", "indexer", "wk"), ("attn.indexer.wk.weight",), Transposed())
            add(("attn", "indexer", "k_norm", "weight"), ("attn.indexer.k_norm.weight",), Same())
    if role.is_index_source:
        add(("attn", "indexer", "wq_b"), ("attn.indexer.wq_b.weight",), HeadsOut(ih, idim))
        add(("attn", "indexer", "weights_proj"), ("attn.indexer.weights_proj.weight",), Transposed())
        if cfg.is_v4:                             # V4 CSA: the indexer's own compressor
            compressor(("attn", "indexer", "compressor"), "attn.indexer.compressor")
    add(("ffn", "gate_weight"), ("ffn.gate.weight",), Transposed())
    if cfg.hash_routed(role.index):               # V4's hash-routed layers: the token → experts table
        add(("ffn", "gate_tid2eid"), ("ffn.gate.tid2eid",), Same())
    else:
        add(("ffn", "gate_bias"), ("ffn.gate.bias",), Same())
    if not cfg.is_v4:
        add(("ffn", "gate_bias_vl"), ("ffn.gate.bias_vl",), Same())
    for w in ("w1", "w2", "w3"):
        experts = tuple(f"ffn.experts.{e}.{w}.weight" for e in range(cfg.n_routed_experts))
        if cfg.keep_quantized:
            add(("ffn", f"experts_{w}_fp4"), experts, Stacked(), True)
            add(("ffn", f"experts_{w}_scale"), tuple(k.replace(".weight", ".scale") for k in experts), Stacked(), True)
        else:
            add(("ffn", f"experts_{w}"), experts, Stacked(transpose=True))
        add(("ffn", f"shared_{w}"), (f"ffn.shared_experts.{w}.weight",), Transposed())
    if role.engram_slot >= 0:
        rows = cfg.engram_num_embeddings[role.engram_slot]
        pad = PaddedRows(rows, cfg.engram_table_rows(role.engram_slot) - rows)
        if cfg.keep_quantized:
            add(("engram", "embed_fp8"), ("engram.embed.weight",), pad, True)
            add(("engram", "embed_scale"), ("engram.embed.scale",), pad, True)
        else:
            add(("engram", "embed"), ("engram.embed.weight",), pad)
        add(("engram", "wkv"), ("engram.wkv.weight",), Transposed())
        add(("engram", "q_weight"), ("engram.q_weight",), Same())
        add(("engram", "k_weight"), ("engram.k_weight",), Same())
    return m


def params_from_released(cfg: ModelConfig, tensors: Mapping[str, Any]) -> dict:
    """Parameter tree (NumPy leaves in the model's dtypes) from released-name tensors.

    Raises `CheckpointError` for a missing key, a quantized tensor (``.scale`` companion), a key
    the config does not explain, or a shape mismatch. Vision, aligner and DSpark (``mtp.*``)
    tensors are skipped with a log line (`drafter_params_from_released` reads the latter).
    """
    return _tree_from(cfg, released_to_tree(cfg), abstract_params(cfg), tensors, IGNORED_PREFIXES)


def drafter_params_from_released(cfg: ModelConfig, tensors: Mapping[str, Any]) -> dict:
    """The drafter's parameter tree (DSpark: `v41cp.drafter.Drafter`; DeepSeek-V4: the MTP layer, `v41cp.mtp`) from
    released-name tensors (``mtp.*``; every other tensor is the target's and is passed over). Errors as
    `params_from_released`; a config without a drafter is an error naming ``num_nextn_predict_layers``."""
    if not cfg.has_drafter:
        raise CheckpointError(f"the config has no drafter (num_nextn_predict_layers="
                              f"{cfg.num_nextn_predict_layers}, dspark_target_layer_ids="
                              f"{list(cfg.dspark_target_layer_ids)})")
    # the target's tensors, passed over by prefix (a top-level name such as V4's ``hc_head_fn`` whole)
    others = tuple({k.split(".")[0] + "." if "." in k else k for k in tensors if not k.startswith("mtp.")})
    abstract = abstract_mtp_params(cfg) if cfg.is_v4 else abstract_drafter_params(cfg)
    return _tree_from(cfg, drafter_to_tree(cfg), abstract, tensors, others)


def _tree_from(cfg: ModelConfig, mapping: dict, abstract, tensors: Mapping[str, Any], ignored: tuple) -> dict:
    if cfg.keep_quantized:
        raise CheckpointError("keep_quantized keeps the release's FP4 / FP8 bytes: read a release-format checkpoint "
                              "with ReleasedCheckpoint (params_from_released takes unquantized arrays)")
    abstract = nn.unbox(abstract)
    used: set[str] = set()
    scales = sorted(k for k in tensors if k.endswith(".scale") and not k.startswith(ignored))
    if scales:
        raise CheckpointError(f"tensor {scales[0]!r} is a quantization scale: quantized checkpoints are read by "
                              f"the released-format reader, params_from_released takes unquantized arrays")
    out: dict = {}
    for path, (keys, fn, _) in mapping.items():
        node = abstract
        for p in path:
            node = node[p]
        for k in keys:
            if k not in tensors:
                raise CheckpointError(f"checkpoint is missing tensor {k!r} (needed for layer role "
                                      f"{role_note(cfg, k)})")
        arr = fn(*[np.asarray(tensors[k]) for k in keys])
        if tuple(arr.shape) != tuple(node.shape):
            raw = tuple(np.shape(tensors[keys[0]]))
            raise CheckpointError(f"tensor {keys[0]!r} has shape {raw}, which does not fit the config "
                                  f"(expected parameter {'/'.join(path)} of shape {tuple(node.shape)})")
        if np.issubdtype(node.dtype, np.integer):
            if not np.issubdtype(arr.dtype, np.integer):
                raise CheckpointError(f"tensor {keys[0]!r} has dtype {arr.dtype}, expected an integer table")
        elif not (np.issubdtype(arr.dtype, np.floating) or arr.dtype.name in ("bfloat16", "float8_e4m3fn")):
            raise CheckpointError(f"tensor {keys[0]!r} has dtype {arr.dtype}, expected a floating dtype")
        used.update(keys)
        if path[-1] == "gate_tid2eid":
            check_expert_table(keys[0], arr, cfg.n_routed_experts)
        insert(out, path, np.asarray(arr).astype(node.dtype))
    skipped = [k for k in tensors if k.startswith(ignored)]
    if skipped:
        log.info("passed over %d tensors that are not this tree's (e.g. %s)", len(skipped), skipped[0])
    extra = sorted(k for k in tensors if k not in used and not k.startswith(ignored))
    if extra:
        raise CheckpointError(f"unexpected tensor {extra[0]!r}: the config gives it no place "
                              f"({len(extra)} unexpected in all)")
    return out


def check_expert_table(key: str, table: np.ndarray, experts: int) -> np.ndarray:
    """A hash-routing table ``tid2eid [vocab, k]`` whose every id names an expert ``[0, experts)``; else an error
    naming ``key`` and the first bad id."""
    bad = (table < 0) | (table >= experts)
    if bad.any():
        raise CheckpointError(f"tensor {key!r} routes to expert {int(table[bad][0])}, outside [0, {experts})")
    return table


def insert(tree: dict, path: tuple[str, ...], value) -> None:
    """Set ``tree[path[0]]...[path[-1]] = value``, creating the intermediate dicts."""
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def role_note(cfg: ModelConfig, key: str) -> str:
    parts = key.split(".")
    if parts[0] == "mtp":
        return f"DSpark stage {parts[1]}"
    if parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) < cfg.num_hidden_layers:
        r = cfg.layer_roles[int(parts[1])]
        return f"{r.kind}, ratio {r.ratio}, layer {r.index}"
    return "model-wide"

