"""Safetensors I/O without pickle and without materialising whole files.

`SafetensorsFile` parses the header (8-byte little-endian length + JSON) and memory-maps each
tensor on demand, with the dtypes the DeepSeek-V4.1 release uses, including ``F8_E8M0`` scales
(which orbax's safetensors layout rejects) and ``F8_E4M3`` weights (ml_dtypes). `ReleasedFiles`
opens a checkpoint directory (``model.safetensors.index.json`` + shards, or ``*.safetensors``) and
checks its integrity before anything is read: every shard the index names exists, no tensor is
listed twice, and no tensor's byte range runs past the end of its file (a truncated shard).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

__all__ = ["SafetensorsError", "TensorInfo", "SafetensorsFile", "ReleasedFiles", "write_safetensors", "DTYPES"]

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsError(ValueError):
    """A checkpoint file is malformed, truncated or inconsistent (the message names file and tensor)."""


@dataclass(frozen=True)
class TensorInfo:
    """Header entry of one tensor: safetensors dtype name, shape, file and byte range."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class SafetensorsFile:
    """One ``.safetensors`` file: header parsed at open, tensors memory-mapped on `read`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise SafetensorsError(f"shard {str(self.path)!r} does not exist")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{str(self.path)!r} is truncated: no safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 * 2**20:
                raise SafetensorsError(f"{str(self.path)!r} is truncated or not a safetensors file "
                                       f"(header of {n} bytes, file of {size})")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise SafetensorsError(f"{str(self.path)!r}: unreadable safetensors header ({e})") from e
        self.metadata = header.pop("__metadata__", {}) or {}
        self.data_start = 8 + n
        self.tensors: dict[str, TensorInfo] = {}
        for name, h in header.items():
            dtype, shape, (a, b) = h["dtype"], tuple(h["shape"]), h["data_offsets"]
            if dtype not in DTYPES:
                raise SafetensorsError(f"tensor {name!r} in {str(self.path)!r} has unsupported dtype {dtype}")
            want = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
            if b - a != want:
                raise SafetensorsError(f"tensor {name!r} in {str(self.path)!r}: byte range {b - a} does not match "
                                       f"shape {list(shape)} x {dtype} ({want} bytes)")
            if self.data_start + b > size:
                raise SafetensorsError(f"shard {str(self.path)!r} is truncated: tensor {name!r} ends at byte "
                                       f"{self.data_start + b}, the file has {size}")
            self.tensors[name] = TensorInfo(name, dtype, shape, self.path, self.data_start + a, self.data_start + b)

    def read(self, name: str) -> np.ndarray:
        """A read-only memory map of tensor ``name`` (no copy until used)."""
        info = self.tensors[name]
        dtype = DTYPES[info.dtype]
        if info.nbytes == 0:
            return np.zeros(info.shape, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=info.start, shape=info.shape)


class ReleasedFiles:
    """All tensors of a released-layout directory, by name, read lazily."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise SafetensorsError(f"checkpoint directory {str(self.path)!r} does not exist")
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map: Mapping[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise SafetensorsError(f"{str(index)!r}: not a safetensors index ({e})") from e
            files = sorted(set(weight_map.values()))
            for f in files:
                if not (self.path / f).exists():
                    missing = next(k for k, v in weight_map.items() if v == f)
                    raise SafetensorsError(f"index {str(index)!r} points tensor {missing!r} to shard {f!r}, "
                                           f"which does not exist")
        else:
            weight_map = None
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise SafetensorsError(f"no .safetensors files in checkpoint directory {str(self.path)!r}")
        self.files = {f: SafetensorsFile(self.path / f) for f in files}
        self.tensors: dict[str, TensorInfo] = {}
        for f, sf in self.files.items():
            for name, info in sf.tensors.items():
                if name in self.tensors:
                    raise SafetensorsError(f"tensor {name!r} appears in two shards: {self.tensors[name].file.name} "
                                           f"and {f}")
                if weight_map is not None and weight_map.get(name) != f:
                    raise SafetensorsError(f"tensor {name!r} is in shard {f!r} but the index says "
                                           f"{weight_map.get(name)!r}")
                self.tensors[name] = info
        if weight_map is not None:
            absent = sorted(set(weight_map) - set(self.tensors))
            if absent:
                raise SafetensorsError(f"index lists tensor {absent[0]!r} in shard {weight_map[absent[0]]!r}, "
                                       f"which does not contain it")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def read(self, name: str) -> np.ndarray:
        return self.files[self.tensors[name].file.name].read(name)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
                      metadata: Mapping[str, str] | None = None) -> int:
    """Write tensors (NumPy / ml_dtypes arrays) to one file; returns the bytes written."""
    items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, arr in items:
        dt = np.dtype(arr.dtype)
        if dt not in _NAMES:
            raise SafetensorsError(f"tensor {name!r}: dtype {dt} cannot be stored in safetensors")
        header[name] = {"dtype": _NAMES[dt], "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, arr in items:
            f.write(np.ascontiguousarray(arr).tobytes())
    return 8 + len(blob) + offset
