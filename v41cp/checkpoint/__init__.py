"""Checkpoints: the released layout (read and validated from headers, decoded tensor by tensor),
the name mapping to the model's tree, conversion to orbax, and sharded restore.

* `ReleasedCheckpoint` — the released DeepSeek-V4.1 layout (FP8 / FP4 / BF16 / FP32), whole tensors or one
  shard's region (`read_shard`);
* `load_released_dir` / `place_released` — straight onto a mesh, each device reading only its own shard;
* `params_from_released` — a mapping of released names to unquantized arrays → parameter tree;
* `convert` / `load` — orbax checkpoint in the model's own tree, restored onto a mesh;
* `open_checkpoint` — either layout, weights as stored; `stores_quantized_at` — whether they are FP4 / FP8;
* `open_drafter` — the drafter's parameters (``mtp.*``: DSpark, or DeepSeek-V4's MTP layer) of either layout;
* `write_released` — write a parameter-name mapping in the release's quantized layout.
"""

import os
from pathlib import Path

from v41cp.checkpoint.names import IGNORED_PREFIXES, CheckpointError, params_from_released, released_to_tree
from v41cp.checkpoint.orbax_io import convert, load, load_drafter
from v41cp.checkpoint.placement import LoadReport, load_released_dir, place_released
from v41cp.checkpoint.released import ReleasedCheckpoint, load_config_dir
from v41cp.checkpoint.safetensors_io import ReleasedFiles, SafetensorsFile, write_safetensors
from v41cp.checkpoint.writer import write_released
from v41cp.sharding.rules import TP_RULES

__all__ = ["CheckpointError", "IGNORED_PREFIXES", "params_from_released", "released_to_tree", "convert", "load",
           "ReleasedCheckpoint", "load_config_dir", "load_released_dir", "place_released", "LoadReport", "ReleasedFiles",
           "SafetensorsFile", "write_safetensors", "write_released", "default_checkpoint", "default_released_checkpoint",
           "tiny_v4_checkpoint", "open_checkpoint", "open_drafter", "load_drafter", "stores_quantized_at"]

_CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"


def default_checkpoint() -> str:
    """The embedded converted tiny checkpoint (``checkpoints/tiny-v41``), or $V41CP_CHECKPOINT."""
    return os.environ.get("V41CP_CHECKPOINT") or str(_CHECKPOINTS / "tiny-v41")


def default_released_checkpoint() -> str:
    """The embedded tiny checkpoint in the released (quantized) layout: ``checkpoints/tiny-v41-released``."""
    return str(_CHECKPOINTS / "tiny-v41-released")


def tiny_v4_checkpoint() -> str:
    """The embedded tiny DeepSeek-V4 in the released layout (``checkpoints/tiny-v4``: `tiny-v4-mtp`, seeded)."""
    return str(_CHECKPOINTS / "tiny-v4")


def open_checkpoint(path, mesh=None, rules=None, progress: bool = False, **overrides):
    """(config, params) of a converted checkpoint (has ``manifest.json``) or a released-layout directory, with
    routed experts and Engram tables as stored (FP4 / FP8 when the release stores them so) unless ``overrides``
    set ``keep_quantized``: False dequantizes a released layout; a converted one restores as converted."""
    if (Path(path) / "manifest.json").exists():
        return load(path, mesh=mesh, rules=rules or TP_RULES, progress=progress, **overrides)
    return load_released_dir(path, mesh=mesh, rules=rules, progress=progress, **overrides)


def stores_quantized_at(path) -> bool:
    """Whether the checkpoint at ``path`` holds routed experts FP4 and Engram tables FP8 (its ``keep_quantized``
    as stored): a converted checkpoint's config says; a released layout's headers do (no weight is read)."""
    if (Path(path) / "manifest.json").exists():
        return load_config_dir(path).keep_quantized
    return ReleasedCheckpoint(path).cfg.keep_quantized


def open_drafter(path, cfg):
    """The drafter's parameter tree (DSpark `v41cp.drafter` or V4's MTP `v41cp.mtp`, host arrays, dequantized) of a
    converted checkpoint or a released-layout directory; `CheckpointError` when it has no ``mtp.*`` tensors."""
    if (Path(path) / "manifest.json").exists():
        return load_drafter(path, cfg)
    return ReleasedCheckpoint(path, cfg).drafter_params()
