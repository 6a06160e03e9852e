"""One request: its sampling parameters, its state machine, and every check it passes at submit.

A `Request` is ``waiting`` (queued) → ``running`` (admitted: a batch slot and pages) → ``done`` (EOS or its output
budget) or ``cancelled``; a running request may be preempted back to ``waiting`` (keeping its outputs). `check_request` holds the submit-time checks of a request against a model and a capacity;
an error names the offending input (`RequestError.field`) and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from v41cp.config import ModelConfig
from v41cp.serving.capacity import Capacity

__all__ = ["RequestError", "EngineFull", "SamplingParams", "Request", "check_request", "STATUSES", "MAX_LOGIT_BIAS",
           "MAX_STOP_IDS"]

STATUSES = ("waiting", "running", "done", "cancelled")
MAX_LOGIT_BIAS = 300        # logit_bias entries per request (the OpenAI API's bound): a static width of the steps
MAX_STOP_IDS = 16           # stop_token_ids held back by min_tokens (with the EOS): a static width of the steps


class RequestError(ValueError):
    """A request is rejected at submit; ``field`` names the offending input (``prompt``, ``max_new_tokens``,
    ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop_token_ids``, ``logit_bias``, ``min_tokens``,
    the penalties, ``request_id`` …). Nothing else
    changes."""

    def __init__(self, message: str, field: str, detail: str | None = None):
        super().__init__(message)
        self.field = field
        self.detail = message if detail is None else detail      # the message without the request's id

    @classmethod
    def of(cls, rid, detail: str, field: str) -> RequestError:
        """``request <rid>: <detail>``, naming ``field``."""
        return cls(f"request {rid!r}: {detail}", field, detail)


class EngineFull(RequestError):
    """The waiting queue holds ``Capacity.max_waiting`` requests already (retry later)."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0                      # 0: off
    min_p: float = 0.0                  # 0: off
    seed: int = 0
    stop_on_eos: bool = True
    stop_token_ids: tuple[int, ...] = ()   # the request ends after any of these (finish reason "stop")
    logprobs: int | None = None         # each output token's log-probability and this many alternatives (None: off)
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (None: off)
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit) pairs, before sampling
    min_tokens: int = 0                 # EOS and stop_token_ids are not sampled before this many outputs
    # penalties (`v41cp.serving.runner.penalties`): once / per occurrence among the outputs; repetition: the logits
    # of ids in the prompt or outputs divided (positive) or multiplied (otherwise) by it
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # structured output: an llguidance grammar (JSON text; `v41cp.serving.runner.grammar`) the output must match
    grammar: str | None = None

    @property
    def penalized(self) -> bool:
        """A penalty that changes something (the host's view of `v41cp.serving.runner.penalties.penalized`)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def __post_init__(self):           # (lists from JSON, e.g. the control plane's broadcast, become tuples)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple((t, v) for t, v in self.logit_bias))


@dataclass
class Request:
    """A request's host state (the scheduler's record; the runner appends its tokens)."""

    rid: object
    prompt: list[int]
    sampling: SamplingParams
    output: list[int] = field(default_factory=list)
    status: str = "waiting"                # one of STATUSES
    finish_reason: str | None = None
    last_logits: np.ndarray | None = None  # FP32 logits that produced the latest output token
    # with sampling.logprobs: one (logprob, ((id, logprob), …)) per output token (`v41cp.serving.runner.logprobs`)
    logprobs: list | None = None
    # with sampling.prompt_logprobs: None for the first prompt token, then one entry per prompt token (as prefilled)
    prompt_logprobs: list | None = None

    def __post_init__(self):
        if self.sampling.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def scoring_prompt(self) -> bool:
        """It asks for prompt log-probabilities and has not had all of them yet (its prefill computes every row)."""
        return self.sampling.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt)
    spec: dict = field(default_factory=lambda: {"steps": 0, "proposed": 0, "accepted": 0, "emitted": 0})
    cached: int = 0                        # prompt tokens reused from the prefix cache (not prefilled)
    matcher: object = field(default=None, repr=False)   # with sampling.grammar: its llguidance matcher (host)
    matched: int = 0                       # outputs the matcher has consumed
    grammar_done: bool = False             # its grammar is complete: it ends (finish reason "stop")
    grammar_error: str | None = None       # its grammar failed at run time (it ends; the result says why)
    prefix_nodes: list = field(default_factory=list)   # prefix-cache nodes this request holds
    cuts: tuple = ()                       # prompt positions where its prefill stores a slot state
    preemptions: int = 0                   # times its pages were taken back (it was recomputed after each)
    filled: int = 0                        # tokens of its history in the cache while it is being prefilled
    prefill_to: int = 0                    # the history length its current prefill reaches (set at admission)

    def emit(self, token: int, logprob=None) -> None:
        """Append an output token, with its log-probability entry when the request asks for them."""
        self.output.append(int(token))
        if self.sampling.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.append(logprob)

    @property
    def history(self) -> list[int]:
        return self.prompt + self.output

    @property
    def prefilling(self) -> bool:
        """Running, with rows of its prefill still to go (a long prompt spans several rounds)."""
        return self.status == "running" and self.filled < self.prefill_to

    @property
    def active(self) -> bool:
        return self.status in ("waiting", "running")


def check_request(rid, prompt: list[int], sampling: SamplingParams, cfg: ModelConfig, capacity: Capacity) -> int:
    """Every check of a request that depends on the model and the capacity alone; returns the tokens that enter
    the cache (prompt + outputs − 1). Raises `RequestError` naming the offending field."""
    if not prompt:
        raise RequestError.of(rid, "the prompt is empty", "prompt")
    bad = cfg.out_of_vocabulary(prompt)
    if bad:
        raise RequestError.of(rid, bad, "prompt")
    if type(sampling.max_new_tokens) is not int or sampling.max_new_tokens <= 0:
        raise RequestError.of(rid, f"max_new_tokens must be a positive integer, got {sampling.max_new_tokens!r}",
                              "max_new_tokens")
    if not sampling.temperature >= 0:
        raise RequestError.of(rid, f"temperature must be >= 0, got {sampling.temperature!r}", "temperature")
    if not 0 < sampling.top_p <= 1:
        raise RequestError.of(rid, f"top_p must be in (0, 1], got {sampling.top_p!r}", "top_p")
    if type(sampling.top_k) is not int or sampling.top_k < 0:
        raise RequestError.of(rid, f"top_k must be a non-negative integer (0: off), got {sampling.top_k!r}", "top_k")
    if not 0 <= sampling.min_p < 1:
        raise RequestError.of(rid, f"min_p must be in [0, 1), got {sampling.min_p!r}", "min_p")
    if type(sampling.seed) is not int or not 0 <= sampling.seed < 2**63:
        raise RequestError.of(rid, f"seed must be an integer in [0, 2**63), got {sampling.seed!r}", "seed")
    if sampling.grammar is not None and not isinstance(sampling.grammar, str):
        raise RequestError.of(rid, f"grammar must be llguidance's grammar text, got {type(sampling.grammar).__name__}",
                              "response_format")
    if any(type(t) is not int for t in sampling.stop_token_ids):
        raise RequestError.of(rid, f"stop_token_ids must be integers, got {list(sampling.stop_token_ids)!r}",
                              "stop_token_ids")
    bad = cfg.out_of_vocabulary(list(sampling.stop_token_ids))
    if bad:
        raise RequestError.of(rid, bad, "stop_token_ids")
    bias = sampling.logit_bias
    if len(bias) > MAX_LOGIT_BIAS or any(type(t) is not int or type(v) not in (int, float) or not -100 <= v <= 100
                                         for t, v in bias):
        raise RequestError.of(rid, f"logit_bias must be at most {MAX_LOGIT_BIAS} (token id, value in [-100, 100]) "
                                   "pairs", "logit_bias")
    bad = cfg.out_of_vocabulary([t for t, _ in bias])
    if bad:
        raise RequestError.of(rid, bad, "logit_bias")
    if type(sampling.min_tokens) is not int or not 0 <= sampling.min_tokens <= sampling.max_new_tokens:
        raise RequestError.of(rid, f"min_tokens must be an integer in [0, max_new_tokens={sampling.max_new_tokens}], "
                                   f"got {sampling.min_tokens!r}", "min_tokens")
    if sampling.min_tokens and len(sampling.stop_token_ids) > MAX_STOP_IDS:
        raise RequestError.of(rid, f"min_tokens holds back at most {MAX_STOP_IDS} stop_token_ids, got "
                                   f"{len(sampling.stop_token_ids)}", "min_tokens")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(sampling, name)
        if type(v) not in (int, float) or not -2 <= v <= 2:
            raise RequestError.of(rid, f"{name} must be a number in [-2, 2], got {v!r}", name)
    v = sampling.repetition_penalty
    if type(v) not in (int, float) or not 0 < v < float("inf"):
        raise RequestError.of(rid, f"repetition_penalty must be a finite number > 0, got {v!r}", "repetition_penalty")
    for name in ("logprobs", "prompt_logprobs"):
        lp = getattr(sampling, name)
        if lp is not None and capacity.max_logprobs == 0:
            raise RequestError.of(rid, f"{name}: this engine computes no log-probabilities (max_logprobs=0)", name)
        if lp is not None and (type(lp) is not int or not 0 <= lp <= capacity.max_logprobs):
            raise RequestError.of(rid, f"{name} must be an integer in [0, {capacity.max_logprobs}] (the engine's "
                                       f"max_logprobs), got {lp!r}", name)
    total = len(prompt) + sampling.max_new_tokens
    if total > capacity.max_tokens:
        field = "prompt" if len(prompt) >= capacity.max_tokens else "max_new_tokens"
        detail = (f"the prompt has {len(prompt)} tokens; the capacity is {capacity.max_tokens} tokens per request "
                  "(prompt + output)" if field == "prompt" else
                  f"prompt ({len(prompt)}) + output ({sampling.max_new_tokens}) = {total} tokens is beyond the "
                  f"capacity of {capacity.max_tokens} per request")
        raise RequestError.of(rid, detail, field)
    return max(total - 1, 1)
