"""The TP-sharded forward on 8 simulated CPU devices equals the single-device forward."""

import jax
import numpy as np
import pytest
from helpers import TOKEN_MAP, rel_err
from helpers import perturbed as _perturbed

from v41cp import model
from v41cp.config import preset
from v41cp.sharding import TP_RULES, ShardingContext, make_mesh


@pytest.mark.parametrize("name,dp,tp", [("tiny-tp8", 1, 8), ("tiny", 2, 4), ("tiny-v4", 2, 4)])
def test_tp_forward_equals_single_device(name, dp, tp):
    """V4 (``tiny-v4``): CSA / HCA compressors and indexers, the hash-routed MoE layers' token-id experts carried
    into the MoE's tensor-parallel island, the head mixer."""
    cfg = preset(name, engram_token_map=TOKEN_MAP) if not name.endswith("v4") else preset(name)
    params = _perturbed(model.init_params(cfg, jax.random.key(0)))
    tokens = np.random.default_rng(1).integers(3, cfg.vocab_size, (2, 40))
    want_logits, want_hidden = model.forward_with_hidden(params, cfg, tokens)

    mesh = make_mesh(tp=tp, dp=dp)
    sharded = model.shard_params(params, cfg, mesh)
    wq_b = sharded["layers_1"]["attn"]["wq_b"]
    experts = sharded["layers_1"]["ffn"]["experts_w1"]                 # (tiny-v4: a hash-routed layer)
    assert wq_b.sharding.spec[1] == "tp" and experts.sharding.spec[2] == "tp"      # tensor-parallel MoE: I split
    assert len({s.device for s in wq_b.addressable_shards}) == dp * tp
    assert wq_b.addressable_shards[0].data.shape[1] == cfg.num_attention_heads // tp
    got_logits, got_hidden = model.forward_with_hidden(sharded, cfg, tokens, shard=ShardingContext(mesh, TP_RULES))
    err, herr = rel_err(got_logits, want_logits), rel_err(got_hidden, want_hidden)
    print(f"\n[tp {name} dp={dp} tp={tp}] logits rel err {err:.2e}, hidden {herr:.2e}")
    assert err <= 1e-5 and herr <= 1e-5


def test_bad_topology_is_named():
    with pytest.raises(ValueError, match="dp=3 x tp=2"):
        make_mesh(tp=2, dp=3)
