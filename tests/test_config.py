"""Config parsing, validation errors (each names the field) and derived layer roles."""

import json

import pytest

from v41cp.config import PRESETS, ConfigError, ModelConfig, preset

pytestmark = pytest.mark.fast           # the developer tier (`pytest -m fast`)


def test_presets_parse():
    for name in PRESETS:
        assert preset(name).num_hidden_layers > 0


def test_composite_and_text_only_agree(tmp_path):
    text = dict(PRESETS["tiny"])
    text = {k: list(v) if isinstance(v, tuple) else v for k, v in text.items()}
    composite = {"model_type": "deepseek_v41", "text_config": text, "vision_config": {"num_hidden_layers": 32},
                 "image_token_id": 129264, "quantization_config": {"quant_method": "fp8"}}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(composite))
    assert ModelConfig.from_json(p) == ModelConfig.from_dict(text) == preset("tiny")
    assert ModelConfig.from_dict(preset("tiny").to_dict()) == preset("tiny")


def test_flash_roles_match_the_release():
    roles = preset("v41-flash").layer_roles
    kinds = [r.kind for r in roles]
    assert kinds[:2] == ["swa", "swa"]
    assert [i for i, k in enumerate(kinds) if k == "full"] == [2, 8, 14, 20]
    assert [i for i, k in enumerate(kinds) if k == "reindex"] == [24, 28, 32, 36]
    assert all(kinds[i] == "reuse" for i in (3, 7, 9, 19, 21, 23, 37, 39))
    assert [r.index for r in roles if r.candidate_source] == [20]
    assert [r.index for r in roles if r.uses_candidates] == [24, 28, 32, 36]
    assert [r.index for r in roles if r.engram_slot >= 0] == [1, 14]
    assert roles[19].kv_source == 14 and roles[21].kv_source == 20 and roles[25].index_source == 24
    assert {r.ratio for r in roles[2:20]} == {2} and {r.ratio for r in roles[20:]} == {1}


def _bad(**changes):
    d = dict(PRESETS["tiny"])
    d.update(changes)
    return d


@pytest.mark.parametrize("changes,needle", [
    (dict(compress_ratios=(0, 2, 2, 2, 1, 1), kv_source_layer_ids=(4,), index_source_layer_ids=(3, 4, 5)),
     "layer 1"),                                            # a ratio-2 layer with no KV source before it
    (dict(num_attention_heads=5), "o_groups"),               # heads not divisible by o_groups
    (dict(candidate_source_layer_id=3), "candidate_source_layer_id"),
    (dict(kv_source_layer_ids=(0, 1, 4), index_source_layer_ids=(0, 1, 3, 4, 5)), "layer 0"),
    (dict(compress_ratios=(0, 2, 2)), "compress_ratios"),
    (dict(index_source_layer_ids=(3, 4, 5)), "kv_source_layer_ids"),
    (dict(head_dim=48), "head_dim"),
    (dict(dtype="float16"), "dtype"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(engram_num_embeddings=(2000,)), "engram_num_embeddings"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(kv_source_layer_ids=(1, 4, 5)), "after candidate_source_layer_id=4"),
])
def test_bad_config_names_the_field(changes, needle):
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_dict(_bad(**changes))


def test_missing_field_is_named():
    d = dict(PRESETS["tiny"])
    d.pop("q_lora_rank")
    with pytest.raises(ConfigError, match="q_lora_rank"):
        ModelConfig.from_dict({"text_config": d})


def test_fake_quant_switch_and_hashable():
    a, b = preset("tiny"), preset("tiny", fake_quant=False)
    assert a.fake_quant and not b.fake_quant and hash(a) != hash(b)
    # the Engram token map is host-side data: it does not change the jit cache key
    assert preset("tiny", engram_token_map=tuple(min(i, 135) for i in range(256))) == a


def test_hf_engram_pad_alias_and_padded_tables():
    d = dict(PRESETS["tiny"])
    d.pop("engram_pad_token_id")
    assert ModelConfig.from_dict({**d, "engram_pad_id": 7}).engram_pad_token_id == 7
    flash = preset("v41-flash")
    # layer 14's table (384016682 rows) is padded so it splits over any TP size up to 64
    assert [flash.engram_table_rows(i) % 64 for i in (0, 1)] == [0, 0]
    assert flash.engram_table_rows(1) - 384016682 < 64


# ------------------------------------------------------------------------------------------ DeepSeek-V4
def _released_v4(**changes) -> dict:
    """V4-Flash's config.json as released: flat, ``model_type`` deepseek_v4, ``compress_ratios`` with the MTP layer's
    trailing 0, ``num_hash_layers``; no sharing or CED fields."""
    d = {k: list(v) if isinstance(v, tuple) else v for k, v in PRESETS["v4-flash"].items()
         if k not in ("kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id",
                      "candidate_topk_blocks", "candidate_block_size", "fake_quant")}
    d.update(changes)
    return d


def test_v4_flash_and_pro_schedules():
    flash = ModelConfig.from_dict(_released_v4())
    assert flash == preset("v4-flash") and flash.is_v4 and flash.fake_quant        # the release's cache formats
    kinds = [r.kind for r in flash.layer_roles]
    assert kinds[:2] == ["swa", "swa"] and kinds.count("csa") == 21 and kinds.count("hca") == 20
    assert all(r.kv_source == r.index for r in flash.layer_roles if r.ratio)            # every layer owns its caches
    assert [r.index for r in flash.layer_roles if r.is_index_source] == [i for i, k in enumerate(kinds) if k == "csa"]
    assert [flash.hash_routed(i) for i in range(4)] == [True, True, True, False]
    pro = preset("v4-pro")
    kinds = [r.kind for r in pro.layer_roles]
    assert len(kinds) == 61 and kinds[:2] == ["hca", "hca"] and kinds.count("csa") == 30 and kinds.count("hca") == 31
    assert ModelConfig.from_dict(flash.to_dict()) == flash                               # a written config reads back


@pytest.mark.parametrize("changes,needle", [
    (dict(compress_ratios=[0, 0, 2] + [4] * 41), r"compress_ratios\[2\]"),              # V4.1's ratio 2
    (dict(kv_source_layer_ids=[2]), "kv_source_layer_ids"),
    (dict(engram_layer_ids=[1], engram_num_embeddings=[100]), "engram_layer_ids"),
    (dict(num_hash_layers=44), "num_hash_layers"),
    (dict(model_type="deepseek_v3"), "model_type"),
])
def test_bad_v4_config_names_the_field(changes, needle):
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_dict(_released_v4(**changes))


def test_v4_fake_quant_needs_the_record_shapes_and_v41_refuses_hash_layers():
    """V4's records: whole FP8 blocks of 64 channels without RoPE, a power-of-two MXFP4 index head (Hadamard)."""
    with pytest.raises(ConfigError, match=r"head_dim - qk_rope_head_dim = 48 .*multiple of 64"):
        preset("tiny-v4", fake_quant=True)                                  # 64 − 16
    with pytest.raises(ConfigError, match="index_head_dim=96"):
        preset("tiny-v4", fake_quant=True, head_dim=80, index_head_dim=96)
    assert preset("tiny-v4", fake_quant=True, head_dim=80).cache_formats == ("fp8_ds_mla", "fp8_ds_mla", "mxfp4")
    with pytest.raises(ConfigError, match="num_hash_layers"):
        preset("tiny", num_hash_layers=1)


def test_v4_quantization_block_and_defaults_from_config_json():
    """A V4 config.json names its FP8 block in ``quantization_config.weight_block_size`` (square), and leaves out the
    fields V4 has no use for or whose V4 value differs from V4.1's (``rms_norm_eps`` 1e-6)."""
    d = _released_v4(quantization_config={"quant_method": "fp8", "weight_block_size": [64, 64]})
    d.pop("rms_norm_eps")
    d.pop("weight_block_size")
    cfg = ModelConfig.from_dict(d)
    assert cfg.weight_block_size == 64 and cfg.rms_norm_eps == 1e-6
    d.pop("quantization_config")
    assert ModelConfig.from_dict(d).weight_block_size == 128
    with pytest.raises(ConfigError, match="weight_block_size"):
        ModelConfig.from_dict({**d, "quantization_config": {"weight_block_size": [128, 32]}})
