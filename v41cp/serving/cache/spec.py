"""The V4.1 (and V4) decode-state layout and its exact byte accounting (docs/architecture.md).

Per request:

* **SWA ring** — every layer, ``sliding_window`` rows of the window KV latent (K = V). Record: FP8
  e4m3 with a ue8m0 scale per 32 channels (``head_dim + head_dim/32`` B; 528 B at head_dim 512) or
  unquantized (``head_dim × dtype``).
* **global caches** — one group per KV source (ratio-2 sources 2, 8, 14 and the ratio-1 source 20 in
  the release), paged, one entry per ``ratio`` tokens: compressed KV (NVFP4: ``D/2 + D/16`` B, 288 B)
  and index keys sharing the group's page numbering (MXFP4: ``Di/2 + Di/32`` B, 68 B).
* **compressor state** — ratio-r sources keep the open group's raw FP32 ``[kv, score]`` rows
  (``r − 1`` rows × ``2·D·4`` B).
* **Engram history** — the last ``max_ngram − 1`` token ids (host side: hashing is host planning).

DeepSeek-V4 (``quantized``: the release's records as vLLM stores them): the window rows and every CSA / HCA main
entry in the **V4 record** — the ``D − rope`` no-RoPE channels FP8 e4m3 with a ue8m0 scale per 64, the RoPE
channels BF16, the scales padded to 8 B (584 B at D 512, rope 64: 448 + 128 + 7 + 1) — and CSA's index keys MXFP4
(68 B); one group per CSA / HCA layer (no sharing), every CSA group with index keys; the compressor rings as
`compressor_state_bytes_per_request` says. v41cp stores exactly these records (`ModelConfig.cache_formats`,
`v41cp.serving.cache.records`) when the cache fake-quant is on.

All global groups share one allocation unit, the **logical block** of ``block_tokens`` tokens (a
multiple of every ratio: the LCM rule): block ``b`` of a request holds ``block_tokens / r`` entries of
every ratio-r group, under the same physical block id. One page lifecycle therefore covers main and
index caches of every group, and prefix matching / eviction work on whole blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from v41cp.config import ModelConfig
from v41cp.serving.cache.records import record_bytes

__all__ = ["CacheGroup", "CacheSpec"]


@dataclass(frozen=True)
class CacheGroup:
    """One global cache group: the compressed KV + index keys of KV source ``source``."""

    source: int
    ratio: int
    entries_per_block: int
    kv_bytes_per_entry: int
    index_bytes_per_entry: int

    @property
    def bytes_per_entry(self) -> int:
        return self.kv_bytes_per_entry + self.index_bytes_per_entry



@dataclass(frozen=True)
class CacheSpec:
    """Layout and sizes of the decode state of ``cfg`` with ``block_tokens`` tokens per logical block.

    ``quantized`` selects the release's record formats (`ModelConfig.cache_formats`: V4.1 FP8 window, NVFP4
    compressed KV, MXFP4 index keys; V4 584 B window rows and entries, MXFP4 index keys); otherwise records are
    stored in ``cfg.dtype``.
    """

    cfg: ModelConfig
    block_tokens: int | None = None          # None: the model's page (`ModelConfig.page_tokens`)
    quantized: bool = True

    def __post_init__(self):
        if self.block_tokens is None:
            object.__setattr__(self, "block_tokens", self.cfg.page_tokens)
        ratios = sorted({r.ratio for r in self.cfg.layer_roles if r.is_kv_source})
        lcm = math.lcm(*ratios) if ratios else 1
        if self.block_tokens <= 0 or self.block_tokens % lcm:
            raise ValueError(f"block_tokens={self.block_tokens} must be a positive multiple of every compress "
                             f"ratio (LCM {lcm})")

    def per_request(self, tokens: int, kvp: int = 1) -> dict:
        """One request of ``tokens`` tokens on one rank of a KVP group of ``kvp``: ``global`` (its pages, split
        page-cyclically: the busiest rank's share, ``⌈blocks / kvp⌉`` blocks), ``swa`` and ``compressor_state``
        (replicated on every rank) and ``total`` bytes."""
        out = {"global": -(-self.blocks_for(tokens) // kvp) * self.block_bytes, "swa": self.swa_bytes_per_request,
               "compressor_state": self.compressor_state_bytes_per_request}
        out["total"] = sum(out.values())
        return out

    @property
    def _elem(self) -> int:
        return 2 if self.cfg.dtype == "bfloat16" else 4

    def _record(self, fmt: str, channels: int) -> int:
        """Bytes of one stored row of ``channels`` values in cache format ``fmt`` (records, or the model dtype)."""
        if not self.quantized:
            return channels * self._elem
        return record_bytes(fmt, channels, self.cfg.qk_rope_head_dim)

    @property
    def v4_record_bytes(self) -> int:
        """DeepSeek-V4's main / window record: ``D − rope`` FP8 channels, ``rope`` BF16 channels, one ue8m0 scale
        per 64 FP8 channels padded to 8 B (584 B at D 512, rope 64)."""
        return record_bytes("fp8_ds_mla", self.cfg.head_dim, self.cfg.qk_rope_head_dim)

    @property
    def swa_bytes_per_row(self) -> int:
        return self._record(self.cfg.cache_formats.window, self.cfg.head_dim)

    @property
    def groups(self) -> tuple[CacheGroup, ...]:
        cfg, fmt = self.cfg, self.cfg.cache_formats
        kv, ik = self._record(fmt.entries, cfg.head_dim), self._record(fmt.index, cfg.index_head_dim)
        return tuple(CacheGroup(r.index, r.ratio, self.block_tokens // r.ratio, kv, ik if r.is_index_source else 0)
                     for r in cfg.layer_roles if r.is_kv_source)

    @property
    def global_bytes_per_token(self) -> float:
        """Persistent global-cache bytes per original token, summed over groups (890 B for V4.1-Flash)."""
        return sum(g.bytes_per_entry / g.ratio for g in self.groups)

    @property
    def block_bytes(self) -> int:
        """Bytes of one logical block across every global group (main + index)."""
        return sum(g.entries_per_block * g.bytes_per_entry for g in self.groups)

    @property
    def swa_bytes_per_request(self) -> int:
        """Bounded SWA rings of every layer for one request."""
        return self.cfg.num_hidden_layers * self.cfg.sliding_window * self.swa_bytes_per_row

    @property
    def compressor_state_bytes_per_request(self) -> int:
        """FP32 ``[kv, score]`` rows of every compressor's open state: V4.1 the open group's ``r − 1`` rows; V4 a
        ring of the last ``n`` rows (`device_cache.declare_cache`: HCA ``r`` rows of ``D``; CSA ``2r`` rows of
        ``2D``, plus its indexer's ``2r`` rows of ``2·Di``)."""
        cfg = self.cfg
        if not cfg.is_v4:
            return sum((g.ratio - 1) * 2 * cfg.head_dim * 4 for g in self.groups)
        total = 0
        for r in cfg.layer_roles:           # [kv, score] FP32 rows of width D (CSA: 2·D and its indexer's 2·Di)
            if r.overlapping:
                total += r.window_rows * 2 * (cfg.head_dim + cfg.index_head_dim) * 2 * 4
            elif r.is_kv_source:
                total += r.window_rows * cfg.head_dim * 2 * 4
        return total

    @property
    def prefix_state_bytes(self) -> int:
        """Bytes of one stored slot state (`v41cp.serving.cache.slot_state`, without a drafter): the window rings of
        every layer and the open ratio-2 pairs — what exact prefix caching keeps per reusable boundary."""
        return self.swa_bytes_per_request + self.compressor_state_bytes_per_request

    def blocks_for(self, tokens: int) -> int:
        """Logical blocks that hold ``tokens`` tokens."""
        return -(-tokens // self.block_tokens)

    def summary(self) -> dict:
        return {
            "block_tokens": self.block_tokens, "quantized": self.quantized,
            "swa_bytes_per_row": self.swa_bytes_per_row, "swa_bytes_per_request": self.swa_bytes_per_request,
            "groups": [{"source": g.source, "ratio": g.ratio, "kv_bytes_per_entry": g.kv_bytes_per_entry,
                        "index_bytes_per_entry": g.index_bytes_per_entry,
                        "bytes_per_token": g.bytes_per_entry / g.ratio,
                        "bytes_per_block": g.entries_per_block * g.bytes_per_entry} for g in self.groups],
            "global_bytes_per_token": self.global_bytes_per_token, "block_bytes": self.block_bytes,
            "compressor_state_bytes_per_request": self.compressor_state_bytes_per_request,
            "prefix_state_bytes": self.prefix_state_bytes,
        }
