"""Model-wide QCP's rows backend: where the one model's attention reads its keys when the rows of a span prefill
are split over attention TP by the per-request zigzag plan (inside the span prefill's ``jax.shard_map``; the
modules' ``shard`` is the `v41cp.sharding.row_group.RowGroup`).

Each rank holds local rows ``[1, C]`` (`StepBatch.qcp`'s ``positions / requests``; −1 = a padding slot) of any
requests, in plan order. The layers compute every projection from their own weights on those rows; `QCPRows`
only moves keys (the `CachedRows` interface, as `v41cp.serving.attention.paged_rows.PagedRows`):

* `window` — the rows' window KV all-gathered and restored to span order (``span_index``), after the pass's
  history from the SWA ring (read before it is written); each local row's window keys; the ring rows of the
  pass's last ``W`` positions (every rank writes the same rows);
* `group_first` — a ratio-2 row's pair partner (the previous position; `CachedRows.groups`): from the gathered
  span, or the cached open pair at a pass's first position; the open pair of each request's last even position is
  written;
* `compressor_windows` (DeepSeek-V4) — each local row's compression window from the gathered span (complete rows:
  a window across a rank boundary is pooled as on one device) or the slot's compressor ring before the pass; the
  ring rows of the pass's last ``n`` positions are written; `every_entry` — HCA's every visible entry;
* `write_entries` — the local rows' complete entries all-gathered, so every rank writes the same entries (under
  KVP = QCP each page by its owner only);
* `history` — a KV source's entries from the request's pages (under KVP from the owners, one all-reduce);
* `select_queries` / `attend` — each local row scores / attends its own request's history (no partial result
  merged), in row tiles × key tiles with a running top-k (`v41cp.layers.tiled_select`): no ``[rows, history]``
  intermediate;
* `ced_split` — CED narrowing at the boundary: the retained decoder rows stay on the rank that owned them
  (``dec_slots``), restored to span order by ``dec_span_index``; no row is redistributed;
* `sampled` — each request's sampled row (on one rank) to every rank by one all-reduce of ``B`` rows;
  `last_rows` — each request's last rows (DSpark's target features) the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from v41cp.config import LayerRole, ModelConfig
from v41cp.layers.attention import CSAState
from v41cp.layers.common import dtype_of
from v41cp.layers.indexer import every_visible_entry
from v41cp.layers.rows_backend import CachedRows
from v41cp.layers.tiled_select import ROW_TILE_BYTES, attend_rows, select_rows
from v41cp.serving.cache import paged as pc
from v41cp.serving.cache.device_cache import PagedCache
from v41cp.serving.step_batch import StepBatch
from v41cp.sharding.query_shard import fresh_visible_total
from v41cp.sharding.row_group import RowGroup

__all__ = ["QCPRows"]


class QCPRows(CachedRows):
    """Trace-time context of one model-wide QCP pass (inside the map; ``batch``'s per-rank fields are the rank's).
    ``kvp``: the KVP group size when the pages are split over the map's ``cp`` axis, else 1; ``tile_bytes``: the
    temporaries of one tile of the row-tiled selection / attention."""

    def __init__(self, cfg: ModelConfig, grp: RowGroup, batch: StepBatch, cache: PagedCache, kvp: int,
                 tile_bytes: int = ROW_TILE_BYTES):
        self.cfg, self.grp, self.kvp, self.batch, self.tile_bytes = cfg, grp, kvp, batch, tile_bytes
        self.dtype = dtype_of(cfg.dtype)
        self.n_slots = pc.cache_slots(cache)
        self.slot_r = jnp.clip(batch.slots, 0, self.n_slots - 1)
        self.narrows = batch.ced is not None
        self.columns = None                 # (no `split_columns_einsum`: inside the map each rank has its rows)
        q = batch.qcp
        self._bind(q.positions[0], q.requests[0], q.span_index, grp.n * batch.rows, batch.starts, batch.lengths,
                   q.continued)

    def _bind(self, pos, req, index, gathered_rows: int, starts, lengths, continued: bool):
        """This context's local rows (``pos / req [C]``), span order (``index [B,S]`` into the ``gathered_rows``
        all-gathered rows; that value = absent) and each request's rows ``starts … starts + lengths − 1``."""
        self.pos_c, self.req, self.rq = pos, req, jnp.maximum(req, 0)
        self.index, self.present = index, index < gathered_rows
        self.starts, self.lengths, self.continued = starts, lengths, continued
        self.pos = pos[None]                                                           # [1, C]
        self.valid = ((req >= 0) & (pos - starts[self.rq] < lengths[self.rq]))[None]

    def _context(self, *args) -> "QCPRows":
        other = object.__new__(QCPRows)
        other.__dict__.update(self.__dict__)
        other.narrows = False
        other._bind(*args)
        return other

    def ced_split(self):
        """CED narrowing at the boundary: ``(encoder, decoder, take)`` — the encoder context = each request's rows
        before its retained decoder rows (the boundary's cache-only writes), the decoder context = the retained
        rows on their owner ranks (a pass continuing at ``starts + encoder rows``), ``take`` = local rows
        ``[1, C, …]`` → the decoder's ``[1, Cd, …]``."""
        m, q, n = self.batch, self.batch.qcp, self.grp.n
        b, s = q.span_index.shape
        gathered_d = n * m.ced.decoder_rows
        enc = m.ced.encoder_rows                                                                # [B]
        encoder = self._context(self.pos_c, self.req, self.index, n * m.rows, self.starts, enc, self.continued)
        dec = q.dec_slots[0]
        d = jnp.maximum(dec, 0)
        p = jnp.arange(s)[None] + enc[:, None]
        index_d = jnp.where(p < s, jnp.take_along_axis(q.dec_span_index, jnp.minimum(p, s - 1), axis=1), gathered_d)
        decoder = self._context(self.pos_c[d], jnp.where(dec >= 0, self.req[d], -1), index_d, gathered_d,
                                self.starts + enc, m.lengths - enc, True)
        return encoder, decoder, lambda a: a[:, d]

    def sampled(self, h: jax.Array, at: jax.Array) -> jax.Array:
        """Local rows ``h [1,C,H]`` → ``[B,1,H]`` on every rank: request ``b``'s row ``at[b]`` of the gathered
        layout (−1: zeros)."""
        c = h.shape[1]
        mine = (at >= 0) & (at // c == self.grp.rank())
        hs = jnp.where(mine[:, None], h[0][jnp.clip(at % c, 0, c - 1)], jnp.zeros((), h.dtype))
        return self.grp.psum(hs)[:, None]

    def last_rows(self, x: jax.Array, count: int):
        """The last ``count`` rows of each request of this pass among the rows that reach the model's end (the
        CED decoder rows of a narrowing pass), from the local rows ``x [1, C, …]``, in span order on every rank:
        ``(rows [B, count, …], positions [B, count], valid [B, count])`` — each row from its owner rank by one
        all-reduce of ``B · count`` rows (the rows are never all gathered)."""
        f = self.ced_split()[1] if self.narrows else self
        b, s = f.index.shape
        c = x.shape[1]
        local = f.lengths[:, None] - count + jnp.arange(count, dtype=jnp.int32)[None]          # [B, count]
        valid = local >= 0
        at = jnp.where(valid, jnp.take_along_axis(f.index, jnp.clip(local, 0, s - 1), axis=1), -1)
        mine = valid & (at // c == self.grp.rank())
        rows = jnp.where(mine[..., None], x[0][jnp.clip(at % c, 0, c - 1)], jnp.zeros((), x.dtype))
        return self.grp.psum(rows), f.starts[:, None] + local, valid

    def _span(self, a: jax.Array) -> jax.Array:
        return self.grp.to_span(a[0], self.index)                                     # [1,C,·] → [B,S,·]

    def _row(self, a: jax.Array, rel: jax.Array) -> jax.Array:
        """Span-order ``a [B,S,·]`` at each request's chunk-relative rows ``rel [B,K]`` (clipped)."""
        return jnp.take_along_axis(a, jnp.clip(rel, 0, a.shape[1] - 1)[..., None], axis=1)

    # -------------------------------------------------------------------------------------- window ring
    def window(self, cache: PagedCache, layer: int, kv: jax.Array):
        """``kv [1,C,D]`` (pre-quantization) → ``(cache, keys, valid [1,C,W])``: the local rows' window keys oldest
        first, as `WindowKeys` (gathered per row tile by `attend`, never as one ``[C, W, D]`` array)."""
        cfg, w = self.cfg, self.cfg.sliding_window
        raw = self._span(kv)                                                            # [B,S,D]
        b, s = raw.shape[:2]
        fmt = cfg.cache_formats.window
        new = pc.stored_values(cfg, raw, fmt, self.dtype)
        start = self.starts
        hist_pos = start[:, None] - w + jnp.arange(w)[None]                             # [B,W]
        if self.continued:
            ring = pc.read(cache.swa, fmt, self.dtype, lambda a: a[layer][self.slot_r])
            hist = jnp.take_along_axis(ring, (hist_pos % w)[..., None], axis=1)
        else:
            hist = jnp.zeros((b, w, new.shape[-1]), new.dtype)
        ext = jnp.concatenate([hist, new], axis=1)            # [B, W+S, D]: column c = position start − W + c
        present = jnp.concatenate([hist_pos >= 0, self.present], axis=1)
        last = start[:, None] + self.lengths[:, None] - w + jnp.arange(w)[None]        # the pass's last W
        at = jnp.where((last >= start[:, None]) & (last >= 0), self.batch.slots[:, None], self.n_slots)
        cache = cache.replace(swa=pc.write(cfg, cache.swa, (layer, at, jnp.maximum(last, 0) % w),
                                           self._row(raw, last - start[:, None]), fmt))
        cols = jnp.clip((self.pos_c - start[self.rq])[:, None] + 1 + jnp.arange(w)[None], 0, w + s - 1)
        valid = present[self.rq[:, None], cols] & (self.pos_c[:, None] - (w - 1) + jnp.arange(w)[None] >= 0)
        return cache, WindowKeys(ext, self.rq, cols), valid[None]

    # ------------------------------------------------------------------------------------ compressor
    def group_first(self, cache: PagedCache, src: str, c: jax.Array, z: jax.Array):
        """Ratio-2 pair partners (the previous position) of the local rows ``c / z [1,C,D]`` → ``(cache, c0,
        z0)``; writes the open pair of each request's last even position of the pass."""
        cs, zs = self._span(c), self._span(z)
        b, s = cs.shape[:2]
        start = self.starts
        prev = (self.pos_c - start[self.rq] - 1)[:, None]                               # [C,1]
        open_kv, open_z = cache.open_kv[src], cache.open_score[src]

        def partner(span, opened):
            got = span[self.rq[:, None], jnp.maximum(prev, 0)][:, 0]
            return jnp.where(prev < 0, opened[self.slot_r][self.rq], got)[None]

        c0, z0 = partner(cs, open_kv), partner(zs, open_z)
        end = start + self.lengths
        first = 2 * ((end - 1) // 2)
        at = jnp.where((self.lengths > 0) & (first >= start), self.batch.slots, self.n_slots)
        pick = lambda a: self._row(a, (first - start)[:, None])[:, 0]
        cache = cache.replace(open_kv={**cache.open_kv, src: open_kv.at[at].set(pick(cs), mode="drop")},
                              open_score={**cache.open_score, src: open_z.at[at].set(pick(zs), mode="drop")})
        return cache, c0, z0

    def compressor_windows(self, cache: PagedCache, role: LayerRole, c: jax.Array, z: jax.Array, part: str):
        """V4's compression windows of the local rows (`CachedRows.groups`): ``c / z [1,C,W]`` FP32 projections →
        ``(cache, c [1,C,n,W], z [1,C,n,W], j, emits)``, row ``p``'s window = positions ``p − n + 1 … p``
        (``n = role.window_rows``) from the gathered span — complete rows, so a window that straddles a rank boundary is the one
        the one-device pass pools — or, before the pass, the slot's ring (`declare_cache`: ``open_kv`` /
        ``open_score`` ``[B, n·W]``; the indexer's under ``"<layer>i"``); positions before 0 empty (value 0, score
        −inf). Every rank writes the same ring rows: each request's last ``n`` positions of the pass."""
        r = role.ratio
        n = role.window_rows
        key = str(role.kv_source) + ("i" if part == "index" else "")
        width = c.shape[-1]
        start, end = self.starts, self.starts + self.lengths
        want = self.pos_c[:, None] - (n - 1) + jnp.arange(n)[None]                     # [C, n] positions
        rel = want - start[self.rq][:, None]
        last = end[:, None] - n + jnp.arange(n)[None]                                   # [B, n] the pass's last n
        at = (jnp.where((last >= start[:, None]) & (last >= 0), self.batch.slots[:, None], self.n_slots),
              jnp.maximum(last, 0) % n)
        out, rings = [], {}
        for name, values, fill in (("open_kv", c, 0.0), ("open_score", z, -jnp.inf)):
            span = self._span(values)                                                   # [B, S, W]
            ring = getattr(cache, name)[key].reshape(self.n_slots, n, width)
            held = ring[self.slot_r][self.rq[:, None], want % n]                        # [C, n, W]
            got = jnp.where((rel >= 0)[..., None], span[self.rq[:, None], jnp.clip(rel, 0, span.shape[1] - 1)], held)
            out.append(jnp.where((want >= 0)[..., None], got, fill)[None])
            fresh = self._row(span, last - start[:, None])                              # [B, n, W]
            rings[name] = {**getattr(cache, name), key: ring.at[at].set(fresh, mode="drop").reshape(self.n_slots, -1)}
        cache = cache.replace(**rings)
        emits = self.valid & (self.pos % r == r - 1)
        return cache, out[0], out[1], self.pos // r, emits

    def every_entry(self, cache: PagedCache, role: LayerRole, state: CSAState) -> jax.Array:
        """V4 HCA's selection of the local rows ``[1, C, G]``: every entry of the request's history (``G = MB ·
        epb``) complete at the row's position, −1 otherwise."""
        return every_visible_entry(self.pos, role.ratio, state.ckv.shape[1])

    def write_entries(self, cache: PagedCache, role: LayerRole, ckv: jax.Array, ik: jax.Array, j: jax.Array,
                      emits: jax.Array) -> dict:
        """The local rows' entries ``j [1,C]`` (``ckv [1,C,D]`` / ``ik [1,C,Di]`` pre-quantization, where
        ``emits``) → every rank's, written to the pages of KV source ``role``."""
        src, g = str(role.kv_source), self.grp.gather
        req = g(self.req)
        tables = self.batch.block_tables[jnp.maximum(req, 0)]                            # [N·C, MB]
        ok = (g(emits[0]) & (req >= 0))[:, None]
        jj = g(j[0])[:, None]
        formats = self.cfg.cache_formats
        for name, values, fmt in (("ckv", ckv, formats.entries), ("ikey", ik, formats.index)):
            if src not in cache.pool(name):                     # V4 HCA: no index keys
                continue
            store = pc.write_entries(self.cfg, self.kvp, True, cache.pool(name)[src], g(values[0])[:, None], jj, ok,
                                     tables, fmt)
            cache = cache.with_pool(name, src, store)
        return cache

    # --------------------------------------------------------------------------- selection and attention
    def history(self, cache: PagedCache, role: LayerRole) -> CSAState:
        """A KV source's entries of every request ``[B, MB·epb, ·]`` from its pages (after this pass's writes)."""
        src = str(role.kv_source)
        read = lambda name, fmt: pc.read_pages(self.kvp, True, cache.pool(name)[src], self.batch.block_tables, fmt,
                                               self.dtype)
        formats = self.cfg.cache_formats
        return CSAState(ckv=read("ckv", formats.entries),
                        ikeys=read("ikey", formats.index) if src in cache.ikey else None)

    def select_queries(self, cache: PagedCache, role: LayerRole, q: jax.Array, weights: jax.Array,
                       state: CSAState):
        """Each local row scores its request's index keys in tiles (`v41cp.layers.tiled_select.select_rows`):
        ``q [1,C,Hi,Di]`` → ``(topk [1,C,K], candidates as kept block ids [C, kb])``. A fresh pass's rows see
        only the pass's own entries: its static bound on their sum (`fresh_visible_total`) lets the selection
        scan only the key tiles each row tile can see."""
        total = None if self.continued else fresh_visible_total(self.pos_c.shape[0], self.index.shape[1],
                                                                 self.grp.n, role.ratio)
        topk, cand = select_rows(self.cfg, role, q[0], weights[0], state.ikeys, self.rq, self.pos_c,
                                 state.candidates, budget=self.tile_bytes, visible_total=total)
        return topk[None], cand

    def attend(self, cache: PagedCache, role: LayerRole, q: jax.Array, keys: "WindowKeys", valid: jax.Array,
               state: CSAState, sink: jax.Array) -> jax.Array:
        """Sink attention of the local rows over their window keys and selected entries (every head), in row tiles
        (`v41cp.layers.tiled_select.attend_rows`)."""
        compressed = role.ratio > 0 and state.topk.shape[-1]
        o = attend_rows(q[0], keys.rows, valid[0], state.ckv if compressed else None, self.rq,
                        state.topk[0] if compressed else None, sink, budget=self.tile_bytes,
                        window_operands=(keys.ext, keys.req, keys.cols))
        return o[None]


class WindowKeys:
    """The local rows' window keys, unmaterialized: ``ext [B, W+S, D]`` (each request's ring history then its span
    rows), the rows' requests ``req [C]`` and columns ``cols [C, W]``. `rows(r)` gathers rows ``r [T]`` →
    ``[T, W, D]``."""

    def __init__(self, ext: jax.Array, req: jax.Array, cols: jax.Array):
        self.ext, self.req, self.cols = ext, req, cols

    def rows(self, r: jax.Array) -> jax.Array:
        return self.ext[self.req[r][:, None], self.cols[r]]
