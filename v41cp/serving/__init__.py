"""Serving: the engine and its rooms.

* `engine` — `Engine`, `Capacity`, `SamplingParams`: continuous batching over the compiled steps;
* `step_batch` — `StepBatch`: the one metadata record of every cached step (decode, verify, prefill passes);
* `cache` — the paged device cache, the page allocator, slot and request states, prefix caching;
* `attention` — the backends the one model reads its keys through (paged rows, KVP / DCP, model-wide QCP);
* `runner` — the jitted steps (decode, verify, prefill), their metadata, speculative decoding;
* `api` — the OpenAI-compatible HTTP server, the engine loop, the tokenizer and chat format;
* `pd` — prefill / decode disaggregation; `multihost` — one engine across processes.

The public names are importable from here (loaded on first use).
"""

import importlib

_PUBLIC = {
    "Engine": "v41cp.serving.engine", "Capacity": "v41cp.serving.engine", "SamplingParams": "v41cp.serving.engine",
    "RequestError": "v41cp.serving.engine", "EngineFull": "v41cp.serving.engine",
    "Speculative": "v41cp.serving.runner.speculative", "DisaggregatedEngine": "v41cp.serving.pd.engines",
    "AllocationError": "v41cp.serving.cache.allocator", "BlockAllocator": "v41cp.serving.cache.allocator",
    "CacheGroup": "v41cp.serving.cache.spec", "CacheSpec": "v41cp.serving.cache.spec",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'v41cp.serving' has no attribute {name!r}")
