"""How released tensors become one parameter of the model's tree, whole or one shard at a time.

A `Layout` is the transform from the stored tensors of one parameter (``keys``, each in its logical,
decoded shape) to the parameter: called on whole arrays it is the transform itself (NumPy on the host,
jnp under tracing); `Layout.read` builds only the region ``index`` of the parameter — one device's
shard — asking a ``reader(key, index)`` for exactly the stored elements that region needs. Index
entries are ascending int arrays, one per axis (``np.arange(n)[slice]``).

Layouts of the release (docs/architecture.md; ``S`` a stored tensor):

* `Same` — ``S`` (norms, biases, embeddings);
* `Transposed` — ``S.T`` (``[out, in]`` linear weights → ``[in, out]``);
* `HeadsOut(h, d)` — ``[h·d, C]`` → ``[C, h, d]`` (query up-projections);
* `GroupsIn(g, r)` — ``[g·r, C]`` → ``[g, C, r]`` (grouped output LoRA down-projection);
* `GroupsOut(g, r)` — ``[C, g·r]`` → ``[g, r, C]`` (grouped output LoRA up-projection);
* `Stacked(transpose)` — E × ``[out, in]`` → ``[E, out, in]`` or ``[E, in, out]`` (routed experts);
* `PaddedRows(rows, pad)` — ``[rows, C]`` plus ``pad`` zero rows (Engram tables).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

__all__ = ["Layout", "Same", "Transposed", "Flattened", "HeadsOut", "GroupsIn", "GroupsOut", "Stacked", "PaddedRows",
           "Reader", "index_arrays"]

Reader = Callable[[str, Sequence[np.ndarray]], np.ndarray]


def _xp(*arrays):
    return np if all(isinstance(a, np.ndarray) for a in arrays) else jnp


def index_arrays(index: Sequence[slice], shape: Sequence[int]) -> tuple[np.ndarray, ...]:
    """A shard's index (slices, as `jax.make_array_from_callback` gives it) → one int array per axis."""
    return tuple(np.arange(n)[s] for s, n in zip(index, shape))


def _combined(outer: np.ndarray, inner: np.ndarray, width: int) -> np.ndarray:
    """Flat indices ``o · width + i`` for every (o, i) pair, ascending when both are."""
    return (outer[:, None] * width + inner[None, :]).reshape(-1)


class Layout(ABC):
    """Stored tensors → parameter: `__call__` on whole arrays, `read` for one region."""

    @abstractmethod
    def __call__(self, *arrays):
        """The parameter from its whole stored tensors."""

    @abstractmethod
    def read(self, reader: Reader, keys: Sequence[str], index: Sequence[np.ndarray]) -> np.ndarray:
        """The parameter's region ``index`` (one ascending int array per axis), from ``reader(key, region)``."""


@dataclass(frozen=True)
class Same(Layout):
    def __call__(self, a):
        return a

    def read(self, reader, keys, index):
        return reader(keys[0], index)


@dataclass(frozen=True)
class Transposed(Layout):
    def __call__(self, a):
        return a.T

    def read(self, reader, keys, index):
        return reader(keys[0], (index[1], index[0])).T


@dataclass(frozen=True)
class Flattened(Layout):
    """A stored ``[1, n]`` row (a one-output linear layer) as the parameter ``[n]``."""

    def __call__(self, a):
        return a.reshape(-1)

    def read(self, reader, keys, index):
        return reader(keys[0], (np.zeros(1, np.int64), index[0]))[0]


@dataclass(frozen=True)
class HeadsOut(Layout):
    heads: int
    dim: int

    def __call__(self, a):
        return a.reshape(self.heads, self.dim, -1).transpose(2, 0, 1)

    def read(self, reader, keys, index):
        cols, heads, dims = index
        block = reader(keys[0], (_combined(heads, dims, self.dim), cols))
        return block.reshape(len(heads), len(dims), len(cols)).transpose(2, 0, 1)


@dataclass(frozen=True)
class GroupsIn(Layout):
    groups: int
    rank: int

    def __call__(self, a):
        return a.reshape(self.groups, self.rank, -1).transpose(0, 2, 1)

    def read(self, reader, keys, index):
        groups, cols, ranks = index
        block = reader(keys[0], (_combined(groups, ranks, self.rank), cols))
        return block.reshape(len(groups), len(ranks), len(cols)).transpose(0, 2, 1)


@dataclass(frozen=True)
class GroupsOut(Layout):
    groups: int
    rank: int

    def __call__(self, a):
        return a.T.reshape(self.groups, self.rank, -1)

    def read(self, reader, keys, index):
        groups, ranks, rows = index
        block = reader(keys[0], (rows, _combined(groups, ranks, self.rank)))
        return block.T.reshape(len(groups), len(ranks), len(rows))


@dataclass(frozen=True)
class Stacked(Layout):
    """One stored tensor per leading index (expert): ``[E, out, in]``, or ``[E, in, out]`` when ``transpose``."""

    transpose: bool = False

    def __call__(self, *arrays):
        return _xp(*arrays).stack([a.T if self.transpose else a for a in arrays])

    def read(self, reader, keys, index):
        lead, a, b = index
        parts = [reader(keys[e], (b, a)).T if self.transpose else reader(keys[e], (a, b)) for e in lead]
        return np.stack(parts) if parts else np.zeros((0, len(a), len(b)), np.float32)


@dataclass(frozen=True)
class PaddedRows(Layout):
    """``pad`` zero rows appended to the ``rows`` stored ones (Engram tables are padded to `ENGRAM_ROW_ALIGN` rows
    in the tree)."""

    rows: int
    pad: int

    def __call__(self, a):
        xp = _xp(a)
        return xp.concatenate([a, xp.zeros((self.pad, *a.shape[1:]), a.dtype)]) if self.pad else a

    def read(self, reader, keys, index):
        rows, rest = index[0], tuple(index[1:])
        stored = rows[rows < self.rows]
        part = reader(keys[0], (stored, *rest))
        if len(stored) == len(rows):
            return part
        out = np.zeros((len(rows), *part.shape[1:]), part.dtype)
        out[: len(stored)] = part                   # rows ascend: the stored ones come first
        return out
