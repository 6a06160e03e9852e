"""`StepBatch`: the one metadata record of every cached step — decode, verification and prefill passes — built on
the host from the scheduled requests and read by the model's rows backend (`v41cp.serving.attention.paged_rows`;
model-wide QCP: `v41cp.serving.attention.qcp_rows`).

A registered dataclass: its arrays are the step's data, its bucket sizes static (one compiled program per bucket,
whatever the batch's contents). Shapes (``B`` = ``max_batch``, ``R`` = ``rows``, ``MB`` = ``max_blocks``):

* ``tokens [B, R]`` int32 — each request's rows (packed: ``[1, R]``);
* ``starts / lengths / slots [B]`` int32 — each request's first position, its rows fed (0 = an idle batch row)
  and its batch slot;
* ``block_tables [B, MB]`` int32 — each request's pages (−1 = none);
* ``engram_ids [B, R, n_engram, hash_heads]`` int32 (packed: ``[1, R, …]``) — hashed on the host;
* ``offsets [B]`` int32 or None — packed rows (a prefill pass): the requests' rows lie back to back in one row
  list, request ``b``'s at ``offsets[b] … offsets[b] + lengths[b] − 1``, the rest padding, so a ragged batch
  computes only its real rows (``R`` ≥ Σ lengths is the bucket);
* ``ced`` (`CEDRows`) or None — CED narrowing of a prefill pass: the first ``encoder_rows [B]`` rows of each
  request run only the layers before the CED boundary and the boundary's cache writes, the rest (at most
  ``decoder_rows`` per request; packed: at most ``decoder_rows`` in all; model-wide QCP: per rank) every layer;
* ``qcp`` (`QCPLayout`) or None — model-wide QCP: the pass's rows laid out per rank by the zigzag row plan
  (`v41cp.sharding.query_shard.QueryShardPlan`). Then ``tokens [N, C]`` / ``engram_ids [N, C, …]`` hold each
  rank's ``C`` = ``rows`` local rows (rank-major, sharded over attention TP: inside the map a rank sees ``[1, C]``)
  and the record says where each local row belongs.

Modes (`mode`): ``DECODE`` one row per request (the decode step; the token-serial prefill scans these),
``VERIFY`` ``R`` rows per request (speculative verification), ``PREFILL`` a pass of a span prefill — packed on one
rank (also under operator-local QCP) or per rank under model-wide QCP. Prefill passes are built by
`v41cp.serving.runner.span_batch.build_span_batch`.
"""

from __future__ import annotations

import dataclasses
import enum
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from v41cp.config import ModelConfig
from v41cp.engram_hash import engram_hash_ids

__all__ = ["StepBatch", "CEDRows", "QCPLayout", "ForwardMode", "engram_ids_for_last"]


def engram_ids_for_last(cfg: ModelConfig, history) -> np.ndarray:
    """Engram row ids ``[n_engram, hash_heads]`` of the last token of ``history`` (host side)."""
    if not cfg.engram_layer_ids:
        return np.zeros((0, 0), np.int32)
    tail = np.asarray(history[-cfg.engram_max_ngram_size:], np.int64)[None]
    # hashing only looks back max_ngram − 1 tokens; a tail shorter than that means the sequence start
    return engram_hash_ids(cfg, tail)[0, -1]


class ForwardMode(enum.Enum):
    DECODE = "decode"
    VERIFY = "verify"
    PREFILL = "prefill"


@partial(jax.tree_util.register_dataclass, data_fields=["encoder_rows"], meta_fields=["decoder_rows"])
@dataclasses.dataclass(frozen=True)
class CEDRows:
    """CED narrowing of a prefill pass: ``encoder_rows [B]`` int32, ``decoder_rows`` (static, > 0)."""

    encoder_rows: jax.Array
    decoder_rows: int


@partial(jax.tree_util.register_dataclass,
         data_fields=["positions", "requests", "dec_slots", "span_index", "dec_span_index", "sampled"],
         meta_fields=["n", "span", "continued"])
@dataclasses.dataclass(frozen=True)
class QCPLayout:
    """Model-wide QCP's row layout of a prefill pass (``N`` = `n` ranks, ``C`` local rows per rank, ``Cd`` local
    CED decoder rows per rank, ``B`` batch rows, ``S`` = `span` padded chunk length):

    * ``positions / requests [N, C]`` int32 — each local row's absolute position and batch row (−1 = padding);
    * ``dec_slots [N, Cd]`` int32 — CED: each rank's retained local rows, in order (−1 padding; without CED every
      real local row);
    * ``span_index [B, S]`` int32 — where row ``(b, p)`` of the chunk lies in the rank-major gathered ``[N·C]``
      rows (``N·C`` = absent): gathering then indexing restores span order for pooling, pairing, windows and
      cache writes; ``dec_span_index [B, S]`` the same for the narrowed ``[N·Cd]`` layout (``N·Cd`` = not
      retained; without CED equal to ``span_index``);
    * ``sampled [B]`` int32 — each request's last row of the pass in the (narrowed) gathered layout (−1 = none);
    * ``continued`` (static) — some request starts past 0: the pass reads its cached history.

    ``positions``, ``requests`` and ``dec_slots`` are per rank (sharded over attention TP); the rest replicated."""

    positions: jax.Array
    requests: jax.Array
    dec_slots: jax.Array
    span_index: jax.Array
    dec_span_index: jax.Array
    sampled: jax.Array
    n: int
    span: int
    continued: bool


@partial(jax.tree_util.register_dataclass, data_fields=["tokens", "starts", "lengths", "slots", "block_tables",
                                                        "engram_ids", "ced", "offsets", "qcp"],
         meta_fields=["max_batch", "max_blocks", "rows"])
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """See the module docstring."""

    tokens: jax.Array
    starts: jax.Array
    lengths: jax.Array
    slots: jax.Array
    block_tables: jax.Array
    engram_ids: jax.Array
    max_batch: int
    max_blocks: int
    rows: int
    ced: CEDRows | None = None
    offsets: jax.Array | None = None
    qcp: QCPLayout | None = None

    # ------------------------------------------------------------------ built on the host
    @classmethod
    def decode(cls, tokens, positions, slots, block_tables, active, engram_ids) -> "StepBatch":
        """One row per request: ``tokens / positions / slots [B]``, ``block_tables [B, MB]``, ``active [B]`` bool,
        ``engram_ids [B, n_engram, hash_heads]`` (host arrays; a leading chunk axis is kept: the token-serial
        prefill scans a stack of these)."""
        tokens, engram_ids = np.asarray(tokens), np.asarray(engram_ids)
        b, mb = np.shape(block_tables)[-2:]
        return cls(jnp.asarray(tokens[..., None], jnp.int32), jnp.asarray(positions, jnp.int32),
                   jnp.asarray(np.asarray(active), jnp.int32), jnp.asarray(slots, jnp.int32),
                   jnp.asarray(block_tables, jnp.int32), jnp.asarray(engram_ids[..., None, :, :], jnp.int32),
                   int(b), int(mb), 1)

    @classmethod
    def for_histories(cls, cfg: ModelConfig, histories, slots, tables, max_batch: int, max_blocks: int) -> "StepBatch":
        """The decode step of requests with token ``histories`` (each's last token is the step's input), batch
        ``slots`` and block ``tables`` (each a list of block ids or a ``[max_blocks]`` row with −1 padding),
        padded to the bucket ``max_batch × max_blocks`` with idle rows."""
        n_eng = len(cfg.engram_layer_ids)
        tok, pos, slot_ids = (np.zeros(max_batch, np.int32) for _ in range(3))
        full, active = np.full((max_batch, max_blocks), -1, np.int32), np.zeros(max_batch, bool)
        eng = np.zeros((max_batch, n_eng, cfg.engram_hash_heads if n_eng else 0), np.int32)
        for i, (hist, slot, table) in enumerate(zip(histories, slots, tables)):
            tok[i], pos[i], slot_ids[i], active[i] = hist[-1], len(hist) - 1, slot, True
            full[i, :len(table)] = table
            eng[i] = engram_ids_for_last(cfg, hist)
        return cls.decode(tok, pos, slot_ids, full, active, eng)

    @classmethod
    def verify(cls, cfg: ModelConfig, histories, drafts, lengths, slots, tables, max_batch: int, max_blocks: int,
               rows: int) -> "StepBatch":
        """The verification step of requests with token ``histories``: request ``i`` feeds ``lengths[i]`` ≤ ``rows``
        rows — its last token, then its first ``lengths[i] − 1`` ``drafts[i]`` — from position ``len(history) −
        1``, in batch slot ``slots[i]`` with block table ``tables[i]`` (a ``[max_blocks]`` row, −1 padding); padded to
        the bucket ``max_batch × max_blocks × rows`` with idle rows. Engram ids are hashed on the host for each
        row's token after its history and the drafts before it."""
        n_eng = len(cfg.engram_layer_ids)
        tok, pos, n, slot_ids = (np.zeros((max_batch, rows), np.int32), *(np.zeros(max_batch, np.int32)
                                                                          for _ in range(3)))
        full = np.full((max_batch, max_blocks), -1, np.int32)
        eng = np.zeros((max_batch, rows, n_eng, cfg.engram_hash_heads if n_eng else 0), np.int32)
        for i, (hist, draft, k, slot, table) in enumerate(zip(histories, drafts, lengths, slots, tables)):
            draft = [int(t) for t in draft[:k - 1]]
            tok[i, :k], pos[i], n[i], slot_ids[i] = [hist[-1], *draft], len(hist) - 1, k, slot
            full[i, :len(table)] = table
            for j in range(k):
                eng[i, j] = engram_ids_for_last(cfg, list(hist) + draft[:j])
        return cls(*(jnp.asarray(a, jnp.int32) for a in (tok, pos, n, slot_ids, full, eng)), max_batch, max_blocks, rows)

    @classmethod
    def idle(cls, cfg: ModelConfig, max_batch: int, max_blocks: int, rows: int = 1) -> "StepBatch":
        """A bucket with no active row (for lowering / compiling a step ahead of traffic)."""
        n_eng = len(cfg.engram_layer_ids)
        z = jnp.zeros(max_batch, jnp.int32)
        return cls(jnp.zeros((max_batch, rows), jnp.int32), z, z, jnp.arange(max_batch, dtype=jnp.int32),
                   jnp.full((max_batch, max_blocks), -1, jnp.int32),
                   jnp.zeros((max_batch, rows, n_eng, cfg.engram_hash_heads if n_eng else 0), jnp.int32),
                   max_batch, max_blocks, rows)

    # ------------------------------------------------------------------ read inside the step
    @property
    def packed(self) -> bool:
        return self.offsets is not None

    @property
    def mode(self) -> ForwardMode:
        if self.packed or self.qcp is not None:
            return ForwardMode.PREFILL
        return ForwardMode.DECODE if self.rows == 1 else ForwardMode.VERIFY

    @property
    def decoder_rows(self) -> int:
        """CED: the decoder rows' bucket (0 = no narrowing)."""
        return self.ced.decoder_rows if self.ced is not None else 0

    def _cached_rows(self) -> None:
        if self.qcp is not None:
            raise ValueError("a model-wide QCP pass lays its rows out per rank (StepBatch.qcp), not per request")

    def row_requests(self) -> tuple[jax.Array, jax.Array]:
        """``(request, row within the request)`` of every row, flattened ``[max_batch · rows]`` (packed:
        ``[rows]``; a padding row's row index is ≥ its request's length)."""
        self._cached_rows()
        if not self.packed:
            b, r = self.max_batch, self.rows
            return (jnp.repeat(jnp.arange(b, dtype=jnp.int32), r), jnp.tile(jnp.arange(r, dtype=jnp.int32), b))
        i = jnp.arange(self.rows, dtype=jnp.int32)
        req = jnp.clip(jnp.searchsorted(self.offsets, i, side="right") - 1, 0, self.max_batch - 1).astype(jnp.int32)
        return req, i - self.offsets[req]

    @property
    def positions(self) -> jax.Array:
        """``[max_batch, rows]`` (packed: ``[1, rows]``): each row's position."""
        self._cached_rows()
        if not self.packed:
            return self.starts[:, None] + jnp.arange(self.rows, dtype=jnp.int32)[None]
        req, local = self.row_requests()
        return (self.starts[req] + local)[None]

    @property
    def row_valid(self) -> jax.Array:
        """``[max_batch, rows]`` (packed: ``[1, rows]``) bool: rows that are fed (``row < length``)."""
        self._cached_rows()
        if not self.packed:
            return jnp.arange(self.rows)[None] < self.lengths[:, None]
        req, local = self.row_requests()
        return (local < self.lengths[req])[None]
