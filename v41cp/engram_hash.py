"""Engram n-gram hashing on the host, integer-exact (docs/architecture.md).

Hashing is host-side planning (like serving metadata): it needs 64-bit integer products, which
jitted JAX code only has under the global ``jax_enable_x64`` flag. The result, row ids
``[B, S, engram_layers, hash_heads]`` (int32; every id is below the table size), is an input of
the jitted forward.

* `compressed_token_map` builds the token id → compressed id map from a ``tokenizers`` tokenizer
  with the release's normalisation; `ModelConfig.engram_token_map` carries it.
* `engram_tables` derives the per-layer primes, row offsets and odd multipliers.
* `engram_hash_ids` hashes token ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import tokenizers
from tokenizers import Regex, normalizers

from v41cp.config import ConfigError, ModelConfig

__all__ = ["compressed_token_map", "EngramTables", "engram_tables", "engram_hash_ids"]


def compressed_token_map(tokenizer) -> tuple[tuple[int, ...], int]:
    """Map every token id to a compressed id (first-seen order) by normalised decoded text.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` (or a path to a ``tokenizer.json``). Each id is
    decoded alone and normalised NFKC → NFD → StripAccents → Lowercase → whitespace runs to one
    space → a lone space kept → Strip; ids whose decoding contains U+FFFD are keyed by their raw
    token string; an empty normalisation keeps the decoded text. Returns ``(map, compressed_vocab)``.
    """
    if isinstance(tokenizer, (str, bytes)) or hasattr(tokenizer, "__fspath__"):
        tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer))
    sentinel = "\ue000"
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])
    key_to_id: dict[str, int] = {}
    out = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = norm.normalize_str(text) or text
        out.append(key_to_id.setdefault(key, len(key_to_id)))
    return tuple(out), len(key_to_id)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


@dataclass(frozen=True)
class EngramTables:
    """Per Engram layer: primes / offsets ``[L, hash_heads]`` and multipliers ``[L, max_ngram]`` (int64)."""

    primes: np.ndarray
    offsets: np.ndarray
    multipliers: np.ndarray


def engram_tables(cfg: ModelConfig) -> EngramTables:
    """Primes (successive primes above ``engram_vocab_size − 1``, never reused), offsets, multipliers."""
    seen: set[int] = set()
    primes, offsets, mults = [], [], []
    vc = cfg.engram_compressed_vocab_size
    bound = max(1, (np.iinfo(np.int64).max // vc) // 2)
    for layer_id, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings):
        layer_primes = []
        for _ in range(cfg.engram_max_ngram_size - 1):
            current = cfg.engram_vocab_size - 1
            for _ in range(cfg.engram_n_heads):
                current += 1
                while not _is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                layer_primes.append(current)
        if sum(layer_primes) > rows:
            raise ConfigError(f"engram layer {layer_id} needs {sum(layer_primes)} table rows but "
                              f"engram_num_embeddings gives {rows}")
        primes.append(layer_primes)
        offsets.append(np.cumsum([0, *layer_primes[:-1]]))
        rng = np.random.default_rng(10007 * layer_id)
        mults.append(rng.integers(0, bound, size=(cfg.engram_max_ngram_size,), dtype=np.int64) * 2 + 1)
    return EngramTables(np.asarray(primes, np.int64), np.asarray(offsets, np.int64), np.asarray(mults, np.int64))


def engram_hash_ids(cfg: ModelConfig, tokens: np.ndarray, token_mask: np.ndarray | None = None,
                    tables: EngramTables | None = None) -> np.ndarray:
    """Row ids ``[B, S, engram_layers, hash_heads]`` (int32) for token ids ``[B, S]``.

    Look-back crossing the sequence start or a masked (image / padding) token is replaced by the
    compressed pad id, stickily for all longer n-grams. Raises `ValueError` naming a token id
    outside the vocabulary.
    """
    if cfg.engram_token_map is None:
        raise ConfigError("engram_token_map is not set: load it from the checkpoint's tokenizer "
                          "(v41cp.engram_hash.compressed_token_map) before running Engram layers")
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be an integer array [batch, seq], got {tokens.dtype} {tokens.shape}")
    bad = cfg.out_of_vocabulary(tokens)
    if bad:
        raise ValueError(bad)
    tables = tables or engram_tables(cfg)
    token_map = np.asarray(cfg.engram_token_map, np.int64)
    pad = token_map[cfg.engram_pad_token_id]
    compressed = token_map[tokens]
    if token_mask is not None:
        compressed = np.where(token_mask, compressed, -1)
    b, s = tokens.shape
    pos = np.arange(s)
    blocked = np.zeros((b, s), bool)
    shifted = []
    for shift in range(cfg.engram_max_ngram_size):
        src = pos - shift
        source = compressed[:, np.maximum(src, 0)]
        blocked = blocked | (src < 0)[None, :] | (source == -1)
        shifted.append(np.where(blocked, pad, source))
    toks = np.stack(shifted, axis=-1)                                    # [B, S, N]
    products = toks[:, :, None, :] * tables.multipliers[None, None]      # [B, S, L, N]
    rolling = products[..., 0]
    heads = []
    n_heads = cfg.engram_n_heads
    for shift in range(1, cfg.engram_max_ngram_size):
        rolling = np.bitwise_xor(rolling, products[..., shift])
        p = tables.primes[:, (shift - 1) * n_heads: shift * n_heads]      # [L, heads]
        heads.append(rolling[..., None] % p)
    ids = np.concatenate(heads, axis=-1) + tables.offsets
    return ids.astype(np.int32)
