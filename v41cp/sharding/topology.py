"""Parallel configuration: attention TP, data-parallel replicas and the context-parallel sub-groups.

`ParallelConfig` carries the serving engines' knobs (``--tp-size``, ``--kv-parallel-size``,
``--decode-context-parallel-size``, ``--query-context-parallel-size``) and validates them with errors
that name the offending values. KVP / DCP / QCP groups are sub-groups of attention TP (they add no
devices): the inner ``cp`` axis of `v41cp.sharding.make_mesh`.

Restrictions:

* ``kv_parallel_size`` divides attention TP (so a group never crosses a data-parallel replica);
* decode runs the DCP path over the KVP pages, so ``decode_context_parallel_size == kv_parallel_size``;
* ``query_context_parallel_size`` is 1 or the attention TP size, and with it KVP is 1 or equal to QCP;
* the operator-local indexer / attention QCP sizes are 1 or the attention TP size, and neither combines with
  model-wide QCP;
* the ``a2a`` merge and the ``heads`` mode split the query heads over the group: ``num_attention_heads`` must
  divide by attention TP;
* prefill and decode run in separate rounds and prefill is eager (the engine's only mode).
"""

from __future__ import annotations

from dataclasses import dataclass

from v41cp.sharding.mesh import make_mesh
from v41cp.sharding.rules import INDEXER_QCP_RULES, QCP_RULES, REPLICATED_Q_RULES, TP_RULES, ShardingContext

__all__ = ["ParallelConfig", "DCP_MERGES", "DCP_Q_MODES"]

DCP_MERGES = ("auto", "ag_rs", "a2a", "heads")
DCP_Q_MODES = ("gather", "replicate")


@dataclass(frozen=True)
class ParallelConfig:
    """Topology of one serving instance.

    tp_size: attention tensor-parallel size; dp_size: data-parallel replicas (devices = tp · dp).
    kv_parallel_size: ranks that share one request's global KV / index-K pages page-cyclically (KVP).
    decode_context_parallel_size: ranks of one DCP decode group (must equal KVP).
    query_context_parallel_size: model-wide prefill query partition (1 = off; rows per `QueryShardPlan`).
    indexer_query_parallel_size / attention_query_parallel_size: operator-local QCP of the indexer / the selected
    prefill attention (1 = off, else the attention TP size; not combinable with model-wide QCP), applied from
    ``indexer_query_min_tokens`` query rows and from ``attention_query_min_tokens`` (global layers) /
    ``attention_query_swa_min_tokens`` (SWA-only layers) rows.
    dcp_merge: ``ag_rs`` (all-gather LSE + reduce-scatter outputs) or ``a2a`` (one packed all-to-all) merge
    partial attention over owned entries; ``heads`` gathers the selected entries' records from their owners
    instead (one all-reduce of ``B·K`` records) and each rank attends only its own query heads (no merge);
    ``auto`` (the default, `dcp_merge_for`): ``heads`` where the query heads split evenly over attention TP —
    the compiled decode programs show it best (fewest FLOPs, temporaries and collective bytes, tiny and released
    sizes) — else ``ag_rs``.
    dcp_q: ``gather`` (all-gather query heads per layer) or ``replicate`` (query projections replicated
    over the group, queries computed locally).
    """

    tp_size: int = 1
    dp_size: int = 1
    kv_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    query_context_parallel_size: int = 1
    dcp_merge: str = "auto"
    dcp_q: str = "gather"
    indexer_query_parallel_size: int = 1
    attention_query_parallel_size: int = 1
    indexer_query_min_tokens: int = 1024
    attention_query_min_tokens: int = 1024
    attention_query_swa_min_tokens: int = 4096

    def __post_init__(self):
        for name in ("tp_size", "dp_size", "kv_parallel_size", "decode_context_parallel_size",
                     "query_context_parallel_size", "indexer_query_parallel_size", "attention_query_parallel_size",
                     "indexer_query_min_tokens", "attention_query_min_tokens", "attention_query_swa_min_tokens"):
            v = getattr(self, name)
            if type(v) is not int or v <= 0:
                raise ValueError(f"topology: {name} must be a positive integer, got {v!r}")
        tp, kvp, dcp, qcp = (self.tp_size, self.kv_parallel_size, self.decode_context_parallel_size,
                             self.query_context_parallel_size)
        if kvp > tp and (tp * self.dp_size) % kvp == 0:
            raise ValueError(f"topology: kv_parallel_size={kvp} would cross data-parallel replicas "
                             f"(attention TP is {tp}, dp {self.dp_size}); a KVP group must fit inside one replica")
        if tp % kvp:
            raise ValueError(f"topology: kv_parallel_size={kvp} does not divide attention tp_size={tp}")
        if dcp != kvp:
            raise ValueError(f"topology: decode_context_parallel_size={dcp} must equal kv_parallel_size={kvp} "
                             f"(decode attends the KVP page owners)")
        if qcp not in (1, tp):
            raise ValueError(f"topology: query_context_parallel_size={qcp} must be 1 or the attention tp_size={tp}")
        if qcp > 1 and kvp not in (1, qcp):
            raise ValueError(f"topology: with query_context_parallel_size={qcp}, kv_parallel_size={kvp} must be "
                             f"1 (replicated KV) or equal to it")
        for name in ("indexer_query_parallel_size", "attention_query_parallel_size"):
            v = getattr(self, name)
            if v not in (1, tp):
                raise ValueError(f"topology: {name}={v} must be 1 or the attention tp_size={tp}")
            if v > 1 and qcp > 1:
                raise ValueError(f"topology: operator-local {name}={v} cannot be combined with model-wide "
                                 f"query_context_parallel_size={qcp}")
        if self.dcp_merge not in DCP_MERGES:
            raise ValueError(f"topology: dcp_merge={self.dcp_merge!r} is not one of {DCP_MERGES}")
        if self.dcp_q not in DCP_Q_MODES:
            raise ValueError(f"topology: dcp_q={self.dcp_q!r} is not one of {DCP_Q_MODES}")

    @property
    def cp(self) -> int:
        """Size of the context-parallel sub-axis of the mesh."""
        return max(self.kv_parallel_size, self.query_context_parallel_size)

    @property
    def num_devices(self) -> int:
        return self.tp_size * self.dp_size

    def dcp_merge_for(self, cfg) -> str:
        """The DCP merge this topology runs for model ``cfg``: ``dcp_merge``, with ``auto`` resolved (``heads``
        when ``cfg.num_attention_heads`` divides by ``tp_size``, else ``ag_rs``)."""
        if self.dcp_merge != "auto":
            return self.dcp_merge
        return "heads" if cfg.num_attention_heads % self.tp_size == 0 else "ag_rs"

    def validate_model(self, cfg) -> None:
        """Model-dependent restrictions (raise ValueError naming the value)."""
        if self.kv_parallel_size > 1 and self.dcp_merge in ("a2a", "heads") and cfg.num_attention_heads % self.tp_size:
            raise ValueError(f"topology: the {self.dcp_merge} DCP merge splits query heads over attention TP, but "
                             f"num_attention_heads={cfg.num_attention_heads} does not divide by tp_size={self.tp_size}")

    def make_mesh(self, devices=None):
        """The ``(dp, tp / cp, cp)`` mesh of this topology over ``devices`` (default: the first
        ``tp_size · dp_size`` devices of the host)."""
        import jax

        if devices is None:
            devices = jax.devices()
            devices = devices[:self.num_devices] if len(devices) >= self.num_devices else devices
        devices = list(devices)
        if len(devices) != self.num_devices:
            raise ValueError(f"topology: tp_size={self.tp_size} x dp_size={self.dp_size} = {self.num_devices} "
                             f"devices, but {len(devices)} devices are available")
        return make_mesh(tp=self.tp_size, dp=self.dp_size, devices=devices, cp=self.cp)

    def rules(self):
        """Parameter sharding rules for this topology."""
        if self.query_context_parallel_size > 1:
            return QCP_RULES
        if self.indexer_query_parallel_size > 1:
            if self.kv_parallel_size > 1 and self.dcp_q == "replicate":
                raise ValueError("topology: indexer_query_parallel_size > 1 with dcp_q='replicate' is not supported "
                                 "(both choose the indexer's query-projection layout)")
            return INDEXER_QCP_RULES
        return REPLICATED_Q_RULES if self.kv_parallel_size > 1 and self.dcp_q == "replicate" else TP_RULES

    def sharding_context(self, mesh):
        """The `ShardingContext` of a full-sequence forward under this topology (rules + operator-local QCP)."""
        return ShardingContext(mesh, self.rules(), indexer_query_parallel=self.indexer_query_parallel_size > 1,
                               indexer_query_min_tokens=self.indexer_query_min_tokens,
                               attention_query_parallel=self.attention_query_parallel_size > 1,
                               attention_query_min_tokens=self.attention_query_min_tokens,
                               attention_query_swa_min_tokens=self.attention_query_swa_min_tokens)
