"""The cache room: what a request's state occupies on the devices and on the host, and who owns which page.

* `spec` — the decode-state layout (cache groups, bytes per token, exact byte accounting);
* `records` — the release's byte records of cached keys (FP8 / MXFP4) in jnp;
* `paged` — the paged device cache: its layout and shardings, its stores and every read / write of them;
* `allocator` — host-side logical blocks, per-request block tables, batch slots, KVP page cycles;
* `slot_state` / `request_state` — a request's slot rows and its whole state as host bytes (prefix hits, transfers);
* `prefix` — exact prefix caching: a tree of full blocks keyed by their tokens, admission plans and eviction.
"""
