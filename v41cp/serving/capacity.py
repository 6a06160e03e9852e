"""`Capacity`: the static capacity of an engine — the compile bucket every step's shapes derive from."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Capacity"]


@dataclass(frozen=True)
class Capacity:
    """Static capacity (the compile bucket): batch rows, tokens per request, block size and count."""

    max_batch: int = 4
    max_tokens: int = 256
    block_tokens: int = 16
    num_blocks: int | None = None          # default: enough for max_batch full requests
    prefill_chunk: int = 32
    ced: bool = False                      # CED narrowing of prefill (exact; off by default)
    # prefill admissions in one pass per round (`v41cp.serving.runner.span_prefill`) instead of token-serial chunks;
    # always on under model-wide QCP
    span_prefill: bool = False
    span_chunk: int | None = None          # span prefill rows per request per pass (None: the whole prompt)
    max_waiting: int = 64                  # queued requests beyond this are rejected at submit
    # exact prefix caching (token-serial prefill; `v41cp.serving.cache.prefix`) and its stored slot states at most
    prefix_caching: bool = False
    prefix_states: int | None = None       # default: 4 per batch slot

    def __post_init__(self):
        if self.prefix_states is not None and (type(self.prefix_states) is not int or self.prefix_states <= 0):
            raise ValueError(f"capacity prefix_states must be a positive integer or None, got {self.prefix_states!r}")
        if self.span_chunk is not None and (type(self.span_chunk) is not int or self.span_chunk <= 0):
            raise ValueError(f"capacity span_chunk must be a positive integer or None, got {self.span_chunk!r}")
        for name in ("max_batch", "max_tokens", "block_tokens", "prefill_chunk"):
            v = getattr(self, name)
            if type(v) is not int or v <= 0:
                raise ValueError(f"capacity {name} must be a positive integer, got {v!r}")

    @property
    def max_blocks(self) -> int:
        return -(-self.max_tokens // self.block_tokens)

    @property
    def blocks(self) -> int:
        return self.num_blocks or self.max_batch * self.max_blocks

    def block_count(self, kv_parallel_size: int = 1) -> int:
        """Virtual cache blocks of an engine under KVP ``kv_parallel_size``: every rank holds num_blocks / N pages,
        so the count rounds up to whole ranks."""
        n = kv_parallel_size
        if self.num_blocks:
            return -(-self.blocks // n) * n
        return n * self.max_batch * -(-self.max_blocks // n)
