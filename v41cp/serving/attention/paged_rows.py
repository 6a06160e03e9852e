"""The cached-rows backend: where the model's attention reads its keys when rows continue a request's cached
history (decode = one row per request, verification = ``k`` rows, the token-serial prefill = one row at a time).

The step's metadata is a `v41cp.serving.step_batch.StepBatch` (static bucket fields ``max_batch`` / ``max_blocks``
/ ``rows``): request ``b`` feeds rows ``starts[b] … starts[b] + lengths[b] − 1`` (``lengths ≤ rows``; 0 = an idle
batch row) from batch slot ``slots[b]`` with block table ``block_tables[b]``. Two row layouts: ``[max_batch,
rows]`` (decode, verification: every request the same number of rows) and packed ``[1, rows]`` (a span-prefill
pass: the requests' rows back to back, ``offsets``, so ragged prompts compute no padding rows).

`PagedRows` is the step's trace-time context, handed to the model's layers (`v41cp.layers.attention`). The
layers compute every projection from their own weights; PagedRows only moves keys (the `CachedRows` side of
`v41cp.layers.rows_backend.RowsBackend`):

* `window` — each row's window keys in ring order: positions before the step from the SWA ring (read before
  the ring is written), positions inside the step from the step's own rows (as the ring will store them);
  then the ring rows of the step's last ``W`` positions are written;
* `group_first` — a ratio-2 row's pair partner (`CachedRows.groups`): the open pair (cache) or the step's previous
  row; the open pair of each request's last even position is written;
* `write_entries` — complete compressed entries and index keys to their pages (owner-masked under KVP);
* `history` / `select_queries` / `attend` — index selection and sparse attention of every row through the step's
  selection and attention paths, chosen once from the backend settings
  (`v41cp.serving.attention.paged_paths.choose`): the XLA path over the gathered history, the kernels reading the pools in place, or DCP islands over owned pages with
  the exact distributed top-k and the LSE merge. Each of the step's rows (``B·R``, or packed ``R``) is one row of
  these operations (its own position, table and selection).

With ``undo=True`` the context records what the step overwrites (ring rows, open pairs, page entries), the
input of `v41cp.serving.runner.steps.commit_rows` (keep only the first ``a`` rows of a verification step).
"""

from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp

from v41cp.config import LayerRole, ModelConfig
from v41cp.layers.attention import CSAState
from v41cp.layers.common import dtype_of
from v41cp.layers.indexer import every_visible_entry
from v41cp.layers.rows_backend import CachedRows
from v41cp.serving.attention import paged_paths
from v41cp.serving.cache import paged as pc
from v41cp.serving.cache.device_cache import PagedCache, kv_groups
from v41cp.serving.cache.undo import EntriesUndo, OpenPairUndo, RingUndo, VerifyUndo
from v41cp.serving.step_batch import StepBatch
from v41cp.sharding.rules import TP_RULES, ShardingContext

__all__ = ["PagedRows"]


class PagedRows(CachedRows):
    """Trace-time context of one cached step (see the module docstring). Not a pytree: built inside the jitted
    step from the cache and `StepBatch`; ``plan`` is the static KVP / DCP layout (None = one device or GSPMD), or
    with replicated pages (`DCPPlan.split_selection`, plain attention TP) the split of the XLA selection's scoring
    over the TP ranks: then no step gathers a history (selection reads the pools in place, attention only the
    selected entries)."""

    def __init__(self, cfg: ModelConfig, meta: StepBatch, cache: PagedCache, plan=None, undo: bool = False,
                 operator=None):
        split = plan is not None and plan.replicated_pages
        self.cfg, self.op = cfg, operator
        # a sharded decode / verification step's replicated projections split their output columns over attention
        # TP (not a span-prefill pass's packed rows: their programs stay as a prefill on any topology computes them)
        self.columns = ShardingContext(plan.mesh, TP_RULES) if plan is not None and not meta.packed else None
        self.plan = None if split else plan                         # KVP: the pages are split over cp
        xla = cfg.indexer_backend == "xla" and cfg.attention_backend == "xla"
        self.split = plan if split and xla else None
        self.selection, self.attention = paged_paths.choose(cfg, self.plan, self.split)
        self.dtype = dtype_of(cfg.dtype)
        self.n_slots = pc.cache_slots(cache)
        groups = kv_groups(cfg)
        first = cache.ckv[str(groups[0].index)] if groups else None
        self.num_blocks = pc.store_rows(first) if groups else 0
        if undo and meta.packed:
            raise ValueError("a packed-rows step records no undo (it is a prefill pass)")
        self.undo = {"swa": {}, "open": {}, "entries": {}, "rings": {}} if undo else None
        self._bind(meta)

    def _bind(self, meta: StepBatch):
        self.meta = meta
        self.pos, self.valid = meta.positions, meta.row_valid
        self.slot_r = jnp.clip(meta.slots, 0, self.n_slots - 1)
        b, r = meta.max_batch, meta.rows
        lead = 1 if meta.packed else b
        # the step's rows (B·R, or packed R) as rows of the selection / attention operations: each with its
        # request, its row within the request, its request's table; ``first`` = each request's first flat row
        self.row_req, self.row_local = meta.row_requests()
        self.first = meta.offsets if meta.packed else jnp.arange(b, dtype=jnp.int32) * r
        self.n_rows = lead * r
        # a per-request array [B, …] → broadcastable against the rows [B|1, R, …] (packed: gathered per row)
        self.by_row = (lambda a: a[self.row_req][None]) if meta.packed else (lambda a: a[:, None])
        self.row_tables = meta.block_tables[self.row_req] if meta.packed else jnp.repeat(meta.block_tables, r, axis=0)
        self.flat = lambda a: a.reshape(lead * r, *a.shape[2:])
        self.unflat = lambda a: a.reshape(lead, r, *a.shape[1:])

    def _flat_row(self, req: jax.Array, local: jax.Array) -> jax.Array:
        """The flat step row of request ``req``'s row ``local`` (clipped into the step)."""
        return jnp.clip(self.first[req] + local, 0, self.n_rows - 1)

    def undo_record(self) -> VerifyUndo:
        """What the step overwrote (``undo=True``; call after the model ran): the input of ``commit_rows``."""
        m = self.meta
        return VerifyUndo(swa=self.undo["swa"], open=self.undo["open"], entries=self.undo["entries"],
                          starts=m.starts, lengths=m.lengths, slots=m.slots, rings=self.undo["rings"])

    def _with_meta(self, meta: StepBatch) -> "PagedRows":
        other = copy.copy(self)
        other._bind(meta)
        return other

    @property
    def narrows(self) -> bool:
        """Whether this step narrows to its CED decoder rows at the CED boundary (`ced_split`)."""
        return self.meta.decoder_rows > 0

    def ced_split(self):
        """CED narrowing at the boundary layer: ``(encoder, decoder, take)`` — ``encoder`` the context of each
        request's first ``encoder_rows`` rows (the boundary's cache-only writes), ``decoder`` the context of the
        remaining rows from position ``starts + encoder_rows`` (``decoder_rows`` rows), and ``take`` gathering a
        ``[B, rows, …]`` row array to the decoder's ``[B, decoder_rows, …]`` (packed: ``[1, rows, …]`` → ``[1,
        decoder_rows, …]``)."""
        m = self.meta
        if self.undo is not None:
            raise ValueError("a CED-narrowed step records no undo (it is a prefill pass)")
        enc, rd = m.ced.encoder_rows, m.ced.decoder_rows
        encoder = dataclasses.replace(m, lengths=jnp.minimum(enc, m.lengths), ced=None)
        dec_lengths = jnp.maximum(m.lengths - enc, 0)
        if m.packed:                    # the decoder rows packed again: request b's from offsets_d[b]
            offsets = (jnp.cumsum(dec_lengths) - dec_lengths).astype(jnp.int32)
            i = jnp.arange(rd, dtype=jnp.int32)
            req = jnp.clip(jnp.searchsorted(offsets, i, side="right") - 1, 0, m.max_batch - 1)
            src = jnp.clip(m.offsets[req] + enc[req] + i - offsets[req], 0, m.rows - 1)              # [rd]
            take = lambda a: a[:, src]
        else:
            offsets = None
            shift = jnp.clip(enc[:, None] + jnp.arange(rd)[None], 0, m.rows - 1)             # [B, rd]

            def take(a):
                return jnp.take_along_axis(a, shift.reshape(*shift.shape, *(1,) * (a.ndim - 2)), axis=1)

        decoder = dataclasses.replace(m, tokens=take(m.tokens), engram_ids=take(m.engram_ids), starts=m.starts + enc,
                                      lengths=dec_lengths, rows=rd, ced=None,
                                      offsets=offsets)
        return self._with_meta(encoder), self._with_meta(decoder), take

    def last_rows(self, x: jax.Array, count: int):
        """The last ``count`` rows of each request among the rows that reach the model's end (the CED decoder rows
        of a narrowing step) of ``x [B, R, …]`` (packed ``[1, R, …]``) → ``(rows [B, count, …], positions [B,
        count], valid [B, count])``, oldest first; a request with fewer rows has its first entries invalid."""
        f = self.ced_split()[1] if self.narrows else self
        m, b = f.meta, f.meta.max_batch
        local = m.lengths[:, None] - count + jnp.arange(count, dtype=jnp.int32)[None]          # [B, count]
        if m.packed:
            rows = f.flat(x)[f._flat_row(jnp.arange(b)[:, None], jnp.maximum(local, 0))]
        else:
            rows = x[jnp.arange(b)[:, None], jnp.clip(local, 0, m.rows - 1)]
        return rows, m.starts[:, None] + local, local >= 0

    def sampled(self, h: jax.Array, at: jax.Array) -> jax.Array:
        """Row ``at [B]`` of each request of ``h [B,R,H]`` (packed ``[1,R,H]``) → ``[B,1,H]`` (−1: zeros)."""
        b = self.meta.max_batch
        if self.meta.packed:
            rows = self.flat(h)[self._flat_row(jnp.arange(b), jnp.maximum(at, 0))][:, None]
        else:
            rows = h[jnp.arange(b), jnp.maximum(at, 0)][:, None]
        return jnp.where((at >= 0)[:, None, None], rows, 0)

    # -------------------------------------------------------------------------------------- window ring
    def window(self, cache: PagedCache, layer: int, kv: jax.Array):
        """Window keys of every row and the ring update. ``kv [B,R,D]`` (packed ``[1,R,D]``; pre-quantization) →
        ``(cache, keys [B,R,W,D], valid [B,R,W])``; key column ``k`` holds position ``p − ((p − k) mod W)``."""
        cfg, w, m = self.cfg, self.cfg.sliding_window, self.meta
        b, r = self.pos.shape
        swa = cache.swa
        start = self.by_row(m.starts)[..., None]
        held = self.pos[..., None] - ((self.pos[..., None] - jnp.arange(w)) % w)           # [B,R,W]
        fmt = cfg.cache_formats.window
        ring = pc.read(swa, fmt, self.dtype, lambda a: a[layer][self.slot_r])            # [B,W,D] before the step
        new = pc.stored_values(cfg, kv, fmt, self.dtype)                                # as the ring will hold it
        from_step = held >= start
        if m.packed:                   # each row's request's rows: from its offset
            step_rows = self.flat(new)[self._flat_row(self.unflat(self.row_req)[..., None], held - start)]
        else:
            step_rows = new[jnp.arange(b)[:, None, None], jnp.clip(held - start, 0, r - 1)]  # [B,R,W,D]
        keys = jnp.where(from_step[..., None], step_rows, self.by_row(ring))
        # rows written: fed, and among the last W of the step (an earlier row's ring row is overwritten)
        ok = self.valid & (self.unflat(self.row_local) >= self.by_row(m.lengths) - w)
        at = (layer, jnp.where(ok, self.by_row(m.slots), self.n_slots), self.pos % w)
        if self.undo is not None:
            self.undo["swa"][layer] = pc.take_raw(swa, (layer, self.slot_r[:, None], self.pos % w))
        cache = cache.replace(swa=pc.write(cfg, swa, at, kv, fmt))
        return cache, keys, held >= 0

    # ------------------------------------------------------------------------------------ compressor
    def group_first(self, cache: PagedCache, src: str, c: jax.Array, z: jax.Array):
        """Ratio-2 pair partners of every row: ``c / z [B,R,D]`` (packed ``[1,R,D]``) FP32 projections → ``(cache,
        c0, z0)`` where a request's row ``i``'s partner is its row ``i − 1`` of the step or, for ``i = 0``, the cached
        open pair. Writes the open pair
        of each request's last fed even position."""
        m = self.meta
        open_kv, open_z = cache.open_kv[src], cache.open_score[src]
        if m.packed:                   # the previous flat row, or the open pair at a request's first row
            first_row = (self.row_local == 0)[:, None]
            before = jnp.clip(jnp.arange(self.n_rows) - 1, 0, self.n_rows - 1)
            prev = lambda a, opened: self.unflat(jnp.where(first_row, opened[self.slot_r][self.row_req],
                                                           self.flat(a)[before]))
        else:
            prev = lambda a, opened: jnp.concatenate([opened[self.slot_r][:, None], a[:, :-1]], axis=1)
        c0, z0 = prev(c, open_kv), prev(z, open_z)
        last = m.lengths - 1
        even = jnp.where((m.starts + jnp.maximum(last, 0)) % 2 == 0, last, last - 1)               # [B]
        at = jnp.where(even >= 0, m.slots, self.n_slots)
        if m.packed:
            pick = lambda a: self.flat(a)[self._flat_row(jnp.arange(m.max_batch), jnp.maximum(even, 0))]
        else:
            pick = lambda a: a[jnp.arange(m.max_batch), jnp.maximum(even, 0)]
        if self.undo is not None:
            self.undo["open"][src] = OpenPairUndo(kv=open_kv[self.slot_r], score=open_z[self.slot_r], c=c, z=z)
        cache = cache.replace(open_kv={**cache.open_kv, src: open_kv.at[at].set(pick(c), mode="drop")},
                              open_score={**cache.open_score, src: open_z.at[at].set(pick(z), mode="drop")})
        return cache, c0, z0

    def compressor_windows(self, cache: PagedCache, role: LayerRole, c: jax.Array, z: jax.Array, part: str):
        """V4's compression windows of every row (`CachedRows.groups`): ``c / z [B,R,C]`` (packed ``[1,R,C]``) FP32
        projections → ``(cache, c [B,R,n,C], z [B,R,n,C], j, emits)`` where row ``p``'s ``n`` window rows are
        positions ``p − n + 1 … p`` (``n = r``; CSA: ``2r``, the window before too) — from the step's own rows or
        the slot's ring of its last ``n`` rows (`declare_cache`: ``open_kv`` / ``open_score``, flattened ``[B,
        n·C]``; the indexer's under key ``"<layer>i"``), positions before 0 empty (value 0, score −inf). The
        ring rows of each request's last ``n`` positions are written (with ``undo``, what each row's ring row held
        is recorded: `RingUndo`)."""
        m, r = self.meta, role.ratio
        n = role.window_rows
        key = str(role.kv_source) + ("i" if part == "index" else "")
        b, rr = self.pos.shape
        width = c.shape[-1]
        want = self.pos[..., None] - (n - 1) + jnp.arange(n)                                   # [B,R,n] positions
        start = self.by_row(m.starts)[..., None]
        local = jnp.clip(want - start, 0, None)
        # ring rows written: each request's fed rows among its last n of the step
        ok = self.valid & (self.unflat(self.row_local) >= self.by_row(m.lengths) - n)
        at = (jnp.where(ok, self.by_row(m.slots), self.n_slots), self.pos % n)
        out, rings, old = [], {}, {}
        for name, values, fill in (("open_kv", c, 0.0), ("open_score", z, -jnp.inf)):
            ring = getattr(cache, name)[key].reshape(self.n_slots, n, width)
            held = self.by_row(ring[self.slot_r])                                   # [B|1, R|B·…, n, C] per row
            held = jnp.take_along_axis(held, (want % n)[..., None], axis=-2)
            if m.packed:
                step = self.flat(values)[self._flat_row(self.unflat(self.row_req)[..., None], local)]
            else:
                step = values[jnp.arange(b)[:, None, None], jnp.clip(local, 0, rr - 1)]
            got = jnp.where((want >= start)[..., None], step, held)
            out.append(jnp.where((want >= 0)[..., None], got, fill))
            if self.undo is not None:                       # (not packed) each row's own ring row before the step
                old[name] = ring[self.slot_r[:, None], self.pos % n]
            rings[name] = {**getattr(cache, name), key: ring.at[at].set(values, mode="drop").reshape(self.n_slots, -1)}
        cache = cache.replace(**rings)
        if self.undo is not None:
            self.undo["rings"][key] = RingUndo(kv=old["open_kv"], score=old["open_score"], c=c, z=z)
        emits = self.valid & (self.pos % r == r - 1)
        return cache, out[0], out[1], self.pos // r, emits

    def every_entry(self, cache: PagedCache, role: LayerRole, state: CSAState) -> jax.Array:
        """V4 HCA's selection of every row: each entry of the request's table ``[B,R,G]`` (``G = max_blocks · epb``,
        the gathered history's length) complete at the row's position (``j < (p + 1) // r``), −1 otherwise. (Under
        DCP the attention path attends them from their owners without reading this list, `dcp.attend_visible`.)"""
        g = self.meta.block_tables.shape[1] * pc.entries_per_block(cache.ckv[str(role.kv_source)])
        return every_visible_entry(self.pos, role.ratio, g)

    def write_entries(self, cache: PagedCache, role: LayerRole, ckv: jax.Array, ik: jax.Array, j: jax.Array,
                      emits: jax.Array) -> dict:
        """Write entries ``j [B,R]`` (compressed KV ``ckv [B,R,D]``, index keys ``ik [B,R,Di]``, pre-quantization)
        where ``emits [B,R]`` to the pages of KV source ``role``."""
        src = str(role.kv_source)
        epb = pc.entries_per_block(cache.ckv[src])
        if self.meta.packed:
            blk, row, inside = (self.unflat(a[:, 0]) for a in pc.entry_location(self.row_tables, self.flat(j)[:, None],
                                                                                 epb))
        else:
            blk, row, inside = pc.entry_location(self.meta.block_tables, j, epb)
        emits = emits & (blk >= 0) & inside
        undo = {"blk": blk, "row": row, "emits": emits} if self.undo is not None else None
        out = {}
        formats = self.cfg.cache_formats
        for name, values, fmt in (("ckv", ckv, formats.entries), ("ikey", ik, formats.index)):
            if src not in cache.pool(name):         # V4 HCA: no index keys
                continue
            pool = cache.pool(name)[src]
            if self.plan is not None:
                got = pc.write_owned(self.plan, self.cfg, pool, self.flat(blk), self.flat(row), self.flat(values),
                                     self.flat(emits), fmt, keep_old=undo is not None)
                out[name], old = got if undo is not None else (got, None)
            else:
                if undo is not None:
                    old = pc.take_raw(pool, (jnp.clip(blk, 0, self.num_blocks - 1), row))
                out[name] = pc.write(self.cfg, pool, (jnp.where(emits, blk, self.num_blocks), row), values, fmt)
            if undo is not None:
                undo[name] = old
        if undo is not None:
            self.undo["entries"][src] = EntriesUndo(**undo)
        for name, store in out.items():
            cache = cache.with_pool(name, src, store)
        return cache

    # --------------------------------------------------------------------------- selection and attention
    def history(self, cache: PagedCache, role: LayerRole) -> CSAState:
        """The gathered history of a KV source (``ckv [B,G,D]``, ``ikeys [B,G,Di]``) when this step's selection or
        attention path reads it (`paged_paths`); empty when both read the pools in place."""
        if not (self.selection.reads_history or self.attention.reads_history):
            return CSAState()
        src = str(role.kv_source)
        gather = lambda a: pc.gather_pages(a, self.meta.block_tables)
        formats = self.cfg.cache_formats
        ikeys = pc.read(cache.ikey[src], formats.index, self.dtype, gather) if src in cache.ikey else None
        return CSAState(ckv=pc.read(cache.ckv[src], formats.entries, self.dtype, gather), ikeys=ikeys)

    def select_queries(self, cache: PagedCache, role: LayerRole, q: jax.Array, weights: jax.Array,
                       state: CSAState):
        """Index selection of every row: ``q [B,R,Hi,Di]`` / ``weights [B,R,Hi]`` → ``(topk [B,R,K], candidates)``;
        candidates are the candidate source's kept mask in this path's form (entry mask ``[B,R,G]``, or
        kept blocks ``[B·R, kb]`` under DCP), passed back in for the layers that use them."""
        return self.selection.select(self, cache, role, q, weights, state)

    def attend(self, cache: PagedCache, role: LayerRole, q: jax.Array, keys: jax.Array, valid: jax.Array,
               state: CSAState, sink: jax.Array) -> jax.Array:
        """Sink attention of every row over its window keys (`window`) and its selected entries ``state.topk``:
        ``q [B,R,H,D]`` → ``[B,R,H,D]``."""
        return self.attention.attend(self, cache, role, q, keys, valid, state, sink)
