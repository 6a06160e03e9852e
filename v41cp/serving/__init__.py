"""Serving: paged V4.1 caches, prefill, the static-capacity jitted decode step, the engine and the HTTP API.

* `cache_spec` / `allocator` / `records` / `paged_cache` — the decode-state layout (exact byte accounting), block
  tables and batch slots, the release's cache byte records, the cache's reads and writes;
* `paged_rows` — the cached-rows backend the one model (`v41cp.model.Transformer`) reads its keys through;
  `decode` (the decode step, multi-row verification + commit, token-serial prefill chunks), `dcp` (KVP pages,
  DCP selection and attention), `kernel_ops`; `span_metadata` / `span_prefill` (one-pass prefill, model-wide /
  operator-local QCP);
* `engine` — `Engine`, `Capacity`, `SamplingParams`: continuous batching over the compiled buckets;
* `text` — the checkpoint's tokenizer and chat format, streaming detokenization with stop strings;
* `engine_loop` — one engine thread serving many asyncio callers; `openai_protocol` (request bodies and the
  field policy) / `openai_api` / `server` — the OpenAI-compatible HTTP server (``python -m v41cp serve``).
"""

from v41cp.serving.allocator import AllocationError, BlockAllocator
from v41cp.serving.cache_spec import CacheGroup, CacheSpec

__all__ = ["AllocationError", "BlockAllocator", "CacheGroup", "CacheSpec"]
