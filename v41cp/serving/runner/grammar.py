"""Structured output: a request's grammar as a token mask, computed on the host and applied inside the jitted steps.

The grammar library is **llguidance** (Microsoft's low-level guidance parser: a Rust core behind an ABI3 wheel with no
Python dependencies; JSON schemas, regular expressions and Lark grammars; a token mask in tens of microseconds). The
alternatives were xgrammar (needs torch at install) and outlines-core (regex and JSON schema only).

* `SamplingParams.grammar` carries an llguidance grammar (the JSON text `llguidance.LLMatcher.grammar_from_*`
  returns; the server builds it from ``response_format`` / ``structured_outputs``: `v41cp.serving.api.structured`).
* `Grammars` (one per engine, from the checkpoint's ``tokenizer.json``; the llguidance tokenizer is built on first
  use) checks a grammar at submit (`check`), keeps one matcher per request (on `Request.matcher`, rebuilt from the
  grammar and the request's outputs wherever it is missing — an engine that adopts a request, a restart — so the
  state is always a function of the outputs), writes each step's masks (`masks`: ``[batch, ⌈V/32⌉]`` int32 bits,
  all set for rows without a grammar) and advances the matchers by the tokens a step emitted (`advance`: a request
  whose grammar is complete is done, finish reason ``stop``).
* The step applies the mask (`v41cp.serving.runner.sampling.adjusted_logits`): disallowed ids at −inf, before the
  bias, penalties and filters, greedy included, each device on its vocabulary slice; a batch without grammar rows
  skips it (`lax.cond`).

Speculative decoding: the drafts come to the host before verification, so `draft_masks` gives each verification
row the mask that follows the drafts before it (walked on a copy of the matcher); a grammar row
verifies only the drafts its grammar accepts, and rejection against the masked target keeps the output the
grammar's and the target's.
"""

from __future__ import annotations

from pathlib import Path

import llguidance
import llguidance.numpy as lln
import numpy as np

__all__ = ["Grammars", "GrammarError", "mask_words", "no_masks"]


class GrammarError(ValueError):
    """A grammar this engine cannot use (invalid, or a tokenizer llguidance cannot read)."""


def mask_words(vocab: int) -> int:
    """32-bit words of a token mask over ``vocab`` ids."""
    return -(-vocab // 32)


class Grammars:
    """llguidance matchers for one engine's requests (see the module docstring). ``tokenizer_json``: the path of the
    checkpoint's ``tokenizer.json``; ``vocab``: the model's vocabulary size (≥ the tokenizer's); ``eos``: its EOS
    id."""

    def __init__(self, tokenizer_json: str | Path, vocab: int, eos: int):
        self.path, self.vocab, self.eos = Path(tokenizer_json), vocab, eos
        self.words = mask_words(vocab)
        self._tok = None

    @property
    def tokenizer(self):
        if self._tok is None:
            try:
                self._tok = llguidance.LLTokenizer(self.path.read_text(), n_vocab=self.vocab, eos_token=self.eos)
            except (ValueError, OSError) as e:
                raise GrammarError(f"structured output is not supported with the tokenizer {str(self.path)!r} "
                                   f"(llguidance cannot read it: {e})") from e
        return self._tok

    def check(self, grammar: str) -> None:
        """Raise `GrammarError` with llguidance's message unless ``grammar`` is valid for this tokenizer."""
        if not isinstance(grammar, str):
            raise GrammarError(f"a grammar is llguidance's JSON text, got {type(grammar).__name__}")
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:                                   # llguidance's message, on one line (its source excerpt dropped)
            lines = [ln.strip() for ln in error.splitlines() if ln.strip() and not ln.strip().startswith(("^", "|"))]
            raise GrammarError(" ".join(ln for ln in lines if not ln[:1].isdigit())[:500] or error)

    def matcher(self, req):
        """``req``'s matcher, advanced over all its outputs (built when missing). A matcher that fails at run time
        (a token it refuses, a parser limit) is left in its error state, where it allows only the EOS; the request
        records the error (`Request.grammar_error`) and `advance` ends it — it never stops the engine."""
        if getattr(req, "matcher", None) is None:
            req.matcher, req.matched = llguidance.LLMatcher(self.tokenizer, req.sampling.grammar, log_level=0), 0
        while req.matched < len(req.output) and not req.matcher.is_error():
            if not req.matcher.consume_token(req.output[req.matched]):
                req.grammar_error = (f"output token {req.output[req.matched]} does not match the grammar: "
                                     f"{req.matcher.get_error().splitlines()[0] if req.matcher.get_error() else ''}")
            req.matched += 1
        return req.matcher

    def masks(self, reqs, batch: int, rows=None) -> np.ndarray:
        """``[batch, words]`` int32: request ``reqs[i]``'s allowed next ids in row ``rows[i]`` (default ``i``); every
        bit set elsewhere."""
        out = np.full((batch, self.words), -1, np.int32)
        for i, req in enumerate(reqs):
            if req.sampling.grammar is not None:
                lln.fill_next_token_bitmask(self.matcher(req), out, i if rows is None else rows[i])
        return out

    def draft_masks(self, reqs, drafts: np.ndarray, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """The masks of a speculative round: ``(masks [batch, n + 1, words], valid [len(reqs)])`` for ``drafts
        [len(reqs), n]`` — row ``j`` of request ``i`` what its grammar allows after its drafts ``0 … j−1`` (every
        bit set for rows without a grammar and past ``valid[i]``), ``valid[i]`` how many of its leading drafts the
        grammar accepts (``n`` without a grammar). The drafts are walked on a copy of the matcher
        (`LLMatcher.deep_copy`), so the request's own matcher stays that of its outputs whatever the drafts are —
        an EOS, a draft after the grammar's end, one the copy refuses."""
        n = drafts.shape[1]
        out = np.full((batch, n + 1, self.words), -1, np.int32)
        flat = out.reshape(batch * (n + 1), self.words)
        valid = np.full(len(reqs), n, np.int64)
        for i, req in enumerate(reqs):
            if req.sampling.grammar is None:
                continue
            m = self.matcher(req)
            if m.is_error():                     # (it allows only the EOS; `advance` ends the request)
                valid[i] = 0
                lln.fill_next_token_bitmask(m, flat, i * (n + 1))
                continue
            walk = m.deep_copy()
            valid[i] = 0
            for j in range(n + 1):
                lln.fill_next_token_bitmask(walk, flat, i * (n + 1) + j)
                if j == n or not walk.consume_token(int(drafts[i, j])) or walk.is_error():
                    break
                valid[i] = j + 1
        return out, valid

    def advance(self, req) -> bool:
        """Consume ``req``'s new outputs; True when its grammar is complete (nothing but the end may follow) or
        failed (`Request.grammar_error`)."""
        if req.sampling.grammar is None:
            return False
        m = self.matcher(req)
        if m.is_error() and req.grammar_error is None:
            req.grammar_error = m.get_error().splitlines()[0] if m.get_error() else "the grammar failed"
        return m.is_stopped() or m.is_error()


def no_masks(batch: int, vocab: int) -> np.ndarray:
    """The masks of a batch without grammar rows (every id allowed)."""
    return np.full((batch, mask_words(vocab)), -1, np.int32)
