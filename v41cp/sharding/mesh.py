"""Device mesh construction with topology validation.

The mesh has two axes: ``dp`` (independent replicas) and ``tp`` (attention tensor parallelism).
Context parallelism (QCP / KVP / DCP) partitions work *within* ``tp`` — it adds no devices — so
later issues add no mesh axis, only different specs over ``tp``.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh

__all__ = ["make_mesh"]


def make_mesh(tp: int | None = None, dp: int = 1, devices=None) -> Mesh:
    """A ``(dp, tp)`` mesh over ``devices`` (default: all). ``tp`` defaults to ``len(devices) // dp``.

    Raises ValueError naming the topology when ``dp · tp`` does not equal the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if type(dp) is not int or dp <= 0:
        raise ValueError(f"dp must be a positive integer, got {dp!r}")
    if tp is None:
        if n % dp:
            raise ValueError(f"topology dp={dp} does not divide the {n} available devices")
        tp = n // dp
    if type(tp) is not int or tp <= 0:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if dp * tp != n:
        raise ValueError(f"topology dp={dp} x tp={tp} = {dp * tp} devices, but {n} devices were given")
    return jax.make_mesh((dp, tp), ("dp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)
