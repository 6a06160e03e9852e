"""The released dtype (BF16 weights and activations, FP32 islands) runs and tracks the FP32 model."""

import jax.numpy as jnp
import numpy as np
from helpers import rel_err

from v41cp import model
from v41cp.checkpoint import default_checkpoint, load

# Complete selection: a hard top-k flips under BF16 rounding wherever two scores are close, which
# would measure selection noise rather than arithmetic (observed: 12% of rows at layer 4 with top-4; MoE top-2
# of 4 flips gave 1.9e-2 – 3.4e-2 on seeds 4–6, against 6.4e-3 – 8.6e-3 with every expert routed).
COMPLETE = dict(index_topk=64, candidate_topk_blocks=64, fake_quant=False, num_experts_per_tok=4)


def test_bf16_forward_tracks_fp32():
    cfg32, params32 = load(default_checkpoint(), **COMPLETE)
    cfg16, params16 = load(default_checkpoint(), dtype="bfloat16", **COMPLETE)
    assert params16["layers_1"]["attn"]["wq_b"].dtype == jnp.bfloat16
    assert params16["layers_1"]["hc_attn"]["fn"].dtype == np.float32          # FP32 islands stay FP32
    assert params16["layers_1"]["attn"]["compressor"]["wkv"].dtype == np.float32
    assert params16["head"].dtype == np.float32
    tokens = np.random.default_rng(4).integers(3, cfg32.vocab_size, (1, 24))
    want = np.asarray(model.forward(params32, cfg32, tokens))
    got, _, inter = model.forward_debug(params16, cfg16, tokens)
    assert got.dtype == jnp.float32 and bool(jnp.isfinite(got).all())
    # the index scores are stored as the reference stores them at this dtype: BF16 values (rounded dot, weighted
    # ReLU and head sum; the per-point match with the port is tests/test_oracle_model.py)
    for role in cfg16.layer_roles:
        if role.is_index_source:
            scores = np.asarray(inter[f"layers_{role.index}"]["attn"]["index_scores"][0])
            finite = scores[np.isfinite(scores)]
            assert finite.size and np.array_equal(finite, np.asarray(jnp.asarray(finite, jnp.bfloat16), np.float32))
    err = rel_err(got, want)
    print(f"\n[bf16 vs fp32, complete selection] logits rel err {err:.2e}")
    # BF16 rounding (8-bit mantissa, ~4e-3) through 6 layers; catches dtype bugs, not ulps
    assert err < 1.5e-2
