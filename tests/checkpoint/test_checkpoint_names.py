"""params_from_released (unquantized released names → tree): layout transforms; bad tensors name the key."""

import numpy as np
import pytest

from v41cp.checkpoint import CheckpointError, ReleasedCheckpoint, default_released_checkpoint, params_from_released

pytestmark = pytest.mark.fast           # the developer tier (`pytest -m fast`)


@pytest.fixture(scope="module")
def embedded():
    """(config, every tensor of the embedded released checkpoint decoded to unquantized arrays)."""
    ckpt = ReleasedCheckpoint(default_released_checkpoint(), keep_quantized=False)
    names = [k for k in ckpt.files if not k.endswith(".scale")]
    return ckpt.cfg, {k: np.asarray(ckpt.read(k), np.float32) for k in names}


def test_embedded_checkpoint_roundtrip(embedded):
    cfg, tensors = embedded
    params = params_from_released(cfg, tensors)
    # head is stored [vocab, hidden] in the release and [hidden, vocab] in the tree
    np.testing.assert_array_equal(params["head"], tensors["head.weight"].T)
    e1 = tensors["layers.0.ffn.experts.1.w2.weight"]
    np.testing.assert_array_equal(params["layers_0"]["ffn"]["experts_w2"][1], e1.T)
    wq_b = tensors["layers.2.attn.wq_b.weight"].reshape(cfg.num_attention_heads, cfg.head_dim, -1)
    np.testing.assert_array_equal(params["layers_2"]["attn"]["wq_b"][:, 3], wq_b[3].T)


@pytest.mark.parametrize("mutate,needle", [
    (lambda t: t.pop("layers.1.attn.compressor.wgate.weight"), "missing tensor 'layers.1.attn.compressor.wgate.weight'"),
    (lambda t: t.__setitem__("layers.0.attn.wq_a.weight", np.zeros((32, 65), np.float32)),
     r"'layers.0.attn.wq_a.weight' has shape \(32, 65\)"),
    (lambda t: t.__setitem__("layers.2.attn.compressor.wkv.weight", np.zeros((64, 64), np.float32)),
     "unexpected tensor 'layers.2.attn.compressor.wkv.weight'"),
    (lambda t: t.__setitem__("layers.0.attn.wq_a.scale", np.zeros((1, 2), np.float32)), "quantization scale"),
    (lambda t: t.__setitem__("layers.0.attn.attn_sink", np.zeros(4, np.int32)), "dtype int32"),
])
def test_bad_tensor_names_the_key(embedded, mutate, needle):
    cfg, tensors = embedded
    tensors = dict(tensors)
    mutate(tensors)
    with pytest.raises(CheckpointError, match=needle):
        params_from_released(cfg, tensors)


def test_vision_and_dspark_tensors_are_ignored(embedded):
    cfg, tensors = embedded
    extra = dict(tensors, **{"vision.blocks.0.w": np.zeros(3, np.float32), "mtp.0.main_norm.weight": np.ones(64)})
    params_from_released(cfg, extra)


def test_forward_rejects_bad_tokens(embedded):
    from v41cp import model

    cfg, tensors = embedded
    params = params_from_released(cfg, tensors)
    with pytest.raises(ValueError, match="token id 300"):
        model.forward(params, cfg, np.array([[1, 300]]))
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=8"):
        model.forward(params, cfg.replace(max_position_embeddings=8), np.ones((1, 9), np.int32))
    with pytest.raises(ValueError, match="non-empty"):
        model.forward(params, cfg, np.zeros((1, 0), np.int32))
