"""Log-probabilities in the OpenAI API's shapes, from the engine's entries (`v41cp.serving.runner.logprobs`).

An entry is ``(logprob, ((id, logprob), …))``: the token's log-probability under the model's distribution (the
log-softmax of its logits) and the request's top alternatives. Token strings are each token's own text through the
checkpoint's tokenizer (special tokens spelled out); without a tokenizer, ``token_id:<id>`` (vLLM's
``return_tokens_as_token_ids`` form).

* `completion_logprobs(ids, entries, token_text, offset)` — ``/v1/completions``: ``{tokens, token_logprobs,
  top_logprobs, text_offset}``; each ``top_logprobs`` dict holds the top alternatives and the chosen token (as vLLM
  does: up to ``logprobs + 1`` keys), ``text_offset`` counts characters from ``offset``; an entry None (an echoed
  prompt's first token) gives ``null`` log-probability and alternatives;
* `chat_logprobs(ids, entries, token_text)` — ``/v1/chat/completions``: ``{content: [{token, logprob, bytes,
  top_logprobs: [{token, logprob, bytes}, …]}]}`` with exactly the requested alternatives.
"""

from __future__ import annotations

from typing import Callable, Sequence

__all__ = ["completion_logprobs", "chat_logprobs", "token_texts"]


def token_texts(codec) -> Callable[[int], str]:
    """``id → text`` of one token: its decoded text (special tokens kept), or ``token_id:<id>`` without ``codec``."""
    if codec is None:
        return lambda t: f"token_id:{int(t)}"
    return lambda t: codec.tokenizer.decode([int(t)], skip_special_tokens=False)


def completion_logprobs(ids: Sequence[int], entries: Sequence, token_text: Callable[[int], str],
                        offset: int = 0) -> dict:
    tokens, chosen, tops, offsets = [], [], [], []
    for t, entry in zip(ids, entries):
        text = token_text(t)
        if entry is None:                       # an echoed prompt's first token: nothing predicts it
            top, lp = None, None
        else:
            lp, alternatives = entry
            top = {token_text(i): float(v) for i, v in alternatives}
            top.setdefault(text, float(lp))
            lp = float(lp)
        tokens.append(text)
        chosen.append(lp)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}


def _item(text: str, lp: float) -> dict:
    return {"token": text, "logprob": float(lp), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(ids: Sequence[int], entries: Sequence, token_text: Callable[[int], str]) -> dict:
    return {"content": [{**_item(token_text(t), lp),
                         "top_logprobs": [_item(token_text(i), v) for i, v in alternatives]}
                        for t, (lp, alternatives) in zip(ids, entries)]}
