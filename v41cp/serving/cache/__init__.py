"""The cache room: what a request's state occupies on the devices and on the host, and who owns which page.

* `spec` — the decode-state layout (cache groups, bytes per token, exact byte accounting);
* `records` — the release's byte records of cached keys (FP8 / MXFP4) in jnp;
* `device_cache` — the device cache declared once (`PagedCache`; each leaf's shape, dtype, logical axes, initial
  value) and what follows from it: abstract layout, partition specs, the zeroed cache;
* `paged` — every read / write of the device cache's stores and its page addressing;
* `undo` — what a verification step overwrote (`VerifyUndo`), for keeping a prefix of its rows;
* `allocator` — host-side logical blocks, per-request block tables, batch slots, KVP page cycles;
* `slot_state` / `request_state` — a request's slot rows and its whole state as host bytes (prefix hits, transfers);
* `prefix` — exact prefix caching: a tree of full blocks keyed by their tokens, admission plans and eviction.
"""
