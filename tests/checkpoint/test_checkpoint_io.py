"""Released layout → orbax → restore (1 device and 8), against the oracle; formats; bad input."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from helpers import rel_err
from safetensors.numpy import load_file

from v41cp import model
from v41cp.checkpoint import (
    CheckpointError,
    ReleasedCheckpoint,
    convert,
    default_released_checkpoint,
    load,
    load_released_dir,
)
from v41cp.checkpoint.formats import (
    dequant_fp4_rows,
    dequant_fp8_blocks,
    dequant_fp8_rows,
    quant_fp4_rows,
    quant_fp8_blocks,
    quant_fp8_rows,
)
from v41cp.checkpoint.safetensors_io import write_safetensors
from v41cp.sharding import make_mesh

RELEASED = Path(default_released_checkpoint())


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    dst = tmp_path_factory.mktemp("conv") / "tiny"
    summary = convert(RELEASED, dst, progress=False, keep_quantized=False)        # dequantized (FP32 tree)
    return dst, summary


@pytest.mark.oracle
def test_dequant_bit_exact_vs_oracle_incl_ragged_blocks(oracle, tmp_path):
    rng = np.random.default_rng(0)
    src = {}
    for name, shape, quant in (("a.attn.wq_b.weight", (70, 45), quant_fp8_blocks),      # ragged 32x32 edges
                               ("b.attn.wo_a.weight", (64, 96), quant_fp8_blocks),
                               ("c.ffn.experts.0.w1.weight", (5, 38), quant_fp4_rows),   # ragged 32-column edge
                               ("d.ffn.experts.1.w2.weight", (16, 64), quant_fp4_rows),
                               ("e.engram.embed.weight", (7, 40), quant_fp8_rows)):
        x = rng.normal(size=shape).astype(np.float32) * rng.choice([1e-3, 1.0, 300.0], size=(shape[0], 1))
        w, s = quant(x)
        src[name], src[name[: -len(".weight")] + ".scale"] = w, s
    write_safetensors(tmp_path / "pairs.safetensors", src)
    ref = load_file(str(oracle.run("dequant", "--src", str(tmp_path / "pairs.safetensors")) / "dequant.safetensors"))
    for name, want in ref.items():
        w, s = src[name], src[name[: -len(".weight")] + ".scale"]
        got = (dequant_fp4_rows if w.dtype == np.int8 else
               dequant_fp8_rows if ".engram.embed." in name else dequant_fp8_blocks)(w, s)
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.fast
def test_quantizers_round_trip_on_the_grid():
    x = np.array([[0.5, -1.0, 6.0, 0.0] * 8 + [1.5, -3.0, 4.0, -0.5] * 8], np.float32)
    np.testing.assert_array_equal(dequant_fp4_rows(*quant_fp4_rows(x)), x)
    grid = np.array([0, 0.5, -0.5, 1, -1, 1.5, -1.5, 2, -2, 3, -3, 4, -4, 6, -6, 8], np.float32)
    y = np.concatenate([grid, -grid[::-1] * 1.5] * 6).reshape(3, 64)[:, :48] * np.float32(2) ** np.arange(3)[:, None]
    np.testing.assert_array_equal(dequant_fp8_blocks(*quant_fp8_blocks(y)), y)
    np.testing.assert_array_equal(dequant_fp8_rows(*quant_fp8_rows(y)), y)


@pytest.mark.oracle
def test_round_trip_equals_oracle_on_one_and_eight_devices(oracle, converted):
    """released (FP8 / FP4 / e8m0) → convert → load → logits = the oracle's on its own dequantization."""
    out = oracle.run("model", "--weights", str(RELEASED), "--fake-quant", "off")
    ref = load_file(str(out / "reference.safetensors"))
    dequantized = load_file(str(out / "dequantized.safetensors"))
    ckpt = ReleasedCheckpoint(RELEASED, fake_quant=False)
    for key, want in dequantized.items():                     # the reader decodes exactly as the oracle
        np.testing.assert_array_equal(np.asarray(ckpt.read(key), np.float32), want, err_msg=key)
    tokens = ref["input_ids"]
    direct_cfg, direct = load_released_dir(RELEASED, fake_quant=False, keep_quantized=False)
    want_direct = np.asarray(model.forward(direct, direct_cfg, tokens))
    dst, summary = converted
    cfg1, p1 = load(dst, fake_quant=False)
    got1 = np.asarray(model.forward(p1, cfg1, tokens))
    mesh = make_mesh(tp=4, dp=2)                              # 8 devices; the tiny model has 4 heads / experts
    cfg8, p8 = load(dst, mesh=mesh, fake_quant=False)
    wq_b, table = p8["layers_1"]["attn"]["wq_b"], p8["layers_1"]["engram"]["embed"]
    assert wq_b.sharding.mesh == mesh and wq_b.sharding.spec[1] == "tp" and table.sharding.spec[0] == "tp"
    assert wq_b.addressable_shards[0].data.shape[1] == cfg8.num_attention_heads // 4
    got8 = np.asarray(model.forward(p8, cfg8, tokens))
    print(f"\n[checkpoint round trip] 1 device {rel_err(got1, ref['logits']):.2e}, 8 devices "
          f"{rel_err(got8, ref['logits']):.2e} vs oracle; direct==converted: {np.array_equal(want_direct, got1)}")
    np.testing.assert_array_equal(got1, want_direct)          # direct and converted paths are the same model
    assert rel_err(got1, ref["logits"]) <= 1e-5 and rel_err(got8, ref["logits"]) <= 1e-5
    assert summary["tensors"] == len(jax.tree.leaves(p1))


@pytest.mark.parametrize("keep_quantized", [False, True])
def test_direct_load_onto_mesh_reads_each_shard_and_equals_host_load(keep_quantized):
    """Each device's shard is read by itself from the memory maps (no whole-tensor decode: distinct regions
    decode exactly the model's bytes once), and the placed tree is bit-equal to the host load."""
    from v41cp.sharding.rules import QCP_RULES, TP_RULES

    cfg, host = load_released_dir(RELEASED, keep_quantized=keep_quantized)
    flat = jax.tree_util.tree_flatten_with_path(host)[0]
    for mesh, rules in ((make_mesh(tp=4, dp=2), TP_RULES), (make_mesh(tp=8), QCP_RULES)):
        _, sharded, report = load_released_dir(RELEASED, mesh=mesh, rules=rules, report=True, workers=3,
                                               keep_quantized=keep_quantized)
        leaves = jax.tree.leaves(sharded)
        assert len(leaves) == len(flat) == report.parameters
        for (path, a), b in zip(flat, leaves):
            assert a.dtype == b.dtype, path
            np.testing.assert_array_equal(a.view(np.uint8), np.asarray(b).view(np.uint8), err_msg=str(path))
        assert report.decoded_bytes == report.placed_bytes == sum(a.nbytes for _, a in flat)
    experts = "experts_w1_fp4" if keep_quantized else "experts_w1"
    assert sharded["layers_1"]["ffn"][experts].sharding.spec[1 if keep_quantized else 2] == "tp"


# ----------------------------------------------------------------------------------------- bad input
def _copy(tmp_path) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(RELEASED, dst)
    return dst


def _rewrite(src: Path, edit):
    """Load every tensor, apply ``edit(dict)``, write one shard + index."""
    ckpt_files = sorted(src.glob("*.safetensors"))
    from v41cp.checkpoint.safetensors_io import ReleasedFiles

    files = ReleasedFiles(src)
    tensors = {k: np.array(files.read(k)) for k in files}
    for f in ckpt_files:
        f.unlink()
    edit(tensors)
    write_safetensors(src / "model-00001.safetensors", tensors)
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "model-00001.safetensors" for k in tensors}}))


def _expect_convert_error(src, dst, needle):
    with pytest.raises(CheckpointError, match=needle):
        convert(src, dst, progress=False)
    assert not dst.exists() and not list(dst.parent.glob(dst.name + ".partial-*"))


@pytest.mark.parametrize("edit,needle", [
    (lambda t: t.pop("layers.3.attn.indexer.wq_b.weight"), "missing tensor 'layers.3.attn.indexer.wq_b.weight'"),
    (lambda t: t.__setitem__("layers.2.attn.indexer.wk.weight", np.zeros((32, 64), ml_dtypes.bfloat16)),
     "unexpected tensor 'layers.2.attn.indexer.wk.weight'"),
    (lambda t: t.__setitem__("norm.weight", np.zeros((65,), ml_dtypes.bfloat16)), "'norm.weight' has shape"),
    (lambda t: t.__setitem__("layers.0.attn.attn_sink", np.zeros((4,), np.int32)), "'layers.0.attn.attn_sink' has dtype I32"),
    (lambda t: t.pop("layers.0.attn.wq_a.scale"), "'layers.0.attn.wq_a.weight' .* missing its scale"),
    (lambda t: t.__setitem__("layers.0.attn.wq_a.scale", np.ones((2, 2), ml_dtypes.float8_e8m0fnu)),
     "scale 'layers.0.attn.wq_a.scale' has shape"),
])
def test_bad_tensor_is_named_and_leaves_no_output(tmp_path, edit, needle):
    src = _copy(tmp_path)
    _rewrite(src, edit)
    _expect_convert_error(src, tmp_path / "out", needle)


@pytest.mark.fast
def test_truncated_shard(tmp_path):
    src = _copy(tmp_path)
    shard = sorted(src.glob("*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    _expect_convert_error(src, tmp_path / "out", f"shard .*{shard.name}.* is truncated")


def test_index_points_to_missing_shard(tmp_path):
    src = _copy(tmp_path)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["norm.weight"] = "model-00099.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    _expect_convert_error(src, tmp_path / "out", "'norm.weight' to shard 'model-00099.safetensors', which does not exist")


def test_config_tensor_mismatch(tmp_path):
    src = _copy(tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["n_routed_experts"] = 8
    cfg["text_config"]["hidden_size"] = 128
    (src / "config.json").write_text(json.dumps(cfg))
    _expect_convert_error(src, tmp_path / "out", "does not fit the config")


def test_load_refuses_incomplete_checkpoint(tmp_path, converted):
    dst, _ = converted
    broken = tmp_path / "broken"
    shutil.copytree(dst, broken)
    (broken / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="not a complete converted checkpoint"):
        load(broken)


def test_cli_convert_in_parallel_workers_equals_serial(tmp_path, converted):
    """``convert --workers 2`` (subtrees in two processes) writes the same checkpoint as the serial conversion."""
    dst = tmp_path / "cli"
    res = subprocess.run([sys.executable, "-m", "v41cp", "convert", str(RELEASED), str(dst), "--workers", "2",
                          "--dequantize", "--json"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["tensors"] == converted[1]["tensors"] and summary["workers"] == 2 and not summary["keep_quantized"]
    assert summary["parts"] == converted[1]["parts"] and summary["peak_worker_rss_bytes"] > 0
    _, serial = load(converted[0])
    _, parallel = load(dst)
    for a, b in zip(jax.tree.leaves(serial), jax.tree.leaves(parallel)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    res = subprocess.run([sys.executable, "-m", "v41cp", "convert", str(RELEASED), str(dst)], capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 2 and "already exists" in res.stderr


def test_unquantized_export_and_dspark_vision_tensors(tmp_path):
    """The same names stored FP32 without scales (other frameworks' exports) load to the same tree, the DSpark
    drafter too; mtp.* tensors go to their own subtree of a conversion (and decode to the same drafter), vision
    tensors are skipped."""
    from v41cp.checkpoint import write_released
    from v41cp.checkpoint.safetensors_io import ReleasedFiles

    quantized = ReleasedCheckpoint(RELEASED, keep_quantized=False)
    names = [k for k in quantized.files if not k.endswith(".scale")]
    extra = {"vision.blocks.0.w": np.zeros(3, np.float32)}
    tensors = [(k, np.asarray(quantized.read(k), np.float32)) for k in names] + list(extra.items())
    write_released(tmp_path / "fp32", json.loads((RELEASED / "config.json").read_text()), tensors,
                   tokenizer=RELEASED / "tokenizer.json", quantize=False)
    assert not any(k.endswith(".scale") for k in ReleasedFiles(tmp_path / "fp32"))
    plain = ReleasedCheckpoint(tmp_path / "fp32")
    assert not plain.cfg.keep_quantized                   # as stored: an unquantized export loads dequantized
    for a, b in zip(jax.tree.leaves(quantized.params()), jax.tree.leaves(plain.params())):
        np.testing.assert_array_equal(a, b)
    summary = convert(tmp_path / "fp32", tmp_path / "conv", progress=False)
    assert not summary["keep_quantized"]
    mtp = [k for k in names if k.startswith("mtp.")]
    assert summary["dspark_tensors"] == len(mtp) > 0 and (tmp_path / "conv" / "params" / "dspark").exists()
    from v41cp.checkpoint import open_drafter

    want = quantized.drafter_params()
    for other in (plain.drafter_params(), open_drafter(tmp_path / "conv", quantized.cfg)):
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(other)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.fast
def test_in_jit_decoders_match_host_decoders():
    import jax.numpy as jnp

    from v41cp.kernels.stored_weights import decode_fp4, decode_fp8_rows

    rng = np.random.default_rng(5)
    packed = rng.integers(-128, 128, (6, 16), dtype=np.int8)
    # realistic exponents (2^-27 .. 2^23): XLA flushes subnormal results to zero, NumPy does not
    scale = rng.integers(100, 150, (6, 1), dtype=np.uint8)
    want = dequant_fp4_rows(packed, scale.view(ml_dtypes.float8_e8m0fnu))
    got = decode_fp4(jnp.asarray(packed.view(np.uint8)), jnp.asarray(scale), jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), want)
    rows = rng.integers(0, 256, (5, 64), dtype=np.uint8)
    rows[(rows & 0x7F) == 0x7F] = 0
    s2 = rng.integers(100, 140, (5, 2), dtype=np.uint8)
    want = dequant_fp8_rows(rows.view(ml_dtypes.float8_e4m3fn), s2.view(ml_dtypes.float8_e8m0fnu))
    np.testing.assert_array_equal(np.asarray(decode_fp8_rows(jnp.asarray(rows), jnp.asarray(s2), jnp.float32)), want)


def test_keep_quantized_checkpoint_runs_the_same_model(tmp_path):
    """FP4 experts / FP8 Engram rows kept as stored, decoded in the forward: same logits as dequantized."""
    dst = tmp_path / "kq"
    summary = convert(RELEASED, dst, progress=False, keep_quantized=True)
    assert summary["keep_quantized"]
    cfg, params = load(dst)
    assert cfg.keep_quantized and params["layers_1"]["ffn"]["experts_w1_fp4"].dtype == np.uint8
    assert params["layers_1"]["engram"]["embed_fp8"].dtype == np.uint8
    tokens = np.random.default_rng(2).integers(3, cfg.vocab_size, (1, 24))
    dense_cfg, dense = load_released_dir(RELEASED, keep_quantized=False)
    want = np.asarray(model.forward(dense, dense_cfg, tokens))
    got = np.asarray(model.forward(params, cfg, tokens))
    assert rel_err(got, want) <= 1e-6
    kernel = np.asarray(model.forward(params, cfg.replace(expert_backend="pallas"), tokens))   # grouped FP4 kernel
    assert rel_err(kernel, want) <= 1e-5
    _, sharded = load(dst, mesh=make_mesh(tp=4, dp=2))
    assert sharded["layers_1"]["ffn"]["experts_w1_fp4"].sharding.spec[1] == "tp"     # [E, I, H/2]: I split
    # stored bytes are 4x (experts) / 2-4x (Engram) smaller than the dequantized FP32 tree
    kq = sum(x.nbytes for x in jax.tree.leaves(params["layers_1"]["ffn"]) if x.dtype == np.uint8)
    dq = sum(dense["layers_1"]["ffn"][k].nbytes for k in ("experts_w1", "experts_w2", "experts_w3"))
    assert kq * 7 < dq


def test_weights_are_kept_as_stored_by_default(tmp_path):
    """A release storing FP4 experts / FP8 Engram rows loads and converts as stored unless asked to dequantize; a
    converted checkpoint restores as converted (a contradicting request names both); every command that opens or
    plans a model takes the same default and the same two flags."""
    import importlib

    from v41cp.checkpoint import default_checkpoint, open_checkpoint, stores_quantized_at
    from v41cp.cli import COMMANDS, flags, parser

    cfg, params = open_checkpoint(RELEASED)
    assert cfg.keep_quantized and params["layers_1"]["ffn"]["experts_w1_fp4"].dtype == np.uint8
    assert params["layers_1"]["engram"]["embed_fp8"].dtype == np.uint8 and stores_quantized_at(RELEASED)
    dense_cfg, dense = open_checkpoint(RELEASED, keep_quantized=False)
    assert not dense_cfg.keep_quantized and dense["layers_1"]["ffn"]["experts_w1"].dtype == np.float32
    summary = convert(RELEASED, tmp_path / "kq", progress=False)
    assert summary["keep_quantized"] and stores_quantized_at(tmp_path / "kq")
    assert open_checkpoint(tmp_path / "kq")[0].keep_quantized
    with pytest.raises(CheckpointError, match="stores routed experts and Engram tables quantized .* "
                                              "keep_quantized=False was asked"):
        open_checkpoint(tmp_path / "kq", keep_quantized=False)
    assert not stores_quantized_at(default_checkpoint())            # the embedded FP32 conversion
    # the command line: one default (ModelFlags), --dequantize / --keep-quantized to override, on every command
    released = lambda **kw: flags.ModelFlags(checkpoint=str(RELEASED), **kw)
    assert released().config().keep_quantized and released().storage() == {}
    assert not released(dequantize=True).config().keep_quantized
    assert flags.ModelFlags(preset="v41-flash").config().keep_quantized          # planned as the release stores it
    assert not flags.ModelFlags(preset="v41-flash", dequantize=True).config().keep_quantized
    assert not flags.ModelFlags().config().keep_quantized
    with pytest.raises(ValueError, match="--keep-quantized and --dequantize contradict"):
        released(keep_quantized=True, dequantize=True).storage()
    for name in ("plan", "generate", "serve", "bench", "forward", "convert"):
        args = {"convert": ["src", "dst"], "bench": ["decode"]}.get(name, [])
        ns = parser(importlib.import_module(COMMANDS[name][0])).parse_args([name, *args, "--dequantize"])
        assert flags.ModelFlags.from_args(ns).storage() == {"keep_quantized": False}, name


def test_keep_quantized_needs_a_quantized_release(tmp_path):
    from v41cp.checkpoint import write_released

    quantized = ReleasedCheckpoint(RELEASED)
    tensors = [(k, np.asarray(quantized.read(k), np.float32)) for k in quantized.files if not k.endswith(".scale")]
    write_released(tmp_path / "fp32", json.loads((RELEASED / "config.json").read_text()), tensors,
                   tokenizer=RELEASED / "tokenizer.json", quantize=False)
    _expect_convert_error_kq(tmp_path / "fp32", tmp_path / "out")


def _expect_convert_error_kq(src, dst):
    with pytest.raises(CheckpointError, match="keep_quantized keeps the release's storage"):
        convert(src, dst, progress=False, keep_quantized=True)
    assert not dst.exists()
