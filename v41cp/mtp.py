"""DeepSeek-V4's MTP layer (stored as ``mtp.0``): one more V4 block, SWA-only, predicting the token after next.

* **Input** — at position ``t``: the target's last-layer output streams ``h_t [hc, H]``
  (`v41cp.drafter.target_features` for V4, flattened ``[hc · H]``) and the token ``t + 1``: ``x =
  e_proj(enorm(embed(token)))`` broadcast over the streams ``+ h_proj(hnorm(h_t))`` (each stream normed and
  projected) → ``[hc, H]``.
* **Block** — a V4 layer of compress ratio 0 (the release's trailing ``compress_ratios`` entry): the per-site mHC
  (``hc_attn`` / ``hc_ffn``), attention over the layer's own window of ``W`` keys (its inputs' keys at positions
  ``t − W + 1 … t``, causal) with the per-head query norm and the sink, a routed MoE (not hash-routed).
* **Head** — the MTP's own ``hc_head`` collapse, its ``norm``, the target's head: logits of the token ``t + 2``.

Drafting ``n`` tokens from an anchor (the last output token, at position ``q``, not yet fed to the target) runs the
layer ``n`` times: row 0 at ``q − 1`` from the target's streams there and the anchor; row ``i > 0`` at ``q − 1 + i``
from row ``i − 1``'s output streams (the MTP's own state standing in for the target's, as engines chain one MTP
layer) and draft ``i`` (`v41cp.serving.runner.mtp_draft`). The release defines the layer for one step; the chained
rows are a serving choice.

Parameters (a tree of its own, beside the target's, under ``mtp_0``): the backbone layer's names (``attn``,
``hc_attn``, ``hc_ffn``, ``attn_norm``, ``ffn_norm``, ``ffn``) plus ``e_proj`` / ``h_proj [H, H]``, ``enorm``,
``hnorm``, ``norm`` and ``hc_head`` (``fn`` / ``base`` / ``scale``). The layer runs replicated (it is one block
with a bounded window).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from v41cp.config import ModelConfig
from v41cp.drafter import DraftAttention
from v41cp.kernels.sparse_attention.reference import sink_attention
from v41cp.layers.attention import output_projection, query_projection
from v41cp.layers.common import RMSNorm, abstract_tree_cache, declare, dtype_of, weight_for
from v41cp.layers.mhc import HyperConnection, HyperHead, collapse, expand
from v41cp.layers.moe import MoE
from v41cp.layers.rope import rope_angles

__all__ = ["MTP", "mtp_reference", "init_mtp_params", "abstract_mtp_params", "mtp_logits", "call_mtp"]


class MTPLayer(nn.Module):
    """The MTP block ``mtp_0`` (see the module docstring); ``cfg`` is the target's config."""

    cfg: ModelConfig

    def setup(self):
        cfg = self.cfg
        dt = dtype_of(cfg.dtype)
        h = cfg.hidden_size
        self.e_proj = declare(self, "e_proj", (h, h), ("embed", None), dt)
        self.h_proj = declare(self, "h_proj", (h, h), ("embed", None), dt)
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, dt)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, dt)
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dt)
        self.hc_head = HyperHead(cfg)
        self.attn = MTPAttention(cfg)
        self.hc_attn, self.hc_ffn = HyperConnection(cfg), HyperConnection(cfg)
        self.attn_norm = RMSNorm(h, cfg.rms_norm_eps, dt)
        self.ffn_norm = RMSNorm(h, cfg.rms_norm_eps, dt)
        self.ffn = MoE(cfg, hash_routed=False)

    def inputs(self, embedded: jax.Array, features: jax.Array) -> jax.Array:
        """The layer's input streams from the next tokens' embeddings ``[..., H]`` and the target's features
        ``[..., hc · H]`` → ``[..., hc, H]``."""
        cfg = self.cfg
        streams = features.reshape(*features.shape[:-1], cfg.hc_mult, cfg.hidden_size).astype(embedded.dtype)
        e = jnp.einsum("...i,io->...o", self.enorm(embedded), weight_for(self.e_proj, embedded))
        return e[..., None, :] + jnp.einsum("...i,io->...o", self.hnorm(streams), weight_for(self.h_proj, streams))

    def keys(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Window keys of input streams ``x [..., hc, H]`` at ``positions [...]`` → ``[..., D]``: the attention
        site's collapse and norm, then the key projection."""
        pre, _, _ = self.hc_attn(x.reshape(-1, 1, *x.shape[-2:]))
        a = self.attn_norm(collapse(x.reshape(-1, 1, *x.shape[-2:]), pre))
        return self.attn.keys(a, positions.reshape(-1, 1)).reshape(*x.shape[:-2], -1)

    def rows(self, x: jax.Array, positions: jax.Array, ctx_keys: jax.Array, ctx_valid: jax.Array) -> jax.Array:
        """Rows ``x [B, N, hc, H]`` at ``positions [B, N]`` over context keys ``ctx_keys [B, C, D]`` (``ctx_valid
        [B, N, C]``: which each row sees) and the block's own rows causally within the window → output streams
        ``[B, N, hc, H]``."""
        w = self.cfg.sliding_window
        own = positions[:, None, :] <= positions[:, :, None]
        own &= positions[:, :, None] - positions[:, None, :] < w                                     # [B, N, N]

        def attend(a):
            return self.attn(a, positions, ctx_keys, jnp.concatenate([ctx_valid, own], axis=-1))
        pre_a, post_a, comb_a = self.hc_attn(x)
        x = expand(attend(self.attn_norm(collapse(x, pre_a))), x, post_a, comb_a)
        pre_f, post_f, comb_f = self.hc_ffn(x)
        return expand(self.ffn(self.ffn_norm(collapse(x, pre_f))), x, post_f, comb_f)

    def head_input(self, streams: jax.Array) -> jax.Array:
        """Output streams ``[B, N, hc, H]`` → the head's input ``norm(hc_head(·)) [B, N, H]``."""
        return self.norm(self.hc_head(streams))


class MTPAttention(DraftAttention):
    """The MTP layer's SWA-only attention: the DSpark stage's parameters and window keys (V4: no cache
    fake-quant), with V4's per-head query norm and causal rows."""

    def __call__(self, a: jax.Array, positions: jax.Array, ctx_keys: jax.Array, valid: jax.Array) -> jax.Array:
        """Attention inputs ``a [B, N, H]`` over ``ctx_keys [B, C, D]`` and the rows' own keys (``valid [B, N, C +
        N]``) → ``[B, N, H]``."""
        cfg, w = self.cfg, self.w
        angles = rope_angles(cfg, positions, False)
        _, q = query_projection(w, self.q_norm, a, angles, cfg.rms_norm_eps)
        keys = jnp.concatenate([ctx_keys.astype(a.dtype), self.keys(a, positions)], axis=1)      # [B, C + N, D]
        n = a.shape[1]
        o = sink_attention(q, jnp.broadcast_to(keys[:, None], (a.shape[0], n, *keys.shape[1:])), valid, w["attn_sink"])
        return output_projection(cfg, w, o, angles).astype(a.dtype)


class MTP(nn.Module):
    """The MTP layers (one for the release: ``mtp_0``); methods (`nn.Module.apply` with ``method=``) are the
    layer's pure steps: `inputs`, `keys`, `rows`, `head_input`."""

    cfg: ModelConfig

    def setup(self):
        self.layer = MTPLayer(self.cfg, name="mtp_0")

    def inputs(self, embedded, features):
        return self.layer.inputs(embedded, features)

    def keys(self, x, positions):
        return self.layer.keys(x, positions)

    def rows(self, x, positions, ctx_keys, ctx_valid):
        return self.layer.rows(x, positions, ctx_keys, ctx_valid)

    def head_input(self, streams):
        return self.layer.head_input(streams)


def mtp_logits(head: jax.Array, h: jax.Array) -> jax.Array:
    """The target's head ``[H, vocab]`` on the MTP's head input ``h [..., H]`` → FP32 logits."""
    return jnp.einsum("...h,hv->...v", h.astype(jnp.float32), head, precision=jax.lax.Precision.HIGHEST)


def call_mtp(params, cfg: ModelConfig, method, *args):
    """``MTP(cfg).apply`` of ``method`` (the layer is loaded dequantized whatever the target keeps)."""
    cfg = cfg.replace(keep_quantized=False) if cfg.keep_quantized else cfg
    return MTP(cfg).apply({"params": params}, *args, method=method)


@partial(jax.jit, static_argnames=("cfg",))
def mtp_reference(params: dict, embed: jax.Array, head: jax.Array, cfg: ModelConfig, features: jax.Array,
                  next_ids: jax.Array) -> dict:
    """The MTP layer over whole sequences (no cache): row ``t`` from the target's features ``features [B, S, hc ·
    H]`` at ``t`` and ``next_ids [B, S]`` (the token at ``t + 1``), attending rows ``t − W + 1 … t``. Returns
    ``keys [B, S, D]``, ``streams [B, S, hc, H]`` and ``logits [B, S, vocab]`` FP32 (row ``t``: the token at ``t +
    2``) — what the cached drafter (`v41cp.serving.runner.mtp_draft`) is checked against."""
    b, s = next_ids.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    x = call_mtp(params, cfg, MTP.inputs, jnp.take(embed, next_ids, axis=0), features)
    keys = call_mtp(params, cfg, MTP.keys, x, positions)
    empty = jnp.zeros((b, 0, cfg.head_dim), x.dtype)
    streams = call_mtp(params, cfg, MTP.rows, x, positions, empty, jnp.zeros((b, s, 0), bool))
    return {"keys": keys, "streams": streams,
            "logits": mtp_logits(head, call_mtp(params, cfg, MTP.head_input, streams))}


def _dummy(cfg: ModelConfig):
    def init_all(module: MTP):
        x = module.inputs(jnp.zeros((1, 2, cfg.hidden_size), dtype_of(cfg.dtype)),
                          jnp.zeros((1, 2, cfg.hc_mult * cfg.hidden_size), dtype_of(cfg.dtype)))
        pos = jnp.zeros((1, 2), jnp.int32)
        module.keys(x, pos)
        return module.head_input(module.rows(x, pos, jnp.zeros((1, 0, cfg.head_dim), x.dtype),
                                             jnp.zeros((1, 2, 0), bool)))
    return init_all


@abstract_tree_cache
def abstract_mtp_params(cfg: ModelConfig) -> Any:
    """Boxed abstract MTP parameter tree (no allocation)."""
    if not cfg.has_mtp:
        raise ValueError(f"the config has no MTP layer (model_type={cfg.model_type!r}, num_nextn_predict_layers="
                         f"{cfg.num_nextn_predict_layers})")
    return jax.eval_shape(lambda k: MTP(cfg).init(k, method=_dummy(cfg)), jax.random.key(0))["params"]


def init_mtp_params(cfg: ModelConfig, key: jax.Array) -> Any:
    """Random MTP parameters (std 0.02 weights, unit norms, zero biases / sinks)."""
    abstract_mtp_params(cfg)
    return jax.jit(lambda k: nn.unbox(MTP(cfg).init(k, method=_dummy(cfg))["params"]))(key)
