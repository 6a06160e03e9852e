"""The DeepSeek-V4 model (one device, full sequence) against an independent oracle: transformers 5.18.0's
``DeepseekV4ForCausalLM`` (eager attention, no cache fake-quant), live, on tiny random configs that hold every V4
layer kind — SWA-only, HCA (ratio 8), CSA (ratio 4, with its own indexer and overlapping compressors), hash-routed
and top-k-routed MoE, the per-site mHC and its head mixer — in two orders.

Prompts: 40 tokens (past the window of 8, ten CSA windows, five HCA windows: the selection is sparse, top-4 of up
to 10) and 7 (before the first HCA entry, one CSA entry). Logits ≤ 1e-5 relative (FP32); every CSA layer's selected
set equal to the oracle's on every row, with no near-tie at any top-k boundary (asserted from the oracle's scores);
the index scores themselves ≤ 1e-5 relative.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import V4_HARNESS
from helpers import boundary_gap, rel_err, selection_sets
from safetensors.numpy import load_file

from v41cp import model
from v41cp.checkpoint.transformers_v4 import params_from_transformers_v4
from v41cp.config import preset

pytestmark = pytest.mark.oracle

TIE_GAP = 1e-5                      # as the V4.1 oracle test: a smaller relative gap may flip between the two


def _run(oracle, name, length):
    out = oracle.run("model", "--preset", name, "--length", str(length), "--chunk", str(length // 2 + 1),
                     harness=V4_HARNESS)
    cfg = preset(name)
    params = jax.tree.map(jnp.asarray, params_from_transformers_v4(cfg, load_file(str(out / "weights.safetensors"))))
    ref = load_file(str(out / "reference.safetensors"))
    logits, _, inter = model.forward_debug(params, cfg, ref["input_ids"])
    return cfg, ref, np.asarray(logits), inter


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v4-csa-first"])
@pytest.mark.parametrize("length", [40, 7])
def test_v4_logits_and_selections_match_transformers(oracle, name, length):
    cfg, ref, logits, inter = _run(oracle, name, length)
    err = rel_err(logits, ref["logits"])
    print(f"\n[v4 oracle] {name} S={length}: logits rel err {err:.2e}")
    assert err <= 1e-5, err
    csa = [r.index for r in cfg.layer_roles if r.kind == "csa"]
    assert csa and all(f"topk_{i}" in ref for i in csa)
    for i in csa:
        want_scores = ref[f"index_scores_{i}"][0]
        got = np.asarray(inter[f"layers_{i}"]["attn"]["topk"][0][0])
        k = got.shape[-1]
        assert k == min(cfg.index_topk, length // 4)
        if k == 0:
            continue
        gap = boundary_gap(want_scores, k)
        assert gap.min() > TIE_GAP, (i, float(gap.min()))                    # no near-tie: sets comparable
        assert selection_sets(got) == selection_sets(ref[f"topk_{i}"][0]), i
        scores = np.asarray(inter[f"layers_{i}"]["attn"]["index_scores"][0][0])
        visible = np.isfinite(want_scores)
        assert np.array_equal(np.isfinite(scores), visible)
        assert rel_err(scores[visible], want_scores[visible]) <= 1e-5
        if length == 40:                             # sparse: the last rows choose 4 of their 10 visible entries
            assert np.isfinite(want_scores[-1]).sum() == 10 and (got[-1] >= 0).sum() == 4


def test_release_names_and_formats(oracle, tmp_path):
    """The release's V4 layout. (1) The oracle's tensors under the release's names (its own renaming of
    transformers' modules) load to the same tree as transformers' names, bit for bit — two independent spellings
    of the mapping agree. (2) Written in the release's formats — dense FP8 in 128×128 blocks (``weight_block_size``
    from config.json's ``quantization_config``), packed FP4 experts, the int32 hash tables — and read back: FP4
    experts are kept as stored by default, every FP8 weight decodes to its quantize-dequantize value, and the model
    kept quantized gives the logits of the one dequantized on the host."""
    from v41cp.checkpoint.formats import dequant_fp8_blocks, quant_fp8_blocks
    from v41cp.checkpoint.names import params_from_released
    from v41cp.checkpoint.released import ReleasedCheckpoint
    from v41cp.checkpoint.writer import write_released

    out = oracle.run("model", "--preset", "tiny-v4", "--length", "40", "--chunk", "21", harness=V4_HARNESS)
    cfg = preset("tiny-v4")
    released = load_file(str(out / "released.safetensors"))
    a = params_from_released(cfg, released)
    b = params_from_transformers_v4(cfg, load_file(str(out / "weights.safetensors")))
    flat = lambda t: {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(t)[0]}
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys() and all(np.array_equal(fa[k], fb[k]) for k in fa)

    write_released(tmp_path / "r", cfg, released)
    stored = ReleasedCheckpoint(tmp_path / "r")
    assert stored.cfg.weight_block_size == 128 and stored.cfg.keep_quantized and stored.cfg.is_v4
    assert tuple(stored.files.tensors["layers.2.attn.wq_b.scale"].shape) == (2, 1)          # [256, 32] in 128²
    key = "layers.2.attn.wq_b.weight"
    want = dequant_fp8_blocks(*quant_fp8_blocks(released[key], 128), block=128)
    np.testing.assert_array_equal(stored.read(key), want)
    assert np.array_equal(stored.read("layers.0.ffn.gate.tid2eid"), released["layers.0.ffn.gate.tid2eid"])
    tokens = load_file(str(out / "reference.safetensors"))["input_ids"]
    logits = {}
    for keep in (True, False):
        ck = ReleasedCheckpoint(tmp_path / "r", keep_quantized=keep)
        logits[keep] = np.asarray(model.forward(jax.tree.map(jnp.asarray, ck.params()), ck.cfg, tokens))
    assert rel_err(logits[True], logits[False]) <= 1e-5
