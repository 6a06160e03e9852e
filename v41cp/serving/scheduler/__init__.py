"""The scheduler room: requests and their states, validation at submit, FIFO admission into pages and slots.

* `request` — `SamplingParams`, `Request` (one request's state machine: waiting → running → done / cancelled),
  `RequestError` / `EngineFull`, `check_request` (every submit-time check, written once);
* `scheduler` — `Scheduler`: the request table, admission (with prefix caching: `v41cp.serving.cache.prefix`),
  finishing, freeing, the load report and the consistency check.
"""
