"""DeepSeek-V4 MTP speculative decoding (`v41cp.mtp`, `v41cp.serving.runner.mtp_draft`) on `tiny-v4-mtp` (SWA | HCA
ratio 8 | CSA | CSA + the MTP layer, window 8), against the full-sequence MTP layer (`mtp_reference`) over the
target's full forward and against plain greedy decoding.

* after every engine round (span prefill, a prefix-cache hit continuing from the stored slot state, speculative
  rounds whose drafts are rejected): each running request's draft cache holds the MTP keys of the positions in its
  window, the target's streams at its last fed position and that position, as the full sequences give them; the
  draft step's logits of row 0 (from the target's streams and the anchor) and of row 1 (chained from row 0's
  output streams and draft 1) equal the full-sequence layer's;
* greedy MTP speculative decoding equals plain greedy (the full forward's continuation, no near-tie) on one device
  (a prompt that hits the prefix cache too), under KVP = DCP 2 and after a model-wide QCP 2 prefill (the draft
  cache checked as above after every round: its rows come back from the ranks that own them), and disaggregated
  (the prefill role writes the prompt's MTP context, the PD transfer carries it);
* the released names and formats (``mtp.0.*``) write, convert and load into the layer's tree; bad settings are
  refused naming the value.

The MTP weights are random: its drafts are rejected (acceptance lengths are covered by injected proposals,
`tests/serving/test_v4_speculative.py`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SPECULATIVE_TOPOLOGIES, continuation_proposer, greedy_reference, perturbed, rel_err

from v41cp import model
from v41cp.config import preset
from v41cp.model import embedding_and_head
from v41cp.mtp import init_mtp_params, mtp_reference
from v41cp.serving.engine import Capacity, Engine, SamplingParams
from v41cp.serving.runner.mtp_draft import mtp_draft_step
from v41cp.serving.runner.speculative import Speculative

CAP = Capacity(prefill_bucket_count=1, max_batch=3, max_tokens=48, block_tokens=8)
N = 2                                                         # chained MTP rows per step
NEW = 12
LENGTH = 48                                                   # the full forwards' padded length (one compile)


@pytest.fixture(scope="module")
def setup():
    cfg = preset("tiny-v4-mtp")
    params = perturbed(model.init_params(cfg, jax.random.key(0)))
    layer = init_mtp_params(cfg, jax.random.key(1))
    rng = np.random.default_rng(5)
    prompts = {f"p{n}": rng.integers(3, cfg.vocab_size, n).tolist() for n in (6, 15, 29)}
    prompts["hit"] = prompts["p29"][:24] + rng.integers(3, cfg.vocab_size, 5).tolist()   # p29 stored its state at 24
    want, _ = greedy_reference(cfg, params, prompts, NEW, LENGTH)
    return cfg, params, layer, prompts, want


def _submit(eng, prompts, ids):
    for rid in ids:
        eng.submit(rid, prompts[rid], SamplingParams(max_new_tokens=NEW, stop_on_eos=False))


def _check_draft_state(eng, cfg, params, layer, req, slot):
    """The draft cache of ``req`` (anchor = its last token, at position q = len(history) − 1) against the
    full-sequence MTP layer; the draft step's two rows' logits against it too."""
    hist = list(req.history)
    q, w = len(hist) - 1, cfg.sliding_window
    padded = np.zeros((1, LENGTH), np.int32)
    padded[0, :len(hist)] = hist
    _, feats = model.forward_with_features(params, cfg, padded)                  # [1, S, hc·H] (causal)
    embed, head = embedding_and_head(params)
    nxt = jnp.asarray(np.append(padded[0, 1:], 0)[None], jnp.int32)
    ref = mtp_reference(layer, embed, head, cfg, feats, nxt)
    dc = eng.runner.dcache
    assert int(dc.fed[slot, 0]) == q, (req.rid, int(dc.fed[slot, 0]), q)
    assert rel_err(dc.last[slot], feats[0, q - 1]) <= 1e-5
    pos = np.arange(max(0, q - w), q - 1)                                       # the ring's positions in row 0's window
    if len(pos):
        err = rel_err(np.asarray(dc.keys[0, slot, pos % w]), np.asarray(ref["keys"][0, pos]))
        assert err <= 1e-5, (req.rid, q, err)
    drafts, logits = mtp_draft_step(layer, embed, head, cfg, dc, *(jnp.asarray([v], jnp.int32) for v in
                                                                    (slot, hist[-1], q)), N, with_logits=True)
    assert rel_err(logits[0, 0], ref["logits"][0, q - 1]) <= 1e-5, (req.rid, q)
    # row 1: the layer at q from row 0's output streams and draft 1
    chained = feats.at[0, q].set(ref["streams"][0, q - 1].reshape(-1))
    ref1 = mtp_reference(layer, embed, head, cfg, chained, nxt.at[0, q].set(drafts[0, 0]))
    assert rel_err(logits[0, 1], ref1["logits"][0, q]) <= 1e-5, (req.rid, q)


@pytest.mark.parametrize("drafts", ["mtp", "kept-1-of-2"])
def test_cached_mtp_equals_the_full_sequence_layer(setup, drafts):
    """``mtp``: the layer's own drafts (rejected: each commit keeps the anchor); ``kept-1-of-2``: host proposals
    (the target's continuation, draft 2 wrong) beside the layer, so each commit keeps two rows and the context write
    takes several rows at once."""
    cfg, params, layer, prompts, want = setup
    proposer = None if drafts == "mtp" else continuation_proposer(cfg, prompts, want, 1)
    eng = Engine(params, cfg, CAP, speculative=Speculative(layer, N, proposer=proposer))
    checked = set()
    for ids in (("p6", "p15", "p29"), ("hit",)):
        _submit(eng, prompts, ids)
        while eng.pending:
            eng.step()
            for rid in ids:
                req = eng.requests.get(rid)
                if req is not None and req.status == "running":
                    _check_draft_state(eng, cfg, params, layer, req, eng.alloc.slot(rid))
                    checked.add((rid, len(req.history)))
        for rid in ids:
            assert eng.result(rid)["output_ids"] == want[rid], rid
    assert eng.result("hit")["cached_tokens"] == 24
    stats = eng.speculative_stats()
    assert len(checked) > 15 and stats["drafts_proposed"] > 0
    assert (stats["drafts_accepted"] > 0) == (drafts != "mtp"), stats


@pytest.mark.parametrize("name", list(SPECULATIVE_TOPOLOGIES))
def test_sharded_mtp_speculative_equals_plain_greedy(setup, name):
    cfg, params, layer, prompts, want = setup
    eng = Engine(params, cfg, CAP, parallel=SPECULATIVE_TOPOLOGIES[name], speculative=Speculative(layer, N))
    ids = ("p6", "p15", "p29")
    _submit(eng, prompts, ids)
    while eng.pending:
        eng.step()
        for rid in ids:                     # the draft context written from the sharded passes' rows
            req = eng.requests.get(rid)
            if req is not None and req.status == "running":
                _check_draft_state(eng, cfg, params, layer, req, eng.alloc.slot(rid))
    assert {rid: eng.result(rid)["output_ids"] for rid in ids} == {rid: want[rid] for rid in ids}


def test_disaggregated_mtp_carries_the_draft_state(setup):
    """PD (prefill KVP 2 → decode KVP = DCP 2, the collective transfer): the prefill role writes the MTP context of
    the prompt, the transfer carries it with the slot state (keys, last streams, fed position) and the bytes moved
    equal the plan's; the decode role's draft state equals the full-sequence layer's after every round and the
    tokens plain greedy's."""
    from v41cp.serving.pd.engines import DisaggregatedEngine

    cfg, params, layer, prompts, want = setup
    kvp2 = SPECULATIVE_TOPOLOGIES["kvp2"]
    pd = DisaggregatedEngine(params, cfg, CAP, kvp2, kvp2, transport="collective", speculative=Speculative(layer, N))
    ids = ("p6", "p15", "p29")
    _submit(pd, prompts, ids)
    while pd.pending:
        pd.step()
        for rid in ids:
            req = pd.decode.requests.get(rid)
            if req is not None and req.status == "running":
                _check_draft_state(pd.decode, cfg, params, layer, req, pd.decode.alloc.slot(rid))
    assert {rid: pd.result(rid)["output_ids"] for rid in ids} == {rid: want[rid] for rid in ids}
    assert len(pd.transfers) == 3 and all(x["bytes"] == x["planned_bytes"] > 0 for x in pd.transfers)


def test_released_mtp_names_load(setup):
    from v41cp.checkpoint.names import drafter_params_from_released, drafter_to_tree

    cfg, _, layer, _, _ = setup
    mapping = drafter_to_tree(cfg)
    keys = sorted({k for src in mapping.values() for k in src.keys})
    assert {"mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.enorm.weight", "mtp.0.hnorm.weight",
            "mtp.0.norm.weight", "mtp.0.hc_head_fn", "mtp.0.attn.wkv.weight", "mtp.0.hc_attn_fn"} <= set(keys)
    assert not any(k.startswith("mtp.0.attn.compressor") or k.startswith("mtp.0.attn.indexer") for k in keys)
    # every leaf of the layer's tree has its released source; tensors of the wrong shape are refused by name
    from v41cp.checkpoint.names import CheckpointError

    rng = np.random.default_rng(0)
    tensors = {}
    flat = {tuple(p.key for p in path): np.asarray(v) for path, v in jax.tree_util.tree_flatten_with_path(layer)[0]}
    for path, src in mapping.items():
        tensors.update({k: rng.standard_normal(1) for k in src.keys})
    assert set(flat) == set(mapping), set(flat) ^ set(mapping)
    with pytest.raises(CheckpointError, match=r"tensor 'mtp\.0\.[\w.]+' has shape \(1,\), which does not fit"):
        drafter_params_from_released(cfg, tensors)


def test_released_layout_mtp_writes_converts_and_loads(setup, tmp_path):
    """Random tensors under the release's names (``mtp.0.*`` included: FP8 ``e_proj`` / ``h_proj`` and attention,
    FP4 routed experts, FP32 ``hc_head_*``), written in the release's formats: the layer's tree decodes from the
    released layout and from its orbax conversion bit for bit (FP32 ``hc_head`` exactly as written), and the
    engine drafts with it."""
    from v41cp.checkpoint import convert, open_drafter
    from v41cp.checkpoint.writer import release_storage, released_shapes, write_released

    cfg, params, _, prompts, _ = setup
    shapes = released_shapes(cfg)
    assert release_storage("mtp.0.e_proj.weight") == "fp8" and release_storage("mtp.0.hc_head_fn") == "fp32"
    assert {"mtp.0.e_proj.weight", "mtp.0.hc_head_scale", "mtp.0.ffn.experts.3.w2.weight"} <= set(shapes)
    rng = np.random.default_rng(0)
    tensors = {k: (rng.integers(0, cfg.n_routed_experts, shape) if k.endswith("tid2eid")
                   else rng.normal(0, 0.05, shape).astype(np.float32)) for k, shape in shapes.items()}
    write_released(tmp_path / "r", cfg, tensors)
    released = open_drafter(tmp_path / "r", cfg)
    convert(tmp_path / "r", tmp_path / "o", dtype="fp32", progress=False, keep_quantized=False)
    converted = open_drafter(tmp_path / "o", cfg)
    flat = lambda t: {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(t)[0]}
    got, want = flat(converted), flat(released)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    # FP8 e_proj decoded within its blocks' quantization step of the random values
    e_proj = np.asarray(released["mtp_0"]["e_proj"])
    np.testing.assert_allclose(e_proj, tensors["mtp.0.e_proj.weight"].T, atol=0.02)
    np.testing.assert_array_equal(released["mtp_0"]["hc_head"]["fn"], tensors["mtp.0.hc_head_fn"])
    eng = Engine(params, cfg, CAP, speculative=Speculative(released, N))
    _submit(eng, prompts, ("p15",))
    while eng.pending:
        eng.step()
    assert eng.speculative_stats()["drafts_proposed"] > 0


def test_bad_mtp_settings_name_the_value(setup):
    cfg, params, layer, _, _ = setup
    for n in (0, 8, 2.0):
        with pytest.raises(ValueError, match=rf"num_draft_tokens must be an integer in \[1, sliding_window - 1=7\], "
                                             rf"got {n}"):
            Engine(params, cfg, CAP, speculative=Speculative(layer, n))
    assert Engine(params, cfg, CAP, speculative=Speculative(layer)).speculative.num_draft_tokens == 1   # as trained
    with pytest.raises(ValueError, match="algorithm 'dspark' does not fit model_type='deepseek_v4': its drafter is "
                                         "'mtp'"):
        Engine(params, cfg, CAP, speculative=Speculative(layer, 2, algorithm="dspark"))
    with pytest.raises(ValueError, match="'mtp' needs the MTP layer.*num_nextn_predict_layers=0"):
        Engine(params, cfg.replace(num_nextn_predict_layers=0), CAP, speculative=Speculative(layer, 2))
