"""`Capacity`: the static capacity of an engine — the compile buckets every step's shapes derive from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["Capacity", "DEFAULT_PREFILL_TOKENS"]

# the per-round prefill token budget when none is given (vLLM's max_num_batched_tokens default for chunked prefill
# is of this order): capped by what the engine's batch can hold at once
DEFAULT_PREFILL_TOKENS = 8192


@dataclass(frozen=True)
class Capacity:
    """Static capacity (the compile buckets): batch rows, tokens per request, block size and count, and how prompts
    are prefilled.

    Prefill: by default each round prefills at most ``prefill_tokens`` prompt rows — the requests being prefilled
    continue (oldest first), then new admissions fill the rest — in one span-prefill pass
    (`v41cp.serving.runner.span_prefill`); a prompt longer than the budget is prefilled over several rounds, each
    pass continuing from its cached history, while the running requests keep decoding. The pass's rows are padded
    to one of `prefill_buckets` (a fixed ladder: every program is compiled at warm-up, nothing on the request path).
    ``span_prefill=False`` selects the token-serial prefill (chunks of ``prefill_chunk`` tokens fed one at a time: the
    exactness reference); ``None`` (default) is the span prefill (True: the same).

    Prefix caching (``prefix_caching``, `v41cp.serving.cache.prefix`): a prompt that starts with cached whole blocks
    reuses their pages and the slot state stored at the deepest of them, and prefills only the rest."""

    max_batch: int = 4
    max_tokens: int = 256
    # tokens per cache page; None: the model's (`ModelConfig.page_tokens`: 16 for V4.1, 128 for DeepSeek-V4, a page
    # holding whole entries of every pool), set by `for_model` when an engine is built
    block_tokens: int | None = None
    num_blocks: int | None = None          # default: enough for max_batch full requests
    prefill_chunk: int = 32                # token-serial prefill: tokens per scanned chunk
    ced: bool = False                      # CED narrowing of prefill (exact; off by default)
    span_prefill: bool | None = None       # None / True: span prefill; False: token-serial (the reference)
    prefill_tokens: int | None = None      # span prefill rows per round (default: DEFAULT_PREFILL_TOKENS, capped)
    # the span prefill's row buckets at most (one compiled program each): the largest ``prefill_bucket_count`` of the
    # halving ladder (`prefill_buckets`); None: the whole ladder down to 16 rows. Fewer buckets: a shorter warm-up
    # and fewer programs held, a short pass padded to a larger bucket (1: every pass computes `round_tokens` rows,
    # rounded up to a multiple of 8)
    prefill_bucket_count: int | None = None
    max_waiting: int = 64                  # queued requests beyond this are rejected at submit
    # admission reserves each request's whole output budget (no request is ever preempted, fewer run at once)
    # instead of pages on demand
    reserve_output: bool = False
    # prefix caching (`v41cp.serving.cache.prefix`) and its stored slot states at most
    prefix_caching: bool = True
    prefix_states: int | None = None       # default: 4 per batch slot
    # the most alternatives a request may ask log-probabilities for (vLLM's max_logprobs): the steps compute this many
    # on the device when a request asks (0: no log-probabilities)
    max_logprobs: int = 20

    def __post_init__(self):
        if self.prefix_states is not None and (type(self.prefix_states) is not int or self.prefix_states <= 0):
            raise ValueError(f"capacity prefix_states must be a positive integer or None, got {self.prefix_states!r}")
        if self.prefill_tokens is not None and (type(self.prefill_tokens) is not int or self.prefill_tokens <= 0):
            raise ValueError(f"capacity prefill_tokens must be a positive integer or None, got {self.prefill_tokens!r}")
        if type(self.max_logprobs) is not int or self.max_logprobs < 0:
            raise ValueError(f"capacity max_logprobs must be a non-negative integer, got {self.max_logprobs!r}")
        if self.prefill_bucket_count is not None and (type(self.prefill_bucket_count) is not int
                                                      or self.prefill_bucket_count <= 0):
            raise ValueError("capacity prefill_bucket_count must be a positive integer or None, got "
                             f"{self.prefill_bucket_count!r}")
        if self.span_prefill not in (None, True, False):
            raise ValueError(f"capacity span_prefill must be True, False or None, got {self.span_prefill!r}")
        for name in ("max_batch", "max_tokens", "block_tokens", "prefill_chunk"):
            v = getattr(self, name)
            if (type(v) is not int or v <= 0) and not (name == "block_tokens" and v is None):
                raise ValueError(f"capacity {name} must be a positive integer, got {v!r}")

    def for_model(self, cfg) -> "Capacity":
        """This capacity with its page resolved for ``cfg`` (`ModelConfig`): ``block_tokens`` None → the model's
        page, `ModelConfig.page_tokens`."""
        return self if self.block_tokens is not None else dataclasses.replace(self, block_tokens=cfg.page_tokens)

    @property
    def max_blocks(self) -> int:
        if self.block_tokens is None:
            raise ValueError("capacity block_tokens is the model's page until resolved: use Capacity.for_model(cfg)")
        return -(-self.max_tokens // self.block_tokens)

    @property
    def blocks(self) -> int:
        return self.num_blocks or self.max_batch * self.max_blocks

    @property
    def by_span(self) -> bool:
        """Whether admissions prefill by span-prefill passes (else token-serial; QCP layouts always span)."""
        return self.span_prefill is not False

    @property
    def round_tokens(self) -> int:
        """Prompt rows one prefill round takes at most: ``prefill_tokens``, by default `DEFAULT_PREFILL_TOKENS`
        capped at what the batch holds (``max_batch · max_tokens``)."""
        return self.prefill_tokens or min(DEFAULT_PREFILL_TOKENS, self.max_batch * self.max_tokens)

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        """The span prefill's row buckets, ascending: `round_tokens` and its halves, quarters, … down to 16 rows
        (multiples of 8) — a pass of ``T`` rows computes the smallest bucket ≥ ``T``, less than 2× ``T`` (but the
        smallest bucket); ⌈log2(round_tokens / 16)⌉ + 1 programs in all (8192 rows: 10), or the largest
        ``prefill_bucket_count`` of them."""
        out, r = [], -(-self.round_tokens // 8) * 8
        while True:
            out.append(r)
            nxt = -(-(r // 2) // 8) * 8
            if r <= 16 or nxt < 16 or nxt >= r or len(out) == self.prefill_bucket_count:
                break
            r = nxt
        return tuple(sorted(out))

    def block_count(self, kv_parallel_size: int = 1) -> int:
        """Virtual cache blocks of an engine under KVP ``kv_parallel_size``: every rank holds num_blocks / N pages,
        so the count rounds up to whole ranks."""
        n = kv_parallel_size
        if self.num_blocks:
            return -(-self.blocks // n) * n
        return n * self.max_batch * -(-self.max_blocks // n)
