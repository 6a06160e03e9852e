"""Prefill / decode disaggregation: a prefill role and a decode role on disjoint devices, and the cache transfer.

* `engines` — both roles in one program (`DisaggregatedEngine`);
* `transfer` — the page-owner transfer plan of one request's cache and its execution;
* `wire` / `processes` — the same transfer between two processes (`jax.distributed`).
"""
