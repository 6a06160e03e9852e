"""Serving: paged V4.1 caches, chunked prefill and the static-capacity jitted decode step.

Empty for now: built by the serving-core issue on top of `v41cp.model` and `v41cp.layers`.
"""
