"""The DSpark drafter against the independent oracle: NeMo AutoModel's cache-free DSpark backbone on the tiny
target with DSpark stages (`tiny-dspark`), live.

Compared, FP32, relative error = max|Δ| / max|reference| per tensor: the target features (the attention-input
streams of the target layers, hc mean — layer 3's after its Engram), and — fed the oracle's own features, so the
drafter is checked alone — the normalized block states, the Markov logits of given previous tokens, the draft
logits and the confidence at every block position, for blocks anchored at 0 (no context), inside the first
window and past it.
"""

import numpy as np
import pytest
from helpers import load_export, rel_err
from safetensors.numpy import load_file

from v41cp import model
from v41cp.checkpoint.names import drafter_params_from_released
from v41cp.drafter import draft_from_features

pytestmark = pytest.mark.oracle


@pytest.mark.parametrize("fake_quant,tol", [(False, 1e-5), (True, 1e-4)], ids=["fq-off", "fq-on"])
def test_drafter_matches_oracle(oracle, fake_quant, tol):
    out = oracle.run("dspark", "--fake-quant", "on" if fake_quant else "off")
    cfg, params, ref = load_export(out, fake_quant=fake_quant, dspark_confidence_input="normed")
    drafter = drafter_params_from_released(cfg, load_file(str(out / "weights.safetensors")))
    _, features = model.forward_with_features(params, cfg, ref["input_ids"])
    got = draft_from_features(drafter, params["embed"], params["head"], cfg, ref["target_features"], ref["anchors"],
                              ref["block_ids"], ref["previous_ids"])
    errs = {"features": rel_err(features, ref["target_features"]),
            **{k: rel_err(got[k], ref[r]) for k, r in (("normed", "normalized"), ("markov", "markov_logits"),
                                                       ("logits", "draft_logits"), ("confidence", "confidence"))}}
    print(f"\n[dspark oracle fake_quant={fake_quant}] " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    assert max(errs.values()) <= tol, errs
    assert (np.asarray(ref["anchors"]) == 0).any()              # a block with no context at all
    assert np.asarray(got["logits"]).shape == ref["draft_logits"].shape
