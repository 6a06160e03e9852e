"""A released-layout checkpoint's model speaking another tokenizer's vocabulary — how the test suite gets a tiny
model with the DeepSeek-V4 release's own tokenizer (129,280 ids) without committing 33 MB of embeddings.

`with_vocabulary(src, dst, tokenizer_dir)` writes ``dst`` in the released layout and formats
(`v41cp.checkpoint.write_released`): every tensor of ``src`` as it is, except the vocabulary-sized ones — the
embedding and the head (``embed.weight``, ``head.weight``) and the DSpark Markov heads
(``mtp.<i>.markov_head.{embed,head}.weight``) — whose rows are those of ``src`` followed by seeded normal rows of
the same standard deviation, and DeepSeek-V4's hash-routing tables (``layers.<i>.ffn.gate.tid2eid [vocab, k]``) —
whose new rows are seeded draws of ``k`` distinct experts; ``config.json`` with ``vocab_size`` the tokenizer's, (V4.1)
its Engram compressed vocabulary (computed from the new ``tokenizer.json``,
`v41cp.engram_hash.compressed_token_map`) and a DSpark noise id moved to the tokenizer's (``dspark_noise_token_id``);
the tokenizer's ``tokenizer.json`` and ``tokenizer_config.json``. The model is untrained either way; what changes is that text, chat formats and grammars
see a real vocabulary.

    python -m v41cp.checkpoint.with_vocabulary SRC DST TOKENIZER_DIR [--noise-token-id ID]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from v41cp.checkpoint.released import ReleasedCheckpoint
from v41cp.checkpoint.writer import write_released
from v41cp.engram_hash import compressed_token_map

__all__ = ["with_vocabulary", "VOCAB_TENSORS"]

# the tensors whose first axis is the vocabulary (released names): rows of weights, and V4's hash-routing tables
VOCAB_TENSORS = re.compile(r"^(embed|head|mtp\.\d+\.markov_head\.(embed|head))\.weight$")
HASH_TABLES = re.compile(r"^layers\.\d+\.ffn\.gate\.tid2eid$")


def with_vocabulary(src: str | os.PathLike, dst: str | os.PathLike, tokenizer_dir: str | os.PathLike,
                    noise_token_id: int | None = None, seed: int = 0, max_shard_bytes: int = 64 * 2**20) -> dict:
    """Write ``src``'s model with ``tokenizer_dir``'s vocabulary to ``dst`` (see the module docstring). The
    vocabulary must not be smaller than ``src``'s. ``noise_token_id``: the DSpark noise id (default: kept when
    inside the new vocabulary; V4.1 only). Returns `write_released`'s summary with ``vocab_size`` and
    ``engram_compressed_vocab_size`` (None for DeepSeek-V4: no Engram)."""
    tokenizer_dir, dst = Path(tokenizer_dir), Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"{str(dst)!r} is not empty: choose a new directory")
    tok_file = tokenizer_dir / "tokenizer.json"
    tok = Tokenizer.from_file(str(tok_file))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    ckpt = ReleasedCheckpoint(src)
    cfg = ckpt.cfg
    config = tokenizer_dir / "tokenizer_config.json"
    specials = json.loads(config.read_text()) if config.exists() else {}
    for name, want in (("bos_token", cfg.bos_token_id), ("eos_token", cfg.eos_token_id)):
        text = specials.get(name)
        text = text.get("content") if isinstance(text, dict) else text
        if isinstance(text, str) and tok.token_to_id(text) != want:
            raise ValueError(f"the tokenizer's {name} {text!r} is id {tok.token_to_id(text)}, the model's is {want}")
    if vocab < cfg.vocab_size:
        raise ValueError(f"{str(tok_file)!r} has {vocab} ids, fewer than the model's vocab_size={cfg.vocab_size}")
    if cfg.is_v4:                       # no Engram, no DSpark: the vocabulary and the hash tables only
        if noise_token_id is not None:
            raise ValueError("noise_token_id: a DeepSeek-V4 checkpoint has no DSpark noise id")
        new, compressed = cfg.replace(vocab_size=vocab), None
    else:
        _, compressed = compressed_token_map(tok_file)
        noise = cfg.dspark_noise_token_id if noise_token_id is None else noise_token_id
        if not 0 <= noise < vocab:
            raise ValueError(f"noise_token_id={noise} is outside the vocabulary [0, {vocab})")
        new = cfg.replace(vocab_size=vocab, engram_compressed_vocab_size=compressed, dspark_noise_token_id=noise,
                          engram_token_map=None)
    rng = np.random.default_rng(seed)

    def tensors():
        for key in sorted(k for k in ckpt.files if not k.endswith(".scale")):
            a = ckpt.read(key)
            if VOCAB_TENSORS.match(key):
                extra = rng.normal(0.0, float(np.asarray(a, np.float32).std()), (vocab - a.shape[0], *a.shape[1:]))
                a = np.concatenate([np.asarray(a, np.float32), extra.astype(np.float32)])
            elif HASH_TABLES.match(key):         # each new token: k distinct experts, seeded
                draws = rng.random((vocab - a.shape[0], cfg.n_routed_experts)).argsort(axis=1)[:, :a.shape[1]]
                a = np.concatenate([np.asarray(a), draws.astype(a.dtype)])
            yield key, a

    info = write_released(dst, new, tensors(), tokenizer=tok_file, max_shard_bytes=max_shard_bytes)
    if (tokenizer_dir / "tokenizer_config.json").exists():
        shutil.copy2(tokenizer_dir / "tokenizer_config.json", dst / "tokenizer_config.json")
    return {**info, "vocab_size": vocab, "engram_compressed_vocab_size": compressed}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m v41cp.checkpoint.with_vocabulary", description=__doc__.split("\n")[0])
    p.add_argument("src", help="a released-layout checkpoint directory")
    p.add_argument("dst", help="the directory to write (new or empty)")
    p.add_argument("tokenizer_dir", help="a directory with tokenizer.json (and tokenizer_config.json)")
    p.add_argument("--noise-token-id", type=int, default=None, help="the DSpark noise id in the new vocabulary")
    a = p.parse_args(argv)
    print(json.dumps(with_vocabulary(a.src, a.dst, a.tokenizer_dir, a.noise_token_id), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
