"""Device mesh construction with topology validation.

The mesh has three axes: ``dp`` (independent replicas), ``tp`` and ``cp``. Attention tensor
parallelism spans ``("tp", "cp")`` — its size is ``tp · cp`` — and the context-parallel group
(KVP = DCP, later QCP) is the inner ``cp`` sub-axis: an aligned run of ``cp`` consecutive attention-TP
ranks inside one replica, so context parallelism adds no devices (``cp_rank = attn_tp_rank % cp``).
With ``cp = 1`` the mesh is plain attention TP.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh

__all__ = ["make_mesh", "ATTN_TP", "CP"]

ATTN_TP = ("tp", "cp")     # the attention tensor-parallel group (mesh axes, outer to inner)
CP = "cp"                  # the context-parallel sub-axis of attention TP


def make_mesh(tp: int | None = None, dp: int = 1, devices=None, cp: int = 1) -> Mesh:
    """A ``(dp, tp / cp, cp)`` mesh over ``devices`` (default: all): attention TP of size ``tp`` (default
    ``len(devices) // dp``) whose inner ``cp`` ranks form a context-parallel group.

    Raises ValueError naming the topology when ``dp · tp`` does not equal the device count or ``cp``
    does not divide ``tp``.
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
    if type(cp) is not int or cp <= 0:
        raise ValueError(f"cp must be a positive integer, got {cp!r}")
    if dp * tp != n:
        raise ValueError(f"topology dp={dp} x tp={tp} = {dp * tp} devices, but {n} devices were given")
    if tp % cp:
        raise ValueError(f"topology: the context-parallel group size {cp} does not divide attention TP {tp}")
    return jax.make_mesh((dp, tp // cp, cp), ("dp", "tp", "cp"), axis_types=(AxisType.Auto,) * 3, devices=devices)
