"""Host-side sampling of a token from FP32 logits: greedy, or temperature / top-p seeded per output index.

The draw of output token ``i`` of a request with seed ``s`` uses ``default_rng([s, i])``, so a request's tokens
depend only on its own logits and seed (deterministic across batch compositions, restarts and speculative rounds).
"""

from __future__ import annotations

import numpy as np

from v41cp.serving.scheduler.request import SamplingParams

__all__ = ["sample_token", "token_distribution"]


def _support(logits: np.ndarray, sp: SamplingParams):
    """Temperature / top-p sampling's support and probabilities ``(ids, q)`` (descending), or None for greedy
    (temperature 0, or so small that logits / T overflows: the greedy limit)."""
    if sp.temperature <= 0:
        return None
    z = logits.astype(np.float64) / sp.temperature
    if not np.isfinite(z).all():
        return None
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    cum = np.cumsum(p[order])
    keep = order[: max(1, int(np.searchsorted(cum, sp.top_p) + 1))]
    return keep, p[keep] / p[keep].sum()


def sample_token(logits: np.ndarray, sp: SamplingParams, index: int) -> int:
    """Greedy (temperature 0) or temperature / top-p sampling of one token, seeded by (seed, index)."""
    support = _support(logits, sp)
    if support is None:
        return int(np.argmax(logits))
    keep, q = support
    return int(keep[np.random.default_rng([sp.seed, index]).choice(len(keep), p=q)])


def token_distribution(logits: np.ndarray, sp: SamplingParams) -> np.ndarray | None:
    """The distribution `sample_token` draws from, as probabilities over the vocabulary (float64); None for
    greedy (speculative acceptance then compares with the argmax)."""
    support = _support(logits, sp)
    if support is None:
        return None
    p = np.zeros(logits.shape[-1])
    p[support[0]] = support[1]
    return p
