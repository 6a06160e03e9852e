"""The DeepSeek-V4.1 text backbone (and DeepSeek-V4's, ``cfg.is_v4``) as a Flax module, and its jitted
full-sequence forward.

Reference order (docs/architecture.md): embed → 4 mHC streams → for each layer
[Engram] → attention site (collapse with the previous FFN site's ``pre``) → FFN site
(collapse with the attention site's ``pre``) → collapse with the last ``pre`` → norm → FP32 head.

Public entry points (all pure; ``params`` is the unboxed parameter tree):

* `forward(params, cfg, tokens)` → logits ``[B,S,vocab]`` FP32;
* `forward_with_hidden(params, cfg, tokens)` → (logits, block inputs ``[L,B,S,hc,H]``);
* `forward_with_features(params, cfg, tokens)` → (logits, the drafter's target features ``[B,S,·]``);
* `forward_debug(...)` → also every layer's selection (``topk``), index scores and MoE routing scores;
* `init_params(cfg, key, mesh=None)` / `abstract_params(cfg)`.

Engram hashing needs 64-bit integers and runs on the host (`v41cp.engram_hash`) before the
jitted part, so ``tokens`` must be concrete (NumPy or a fetched jax.Array).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from v41cp.ced import ced_boundary
from v41cp.config import ModelConfig
from v41cp.drafter import target_features
from v41cp.engram_hash import engram_hash_ids
from v41cp.layers.attention import Attention, CSAState
from v41cp.layers.common import RMSNorm, abstract_tree_cache, declare, dtype_of
from v41cp.layers.engram import Engram
from v41cp.layers.full_sequence import FullSequence
from v41cp.layers.mhc import HyperConnection, HyperHead, collapse, mhc_layer, mhc_layer_v4
from v41cp.layers.moe import MoE
from v41cp.sharding.rules import TP_RULES, AxisRules, ShardingContext, constrain, param_shardings

__all__ = ["Transformer", "forward", "forward_with_hidden", "forward_with_features", "forward_debug",
           "embedding_and_head", "init_params",
           "abstract_params", "shard_params", "engram_inputs"]


class Block(nn.Module):
    """One V4.1 layer with the single-pass mHC hand-off (every mode; ``rows`` / ``cache`` as `Attention`)."""

    cfg: ModelConfig
    layer: int
    shard: ShardingContext | None = None

    @nn.compact
    def __call__(self, streams, pre_prev, state: CSAState, engram_ids, rows=None, cache=None,
                 cache_only: bool = False, tokens=None):
        """``streams [B,S,hc,H]`` → ``(streams, pre, state, cache)``; ``cache_only`` (the CED boundary's prepass):
        only this layer's cache writes, returning ``(None, None, state, cache)``. ``tokens [B,S]``: the rows' token
        ids (V4's hash-routed MoE layers pick their experts from them)."""
        cfg = self.cfg
        role = cfg.layer_roles[self.layer]
        dt = dtype_of(cfg.dtype)
        if role.engram_slot >= 0:
            streams = Engram(cfg, role.engram_slot, self.shard, name="engram")(
                streams, engram_ids[:, :, role.engram_slot], columns=getattr(rows, "columns", None))
        attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, name="attn_norm")
        attention = Attention(cfg, role, self.shard, name="attn")
        if cache_only:
            _, state, cache = attention(attn_norm(collapse(streams, pre_prev)), state, rows, cache, cache_only=True)
            return None, None, state, cache
        if self.layer in cfg.dspark_target_layer_ids:       # the DSpark feature: attention-input streams, hc mean
            self.sow("taps", "dspark", streams.astype(jnp.float32).mean(axis=2).astype(streams.dtype))
        out = {}

        def attend(x):
            y, out["state"], out["cache"] = attention(x, state, rows, cache)
            return y

        # the cached steps' MoE (no model-wide context): the attention-TP island of the rows' mesh, so that every
        # backend — the Pallas expert kernel included — runs on each rank's weight slices (in the GSPMD step XLA
        # would replicate an opaque kernel's operands: every expert matrix all-gathered per layer)
        moe_shard = self.shard
        if moe_shard is None and cfg.moe_backend == "sparse":
            moe_shard = getattr(rows, "columns", None)
        if cfg.is_v4:                                       # each site collapses with its own pre
            moe = MoE(cfg, moe_shard, hash_routed=cfg.hash_routed(self.layer), name="ffn")
            streams = mhc_layer_v4(streams, HyperConnection(cfg, name="hc_attn"), attn_norm, attend,
                                   HyperConnection(cfg, name="hc_ffn"),
                                   RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, name="ffn_norm"),
                                   lambda h: moe(h, tokens=tokens))
            return streams, pre_prev, out["state"], out["cache"]
        streams, pre_f = mhc_layer(streams, pre_prev, HyperConnection(cfg, name="hc_attn"), attn_norm, attend,
                                   HyperConnection(cfg, name="hc_ffn"),
                                   RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, name="ffn_norm"),
                                   MoE(cfg, moe_shard, name="ffn"))
        return streams, pre_f, out["state"], out["cache"]


class Transformer(nn.Module):
    """Embedding, ``num_hidden_layers`` blocks, final norm and LM head — the one model of every forward mode.

    Call with ``tokens [B,S]`` int32 and ``engram_ids [B,S,n_engram_layers,hash_heads]`` int32
    (`engram_inputs`); returns ``(logits [B,S,vocab] FP32, block inputs, cache)``.

    * full sequence (``rows`` None: the `v41cp.layers.full_sequence.FullSequence` backend): rows are positions
      ``0 … S−1`` of each sequence; the returned cache is that backend's (each KV source's entries of the sequence);
    * cached rows (``rows`` a `v41cp.layers.rows_backend.RowsBackend`, ``cache`` its cache): row ``i`` of
      request ``b`` is at position ``starts[b] + i`` and attends the request's cached history; the updated
      cache is returned. CED narrowing: with ``encoder_only``, the layers before the CED boundary and the
      boundary layer's cache-only prepass (logits are zeros); with a narrowing ``rows`` (``decoder_rows > 0``),
      the rows before each request's decoder rows stop at the boundary's cache writes and the returned rows are
      the decoder rows;
    * ``logits_at [B]`` (cached rows): only that row of each request meets the head (−1 = none: zeros); logits
      are then ``[B,1,vocab]``. Every row's head input ``[B,S,hidden]`` is sown into the ``"final"`` collection
      (``mutable=["final"]``: prompt log-probabilities).
    """

    cfg: ModelConfig
    shard: ShardingContext | None = None

    @nn.compact
    def __call__(self, tokens: jax.Array, engram_ids: jax.Array, rows=None, cache: dict | None = None,
                 encoder_only: bool = False, logits_at: jax.Array | None = None):
        cfg = self.cfg
        dt = dtype_of(cfg.dtype)
        embed = declare(self, "embed", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dt)
        head = declare(self, "head", (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), jnp.float32)
        b, s = tokens.shape
        if getattr(self.shard, "in_map", False):        # model-wide QCP: vocab rows split over the row group
            x = self.shard.split_lookup(lambda i: jnp.take(embed, i, axis=0), embed.shape[0], cfg.vocab_size,
                                        tokens.reshape(-1)).reshape(b, s, -1)
        else:
            x = jnp.take(embed, tokens, axis=0)
        streams = jnp.broadcast_to(x[:, :, None, :], (b, s, cfg.hc_mult, cfg.hidden_size))
        pre = jnp.zeros((b, s, cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
        state = CSAState()
        hidden = []
        last = cfg.num_hidden_layers
        boundary = None
        rows = FullSequence(cfg, self.shard, b, s) if rows is None else rows
        if encoder_only or rows.narrows:
            boundary = ced_boundary(cfg)
            last = boundary if encoder_only else last
        for i in range(last):
            block = Block(cfg, i, self.shard, name=f"layers_{i}")
            if i == boundary:
                # CED narrowing: the encoder rows only write the boundary's caches; the decoder rows go on
                enc_rows, rows, take = rows.ced_split()
                _, _, _, cache = block(streams, pre, state, engram_ids, enc_rows, cache, cache_only=True)
                streams, pre, engram_ids = take(streams), take(pre), take(engram_ids)
                state = CSAState()              # the boundary is a KV source: it publishes the state afresh
                b, s = streams.shape[:2]
            hidden.append(streams)
            streams, pre, state, cache = block(streams, pre, state, engram_ids, rows, cache, tokens=tokens)
        if encoder_only:
            _, _, _, cache = Block(cfg, last, self.shard, name=f"layers_{last}")(
                streams, pre, state, engram_ids, rows, cache, cache_only=True)
            return jnp.zeros((b, s, cfg.vocab_size), jnp.float32), hidden, cache
        if cfg.is_v4:                          # the MTP layer's target input: the last layer's output streams
            self.sow("taps", "mtp", streams)
        final = HyperHead(cfg, name="hc_head")(streams) if cfg.is_v4 else collapse(streams, pre)
        h = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, name="norm")(final)
        self.sow("final", "hidden", h)         # every row's head input (kept only when "final" is mutable)
        if logits_at is not None:              # only the sampled row of each request meets the head
            h = rows.sampled(h, logits_at)
        logits = jnp.einsum("bsh,hv->bsv", h.astype(jnp.float32), head, precision=jax.lax.Precision.HIGHEST)
        logits = constrain(logits, ("batch", None, "vocab"), self.shard)
        return logits, hidden, cache


def embedding_and_head(params) -> tuple[jax.Array, jax.Array]:
    """The target's token embedding ``[vocab, H]`` and FP32 head ``[H, vocab]``, which the DSpark drafter shares."""
    return params["embed"], params["head"]


def engram_inputs(cfg: ModelConfig, tokens) -> np.ndarray:
    """Host-side Engram row ids ``[B,S,n_engram,hash_heads]`` (an empty last axis without Engram)."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or 0 in tokens.shape:
        raise ValueError(f"tokens must be a non-empty [batch, seq] array, got shape {tokens.shape}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
    if tokens.shape[1] > cfg.max_position_embeddings:
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_position_embeddings="
                         f"{cfg.max_position_embeddings}")
    bad = cfg.out_of_vocabulary(tokens)
    if bad:
        raise ValueError(bad)
    if not cfg.engram_layer_ids:
        return np.zeros((*tokens.shape, 0, 0), np.int32)
    return engram_hash_ids(cfg, tokens)


@partial(jax.jit, static_argnames=("cfg", "shard", "mode"))
def _apply(params, tokens, engram_ids, cfg: ModelConfig, shard: ShardingContext | None, mode: str):
    # FP32 models mean FP32 matmuls: no TF32 / reduced-precision passes on GPU
    with jax.default_matmul_precision("highest" if cfg.dtype == "float32" else "default"):
        return _apply_traced(params, tokens, engram_ids, cfg, shard, mode)


def _apply_traced(params, tokens, engram_ids, cfg, shard, mode):
    model = Transformer(cfg, shard)
    if mode == "debug":
        (logits, hidden, _), inter = model.apply({"params": params}, tokens, engram_ids, mutable=["intermediates"])
        return logits, jnp.stack(hidden), inter["intermediates"]
    if mode == "features":
        (logits, _, _), taps = model.apply({"params": params}, tokens, engram_ids, mutable=["taps"])
        return logits, target_features(cfg, taps["taps"])
    logits, hidden, _ = model.apply({"params": params}, tokens, engram_ids)
    if mode == "hidden":
        return logits, jnp.stack(hidden)
    return logits


def forward(params, cfg: ModelConfig, tokens, *, shard: ShardingContext | None = None) -> jax.Array:
    """Logits ``[B,S,vocab]`` (FP32) of a full-sequence forward over ``tokens [B,S]``."""
    return _apply(params, jnp.asarray(tokens, jnp.int32), engram_inputs(cfg, tokens), cfg, shard, "logits")


def forward_with_hidden(params, cfg: ModelConfig, tokens, *, shard: ShardingContext | None = None):
    """(logits, every block's input streams ``[L,B,S,hc,H]``)."""
    return _apply(params, jnp.asarray(tokens, jnp.int32), engram_inputs(cfg, tokens), cfg, shard, "hidden")


def forward_with_features(params, cfg: ModelConfig, tokens, *, shard: ShardingContext | None = None):
    """(logits, the drafter's target features: DSpark's ``[B,S,n·H]``, V4 MTP's ``[B,S,hc·H]``;
    `v41cp.drafter.target_features`)."""
    return _apply(params, jnp.asarray(tokens, jnp.int32), engram_inputs(cfg, tokens), cfg, shard, "features")


def forward_debug(params, cfg: ModelConfig, tokens, *, shard: ShardingContext | None = None):
    """(logits, hidden, intermediates): intermediates hold each index layer's ``topk`` and ``index_scores`` and
    each MoE layer's ``route_scores`` (the biased scores its top-k ranks, ``[B·S, E]``)."""
    return _apply(params, jnp.asarray(tokens, jnp.int32), engram_inputs(cfg, tokens), cfg, shard, "debug")


def _dummy_inputs(cfg: ModelConfig, seq: int = 4):
    tokens = jnp.zeros((1, seq), jnp.int32)
    n = len(cfg.engram_layer_ids)
    ids = jnp.zeros((1, seq, n, cfg.engram_hash_heads if n else 0), jnp.int32)
    return tokens, ids


@abstract_tree_cache
def abstract_params(cfg: ModelConfig) -> Any:
    """Boxed abstract parameter tree (``nn.Partitioned`` of ShapeDtypeStruct): no allocation."""
    tokens, ids = _dummy_inputs(cfg)
    return jax.eval_shape(lambda k: Transformer(cfg).init(k, tokens, ids), jax.random.key(0))["params"]


def shard_params(params, cfg: ModelConfig, mesh, rules: AxisRules = TP_RULES):
    """Place an unboxed parameter tree on ``mesh`` with the logical-axis shardings of ``rules``."""
    shardings = param_shardings(abstract_params(cfg), mesh, rules)
    return jax.device_put(params, shardings)


def init_params(cfg: ModelConfig, key: jax.Array, mesh=None, rules: AxisRules = TP_RULES) -> Any:
    """Random parameters (std 0.02 weights, unit norms, zero biases/sinks), sharded when ``mesh`` is given."""
    tokens, ids = _dummy_inputs(cfg)
    init = lambda k: nn.unbox(Transformer(cfg).init(k, tokens, ids)["params"])
    if mesh is None:
        return jax.jit(init)(key)
    shardings = param_shardings(abstract_params(cfg), mesh, rules)
    return jax.jit(init, out_shardings=shardings)(key)
