"""Multi-host control: one engine that spans processes (`jax.distributed`).

* `control_plane` — rank 0 decides each iteration, every rank applies it;
* `fetch` — device → host reads that work in one process and across processes.
"""
