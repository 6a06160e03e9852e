"""The v41-flash preset yields exactly the released checkpoint's tensor shapes (architecture.md §5.1,
§2.10), by abstract evaluation only (nothing is allocated)."""

import flax.linen as nn
import jax
import numpy as np

from v41cp.checkpoint import released_to_tree
from v41cp.config import preset
from v41cp.model import abstract_params

# Released shapes, written out from the architecture reference (not derived from the code).
ATTN = {"attn.wq_a.weight": (1280, 5120), "attn.q_norm.weight": (1280,), "attn.wq_b.weight": (32768, 1280),
        "attn.wkv.weight": (512, 5120), "attn.kv_norm.weight": (512,), "attn.wo_a.weight": (8192, 4096),
        "attn.wo_b.weight": (5120, 8192), "attn.attn_sink": (64,)}
BLOCK = {"attn_norm.weight": (5120,), "ffn_norm.weight": (5120,), "hc_attn_fn": (24, 20480), "hc_attn_base": (24,),
         "hc_attn_scale": (3,), "hc_ffn_fn": (24, 20480), "hc_ffn_base": (24,), "hc_ffn_scale": (3,),
         "ffn.gate.weight": (384, 5120), "ffn.gate.bias": (384,), "ffn.gate.bias_vl": (384,),
         "ffn.shared_experts.w1.weight": (2304, 5120), "ffn.shared_experts.w3.weight": (2304, 5120),
         "ffn.shared_experts.w2.weight": (5120, 2304)}
EXPERT = {"w1": (2304, 5120), "w3": (2304, 5120), "w2": (5120, 2304)}
KV_SOURCE = {"attn.compressor.wkv.weight": (512, 5120), "attn.compressor.norm.weight": (512,),
             "attn.indexer.wk.weight": (128, 512), "attn.indexer.k_norm.weight": (128,)}
INDEX_SOURCE = {"attn.indexer.wq_b.weight": (4096, 1280), "attn.indexer.weights_proj.weight": (32, 5120)}
ENGRAM = {"engram.wkv.weight": (25600, 6144), "engram.q_weight": (4, 5120), "engram.k_weight": (4, 5120)}


def released_shapes():
    shapes = {"embed.weight": (129280, 5120), "head.weight": (129280, 5120), "norm.weight": (5120,)}
    for i in range(40):
        for table in (ATTN, BLOCK):
            shapes.update({f"layers.{i}.{k}": v for k, v in table.items()})
        for e in range(384):
            shapes.update({f"layers.{i}.ffn.experts.{e}.{w}.weight": v for w, v in EXPERT.items()})
        if i in (2, 8, 14, 20):
            shapes.update({f"layers.{i}.{k}": v for k, v in KV_SOURCE.items()})
            if i != 20:                                    # ratio-1 compressor has no gate
                shapes[f"layers.{i}.attn.compressor.wgate.weight"] = (512, 5120)
        if i in (2, 8, 14, 20, 24, 28, 32, 36):
            shapes.update({f"layers.{i}.{k}": v for k, v in INDEX_SOURCE.items()})
        if i in (1, 14):
            shapes.update({f"layers.{i}.{k}": v for k, v in ENGRAM.items()})
            shapes[f"layers.{i}.engram.embed.weight"] = ({1: 384006168, 14: 384016682}[i], 256)
    return shapes


def test_flash_parameter_shapes_equal_the_release():
    cfg = preset("v41-flash")
    abstract = nn.unbox(abstract_params(cfg))
    mapping = released_to_tree(cfg)
    expected = released_shapes()
    used = {k for source in mapping.values() for k in source.keys}
    assert used == set(expected), (sorted(used - set(expected))[:5], sorted(set(expected) - used)[:5])
    n_params = 0
    for path, (keys, fn, _raw) in mapping.items():
        node = abstract
        for p in path:
            node = node[p]
        structs = [jax.ShapeDtypeStruct(expected[k], np.float32) for k in keys]
        got = jax.eval_shape(fn, *structs).shape
        assert got == node.shape, (path, got, node.shape)
        n_params += int(np.prod(node.shape))
    leaves = jax.tree.leaves(abstract)
    assert n_params == sum(int(np.prod(x.shape)) for x in leaves)   # nothing in the tree is unmapped
    # 748.5B: the released 763B less the three DSpark draft blocks (~14.5B: 3 x 128 experts x 3 x 2304 x 5120 + attention)
    assert 7.45e11 < n_params < 7.55e11


def test_released_shapes_from_config_match_the_release():
    """The writer's shape table (used for synthetic checkpoints) agrees with the hand-written one."""
    from v41cp.checkpoint.writer import released_shapes as from_config

    assert from_config(preset("v41-flash")) == released_shapes()


def test_flash_keep_quantized_shapes_are_the_stored_ones():
    """With keep_quantized the tree holds the release's stored bytes: FP4 experts [E, out, in/2] + e8m0
    [E, out, in/32]; Engram FP8 rows [rows (padded to 64), 256] + e8m0 [rows, 8]."""
    cfg = preset("v41-flash", keep_quantized=True)
    ffn = nn.unbox(abstract_params(cfg))["layers_14"]
    assert ffn["ffn"]["experts_w1_fp4"].shape == (384, 2304, 2560)
    assert ffn["ffn"]["experts_w1_scale"].shape == (384, 2304, 160)
    assert ffn["ffn"]["experts_w2_fp4"].shape == (384, 5120, 1152)
    assert ffn["engram"]["embed_fp8"].shape == (384016704, 256)
    assert ffn["engram"]["embed_scale"].shape == (384016704, 8)
    assert all(ffn["ffn"][k].dtype == np.uint8 for k in ffn["ffn"] if k.startswith("experts_"))
    stored = {}
    for name, shape in released_shapes().items():
        if ".ffn.experts." in name:
            stored[name] = (shape[0], shape[1] // 2)
            stored[name.replace(".weight", ".scale")] = (shape[0], shape[1] // 32)
        elif name.endswith("engram.embed.weight"):
            stored[name] = shape
            stored[name.replace(".weight", ".scale")] = (shape[0], shape[1] // 32)
    tree = nn.unbox(abstract_params(cfg))
    for path, source in released_to_tree(cfg).items():
        if source.raw:
            node = tree
            for p in path:
                node = node[p]
            got = jax.eval_shape(source.fn, *[jax.ShapeDtypeStruct(stored[k], np.uint8) for k in source.keys]).shape
            assert got == node.shape, (path, got, node.shape)
