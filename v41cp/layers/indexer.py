"""CSA2 indexer: index keys (KV sources), ReLU-weighted scores and the two-level top-k.

Selection convention (shared by the whole code base): top-k order is score descending, then
logical position ascending (``jax.lax.top_k`` order); picks with score −inf are padding, index −1.
This differs from ``torch.topk`` only among exactly tied scores, whose order torch leaves
unspecified (it depends on the row width); the selected *set* is identical whenever the k-th and
(k+1)-th scores differ.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from v41cp.config import LayerRole, ModelConfig
from v41cp.kernels.indexer_topk import dense_pages, index_block_maxima, indexer_topk
from v41cp.kernels.indexer_topk.reference import index_scores
from v41cp.layers.common import RMSNorm, declare, dtype_of, weight_for
from v41cp.layers.compressor import Compressor
from v41cp.layers.rope import apply_rope
from v41cp.layers.tiled_select import select_rows
from v41cp.quant import hadamard_rotate, mxfp4_block32
from v41cp.sharding.operator_qcp import interleaved_island

__all__ = ["Indexer", "IndexQuery", "index_query", "kept_candidate_entries", "every_visible_entry",
           "kernel_select_rows", "select_candidate_blocks", "select_positions", "select_scored", "topk_select",
           "query_parallel_select", "query_parallel_select_rows"]


def select_candidate_blocks(scores: jax.Array, visible_len: jax.Array, topk_blocks: int,
                            block_size: int) -> jax.Array:
    """Boolean candidate mask ``[B,S,G]`` from masked scores ``[B,S,G]``.

    Block score = max over its ``block_size`` positions; the block holding the newest visible
    position ``(len−1)//block_size`` is pinned (+inf); the top ``topk_blocks`` blocks with a finite
    (or pinned) score are kept.
    """
    b, s, g = scores.shape
    pad = -g % block_size
    blocks = jnp.pad(scores, ((0, 0), (0, 0), (0, pad)), constant_values=-jnp.inf)
    blocks = jnp.max(blocks.reshape(b, s, -1, block_size), axis=-1)
    return kept_candidate_entries(blocks, visible_len[..., 0], topk_blocks, block_size, g)


def kept_candidate_entries(blocks: jax.Array, visible_len: jax.Array, topk_blocks: int, block_size: int,
                           g: int) -> jax.Array:
    """Block maxima ``[..., nb]`` (−inf = no scored entry) → the kept entry mask ``[..., g]``: the block holding
    the newest visible position ``(len−1)//block_size`` is pinned (+inf), the top ``topk_blocks`` blocks with a
    finite (or pinned) maximum are kept. ``visible_len [...]``. Shared by the XLA and kernel paths."""
    lead, nb = blocks.shape[:-1], blocks.shape[-1]
    last = jnp.floor_divide(visible_len - 1, block_size)[..., None]
    blocks = jnp.where(jnp.arange(nb) == last, jnp.inf, blocks).reshape(-1, nb)
    vals, idx = jax.lax.top_k(blocks, min(topk_blocks, nb))
    keep = jnp.zeros(blocks.shape, bool).at[jnp.arange(blocks.shape[0])[:, None], idx].set(vals > -jnp.inf)
    return jnp.repeat(keep.reshape(*lead, nb), block_size, axis=-1)[..., :g]


def every_visible_entry(positions: jax.Array, ratio: int, g: int) -> jax.Array:
    """The selection that reads every entry complete at each row's position (V4 HCA): ``positions [...]`` →
    ``[..., g]`` int32, entry ``j`` where ``j < (p + 1) // ratio``, else −1."""
    j = jnp.arange(g, dtype=jnp.int32)
    return jnp.where(j < ((positions + 1) // ratio)[..., None], j, -1)


def topk_select(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Top-``k`` of ``scores [..., G]`` in ``lax.top_k`` order; −inf picks → index −1. Returns (idx, vals)."""
    vals, idx = jax.lax.top_k(scores, k)
    idx = jnp.where(vals > -jnp.inf, idx, -1)
    return idx.astype(jnp.int32), vals


def index_query(cfg: ModelConfig, wq_b, w_proj, x, qr, angles) -> tuple[jax.Array, jax.Array]:
    """Index queries ``[B,S,index_heads,index_head_dim]`` (rotated; MXFP4 under fake-quant, V4 first turned by the
    Hadamard transform as its keys are, `compressed_keys`) and the per-head score weights ``[B,S,index_heads]``
    (scaled by ``index_head_dim^-1/2 · index_heads^-1/2``)."""
    q = apply_rope(jnp.einsum("bsr,rhe->bshe", qr, weight_for(wq_b, qr)), angles)
    if cfg.fake_quant:
        q = mxfp4_block32(hadamard_rotate(q) if cfg.is_v4 else q)
    weights = jnp.einsum("bsh,hn->bsn", x, weight_for(w_proj, x)) * (
        cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5)
    return q, weights


@dataclasses.dataclass(frozen=True)
class IndexQuery:
    """The index query of a layer's rows, not yet projected: the layer's ``wq_b [q_lora, index_heads, Di]`` and
    ``w_proj [H, index_heads]`` with the rows' ``x [B,R,H]``, ``qr [B,R,q_lora]`` and ``angles [B,R,P]`` (trace time
    only). Calling it projects every row (`index_query`); a rows backend that splits the rows over ranks
    (operator-local indexer QCP of a full sequence, `query_parallel_select`) projects each rank's own rows instead."""

    cfg: ModelConfig
    wq_b: jax.Array
    w_proj: jax.Array
    x: jax.Array
    qr: jax.Array
    angles: jax.Array

    def __call__(self) -> tuple[jax.Array, jax.Array]:
        return index_query(self.cfg, self.wq_b, self.w_proj, self.x, self.qr, self.angles)


def select_positions(cfg: ModelConfig, role: LayerRole, wq_b, w_proj, x, qr, angles, keys, positions, candidates):
    """`index_query` of rows ``x [B,S,H]`` / ``qr [B,S,q_lora]`` / ``angles [B,S,P]`` with the layer's weights
    ``wq_b [q_lora, index_heads, Di]``, ``w_proj [H, index_heads]``, then `select_scored`."""
    q, weights = index_query(cfg, wq_b, w_proj, x, qr, angles)
    return select_scored(cfg, role, q, weights, keys, positions, candidates)


def select_scored(cfg: ModelConfig, role: LayerRole, q, weights, keys, positions, candidates):
    """Score query rows against index keys and select (every mode's XLA / kernel selection of rows whose keys
    are a per-request array).

    Args:
      q ``[B,S,index_heads,Di]`` / weights ``[B,S,index_heads]``: `index_query` of the rows.
      keys ``[B,G,Di]``: index keys in entry order (entries past a row's history are masked).
      positions ``[B|1, S]``: the rows' positions; candidates ``[B,S,G]`` bool or None: the candidate source's mask.
    Returns: ``(topk [B,S,min(index_topk, G)] int32, candidates, scores [B,S,G] or None on the kernel path)``.
    """
    b, s = q.shape[:2]
    g = keys.shape[1]
    if cfg.indexer_backend == "pallas":
        topk, candidates = _kernel_select(cfg, role, q, weights, keys, positions, candidates)
        return topk, candidates, None
    visible_len = jnp.broadcast_to(((positions + 1) // role.ratio)[..., None], (b, s, 1))
    allowed = jnp.arange(g)[None, None, :] < visible_len                            # [B,S,G]
    scores = jnp.where(allowed, index_scores(q, weights, keys), -jnp.inf)
    if role.candidate_source:
        candidates = select_candidate_blocks(scores, visible_len, cfg.candidate_topk_blocks,
                                             cfg.candidate_block_size) & allowed
    elif role.uses_candidates:
        scores = jnp.where(candidates, scores, -jnp.inf)
    topk, _ = topk_select(scores, min(cfg.index_topk, g))
    return topk, candidates, scores


def kernel_select_rows(cfg: ModelConfig, role: LayerRole, q, w, store, pages, page_ids, visible, epb: int, g: int,
                       candidates):
    """Index selection of kernel rows through the indexer kernels (shared by the full-sequence model and the
    decode step). q ``[R, Hi, Di]``, w ``[R, Hi]``; ``store`` / ``pages`` / ``page_ids`` / ``visible`` as
    `v41cp.kernels.indexer_topk`; ``g`` the history capacity in entries (the reference's ``G``);
    ``candidates [R, g]`` the candidate entry mask (uses_candidates layers) or None.
    Returns ``(topk [R, min(index_topk, g)], candidates [R, g] or the input)``, as `select_positions` selects."""
    cbs, backend, mask = cfg.candidate_block_size, cfg.indexer_backend, None
    if role.candidate_source:
        maxima, _ = index_block_maxima(q, w, store, pages, page_ids, visible, epb=epb, cbs=cbs, backend=backend)
        kept = kept_candidate_entries(maxima[:, :-(-g // cbs)], visible, cfg.candidate_topk_blocks, cbs, g)
        candidates = kept & (jnp.arange(g)[None] < visible[:, None])
    elif role.uses_candidates:
        mask = candidates[:, ::cbs]                        # the entry mask repeats a block mask
    topk, _ = indexer_topk(q, w, store, pages, page_ids, visible, min(cfg.index_topk, g), epb=epb,
                           block_mask=mask, cbs=cbs, backend=backend)
    return topk, candidates


def _kernel_select(cfg: ModelConfig, role: LayerRole, q, weights, keys, positions, candidates):
    """`select_positions` through the indexer kernels (``indexer_backend="pallas"``): each query row ``(b, s)`` is
    one kernel row whose page list covers request ``b``'s keys (`v41cp.kernels.indexer_topk.dense_pages`).
    Returns ``(topk [B,S,K], candidates [B,S,G] or the input)``; the scores are never materialized."""
    b, s, hi, di = q.shape
    g = keys.shape[1]
    cbs = cfg.candidate_block_size
    page = cbs * max(1, 16 // cbs)                                    # a whole number of candidate blocks
    store, pages, page_ids = dense_pages(keys, page)
    rows = lambda a: jnp.repeat(a, s, axis=0)                         # [B, ...] -> [B*S, ...]
    visible = jnp.broadcast_to((positions + 1) // role.ratio, (b, s)).reshape(-1)
    cand = None if candidates is None else candidates.reshape(b * s, g)
    topk, cand = kernel_select_rows(cfg, role, q.reshape(b * s, hi, di), weights.reshape(b * s, hi), store,
                                    rows(pages), rows(page_ids), visible, page, g, cand)
    return topk.reshape(b, s, -1), None if cand is None else cand.reshape(b, s, g)


def query_parallel_select(shard, cfg: ModelConfig, role: LayerRole, wq_b, w_proj, x, qr, angles, keys, positions):
    """Operator-local indexer QCP of a full sequence (`interleaved_island`): each rank projects its rows (all
    index heads), scores them against the complete keys and selects. Inputs as `select_positions` (replicated
    over attention TP); returns ``[B,S,K]`` on every rank."""
    b, s, _ = x.shape
    ops = {"wq_b": wq_b, "w_proj": w_proj, "x": x, "qr": qr, "angles": angles, "keys": keys,
           "positions": jnp.broadcast_to(positions, (b, s))}

    def select_rows(rows, o):
        take = lambda a: jnp.take(a, rows, axis=1)
        return select_positions(cfg, role, o["wq_b"], o["w_proj"], take(o["x"]), take(o["qr"]), take(o["angles"]),
                                o["keys"], take(o["positions"]), None)[0]

    return interleaved_island(shard, b, s, ops, select_rows)


def query_parallel_select_rows(shard, cfg: ModelConfig, role: LayerRole, q, weights, keys, requests, positions):
    """Operator-local indexer QCP of cached rows (`interleaved_island`): ``q [T,Hi,Di]`` / ``weights [T,Hi]`` (the
    rows' index queries, replicated), ``keys [B,G,Di]`` each request's index keys, ``requests / positions [T]``.
    Each rank scores its rows against their requests' keys; returns ``[T, K]`` on every rank."""
    t = q.shape[0]

    def local_rows(rows, o):                       # in row tiles × key tiles: no [local, G] intermediate
        topk, _ = select_rows(cfg, role, o["q"][rows], o["w"][rows], o["keys"], o["req"][rows], o["pos"][rows], None)
        return topk[None]                                                           # [1, local, K]

    ops = {"q": q, "w": weights, "keys": keys, "req": requests, "pos": positions}
    return interleaved_island(shard, 1, t, ops, local_rows)[0]


class Indexer(nn.Module):
    """Parameters: ``wq_b [q_lora, index_heads, index_head_dim]``, ``weights_proj [H, index_heads]``;
    KV sources also ``wk [head_dim, index_head_dim]`` and ``k_norm [index_head_dim]``. V4 (CSA layers): instead of
    ``wk`` / ``k_norm``, its own overlapping ratio-4 ``compressor`` at the index head dim (`compressed_keys`)."""

    cfg: ModelConfig
    role: LayerRole

    def setup(self):
        cfg = self.cfg
        dt = dtype_of(cfg.dtype)
        if cfg.is_v4:
            self.compressor = Compressor(cfg, self.role.ratio, v4=True, overlap=True, dim=cfg.index_head_dim)
        elif self.role.is_kv_source:
            self.wk = declare(self, "wk", (cfg.head_dim, cfg.index_head_dim), (None, None), dt)
            self.k_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps, dt)
        self.wq_b = declare(self, "wq_b", (cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim),
                            ("q_lora", "index_heads", None), dt)
        self.weights_proj = declare(self, "weights_proj", (cfg.hidden_size, cfg.index_n_heads),
                                    ("embed", "index_heads"), dt)

    def index_keys(self, latent: jax.Array, compressed_angles: jax.Array, quantize: bool = True) -> jax.Array:
        """Index keys ``[..., index_head_dim]`` (rotated) from pre-RoPE compressor latents ``[..., head_dim]`` at
        their entries' angles; MXFP4 fake-quant under ``cfg.fake_quant`` unless ``quantize=False`` (a cache
        write encodes the raw keys itself)."""
        k = self.k_norm(jnp.einsum("...d,de->...e", latent, weight_for(self.wk, latent)))
        k = apply_rope(k, compressed_angles)
        return mxfp4_block32(k) if self.cfg.fake_quant and quantize else k

    def compressed_keys(self, rows, cache, x: jax.Array, compressed_angles: jax.Array):
        """V4: ``(cache, index keys [B, G, index_head_dim])`` of the rows' complete windows (``rows.groups`` of the
        ``"index"`` part: its own state), pooled by this indexer's own compressor and rotated at their entries'
        ``compressed_angles``; under fake-quant then turned by the Hadamard transform, as the release does before
        their MXFP4 (the cache's format: the store quantizes). The transform is orthonormal and turns the queries
        too (`index_query`), so without the fake-quant it would leave every score as it is: it is skipped there."""
        cache, c, z, _, _ = rows.groups(cache, self.role, *self.compressor.project(x), part="index")
        k = apply_rope(self.compressor.finish(self.compressor.pool(c, z), x.dtype), compressed_angles)
        return cache, hadamard_rotate(k) if self.cfg.fake_quant else k

    def query(self, x: jax.Array, qr: jax.Array, angles: jax.Array) -> IndexQuery:
        """The index query of rows ``x [B,R,H]``, ``qr [B,R,q_lora]`` at ``angles [B,R,P]`` (`IndexQuery`: projected
        where the rows backend selects)."""
        return IndexQuery(self.cfg, self.wq_b, self.weights_proj, x, qr, angles)
