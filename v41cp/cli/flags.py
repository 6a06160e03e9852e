"""The command line's flag groups, declared once and shared by every command (SGLang's ``server_args`` idea).

Each group is a frozen dataclass; each field declares one flag (`flag`: its name, type, default, choices and help
in the field's metadata, the field's name is the flag's ``dest``). `add` puts a group, or some of its fields, on an
argparse parser; ``Group.from_args(args)`` reads the group's value back from the parsed namespace (fields a command
did not add keep their defaults); the group's methods build the library object it stands for.

* `ModelFlags` ``--checkpoint`` / ``--preset`` / ``--no-fake-quant`` / ``--keep-quantized`` / ``--dequantize``: the
  model (`config`) and its weights' storage (`storage`: as stored unless a flag asks);
* `OutputFlags` ``--json``: machine-readable output (and no progress bars);
* `TopologyFlags` ``--devices`` / ``--tp-size`` / ``--kv-parallel-size`` / DCP: the mesh, with
  `QueryParallelFlags` (model-wide and operator-local QCP) → `ParallelConfig` (`parallel_config`);
* `CapacityFlags` the compiled bucket → `Capacity`, with `PrefillFlags` (span prefill, CED, prefix caching);
* `BackendFlags` the attention / indexer / expert / MoE backends → the checkpoint's config overrides;
* `SpeculativeFlags` DSpark speculative decoding → `Speculative`;
* `DisaggregationFlags` prefill / decode on disjoint devices → the two roles' `ParallelConfig`;
* `DistributedFlags` ``--nnodes`` / ``--node-rank`` / ``--dist-init-addr`` → ``jax.distributed`` (`start`);
* `CompileCacheFlags` ``--compilation-cache-dir`` / ``--no-compilation-cache`` → jax's persistent compilation cache
  (`start`; on by default in the user's cache folder).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import jax

from v41cp.checkpoint import default_checkpoint, open_drafter, stores_quantized_at
from v41cp.config import ModelConfig, preset
from v41cp.serving.engine import Capacity
from v41cp.serving.runner.speculative import Speculative, resolved
from v41cp.sharding.topology import DCP_MERGES, DCP_Q_MODES, ParallelConfig


def flag(name: str, *, default=None, help=None, **argparse_kwargs):
    """A dataclass field declaring the flag ``name`` (``help`` may be a function of the default, for groups whose
    commands set different defaults); the other keywords go to ``add_argument`` as given."""
    return dataclasses.field(default=default, metadata={"flag": name, "help": help, "kwargs": argparse_kwargs})


def add(parser, group, *names: str, defaults: dict | None = None, help: dict | None = None, titled: bool = True):
    """Add ``group``'s flags to ``parser`` (only ``names``, in that order, when given), under the group's ``TITLE``
    (an argument group; ``titled=False``: on the parser itself). ``defaults`` / ``help`` replace a field's declared
    default / help text for this command."""
    fields = {f.name: f for f in dataclasses.fields(group)}
    defaults, help = defaults or {}, help or {}
    unknown = (set(names) | set(defaults) | set(help)) - set(fields)
    if unknown:
        raise KeyError(f"{group.__name__} has no field {sorted(unknown)}")
    title = group.TITLE if titled else None
    target = parser.add_argument_group(title) if title else parser
    for f in [fields[n] for n in names] if names else fields.values():
        default = defaults.get(f.name, f.default)
        text = help.get(f.name, f.metadata["help"])
        if callable(text):
            text = text(default)
        target.add_argument(f.metadata["flag"], dest=f.name, default=default, help=text, **f.metadata["kwargs"])


class _Group:
    """A flag group: ``TITLE`` names its argparse argument group (None: the flags go on the parser itself)."""
    TITLE: ClassVar[str | None] = None

    @classmethod
    def from_args(cls, args):
        """The group's value in the parsed ``args``."""
        return cls(**{f.name: getattr(args, f.name, f.default) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class ModelFlags(_Group):
    """Which model: a checkpoint directory (default: the embedded tiny one) or a named preset's config."""
    # the help info and forward show (the engine commands show none)
    DESCRIBED: ClassVar[dict] = {"checkpoint": "released-layout checkpoint directory (default: embedded tiny model)",
                                 "no_fake_quant": "switch the cache fake-quant off"}

    checkpoint: str | None = flag("--checkpoint")
    preset: str | None = flag("--preset", help="a named preset (v41-flash, tiny, ...)")
    no_fake_quant: bool = flag("--no-fake-quant", default=False, action="store_true")
    keep_quantized: bool = flag("--keep-quantized", default=False, action="store_true",
                                help="require routed experts FP4 and Engram tables FP8 as stored, decoded inside the "
                                     "forward (the default wherever the checkpoint stores them so; an error where "
                                     "it does not)")
    dequantize: bool = flag("--dequantize", default=False, action="store_true",
                            help="dequantize routed experts and Engram tables to the model dtype (default: keep "
                                 "them as the checkpoint stores them)")

    @property
    def path(self) -> str:
        return self.checkpoint or default_checkpoint()

    def quant(self) -> dict:
        """The cache fake-quant override: ``fake_quant=False`` under ``--no-fake-quant``, else empty — the model's
        default (on: the release's cache formats, `ModelConfig.cache_formats`)."""
        return {"fake_quant": False} if self.no_fake_quant else {}

    def storage(self) -> dict:
        """The loaders' ``keep_quantized`` override: empty (weights as stored), or what a flag asks."""
        if self.keep_quantized and self.dequantize:
            raise ValueError("--keep-quantized and --dequantize contradict each other: give one")
        return {"keep_quantized": True} if self.keep_quantized else {"keep_quantized": False} if self.dequantize \
            else {}

    def page_tokens(self) -> int:
        """The model's default cache page (`ModelConfig.page_tokens`: 16, or 128 for DeepSeek-V4), from the preset or
        the checkpoint's ``config.json``."""
        if self.preset:
            return preset(self.preset).page_tokens
        return ModelConfig.from_json(Path(self.path) / "config.json").page_tokens

    def config(self) -> ModelConfig:
        """The preset's config (weights as the release stores them: FP4 experts and FP8 Engram rows wherever the
        shapes allow), or the checkpoint's ``config.json`` (weights as it stores them, read from its headers);
        ``--keep-quantized`` / ``--dequantize`` override."""
        storage = self.storage()
        if self.preset:
            cfg = preset(self.preset, **self.quant())
            return cfg.replace(keep_quantized=storage.get("keep_quantized", cfg.storable_quantized))
        path = Path(self.path)
        cfg = ModelConfig.from_json(path / "config.json", **self.quant())
        if "keep_quantized" not in storage:
            headers = (path / "manifest.json").exists() or any(path.glob("*.safetensors"))
            storage["keep_quantized"] = stores_quantized_at(path) if headers else cfg.storable_quantized
        return cfg.replace(**storage)


@dataclass(frozen=True)
class OutputFlags(_Group):
    """``--json``: print JSON."""
    DESCRIBED: ClassVar[dict] = {"json": "print JSON"}       # as info and forward show it

    json: bool = flag("--json", default=False, action="store_true")

    def progress(self) -> bool:
        """Progress bars on stderr: when it is a terminal and the output is not JSON."""
        return sys.stderr.isatty() and not self.json


@dataclass(frozen=True)
class DistributedFlags(_Group):
    """One program over several processes (hosts) through ``jax.distributed``."""
    TITLE: ClassVar[str] = "multi-host (jax.distributed; SGLang's names)"

    nnodes: int = flag("--nnodes", default=1, type=int, help="processes (hosts) in the program; --devices counts "
                       "each one's local devices, the topology flags describe the global mesh")
    node_rank: int = flag("--node-rank", default=0, type=int,
                          help="this process's rank in [0, --nnodes); rank 0 prints")
    dist_init_addr: str | None = flag("--dist-init-addr",
                                      help="HOST:PORT of rank 0's coordinator (required with --nnodes > 1)")

    def start(self) -> None:
        """``jax.distributed.initialize`` for ``--nnodes > 1`` (gloo collectives between CPU processes); ranks > 0
        print nothing on stdout."""
        n, rank, addr = self.nnodes, self.node_rank, self.dist_init_addr
        if type(n) is not int or n < 1:
            raise ValueError(f"--nnodes must be a positive integer, got {n!r}")
        if n == 1:
            return
        if not 0 <= rank < n:
            raise ValueError(f"--node-rank {rank} is outside [0, --nnodes {n})")
        host, _, port = (addr or "").rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--dist-init-addr must be HOST:PORT with --nnodes {n}, got {addr!r}")
        # native libraries (gloo) log on file descriptor 1: send it to stderr, keep Python's stdout for the results
        sys.stdout.flush()
        results = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = os.fdopen(results, "w") if rank == 0 else open(os.devnull, "w")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")     # CPU processes; GPUs use NCCL
        jax.distributed.initialize(coordinator_address=addr, num_processes=n, process_id=rank)


@dataclass(frozen=True)
class CompileCacheFlags(_Group):
    """The persistent compilation cache (jax's own): every program compiled is kept on disk and a later run with the
    same program loads it instead of compiling. On by default, in the user's cache folder."""
    TITLE: ClassVar[str] = "compilation cache"

    compilation_cache_dir: str | None = flag(
        "--compilation-cache-dir", help="where compiled programs are kept (default: $JAX_COMPILATION_CACHE_DIR, else "
        "$XDG_CACHE_HOME/v41cp/jax, else ~/.cache/v41cp/jax)")
    no_compilation_cache: bool = flag("--no-compilation-cache", default=False, action="store_true",
                                      help="compile every program afresh; nothing is read from or written to disk")

    def directory(self) -> str | None:
        """The cache folder these flags ask for (None: no cache)."""
        if self.no_compilation_cache:
            return None
        if self.compilation_cache_dir:
            return self.compilation_cache_dir
        if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
            return os.environ["JAX_COMPILATION_CACHE_DIR"]
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "v41cp", "jax")

    def start(self) -> str | None:
        """Point jax at the cache before anything compiles: every program is kept, however quick its compile (unless
        $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise). Returns the folder, or None when off."""
        folder = self.directory()
        if folder is None:
            jax.config.update("jax_enable_compilation_cache", False)
            return None
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--compilation-cache-dir {folder!r} cannot be created: {e}") from None
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", folder)
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        return folder


@dataclass(frozen=True)
class QueryParallelFlags(_Group):
    """Query context parallelism of prefill: model-wide (the engine) and operator-local (indexer, attention)."""
    TITLE: ClassVar[str] = "query context parallelism (prefill; 1 = off, else the attention TP size)"

    query_context_parallel_size: int = flag(
        "--query-context-parallel-size", default=1, type=int,
        help="model-wide QCP of the engine's prefill (per-request zigzag rows over attention TP; KVP 1 or equal to "
             "it); generate / bench")
    indexer_query_parallel_size: int = flag("--deepseek-v41-indexer-query-parallel-size", default=1, type=int,
                                            help="operator-local indexer QCP (forward; the engine's span prefill)")
    attention_query_parallel_size: int = flag("--deepseek-v41-attention-query-parallel-size", default=1, type=int,
                                              help="operator-local attention QCP (forward; the engine's span prefill)")
    indexer_query_min_tokens: int = flag("--deepseek-v41-indexer-query-min-tokens", default=1024, type=int,
                                         help="indexer QCP applies from this many query rows")
    attention_query_min_tokens: int = flag("--deepseek-v41-attention-query-min-tokens", default=1024, type=int,
                                           help="attention QCP applies from this many rows (global layers)")
    attention_query_swa_min_tokens: int = flag("--deepseek-v41-attention-query-swa-min-tokens", default=4096,
                                               type=int, help="attention QCP applies from this many rows (SWA-only "
                                               "layers)")

    def kwargs(self) -> dict:
        """The `ParallelConfig` fields of the QCP flags."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class TopologyFlags(_Group):
    """The device mesh: attention TP (× DP), KVP / DCP of decode."""

    devices: int = flag("--devices", default=1, type=int,
                        help="devices to use (on a CPU host: simulated CPU devices); tp x dp must equal it")
    tp_size: int | None = flag("--tp-size", type=int, help="attention tensor-parallel size (default: --devices)")
    kv_parallel_size: int = flag("--kv-parallel-size", default=1, type=int,
                                 help="KVP: ranks sharing one request's global pages")
    decode_context_parallel_size: int | None = flag(
        "--decode-context-parallel-size", type=int,
        help="DCP group size (must equal --kv-parallel-size; default: equal to it)")
    dcp_merge: str = flag("--dcp-merge", default="auto", choices=DCP_MERGES,
                          help="DCP decode attention: ag_rs / a2a merge partials over owned entries; heads gathers the "
                               "selected records and splits the query heads (attention work / N); auto: heads when "
                               "the query heads divide by the attention TP size, else ag_rs")
    dcp_q: str = flag("--dcp-q", default="gather", choices=DCP_Q_MODES,
                      help="DCP queries: all-gather heads per layer, or replicated query projections")

    def global_devices(self, nnodes: int = 1) -> int:
        """Devices of the global mesh: ``--devices`` per process times ``--nnodes``."""
        return self.devices * nnodes

    def parallel(self, qcp: QueryParallelFlags, nnodes: int = 1, kv_parallel_size=None) -> ParallelConfig | None:
        """The `ParallelConfig` (None: one device, no mesh); ``kv_parallel_size`` replaces the flags' KVP (and DCP)."""
        kvp = self.kv_parallel_size if kv_parallel_size is None else kv_parallel_size
        dcp = kvp if kv_parallel_size is not None or self.decode_context_parallel_size is None \
            else self.decode_context_parallel_size
        devices = self.global_devices(nnodes)
        tp = self.tp_size or devices
        if devices % tp:
            raise ValueError(f"topology: --tp-size {tp} does not divide --devices {self.devices}"
                             + (f" x --nnodes {nnodes} = {devices}" if nnodes > 1 else ""))
        if devices == 1 and kvp == 1 and dcp == 1:
            return None
        return ParallelConfig(tp_size=tp, dp_size=devices // tp, kv_parallel_size=kvp,
                              decode_context_parallel_size=dcp, dcp_merge=self.dcp_merge, dcp_q=self.dcp_q,
                              **qcp.kwargs())


def parallel_config(args, kv_parallel_size=None) -> ParallelConfig | None:
    """The `ParallelConfig` of the topology, QCP and multi-host flags in ``args`` (None: one device, no mesh)."""
    return TopologyFlags.from_args(args).parallel(QueryParallelFlags.from_args(args),
                                                  DistributedFlags.from_args(args).nnodes, kv_parallel_size)


def global_devices(args) -> int:
    """Devices of the global mesh: ``--devices`` per process times ``--nnodes``."""
    return TopologyFlags.from_args(args).global_devices(DistributedFlags.from_args(args).nnodes)


@dataclass(frozen=True)
class PrefillFlags(_Group):
    """How the engine prefills: span prefill passes under a per-round row budget (default) or token-serial, CED
    narrowing, prefix caching."""

    token_serial_prefill: bool = flag(
        "--token-serial-prefill", default=False, action="store_true",
        help="prefill token by token in chunks of --prefill-chunk (the exactness reference) "
             "instead of the default span prefill (not with --query-context-parallel-size > 1)")
    max_prefill_tokens: int | None = flag(
        "--max-prefill-tokens", type=int,
        help="span prefill rows per round across requests (like vLLM's --max-num-batched-tokens / SGLang's "
             "--chunked-prefill-size): longer prompts continue over rounds while others decode; default "
             "min(8192, max batch × max context)")
    prefill_bucket_count: int | None = flag(
        "--prefill-bucket-count", type=int,
        help="span prefill row buckets compiled at most (one program each: the largest of the halving ladder from "
             "--max-prefill-tokens down to 16 rows); fewer: a shorter warm-up and fewer programs held, short passes "
             "padded to a larger bucket; default: the whole ladder")
    ced: bool = flag("--ced", default=False, action="store_true", help="CED narrowing of prefill (exact)")
    enable_prefix_caching: bool = flag(
        "--enable-prefix-caching", default=True, action=argparse.BooleanOptionalAction,
        help="reuse the cached pages and stored slot state of a prompt's longest cached whole-block prefix (on by "
             "default, as in vLLM; every prefill path and topology, PD included; --no-enable-prefix-caching: off)")
    prefix_states: int | None = flag("--prefix-states", type=int,
                                     help="slot states the prefix cache stores at most (default: 4 per batch row)")

    def options(self) -> dict:
        """The engine's prefill options (`Capacity` fields)."""
        return {"span_prefill": False if self.token_serial_prefill else None, "ced": self.ced,
                "prefill_tokens": self.max_prefill_tokens, "prefill_bucket_count": self.prefill_bucket_count,
                "prefix_caching": self.enable_prefix_caching,
                "prefix_states": self.prefix_states}


def _max_batch_help(default) -> str:
    return "batch rows of the decode step (requests served at once)" + (
        f"; default {default}" if default else "; default: the number of prompts")


def _max_context_help(default) -> str:
    return "tokens per request, prompt + output (Capacity.max_tokens); default " + (
        str(default) if default else "the longest request rounded up to a block")


@dataclass(frozen=True)
class CapacityFlags(_Group):
    """The compiled bucket of the engine (`Capacity`)."""
    TITLE: ClassVar[str] = "capacity (the compiled bucket; `v41cp.serving.engine.Capacity`)"

    max_batch: int | None = flag("--max-batch", type=int, help=_max_batch_help)
    max_context: int | None = flag("--max-context", type=int, help=_max_context_help)
    block_tokens: int | None = flag("--block-tokens", type=int,
                                    help="tokens per cache page (default: the model's page, ModelConfig.page_tokens "
                                         "— 16, or 128 for DeepSeek-V4)")
    num_blocks: int | None = flag("--num-blocks", type=int,
                                  help="cache pages in all (default: max-batch full requests)")
    prefill_chunk: int = flag("--prefill-chunk", default=32, type=int, help="rows per token-serial prefill chunk")
    max_waiting: int = flag("--max-waiting", default=64, type=int, help="queued requests beyond this are rejected")
    max_logprobs: int = flag("--max-logprobs", default=20, type=int,
                             help="the most log-probability alternatives a request may ask for (computed on the "
                                  "device, in the steps, when a request asks; 0: no log-probabilities)")

    def capacity(self, prefill: PrefillFlags, longest: int, page: int | None = None, **fixed) -> Capacity:
        """The `Capacity`; unset fields fit ``longest`` tokens per request, ``fixed`` ones (not None) win; the page is
        ``--block-tokens``, else ``page`` (the model's, `ModelFlags.page_tokens`)."""
        block = self.block_tokens or page
        if block is None:
            raise ValueError("the cache page: give --block-tokens or the model's page")
        fields = {"max_batch": self.max_batch, "max_tokens": self.max_context or -(-longest // block) * block,
                  "block_tokens": block, "num_blocks": self.num_blocks, "prefill_chunk": self.prefill_chunk,
                  "max_waiting": self.max_waiting, "max_logprobs": self.max_logprobs, **prefill.options()}
        fields.update({k: v for k, v in fixed.items() if v is not None})
        return Capacity(**{k: v for k, v in fields.items() if v is not None})


def _backend_help(what: str) -> str:
    return f"{what}: the XLA path, or the Pallas kernel (interpret mode off the GPU)"


@dataclass(frozen=True)
class BackendFlags(_Group):
    """The kernels the model runs: XLA or Pallas per operator, sparse or dense MoE."""

    attention_backend: str = flag("--attention-backend", default="xla", choices=("xla", "pallas"),
                                  help=_backend_help("sparse attention"))
    indexer_backend: str = flag("--indexer-backend", default="xla", choices=("xla", "pallas"),
                                help=_backend_help("indexer scan + top-k"))
    expert_backend: str = flag("--expert-backend", default="xla", choices=("xla", "pallas"), help=_backend_help(
        "FP4 expert GEMMs of the sparse MoE (experts kept FP4 as stored)"))
    moe_backend: str = flag("--moe-backend", default="sparse", choices=("sparse", "dense"),
                            help="routed experts: each token runs only its top-k experts (dropless, static shapes), or "
                                 "every expert on every token (the reference)")

    def overrides(self) -> dict:
        """The model config overrides (`ModelConfig` fields)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SpeculativeFlags(_Group):
    """Speculative decoding with the checkpoint's drafter (V4.1: DSpark; DeepSeek-V4: its MTP layer)."""

    speculative_algorithm: str | None = flag(
        "--speculative-algorithm", choices=("dspark", "mtp"),
        help="speculative decoding with the checkpoint's drafter (mtp.*): dspark (V4.1) or mtp (DeepSeek-V4); "
             "exact (greedy tokens as without it; sampling lossless)")
    speculative_num_draft_tokens: int | None = flag(
        "--speculative-num-draft-tokens", type=int,
        help="drafts verified per step: dspark 1 … dspark_block_size (default: the block size); mtp 1 … "
             "sliding_window - 1 chained MTP rows (default 1, the layer as trained)")

    def speculative(self, cfg: ModelConfig, checkpoint: str) -> Speculative | None:
        """The `Speculative` settings (None: off), the drafter's weights from ``checkpoint``'s ``mtp.*`` tensors."""
        if self.speculative_algorithm is None:
            if self.speculative_num_draft_tokens is not None:
                raise ValueError("--speculative-num-draft-tokens needs --speculative-algorithm (dspark or mtp)")
            return None
        n = self.speculative_num_draft_tokens
        spec = resolved(cfg, Speculative(None, n, self.speculative_algorithm))   # a clear error before any weight
        return Speculative(open_drafter(checkpoint, cfg), spec.num_draft_tokens, spec.algorithm)


@dataclass(frozen=True)
class DisaggregationFlags(_Group):
    """Prefill and decode on disjoint devices of one program (or of two processes)."""
    TITLE: ClassVar[str] = "prefill / decode disaggregation (one program, disjoint devices)"

    prefill_devices: int | None = flag(
        "--prefill-devices", type=int,
        help="prefill on the first N of --devices (attention TP N, with the QCP flags), decode on the rest (KVP = DCP "
             "from --kv-parallel-size); requests move by page-owner transfer plans")
    prefill_kv_parallel_size: int | None = flag(
        "--prefill-kv-parallel-size", type=int,
        help="the prefill's KVP: 1 (relayout to the decode owners) or equal to the decode's (rank-matched); default: "
             "the decode's when it divides --prefill-devices, else 1")

    def parallel(self, topology: TopologyFlags, qcp: QueryParallelFlags,
                 nnodes: int = 1) -> tuple[ParallelConfig, ParallelConfig]:
        """The prefill role's `ParallelConfig` (attention TP ``--prefill-devices``, the QCP flags,
        ``--prefill-kv-parallel-size``) and the decode role's (the other devices, KVP = DCP)."""
        p, devices = self.prefill_devices, topology.global_devices(nnodes)
        if not 0 < p < devices:
            raise ValueError(f"topology: --prefill-devices {p} must be at least 1 and leave decode devices of the "
                             f"{devices} devices")
        if topology.tp_size is not None:
            raise ValueError("topology: --tp-size does not apply with --prefill-devices (each role's attention TP is "
                             "its device count)")
        kvp = topology.kv_parallel_size
        dcp = topology.decode_context_parallel_size or kvp
        pre_kvp = self.prefill_kv_parallel_size
        if pre_kvp is None:
            pre_kvp = kvp if p % kvp == 0 else 1
        prefill = ParallelConfig(tp_size=p, kv_parallel_size=pre_kvp, decode_context_parallel_size=pre_kvp,
                                 **qcp.kwargs())
        decode = ParallelConfig(tp_size=devices - p, kv_parallel_size=kvp, decode_context_parallel_size=dcp,
                                dcp_merge=topology.dcp_merge, dcp_q=topology.dcp_q)
        return prefill, decode
