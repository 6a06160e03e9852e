"""`VerifyUndo`: what a verification step overwrote in the `PagedCache`, so that `commit_rows` can keep only a prefix
of each request's rows (`v41cp.serving.runner.steps`). Recorded by the rows backend (`PagedRows` with
``undo=True``) while the step writes; registered dataclasses, so the record stays on the device between the two steps.

Shapes: ``B`` batch rows, ``R`` rows per request of the step, ``D`` head dim, ``N`` the KVP group size; a *raw*
leaf is a store's leaves as they are (record bytes undecoded: `v41cp.serving.cache.paged.take_raw`).
"""

from __future__ import annotations

import dataclasses

import jax

__all__ = ["OpenPairUndo", "RingUndo", "EntriesUndo", "VerifyUndo"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OpenPairUndo:
    """One ratio-2 source's open pair: ``kv / score [B, D]`` FP32 as they were in each request's slot before the
    step, and the step's compressor projections ``c / z [B, R, D]`` of every row (a kept row's pair comes from them)."""

    kv: jax.Array
    score: jax.Array
    c: jax.Array
    z: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RingUndo:
    """One DeepSeek-V4 compressor ring (its last ``n`` rows' projections per slot, by position mod ``n``):
    ``kv / score [B, R, C]`` FP32 what the ring held at each row's ring row before the step, and the step's own
    projections ``c / z [B, R, C]`` (a kept row's ring row holds its projection)."""

    kv: jax.Array
    score: jax.Array
    c: jax.Array
    z: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EntriesUndo:
    """One KV source's page entries written by the step: ``blk / row [B, R]`` int32 (virtual block, row in the
    page) and ``emits [B, R]`` bool of each row's entry, and what the pools held there — ``ckv / ikey`` raw ``[B, R,
    ·]``, or under KVP ``[N, B·R, ·]`` split over ``cp`` (each rank's own rows; zeros where it owns nothing)."""

    blk: jax.Array
    row: jax.Array
    emits: jax.Array
    ckv: object
    ikey: object = None                       # None: the source has no index keys (DeepSeek-V4 HCA)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyUndo:
    """The step's overwrites: ``swa {layer: raw [B, R, ·]}`` the ring rows of every row before the step, ``open
    {source: OpenPairUndo}``, ``entries {source: EntriesUndo}``, ``rings {ring key: RingUndo}`` (DeepSeek-V4's
    compressor rings), and the step's ``starts / lengths / slots [B]`` int32."""

    swa: dict
    open: dict
    entries: dict
    starts: jax.Array
    lengths: jax.Array
    slots: jax.Array
    rings: dict = dataclasses.field(default_factory=dict)

    @property
    def rows(self) -> int:
        """``R``: rows per request of the recorded step (0 when no layer has a window ring)."""
        return jax.tree.leaves(next(iter(self.swa.values())))[0].shape[1] if self.swa else 0
