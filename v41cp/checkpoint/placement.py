"""A released-layout checkpoint straight onto a device mesh, each device reading only its own shard.

`load_released_dir(path, mesh, rules)` builds every parameter with `jax.make_array_from_callback`: for
each device the callback receives the device's region of the parameter (from the ``NamedSharding`` of the
logical-axis ``rules``) and `ReleasedCheckpoint.read_shard` reads and decodes only the stored elements of
that region from the memory-mapped safetensors — no whole-tensor host decode before placement. Devices
holding the same region (replicas) share one decode. FP4 experts / FP8 Engram rows stay in their stored
bytes with ``keep_quantized``. Parameters are read by a pool of ``workers`` threads (NumPy's decode and
the memory-map reads release the GIL); host memory holds at most ``workers`` parameters' distinct shards
at a time, plus the page cache of the mapped files (reclaimable, not the process's own memory).

`LoadReport` says what was read: parameters, bytes placed (global), bytes decoded on the host (the
distinct shards: each parameter's bytes once, never once per device), bytes on the devices, seconds and
throughput.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from v41cp.checkpoint.names import insert
from v41cp.checkpoint.released import ReleasedCheckpoint
from v41cp.model import abstract_params
from v41cp.sharding.rules import TP_RULES, param_shardings

__all__ = ["LoadReport", "load_released_dir", "place_released"]


@dataclass
class LoadReport:
    """What a mesh load read. ``placed_bytes``: the parameters' global sizes; ``device_bytes``: summed over the
    devices (replicas counted); ``decoded_bytes``: host bytes decoded (every distinct shard once)."""

    parameters: int = 0
    placed_bytes: int = 0
    device_bytes: int = 0
    decoded_bytes: int = 0
    largest_shard_bytes: int = 0
    seconds: float = 0.0
    workers: int = 1

    @property
    def placed_GBps(self) -> float:
        return self.placed_bytes / 1e9 / max(self.seconds, 1e-9)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "seconds": round(self.seconds, 3), "placed_GBps": round(self.placed_GBps, 3)}


def _region_key(index) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


def place_released(ckpt: ReleasedCheckpoint, shardings: dict, *, workers: int | None = None,
                   progress: bool = False) -> tuple[dict, LoadReport]:
    """(parameter tree of ``jax.Array``s placed with ``shardings`` — a tree of ``NamedSharding``s in the model's
    layout —, `LoadReport`). Each device's shard is read from the memory maps by itself."""
    import jax

    workers = max(1, workers or min(8, os.cpu_count() or 1))
    report = LoadReport(workers=workers)
    t0 = time.perf_counter()

    def one(path):
        node = ckpt._node(path)
        sharding = shardings
        for p in path:
            sharding = sharding[p]
        regions: dict[tuple, np.ndarray] = {}

        def shard(index):
            key = _region_key(index)
            if key not in regions:                       # replicas of a region share one decode
                regions[key] = ckpt.read_shard(path, index)
            return regions[key]

        array = jax.make_array_from_callback(tuple(node.shape), sharding, shard)
        sizes = [a.nbytes for a in regions.values()]
        on_devices = sum(s.data.nbytes for s in array.addressable_shards)
        return path, array, on_devices, sum(sizes), max(sizes, default=0)

    params: dict = {}
    paths = list(ckpt.mapping)
    with ThreadPoolExecutor(workers) as pool:
        for path, array, on_devices, decoded, largest in tqdm(pool.map(one, paths), total=len(paths), desc="load", unit="param",
                                                  disable=not progress):
            insert(params, path, array)
            report.parameters += 1
            report.placed_bytes += array.nbytes
            report.device_bytes += on_devices
            report.decoded_bytes += decoded
            report.largest_shard_bytes = max(report.largest_shard_bytes, largest)
    jax.block_until_ready(params)
    report.seconds = time.perf_counter() - t0
    return params, report


def load_released_dir(path: str | os.PathLike, mesh=None, rules=None, progress: bool = False,
                      workers: int | None = None, report: bool = False, **overrides: Any):
    """(config, parameter tree) straight from a released-layout directory, without converting.

    Without ``mesh``: NumPy leaves on the host (the whole model; fine for small checkpoints). With a mesh:
    ``jax.Array``s with the ``NamedSharding`` of ``rules`` (default `TP_RULES`), each device's shard read by
    itself (`place_released`). ``report=True`` returns (config, params, `LoadReport`) — mesh loads only.
    ``overrides`` replace config fields (``dtype``, ``fake_quant``, ``keep_quantized``).
    """
    ckpt = ReleasedCheckpoint(Path(path), **overrides)
    if mesh is None:
        if report:
            raise ValueError("report=True needs a mesh (a host load decodes whole tensors)")
        return ckpt.cfg, ckpt.params()

    shardings = param_shardings(abstract_params(ckpt.cfg), mesh, rules or TP_RULES)
    params, rep = place_released(ckpt, shardings, workers=workers, progress=progress)
    return (ckpt.cfg, params, rep) if report else (ckpt.cfg, params)
