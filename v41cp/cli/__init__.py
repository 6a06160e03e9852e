"""Command line: ``python -m v41cp {info,forward,convert,generate,serve,bench,plan} [...]`` (``v41cp`` once
installed); ``--json`` prints JSON.

* ``info`` config summary and the per-layer role table (`v41cp.cli.info`).
* ``forward`` next-token predictions for a prompt of token ids (full-sequence forward; `v41cp.cli.forward`).
* ``convert SRC DST [--dtype bf16|fp32] [--keep-quantized] [--workers N]`` released layout → orbax in the model's
  tree (`v41cp.cli.convert`).
* ``generate [--prompt-ids 1,2,3 ...] [--prompt TEXT [--chat]] [--max-new-tokens N] [--devices N] [--json]`` the
  serving engine; text prompts go through the checkpoint's tokenizer and stream text back (`v41cp.cli.generate`).
* ``serve [--host 127.0.0.1] [--port 8000]`` the OpenAI-compatible HTTP server (`v41cp.cli.serve`).
* ``bench decode|prefill [--lengths 64,512,2048] --json`` engine step latency, tokens/s, compile counts
  (`v41cp.cli.bench`, `v41cp.serving.offline_bench`); ``bench kernels [--shapes flash|tiny] [--contexts ...]
  [--batches ...] [--expert-tokens ...] --json`` the Pallas kernels vs the XLA paths vs the HBM roofline
  (`v41cp.cli.kernels`, `v41cp.kernel_bench`).
* ``plan --preset v41-flash --mode decode|prefill --batch B --context T [topology flags] --json`` compiles (never
  runs) the step with abstract weights: per-device FLOPs / memory / collective bytes vs the analytic floor
  (`v41cp.cli.plan`, `v41cp.plan`).

The flags the commands share are declared once, in groups (`v41cp.cli.flags`): ``forward``, ``generate``, ``serve``,
``bench`` and ``plan`` take the backends (``--attention-backend`` / ``--indexer-backend`` / ``--expert-backend``:
``xla`` | ``pallas``; ``--moe-backend``: ``sparse`` | ``dense``) and the topology flags; ``forward`` runs
operator-local indexer / attention QCP (``--deepseek-v41-{indexer,attention}-query-parallel-size``); ``generate`` /
``serve`` / ``bench`` run them, or model-wide QCP (``--query-context-parallel-size``), in the engine's span prefill
(``--max-prefill-tokens``, ``--ced``). ``info`` and ``forward`` default to the embedded tiny checkpoint
(``checkpoints/tiny-v41``); ``--checkpoint`` takes a converted or a released-layout directory.

Each command is a module of this package (`COMMANDS`) with ``add_arguments(parser)`` (its flag groups and its own
flags), ``run(args) -> int`` and optionally ``check(args)`` (a usage error, or None). Only the module of the command
that runs is imported, so ``--help`` starts no jax, and ``--devices N`` (simulated CPU devices) is set before jax
starts its backends.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# command → (its module, its one-line help)
COMMANDS = {
    "info": ("v41cp.cli.info", "config summary and per-layer roles"),
    "forward": ("v41cp.cli.forward", "next-token predictions for a prompt of token ids"),
    "convert": ("v41cp.cli.convert", "convert a released-layout checkpoint to an orbax checkpoint"),
    "generate": ("v41cp.cli.generate", "generate tokens with the serving engine"),
    "serve": ("v41cp.cli.serve", "OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)"),
    "bench": ("v41cp.cli.bench", "decode / prefill benchmark of the engine, or of the kernels (prints JSON)"),
    "plan": ("v41cp.cli.plan", "compile (never run) a step with abstract weights: per-device FLOPs, memory, "
             "collective bytes vs the analytic floor (prints JSON)"),
}


def _command(argv: list[str]) -> str | None:
    """The command ``argv`` names: its first argument that is not an option (the top-level parser has no option
    that takes a value), when it is one of `COMMANDS`."""
    name = next((a for a in argv if not a.startswith("-")), None)
    return name if name in COMMANDS else None


def _simulate_devices(n: int) -> None:
    """``n`` host-platform (CPU) devices, unless XLA_FLAGS already sets a count (the user's other flags stay)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def parser(command=None) -> argparse.ArgumentParser:
    """The parser of every command name; ``command`` (a command module) adds its flags to its own sub-parser."""
    p = argparse.ArgumentParser(prog="v41cp", description="DeepSeek-V4.1 in JAX with context parallelism")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, (module, help_) in COMMANDS.items():
        s = sub.add_parser(name, help=help_)
        if command is not None and command.__name__ == module:
            command.add_arguments(s)
    return p


def main(argv=None) -> int:
    """Run the command of ``argv`` (default: ``sys.argv[1:]``): its exit status; usage errors exit with status 2,
    and the library's `ValueError` (`ConfigError`, `CheckpointError`, topology errors) prints ``error: ...`` and
    returns 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    jax_loaded = "jax" in sys.modules             # before the command's module imports it (its backends start later)
    name = _command(argv)
    command = importlib.import_module(COMMANDS[name][0]) if name else None
    p = parser(command)
    args = p.parse_args(argv)
    usage_error = command.check(args) if hasattr(command, "check") else None
    if usage_error:
        p.error(usage_error)
    if getattr(args, "devices", 1) > 1 and not jax_loaded:
        _simulate_devices(args.devices)
    try:
        return command.run(args)
    except ValueError as e:                       # ConfigError and CheckpointError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
