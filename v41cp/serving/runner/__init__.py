"""The model runner room: the jitted steps over the paged cache, their host-built metadata, and speculative rounds.

* `steps` — the decode step, the verify step and its commit, token-serial prefill chunks;
* `span_batch` / `span_prefill` — one-pass prefill of a batch of prompts (model-wide / operator-local QCP, KVP,
  CED);
* `speculative` — DSpark drafting, acceptance and the drafter's cache.
"""
