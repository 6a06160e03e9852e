"""Device → host fetches that work in one process and across processes (`jax.distributed`).

Every process runs the engine's host logic alike (SPMD control), so a fetch of a step's output is a collective:
an array that spans devices of other processes is all-gathered (`multihost_utils.process_allgather`), every process
calling it at the same point; an array this process holds entirely is read directly.
"""

from __future__ import annotations

import numpy as np

__all__ = ["fetch"]


def fetch(x) -> np.ndarray:
    """The value of ``x`` on the host of every process."""
    if getattr(x, "is_fully_addressable", True) or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
