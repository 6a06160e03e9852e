"""DeepSeek-V4 checkpoints: parameters from transformers' module names (`v41cp.checkpoint.transformers_v4`: a round
trip through transformers' layout, errors that name the missing, unexpected or mis-shaped key; the oracle test,
tests/e2e/test_oracle_v4.py, loads transformers' own state dict this way), and the release's V4 layout written,
read (FP8 128×128 blocks, FP4 experts, int hash tables), converted to orbax and loaded."""

import jax
import numpy as np
import pytest

from v41cp import model
from v41cp.checkpoint.transformers_v4 import params_from_transformers_v4
from v41cp.config import preset

pytestmark = pytest.mark.fast


def _to_transformers(cfg, params) -> dict:
    """The inverse mapping, written out here independently: the tree → transformers' ``state_dict`` names."""
    t = lambda a: np.ascontiguousarray(np.asarray(a).T)
    out = {"model.embed_tokens.weight": params["embed"], "lm_head.weight": t(params["head"]),
           "model.norm.weight": params["norm"]["weight"], "model.hc_head.hc_fn": params["hc_head"]["fn"],
           "model.hc_head.hc_base": params["hc_head"]["base"], "model.hc_head.hc_scale": params["hc_head"]["scale"]}
    for role in cfg.layer_roles:
        i, p = role.index, params[f"layers_{role.index}"]
        pre = f"model.layers.{i}."
        a, f = p["attn"], p["ffn"]
        out.update({
            pre + "self_attn.q_a_proj.weight": t(a["wq_a"]), pre + "self_attn.q_a_norm.weight": a["q_norm"]["weight"],
            pre + "self_attn.q_b_proj.weight": t(np.asarray(a["wq_b"]).reshape(cfg.q_lora_rank, -1)),
            pre + "self_attn.kv_proj.weight": t(a["wkv"]), pre + "self_attn.kv_norm.weight": a["kv_norm"]["weight"],
            pre + "self_attn.o_a_proj.weight": np.asarray(a["wo_a"]).transpose(0, 2, 1).reshape(
                cfg.o_groups * cfg.o_lora_rank, -1),
            pre + "self_attn.o_b_proj.weight": t(np.asarray(a["wo_b"]).reshape(-1, cfg.hidden_size)),
            pre + "self_attn.sinks": a["attn_sink"],
            pre + "input_layernorm.weight": p["attn_norm"]["weight"],
            pre + "post_attention_layernorm.weight": p["ffn_norm"]["weight"],
            pre + "mlp.gate.weight": t(f["gate_weight"]),
            pre + "mlp.experts.gate_up_proj": np.concatenate(
                [np.asarray(f["experts_w1"]).transpose(0, 2, 1), np.asarray(f["experts_w3"]).transpose(0, 2, 1)], 1),
            pre + "mlp.experts.down_proj": np.asarray(f["experts_w2"]).transpose(0, 2, 1),
            pre + "mlp.shared_experts.gate_proj.weight": t(f["shared_w1"]),
            pre + "mlp.shared_experts.up_proj.weight": t(f["shared_w3"]),
            pre + "mlp.shared_experts.down_proj.weight": t(f["shared_w2"]),
        })
        for site, name in (("attn_hc", "hc_attn"), ("ffn_hc", "hc_ffn")):
            out.update({pre + f"{site}.{k}": p[name][k] for k in ("fn", "base", "scale")})
        if cfg.hash_routed(i):
            out[pre + "mlp.gate.tid2eid"] = np.asarray(f["gate_tid2eid"]).astype(np.int64)
        else:
            out[pre + "mlp.gate.e_score_correction_bias"] = f["gate_bias"]
        comps = []
        if role.is_kv_source:
            comps.append(("self_attn.compressor", a["compressor"]))
        if role.is_index_source:
            ix = a["indexer"]
            comps.append(("self_attn.compressor.indexer", ix["compressor"]))
            out[pre + "self_attn.compressor.indexer.q_b_proj.weight"] = t(np.asarray(ix["wq_b"]).reshape(
                cfg.q_lora_rank, -1))
            out[pre + "self_attn.compressor.indexer.scorer.weights_proj.weight"] = t(ix["weights_proj"])
        for name, c in comps:
            out.update({pre + f"{name}.kv_proj.weight": t(c["wkv"]), pre + f"{name}.gate_proj.weight": t(c["wgate"]),
                        pre + f"{name}.position_bias": c["ape"], pre + f"{name}.kv_norm.weight": c["norm"]["weight"]})
    return {k: np.asarray(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def v4():
    cfg = preset("tiny-v4")
    params = jax.tree.map(np.asarray, model.init_params(cfg, jax.random.key(3)))
    return cfg, params, _to_transformers(cfg, params)


def test_round_trip_through_transformers_names(v4):
    cfg, params, state = v4
    back = params_from_transformers_v4(cfg, state)
    flat = lambda t: {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(t)[0]}
    want, got = flat(params), flat(back)
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_errors_name_the_key(v4):
    cfg, _, state = v4
    key = "model.layers.2.self_attn.compressor.indexer.position_bias"
    with pytest.raises(KeyError, match="missing 'model.layers.2.self_attn.compressor.indexer.position_bias'"):
        params_from_transformers_v4(cfg, {k: v for k, v in state.items() if k != key})
    with pytest.raises(KeyError, match="unexpected keys"):
        params_from_transformers_v4(cfg, {**state, "model.layers.9.mlp.gate.weight": np.zeros(3)})
    with pytest.raises(ValueError, match="layers_1/attn/compressor/ape"):
        params_from_transformers_v4(cfg, {**state, "model.layers.1.self_attn.compressor.position_bias": np.zeros((4, 64))})
    with pytest.raises(ValueError, match="deepseek_v4"):
        params_from_transformers_v4(preset("tiny"), state)


def test_release_layout_write_read_convert_load(tmp_path):
    """Random tensors under the release's V4 names (`released_shapes`), written in the release's formats, read back
    kept quantized and dequantized (the same logits), converted to orbax and loaded (the same tree, ``hc_head``
    included); a hash table routing outside the experts is refused by name."""
    import jax.numpy as jnp

    from v41cp.checkpoint import convert, load
    from v41cp.checkpoint.names import CheckpointError
    from v41cp.checkpoint.released import ReleasedCheckpoint
    from v41cp.checkpoint.writer import released_shapes, write_released

    cfg = preset("tiny-v4")
    rng = np.random.default_rng(0)
    tensors = {k: (rng.integers(0, cfg.n_routed_experts, shape) if k.endswith("tid2eid")
                   else rng.normal(0, 0.05, shape).astype(np.float32))
               for k, shape in released_shapes(cfg).items()}
    write_released(tmp_path / "r", cfg, tensors)
    stored = ReleasedCheckpoint(tmp_path / "r")
    assert stored.cfg.is_v4 and stored.cfg.weight_block_size == 128 and stored.cfg.keep_quantized
    tokens = rng.integers(3, cfg.vocab_size, (1, 20))
    logits = {keep: np.asarray(model.forward(jax.tree.map(jnp.asarray, ReleasedCheckpoint(
        tmp_path / "r", keep_quantized=keep).params()), stored.cfg.replace(keep_quantized=keep), tokens))
              for keep in (True, False)}
    np.testing.assert_allclose(logits[True], logits[False], rtol=0, atol=1e-5 * np.abs(logits[False]).max())
    convert(tmp_path / "r", tmp_path / "o", dtype="fp32", progress=False, keep_quantized=False)
    cfg_o, params_o = load(tmp_path / "o")
    assert cfg_o.is_v4 and "hc_head" in params_o
    want = jax.tree.map(np.asarray, ReleasedCheckpoint(tmp_path / "r", keep_quantized=False).params())
    flat = lambda t: {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(t)[0]}
    got, want = flat(params_o), flat(want)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)

    bad = dict(tensors)
    bad["layers.0.ffn.gate.tid2eid"] = np.full_like(tensors["layers.0.ffn.gate.tid2eid"], cfg.n_routed_experts)
    write_released(tmp_path / "bad", cfg, bad)
    with pytest.raises(CheckpointError, match="layers.0.ffn.gate.tid2eid' routes to expert 4"):
        ReleasedCheckpoint(tmp_path / "bad").params()


def test_a_model_made_here_is_written_as_a_release():
    """`released_tensors` (the loader's layouts inverted) names a parameter tree the release's way: read back, the
    same tree bit for bit (the MTP layer's too)."""
    from v41cp.checkpoint.names import drafter_params_from_released, params_from_released
    from v41cp.checkpoint.writer import released_shapes, released_tensors
    from v41cp.mtp import init_mtp_params

    cfg = preset("tiny-v4-mtp")
    params, mtp = model.init_params(cfg, jax.random.key(0)), init_mtp_params(cfg, jax.random.key(1))
    tensors = released_tensors(cfg, params, mtp)
    assert tensors.keys() == released_shapes(cfg).keys()
    flat = lambda t: {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(t)[0]}
    for want, got in ((params, params_from_released(cfg, tensors)), (mtp, drafter_params_from_released(cfg, tensors))):
        want, got = flat(want), flat(got)
        assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)

