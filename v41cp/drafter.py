"""The DSpark drafter (docs/architecture.md): three SWA-only stages, stored as ``mtp.0 … mtp.2``, that propose
``dspark_block_size`` tokens in one parallel forward.

* **Target features** — the residual streams at the attention input of ``dspark_target_layer_ids`` (after a
  layer's Engram), mean over the hc streams, concatenated ``[B, T, n_target · H]`` (`target_features`);
  stage 0 projects them: ``main_x = main_norm(main_proj(·)) [B, T, H]`` (`Drafter.main_x`).
* **Context keys** — each stage's own window key of ``main_x`` (its ``wkv`` + ``kv_norm`` + main RoPE at the
  feature's position, FP8 under ``fake_quant``; `Drafter.context_keys`). The feature at position ``t`` is the
  target's state at the input token ``t``; a block anchored at ``p`` sees the features at ``[p − W, p)``.
* **Block** — ``[anchor, noise × (N − 1)]`` embedded with the target's table at positions ``p … p + N − 1``. A
  stage is a V4.1 block (`v41cp.layers.mhc.mhc_layer`: single-pass mHC, MoE with the drafter's experts) whose
  attention sees the context keys and every block row (non-causal inside the block), with the sink
  (`Drafter.block`). Slot ``i`` predicts the token at ``p + i + 1``.
* **Heads** (last stage) — ``h`` = the streams collapsed with the last FFN pre-mix; the base logits are the
  target's head on ``norm(h)``; the Markov head adds ``markov_head(embed(prev_i))`` (``prev_0`` = the anchor,
  ``prev_i`` = draft ``i − 1``: sequential); the confidence ``proj([h ; embed(prev_i)])`` (FP32 logit; ``h``
  pre-norm as released, or ``norm(h)`` with ``dspark_confidence_input = "normed"`` as NeMo trains it).

Parameters (a tree of its own, beside the target's): ``mtp_{k}`` per stage with the backbone layer's names
(``attn``, ``hc_attn``, ``hc_ffn``, ``attn_norm``, ``ffn_norm``, ``ffn``); ``mtp_0.main_proj [n_target·H, H]``,
``mtp_0.main_norm``; on the last stage ``norm``, ``markov_embed [vocab, rank]``, ``markov_head [rank, vocab]``,
``confidence [H + rank]`` (FP32). The drafter runs replicated (it is small and its window is bounded).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from v41cp.ced import ced_boundary
from v41cp.config import ModelConfig
from v41cp.kernels.sparse_attention.reference import sink_attention
from v41cp.layers.attention import attention_weights, output_projection, query_projection, window_kv
from v41cp.layers.common import RMSNorm, abstract_tree_cache, declare, dtype_of, weight_for
from v41cp.layers.mhc import HyperConnection, collapse, mhc_layer
from v41cp.layers.moe import MoE
from v41cp.layers.rope import rope_angles
from v41cp.quant import quantize_as

__all__ = ["Drafter", "target_features", "drafter_rows", "init_drafter_params", "abstract_drafter_params",
           "draft_logits", "draft_from_features"]


def target_features(cfg: ModelConfig, taps: dict, narrow=None) -> jax.Array:
    """The target's DSpark features from a forward's ``taps`` collection (each target layer's attention-input
    streams, mean over hc, ``[B, T, H]``: `v41cp.model.Block`) → ``[B, T, n · H]`` in
    ``dspark_target_layer_ids`` order. ``narrow``: in a CED-narrowed cached step, the map from all rows to the
    decoder rows (`PagedRows.ced_split`), applied to the taps of target layers before the CED boundary (which saw
    every row; the later ones saw the decoder rows only). DeepSeek-V4 (its MTP layer's input): the last layer's
    output streams ``[B, T, hc, H]`` flattened → ``[B, T, hc · H]``."""
    if cfg.is_v4:
        t = taps["mtp"][0]
        return t.reshape(*t.shape[:2], -1)
    boundary = ced_boundary(cfg) if narrow is not None else None
    out = []
    for i in cfg.dspark_target_layer_ids:
        t = taps[f"layers_{i}"]["dspark"][0]
        out.append(narrow(t) if boundary is not None and i < boundary else t)
    return jnp.concatenate(out, axis=-1)


def drafter_rows(cfg: ModelConfig, rows, taps: dict, tokens: jax.Array, count: int):
    """What a cached pass hands the drafter's context write: each request's last ``count`` rows of the pass
    (``rows``: its rows backend's `last_rows`) — ``(features [B, count, ·], positions [B, count], valid [B,
    count], tokens [B, count])``, the rows' own token ids from the pass's ``tokens`` (DeepSeek-V4's MTP keys need
    the token after each row; zeros for DSpark, whose keys do not)."""
    narrow = rows.ced_split()[2] if rows.narrows else None
    feats, pos, ok = rows.last_rows(target_features(cfg, taps, narrow), count)
    own = rows.last_rows(tokens[..., None], count)[0][..., 0] if cfg.is_v4 else jnp.zeros_like(pos)
    return feats, pos, ok, own


class DraftAttention(nn.Module):
    """A stage's SWA-only attention (the backbone attention's parameters, no compressor / indexer)."""

    cfg: ModelConfig

    def setup(self):
        cfg, dt = self.cfg, dtype_of(self.cfg.dtype)
        self.w = attention_weights(self, cfg)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dt)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dt)

    def keys(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Window keys of rows ``x [..., H]`` at ``positions [...]`` → ``[..., D]`` (in the window rows' cache format
        under ``fake_quant``: V4.1 FP8, V4 its 584 B record's FP8 + BF16)."""
        cfg = self.cfg
        kv = window_kv(self.w["wkv"], self.kv_norm, x, rope_angles(cfg, positions, False))
        return quantize_as(kv, cfg.cache_formats.window, cfg.qk_rope_head_dim) if cfg.fake_quant else kv

    def __call__(self, x: jax.Array, positions: jax.Array, ctx_keys: jax.Array, ctx_valid: jax.Array) -> jax.Array:
        """Block rows ``x [B, N, H]`` at ``positions [B, N]`` over the context keys ``ctx_keys [B, C, D]``
        (``ctx_valid [B, C]``) and every block row → ``[B, N, H]``."""
        cfg, w = self.cfg, self.w
        angles = rope_angles(cfg, positions, False)
        _, q = query_projection(w, self.q_norm, x, angles)
        keys = jnp.concatenate([ctx_keys.astype(x.dtype), self.keys(x, positions)], axis=1)     # [B, C + N, D]
        valid = jnp.concatenate([ctx_valid, jnp.ones(x.shape[:2], bool)], axis=1)
        n = x.shape[1]
        o = sink_attention(q, jnp.broadcast_to(keys[:, None], (x.shape[0], n, *keys.shape[1:])),
                           jnp.broadcast_to(valid[:, None], (x.shape[0], n, valid.shape[1])), w["attn_sink"])
        return output_projection(cfg, w, o, angles).astype(x.dtype)


class DraftStage(nn.Module):
    """One DSpark stage (``mtp.{stage}``); ``cfg`` is the target's config (the stage runs its MoE with the
    drafter's experts, `ModelConfig.draft_stage_config`)."""

    cfg: ModelConfig
    stage: int

    def setup(self):
        cfg = self.cfg
        dt = dtype_of(cfg.dtype)
        self.attn = DraftAttention(cfg)
        self.hc_attn, self.hc_ffn = HyperConnection(cfg), HyperConnection(cfg)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.ffn = MoE(cfg.draft_stage_config())
        if self.stage == 0:
            n = len(cfg.dspark_target_layer_ids)
            self.main_proj = declare(self, "main_proj", (n * cfg.hidden_size, cfg.hidden_size), (None, "embed"), dt)
            self.main_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        if self.stage == cfg.num_nextn_predict_layers - 1:
            r = cfg.dspark_markov_rank
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
            self.markov_embed = declare(self, "markov_embed", (cfg.vocab_size, r), ("vocab", None), dt)
            self.markov_head = declare(self, "markov_head", (r, cfg.vocab_size), (None, "vocab"), dt)
            self.confidence = declare(self, "confidence", (cfg.hidden_size + r,), (None,), jnp.float32)

    def __call__(self, streams: jax.Array, pre: jax.Array, positions, ctx_keys, ctx_valid):
        """Block streams ``[B, N, hc, H]`` (``pre`` the previous site's) → ``(streams, pre)``."""
        attend = lambda a: self.attn(a, positions, ctx_keys, ctx_valid)
        return mhc_layer(streams, pre, self.hc_attn, self.attn_norm, attend, self.hc_ffn, self.ffn_norm, self.ffn)


class Drafter(nn.Module):
    """The DSpark stages ``mtp_0 … mtp_{K−1}``; methods (`nn.Module.apply` with ``method=``) are the drafter's
    steps, all pure: `main_x`, `context_keys`, `block`, `markov`."""

    cfg: ModelConfig

    def setup(self):
        self.stages = [DraftStage(self.cfg, k, name=f"mtp_{k}") for k in range(self.cfg.num_nextn_predict_layers)]

    def main_x(self, features: jax.Array) -> jax.Array:
        """Target features ``[..., n·H]`` → ``main_x [..., H]`` (stage 0's ``main_norm(main_proj(·))``)."""
        s0 = self.stages[0]
        return s0.main_norm(jnp.einsum("...i,io->...o", features, weight_for(s0.main_proj, features)))

    def context_keys(self, main_x: jax.Array, positions: jax.Array) -> jax.Array:
        """Every stage's context keys of ``main_x [..., H]`` at ``positions [...]`` → ``[K, ..., D]``."""
        return jnp.stack([st.attn.keys(main_x, positions) for st in self.stages])

    def block(self, x: jax.Array, positions: jax.Array, ctx_keys: jax.Array, ctx_valid: jax.Array):
        """Block embeddings ``x [B, N, H]`` at ``positions [B, N]`` through every stage over its context keys
        ``ctx_keys [K, B, C, D]`` (``ctx_valid [B, C]``) → ``(h [B, N, H] pre-norm, norm(h))``."""
        cfg = self.cfg
        b, n, h = x.shape
        streams = jnp.broadcast_to(x[:, :, None, :], (b, n, cfg.hc_mult, h))
        pre = jnp.zeros((b, n, cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
        for k, st in enumerate(self.stages):
            streams, pre = st(streams, pre, positions, ctx_keys[k], ctx_valid)
        hidden = collapse(streams, pre)
        return hidden, self.stages[-1].norm(hidden)

    def markov(self, prev: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Markov head of the previous tokens ``prev [...]`` → ``(logits [..., vocab] FP32, embedding [...,
        rank])``."""
        last = self.stages[-1]
        e = jnp.take(last.markov_embed, prev, axis=0)
        return jnp.einsum("...r,rv->...v", e, last.markov_head.astype(e.dtype)).astype(jnp.float32), e

    def confidence(self, h: jax.Array, h_normed: jax.Array, markov_embedding: jax.Array) -> jax.Array:
        """The confidence logit ``[...]`` FP32 of a block row (``h`` / ``h_normed [..., H]``, the Markov
        embedding of its previous token ``[..., rank]``)."""
        state = h_normed if self.cfg.dspark_confidence_input == "normed" else h
        feats = jnp.concatenate([state.astype(jnp.float32), markov_embedding.astype(jnp.float32)], axis=-1)
        return jnp.einsum("...i,i->...", feats, self.stages[-1].confidence, precision=jax.lax.Precision.HIGHEST)


def draft_logits(head: jax.Array, h_normed: jax.Array, markov_logits: jax.Array) -> jax.Array:
    """Draft logits FP32: the target's head ``[H, vocab]`` on ``h_normed [..., H]`` plus the Markov logits."""
    base = jnp.einsum("...h,hv->...v", h_normed.astype(jnp.float32), head, precision=jax.lax.Precision.HIGHEST)
    return base + markov_logits


@partial(jax.jit, static_argnames=("cfg",))
def draft_from_features(params: dict, embed: jax.Array, head: jax.Array, cfg: ModelConfig, features: jax.Array,
                        anchors: jax.Array, block_ids: jax.Array, previous_ids: jax.Array) -> dict:
    """The drafter's full-sequence reference (no cache): blocks anchored at ``anchors [B, A]`` of sequences whose
    target features are ``features [B, S, n·H]``; block ``(b, a)`` holds ``block_ids [B, A, N]`` (the anchor
    token, then noise) at positions ``anchor … anchor + N − 1`` and sees the features at ``[anchor − W, anchor)``;
    the Markov head reads ``previous_ids [B, A, N]``. ``embed [vocab, H]`` / ``head [H, vocab]``: the target's.
    Returns ``h`` / ``normed [B, A, N, H]``, ``markov`` / ``logits [B, A, N, vocab]`` FP32, ``confidence [B, A,
    N]`` FP32 — what the cached drafter (`v41cp.serving.runner.speculative`) is checked against."""
    b, a = anchors.shape
    n, w = block_ids.shape[-1], cfg.sliding_window
    d = Drafter(cfg)
    call = lambda method, *args: d.apply({"params": params}, *args, method=method)
    main_x = call(Drafter.main_x, features)                                        # [B, S, H]
    s = main_x.shape[1]
    ctx_pos = anchors[..., None] - w + jnp.arange(w)                               # [B, A, W]
    ctx_valid = (ctx_pos >= 0).reshape(b * a, w)
    ctx_x = jax.vmap(lambda m, p: m[jnp.clip(p, 0, s - 1)])(main_x, ctx_pos).reshape(b * a, w, -1)
    ctx_keys = call(Drafter.context_keys, ctx_x, jnp.maximum(ctx_pos, 0).reshape(b * a, w))
    positions = (anchors[..., None] + jnp.arange(n)).reshape(b * a, n)
    x = jnp.take(embed, block_ids.reshape(b * a, n), axis=0)
    h, normed = call(Drafter.block, x, positions, ctx_keys, ctx_valid)
    markov, emb = call(Drafter.markov, previous_ids.reshape(b * a, n))
    out = {"h": h, "normed": normed, "markov": markov, "logits": draft_logits(head, normed, markov),
           "confidence": call(Drafter.confidence, h, normed, emb)}
    return {k: v.reshape(b, a, n, *v.shape[2:]) for k, v in out.items()}


def _dummy(cfg: ModelConfig):
    n = len(cfg.dspark_target_layer_ids)
    x = jnp.zeros((1, cfg.dspark_block_size, cfg.hidden_size), dtype_of(cfg.dtype))
    pos = jnp.zeros((1, cfg.dspark_block_size), jnp.int32)
    feats = jnp.zeros((1, 2, n * cfg.hidden_size), dtype_of(cfg.dtype))

    def init_all(module: Drafter):
        keys = module.context_keys(module.main_x(feats), pos[:, :2])
        module.block(x, pos, keys, jnp.ones((1, 2), bool))
        module.markov(pos)
        return module.confidence(x, x, jnp.zeros((*x.shape[:2], cfg.dspark_markov_rank)))
    return init_all


@abstract_tree_cache
def abstract_drafter_params(cfg: ModelConfig) -> Any:
    """Boxed abstract DSpark parameter tree (no allocation; DeepSeek-V4's MTP layer: `v41cp.mtp`)."""
    if not cfg.has_dspark:
        raise ValueError("the config has no DSpark stages (num_nextn_predict_layers = 0 or no "
                         "dspark_target_layer_ids)")
    return jax.eval_shape(lambda k: Drafter(cfg).init(k, method=_dummy(cfg)), jax.random.key(0))["params"]


def init_drafter_params(cfg: ModelConfig, key: jax.Array) -> Any:
    """Random DSpark parameters (std 0.02 weights, unit norms, zero biases / sinks; the MTP layer's:
    `v41cp.mtp.init_mtp_params`)."""
    abstract_drafter_params(cfg)
    return jax.jit(lambda k: nn.unbox(Drafter(cfg).init(k, method=_dummy(cfg))["params"]))(key)
