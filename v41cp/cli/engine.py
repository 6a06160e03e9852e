"""The serving engine and the text codec a command runs, built from the flag groups (`v41cp.cli.flags`).

* `open_engine` — ``(config, engine)``: one `Engine` on the topology flags' mesh, or prefill / decode on disjoint
  devices (`DisaggregatedEngine`; across two processes `CrossProcessDisaggregatedEngine`) with ``--prefill-devices``;
* `text_codec` — the checkpoint's tokenizer and chat format.
"""

from __future__ import annotations

from pathlib import Path

from v41cp.checkpoint import open_checkpoint
from v41cp.cli import flags
from v41cp.serving.api.text import ChatFormatError, TextCodec
from v41cp.serving.engine import Capacity, Engine
from v41cp.serving.pd.engines import DisaggregatedEngine
from v41cp.serving.pd.processes import CrossProcessDisaggregatedEngine


def open_engine(args, capacity: Capacity):
    """``(config, engine)`` of the parsed flags: the checkpoint's weights straight onto the mesh (each device reads
    only its own shard of every parameter)."""
    if flags.DisaggregationFlags.from_args(args).prefill_devices is not None:
        return _disaggregated_engine(args, capacity)
    model, parallel = flags.ModelFlags.from_args(args), flags.parallel_config(args)
    mesh = parallel.make_mesh() if parallel is not None else None
    cfg, params = open_checkpoint(model.path, mesh=mesh, rules=parallel.rules() if parallel is not None else None,
                                  **model.quant(), progress=flags.OutputFlags.from_args(args).progress(),
                                  **model.storage(), **flags.BackendFlags.from_args(args).overrides())
    speculative = flags.SpeculativeFlags.from_args(args).speculative(cfg, model.path)
    return cfg, Engine(params, cfg, capacity, mesh=mesh, parallel=parallel, speculative=speculative,
                       tokenizer=_tokenizer(model.path))


def _disaggregated_engine(args, capacity: Capacity):
    """Prefill on the first ``--prefill-devices`` devices (their attention TP, with the QCP flags and
    ``--prefill-kv-parallel-size``), decode on the rest (``--kv-parallel-size`` = DCP)."""
    nnodes = flags.DistributedFlags.from_args(args).nnodes
    prefill, decode = flags.DisaggregationFlags.from_args(args).parallel(
        flags.TopologyFlags.from_args(args), flags.QueryParallelFlags.from_args(args), nnodes)
    model = flags.ModelFlags.from_args(args)
    cfg, params = open_checkpoint(model.path, **model.quant(),
                                  progress=flags.OutputFlags.from_args(args).progress(), **model.storage(),
                                  **flags.BackendFlags.from_args(args).overrides())
    speculative = flags.SpeculativeFlags.from_args(args).speculative(cfg, model.path)
    tok = _tokenizer(model.path)
    if nnodes > 1:                                # prefill in process 0, decode in process 1
        return cfg, CrossProcessDisaggregatedEngine(params, cfg, capacity, prefill, decode, speculative=speculative,
                                                    tokenizer=tok)
    return cfg, DisaggregatedEngine(params, cfg, capacity, prefill, decode, speculative=speculative, tokenizer=tok)


def _tokenizer(checkpoint: str) -> str | None:
    """The checkpoint's ``tokenizer.json`` (structured output's grammars need it), or None."""
    path = Path(checkpoint) / "tokenizer.json"
    return str(path) if path.exists() else None


def text_codec(checkpoint: str, required: bool) -> TextCodec | None:
    """The checkpoint's `TextCodec` (tokenizer + chat format); None when it has no tokenizer.json and text is
    not required."""
    try:
        return TextCodec.from_checkpoint(checkpoint)
    except ChatFormatError:
        if required:
            raise
        return None
