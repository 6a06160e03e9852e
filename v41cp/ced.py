"""CED (cache-encoder / decoder) structure of a config: which layers a prefill row must run (pure config math).

From the CED boundary on — the ratio-1 KV source after which every layer is a ratio-1 consumer — a layer
depends on other tokens only through its sliding window and that source's frozen global KV. A prefill row
far enough before the end of the prompt therefore only needs the layers up to the boundary's cache writes
(the *encoder*); the last `ced_rows` rows (the decoder's dependency halo) run every layer.
"""

from __future__ import annotations

from v41cp.config import ModelConfig

__all__ = ["ced_boundary", "ced_rows"]


def ced_boundary(cfg: ModelConfig) -> int | None:
    """The CED boundary layer: the ratio-1 KV source after which every layer is a ratio-1 consumer, or None."""
    roles = cfg.layer_roles
    for r in roles:
        if r.ratio == 1 and r.is_kv_source:
            rest = roles[r.index + 1:]
            if all(x.ratio == 1 and not x.is_kv_source for x in rest):
                return r.index
            return None
    return None


def ced_rows(cfg: ModelConfig) -> int:
    """Rows before the end of a prefill that must run the decoder layers (the dependency halo):
    ``W + (L − 1)(W − 1)`` with L = the decoder layers from the CED boundary on."""
    b = ced_boundary(cfg)
    layers = cfg.num_hidden_layers - b
    return cfg.sliding_window + (layers - 1) * (cfg.sliding_window - 1)
