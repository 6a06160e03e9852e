"""Dropless sparse MoE dispatch with static shapes (``moe_backend="sparse"``, the default).

Each token runs only the ``k`` experts the router chose; no (token, expert) pair is ever dropped and every
shape is a function of the bucket (``T`` tokens, ``k``, ``E`` experts, the local expert width), never of the
routing, so a step compiles once per bucket (CUDA-graph-like decode).

Layout (`DispatchShape`): the ``T·k`` pairs are sorted by expert (stable: token order inside an expert) and
laid out in **tiles** of ``G`` slots, every tile belonging to one expert; an expert with ``c`` pairs takes
``⌈c / G⌉`` tiles. The slot capacity ``T·k + min(E, T·k)·(G − 1)`` (rounded up to whole tiles) holds any
routing, so nothing is dropped; unused slots hold pair −1 (a zero row whose output is dropped). ``G``
is the largest power of two whose worst-case padding stays within `TILE_PADDING` of the pairs (decode: ``G =
1``, exactly ``T·k`` slots; long prefills: up to 128). Tiles are processed in chunks (a ``fori_loop`` when
there is more than one) so the gathered expert weights of a chunk stay under ``chunk_bytes``.

Work per tile: the tile's expert weights are gathered — as stored: FP4 experts stay packed in device memory
and are decoded per tile, only for the tiles computed (`stored_matmul`) — then ``[G, H] → [G, I'] → [G,
H]`` clamped SwiGLU. Each pair's output is written to its own row (token-major, ``t·k + j``); `_combine` then
sums a token's ``k`` rows times their routing weights in FP32, always in the order ``j = 0 … k−1``.

Batch invariance: a token's output depends on its own pairs only, never on the tile size or on which other
tokens share the pass — the dispatch adds nothing across tiles (no scatter-add: no atomics, and no order that
follows other tokens' routing). What remains is the expert GEMM's own rounding at different tile heights: the
grouped kernel's fixed ``block_k`` loop gives the same row at every height; XLA's GEMMs (CPU, cuBLAS) may not at
every width, and `stored_matmul` folds FP4 scales into the weights from 16-row tiles on. (A prefix-cache hit's
shorter pass computes the cold pass's rows bit for bit: `tests/serving/cache/test_prefix_cache.py`.)

Expert GEMM backend (``cfg.expert_backend``): ``"xla"`` gathers each tile's expert weights and decodes them per
tile (`stored_matmul`); ``"pallas"`` runs the grouped FP4 kernel (`v41cp.kernels.grouped_matmul`), which reads
each tile's expert bytes as stored and decodes them in registers. The kernel needs tiles of at least 16 rows
(the tensor-core minimum), so with it the dispatch always sorts pairs into expert tiles (``G ≥ 16``; decode
included): pairs of one expert share a tile, so an expert's weights are read once per tile, and tiles with
no pair are skipped. Plain (dequantized) expert weights always take the XLA path.

Tensor-parallel MoE: the caller passes each rank's slice of every expert's intermediate width (``I' = I /
N``); the result is that rank's partial sum (the caller reduces), so every rank does the same work on the
same routing — balanced by construction, and dropless without dynamic counts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from v41cp.kernels import match_varying
from v41cp.kernels.grouped_matmul import grouped_fp4_matmul
from v41cp.kernels.grouped_matmul.reference import stored_matmul
from v41cp.layers.common import full_after

__all__ = ["DispatchShape", "dispatch", "sparse_routed_output", "expert_width", "TILE_PADDING",
           "CHUNK_WEIGHT_BYTES", "row_bytes"]

TILE_PADDING = 1.0625           # worst-case padded slots ≤ 1.0625 × pairs (or G = 1)
MAX_TILE = 128
CHUNK_WEIGHT_BYTES = 1 << 30    # gathered (decoded) expert weights per chunk of tiles


@dataclasses.dataclass(frozen=True)
class DispatchShape:
    """Static dispatch geometry: ``pairs = T·k``, ``tile`` slots per tile, ``tiles`` (= ``chunks · chunk``)."""

    pairs: int
    experts: int
    tile: int
    chunk: int
    chunks: int

    @property
    def tiles(self) -> int:
        return self.chunk * self.chunks

    @property
    def slots(self) -> int:
        return self.tiles * self.tile

    @classmethod
    def build(cls, tokens: int, k: int, experts: int, tile_weight_bytes: int,
              chunk_bytes: int = CHUNK_WEIGHT_BYTES, min_tile: int = 1, slot_bytes: int = 0) -> "DispatchShape":
        """Geometry for ``tokens`` rows routed to ``k`` of ``experts`` experts; ``tile_weight_bytes`` (+ the tile's
        slots × ``slot_bytes``): what one tile holds in flight, which sets the chunk size under ``chunk_bytes``;
        ``min_tile``: the smallest tile (16 for the grouped kernel)."""
        pairs = tokens * k
        capacity = lambda g: -(-(pairs + min(experts, pairs) * (g - 1)) // g)      # tiles that hold any routing
        tile = min_tile
        while tile < MAX_TILE and capacity(2 * tile) * 2 * tile <= TILE_PADDING * pairs:
            tile *= 2
        need = capacity(tile)
        per_chunk = max(1, chunk_bytes // max(1, tile_weight_bytes + tile * slot_bytes))
        chunks = -(-need // per_chunk)
        return cls(pairs, experts, tile, -(-need // chunks), chunks)


def dispatch(idx: jax.Array, shape: DispatchShape):
    """Router ids ``idx [T, k]`` → ``(tile_expert [tiles] int32, slot_pair [tiles, G] int32)``: the ``T·k``
    (token, expert) pairs — pair ``p = t·k + j`` is token ``t``'s ``j``-th choice — sorted by expert (stable:
    token order inside an expert), each expert's pairs in whole tiles of its own; empty slots hold −1 (tiles past
    the last used one: the last used expert, every slot empty)."""
    t, k = idx.shape
    e, g = shape.experts, shape.tile
    flat = idx.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    sorted_e = flat[order]
    counts = jnp.zeros((e,), jnp.int32).at[flat].add(1)
    first = jnp.cumsum(counts) - counts                               # first sorted pair of each expert
    tiles_e = (counts + g - 1) // g
    tile_end = jnp.cumsum(tiles_e)
    slot = (tile_end - tiles_e)[sorted_e] * g + jnp.arange(t * k, dtype=jnp.int32) - first[sorted_e]
    slot_pair = jnp.full((shape.slots,), -1, jnp.int32).at[slot].set(order)
    # each non-empty expert marks its first tile; a running maximum fills its other tiles (and the unused tail)
    starts = jnp.where(tiles_e > 0, tile_end - tiles_e, shape.tiles)
    marks = jnp.zeros((shape.tiles,), jnp.int32).at[starts].max(jnp.arange(e, dtype=jnp.int32), mode="drop")
    tile_expert = jax.lax.cummax(marks)
    return tile_expert, slot_pair.reshape(shape.tiles, g)


def row_bytes(hidden: int, k: int, dtype) -> int:
    """Bytes `sparse_routed_output` holds per input row at once: the row, the FP32 output of each of its ``k``
    pairs (their own rows) and its FP32 result."""
    return hidden * (jnp.dtype(dtype).itemsize + 4 * k + 4)


def _tile_matmul(x: jax.Array, weight, tiles: jax.Array, backend: str = "xla", live=None) -> jax.Array:
    """``x [c, G, n]`` times expert ``tiles [c]``'s weight: a plain ``[E, n, o]`` array, or stored FP4 ``(packed
    [E, o, n/2], scale [E, o, n/32])`` → ``[c, G, o]``; ``backend="pallas"``: FP4 weights through the grouped
    kernel (``live [c]``: 0 = tile without pairs, skipped)."""
    if isinstance(weight, tuple):
        packed, scale = weight
        if backend == "pallas":
            return grouped_fp4_matmul(x, tiles, packed, scale, live=live, backend="pallas")
        return stored_matmul(x, packed[tiles], scale[tiles])
    return jnp.einsum("cgn,cno->cgo", x, weight[tiles].astype(x.dtype))


def expert_width(experts: dict) -> tuple[int, int]:
    """(experts ``E``, intermediate width ``I'``) of `sparse_routed_output`'s ``experts`` (read from ``w2``)."""
    w2 = experts["w2"]
    return (w2[0].shape[0], 2 * w2[0].shape[2]) if isinstance(w2, tuple) else (w2.shape[0], w2.shape[1])


def _expert_ffn(xs: jax.Array, tiles: jax.Array, experts: dict, swiglu, backend: str = "xla", live=None) -> jax.Array:
    """Tile rows ``xs [c, G, H]`` through expert ``tiles [c]``: SwiGLU of ``w1`` / ``w3``, then ``w2`` →
    ``[c, G, H]`` in ``xs.dtype``."""
    mm = lambda x, name: _tile_matmul(x, experts[name], tiles, backend, live)
    act = swiglu(mm(xs, "w1"), mm(xs, "w3"))
    return mm(act, "w2").astype(xs.dtype)


def _combine(pair_out: jax.Array, weights: jax.Array) -> jax.Array:
    """``Σ_j weights[t, j] · pair_out[t·k + j]`` in FP32, in the order ``j = 0 … k−1``, for every token:
    ``pair_out [≥ T·k, H]`` FP32 (each pair's expert output, token-major), ``weights [T, k]`` → ``[T, H]``. Written
    as a chain of adds so the order is the program's, not the backend's: a token's output depends on its own
    pairs only — not on the tile size or the other tokens of the pass (batch invariance)."""
    t, k = weights.shape
    y = pair_out[:t * k].reshape(t, k, -1)
    w = weights.astype(jnp.float32)
    out = y[:, 0] * w[:, :1]
    for j in range(1, k):
        out = out + y[:, j] * w[:, j:j + 1]
    return out


def _loop_carry(init: jax.Array, *operands) -> jax.Array:
    """``init`` varying over the mesh axes the operands vary over (a ``fori_loop`` carry inside ``jax.shard_map``
    keeps one variance; a no-op outside)."""
    return match_varying([init, *jax.tree.leaves(operands)])[0][0]


def _chunked(shape: DispatchShape, run, init: jax.Array, operands: tuple, like) -> jax.Array:
    """``run(acc, *chunk)`` over the ``shape.chunks`` chunks of ``operands`` (leading axis ``tiles``): straight-line
    for one chunk, else a ``fori_loop``."""
    if shape.chunks == 1:
        return run(init, *operands)
    c = shape.chunk

    def body(i, acc):
        return run(acc, *(jax.lax.dynamic_slice_in_dim(a, i * c, c, axis=0) for a in operands), offset=i * c)

    return jax.lax.fori_loop(0, shape.chunks, body, _loop_carry(init, like))


def sparse_routed_output(x: jax.Array, idx: jax.Array, weights: jax.Array, experts: dict, swiglu,
                         chunk_bytes: int = CHUNK_WEIGHT_BYTES, backend: str = "xla") -> jax.Array:
    """Σ over each token's ``k`` experts of ``weights[t, j] · expert_idx[t, j](x_t)`` — only the chosen experts
    run. ``x [T, H]``; ``idx`` / ``weights [T, k]`` (router output); ``experts``: ``{"w1", "w3", "w2"}``, each a
    plain array (``w1`` / ``w3 [E, H, I']``, ``w2 [E, I', H]``) or stored FP4 ``(packed, scale)`` in the
    ``[E, out, in]`` orientation (``[E, I', H/2]`` / ``[E, H, I'/2]``); ``swiglu(gate, up)`` the activation.
    ``backend``: the expert GEMMs (``"xla"`` or ``"pallas"``, see the module docstring).
    Returns FP32 ``[T, H]`` (a partial sum when ``I'`` is a slice of the intermediate width)."""
    t, h = x.shape
    n_experts, width = expert_width(experts)
    kernel = backend == "pallas" and isinstance(experts["w2"], tuple)
    # per tile in flight: the XLA path's gathered, decoded weights; the kernel's are read in place, so only the
    # tile's activations count, per slot of the tile chosen (rows in and out, gate / up / act; FP32 bound)
    shape = DispatchShape.build(t, idx.shape[1], n_experts, 0 if kernel else 3 * h * width * x.dtype.itemsize,
                                chunk_bytes, min_tile=16 if kernel else 1,
                                slot_bytes=(2 * h + 3 * width) * 4 if kernel else 0)
    like = (x, idx, weights, experts)
    k = idx.shape[1]
    pairs = t * k
    # every pair's expert output lands in its own row of ``pair_out`` (token-major: row t·k + j), then
    # `_combine` sums each token's k rows in a fixed order: a plain scatter, no accumulation across tiles, so
    # the result is the same whatever the tile size and deterministic on backends whose scatter-add is atomic
    # FP32 rows (exact for the expert outputs; a BF16 scatter would be widened to FP32 and back on backends
    # without BF16 scatter, measured on XLA:CPU), allocated with this layer
    out0 = full_after((shape.slots if shape.tile == 1 else pairs, h), 0, jnp.float32, x)
    if shape.tile == 1:
        # tiles of one slot (decode): every (token, expert) pair is its own tile, already in token-major order —
        # no sort and no scatter
        pad = shape.slots - pairs
        tiles = jnp.pad(idx.reshape(-1).astype(jnp.int32), (0, pad))
        xs = jnp.pad(jnp.repeat(x, k, axis=0), ((0, pad), (0, 0)))[:, None, :]          # [P, 1, H]

        def one_slot(out, tiles, xs, offset=0):
            y = _expert_ffn(xs, tiles, experts, swiglu)[:, 0].astype(jnp.float32)
            return jax.lax.dynamic_update_slice_in_dim(out, y, offset, axis=0)

        return _combine(_chunked(shape, one_slot, out0, (tiles, xs), like), weights)
    tile_expert, slot_pair = dispatch(idx, shape)
    rows = jnp.concatenate([x, jnp.zeros((1, h), x.dtype)])                 # row T: the empty slot's zero row

    def tiles_run(out, tiles, slot_pairs, offset=0):
        tok = jnp.where(slot_pairs < 0, t, slot_pairs // k)
        live = jnp.any(slot_pairs >= 0, axis=1).astype(jnp.int32) if kernel else None
        y = _expert_ffn(rows[tok], tiles, experts, swiglu, backend if kernel else "xla", live).astype(jnp.float32)
        dest = jnp.where(slot_pairs < 0, pairs, slot_pairs).reshape(-1)     # empty slots: out of range, dropped
        return out.at[dest].set(y.reshape(-1, h), mode="drop")

    return _combine(_chunked(shape, tiles_run, out0, (tile_expert, slot_pair), like), weights)
