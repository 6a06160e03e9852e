"""Model-wide QCP row plan: each request's extend rows in per-request zigzag order over the query group.

`QueryShardPlan.build(lengths, n)` runs on the host, from the batch's extend spans only, so every host and
every rank computes the same plan (no communication, no device values). Request ``i`` with ``S_i`` rows is cut
into ``2n`` consecutive blocks — the first ``S_i mod 2n`` blocks one row longer — and rank ``r`` owns blocks
``r`` and ``2n − 1 − r`` (causal cost balanced: an early and a late block). A rank's local rows are its
blocks of request 0, then of request 1, …; each in span order. Requests shorter than ``2n`` rows leave some
ranks without rows of that request; a rank may own no row at all and still joins every collective.

Layouts (``T`` = total extend rows, ``C`` = `capacity`, the per-rank row count padded to a static bucket):

* ``local_rows [n, C]`` — the batch-global row (span order, requests concatenated) at each local slot, −1
  for padding slots;
* ``restore [T]`` — for each global row, its position ``rank · C + slot`` in the rank-major all-gather of
  the local rows (``all_gather(x_local).reshape(n · C, ·)[restore]`` is the span-order tensor);
* ``sampled [B]`` — the position (``rank · C + slot``) of each request's last row (the row whose logits
  are sampled), −1 for an empty request.

Balance: for every request, the ranks' row counts differ by at most one (see `zigzag_blocks`), so the
batch's per-rank counts differ by at most the number of requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["zigzag_blocks", "fresh_visible_total", "QueryShardPlan"]


def zigzag_blocks(length: int, n: int) -> list[tuple[int, int]]:
    """The ``2n`` blocks ``[start, end)`` of a request of ``length`` rows (the first ``length mod 2n`` blocks
    one row longer). Rank ``r`` owns blocks ``r`` and ``2n − 1 − r``."""
    if length < 0 or n <= 0:
        raise ValueError(f"zigzag_blocks: length={length} must be ≥ 0 and n={n} positive")
    base, extra = divmod(length, 2 * n)
    sizes = [base + (b < extra) for b in range(2 * n)]
    starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    return [(starts[b], starts[b + 1]) for b in range(2 * n)]


def fresh_visible_total(rows: int, span: int, n: int, ratio: int) -> int:
    """A static bound on ``Σ (pos + 1) // ratio`` over one rank's ``rows`` local rows of a fresh pass (every request
    from position 0, at most ``span`` rows each) under the zigzag plan over ``n`` ranks: a rank's ``m`` rows of a
    request of ``L`` rows (blocks ``r`` and ``2n − 1 − r``) sum their positions + 1 to at most ``m · (L + n) / 2``
    (the mirrored blocks average ``(L + 1) / 2``; the first ``L mod 2n`` blocks' extra row shifts it by at most
    ``(n − 1) / 2`` per row — `tests/sharding/test_query_shard.py` checks it for every length to 2,000)."""
    return rows * (span + n) // (2 * ratio)


@dataclass(frozen=True)
class QueryShardPlan:
    """The row maps of one forward (host numpy; see the module docstring). Build with `build`."""

    n: int
    lengths: tuple[int, ...]
    capacity: int
    local_rows: np.ndarray          # [n, capacity] int32, −1 = padding slot
    restore: np.ndarray             # [T] int32
    sampled: np.ndarray             # [B] int32, −1 = empty request

    @classmethod
    def build(cls, lengths, n: int, capacity: int | None = None) -> "QueryShardPlan":
        """Plan ``lengths`` (extend rows per request) over ``n`` ranks. ``capacity`` (static per-rank row
        bucket) defaults to the largest rank's row count; a smaller one is an error naming both."""
        lengths = tuple(int(x) for x in lengths)
        if n <= 0:
            raise ValueError(f"QueryShardPlan: query_context_parallel_size must be positive, got {n}")
        if any(x < 0 for x in lengths):
            raise ValueError(f"QueryShardPlan: negative extend length in {lengths}")
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
        per_rank: list[list[int]] = [[] for _ in range(n)]
        for i, length in enumerate(lengths):
            blocks = zigzag_blocks(length, n)
            for r in range(n):
                for b in (r, 2 * n - 1 - r):
                    start, end = blocks[b]
                    per_rank[r].extend(range(offsets[i] + start, offsets[i] + end))
        need = max((len(rows) for rows in per_rank), default=0)
        cap = need if capacity is None else int(capacity)
        if cap < need:
            raise ValueError(f"QueryShardPlan: a rank needs {need} rows but capacity={cap}")
        local = np.full((n, cap), -1, np.int32)
        total = int(offsets[-1])
        restore = np.full(total, -1, np.int64)
        for r, rows in enumerate(per_rank):
            local[r, :len(rows)] = rows
            restore[rows] = r * cap + np.arange(len(rows))
        sampled = np.array([restore[offsets[i + 1] - 1] if lengths[i] else -1 for i in range(len(lengths))],
                           np.int32)
        return cls(n, lengths, cap, local, restore.astype(np.int32), sampled)

    @property
    def total_rows(self) -> int:
        return int(sum(self.lengths))

    def rows_per_rank(self) -> np.ndarray:
        """Real (non-padding) rows of each rank ``[n]``."""
        return (self.local_rows >= 0).sum(axis=1)

    def positions(self) -> np.ndarray:
        """Position of each local slot inside its request ``[n, C]`` (0 for padding) — with a request's
        prefix length added, its cache coordinate."""
        offsets = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])
        starts = np.repeat(offsets[:-1], self.lengths)
        pos = np.arange(self.total_rows) - starts
        if not self.total_rows:                                # padding slots only
            return np.zeros(self.local_rows.shape, np.int32)
        return np.where(self.local_rows >= 0, pos[np.maximum(self.local_rows, 0)], 0).astype(np.int32)

    def request_of_slot(self) -> np.ndarray:
        """Request index of each local slot ``[n, C]`` (−1 for padding)."""
        req = np.repeat(np.arange(len(self.lengths)), self.lengths)
        if not self.total_rows:
            return np.full(self.local_rows.shape, -1, np.int32)
        return np.where(self.local_rows >= 0, req[np.maximum(self.local_rows, 0)], -1).astype(np.int32)

    def shard(self, x: np.ndarray) -> np.ndarray:
        """Span-order rows ``[T, ...]`` → the local layout ``[n, C, ...]`` (zeros in padding slots)."""
        out = np.zeros((self.n, self.capacity) + x.shape[1:], x.dtype)
        ok = self.local_rows >= 0
        out[ok] = x[self.local_rows[ok]]
        return out

    def unshard(self, local: np.ndarray) -> np.ndarray:
        """The local layout ``[n, C, ...]`` (as a rank-major all-gather returns it) → span order ``[T, ...]``."""
        return local.reshape((self.n * self.capacity,) + local.shape[2:])[self.restore]
