"""Checkpoints: the released layout (read and validated from headers, decoded tensor by tensor),
the name mapping to the model's tree, conversion to orbax, and sharded restore.

* `ReleasedCheckpoint` / `load_released_dir` — the released DeepSeek-V4.1 layout (FP8 / FP4 / BF16 / FP32);
* `params_from_released` — a mapping of released names to unquantized arrays → parameter tree;
* `convert` / `load` — orbax checkpoint in the model's own tree, restored onto a mesh;
* `write_released` — write a parameter-name mapping in the release's quantized layout.
"""

from pathlib import Path

from v41cp.checkpoint.names import CheckpointError, IGNORED_PREFIXES, params_from_released, released_to_tree
from v41cp.checkpoint.orbax_io import convert, load
from v41cp.checkpoint.released import ReleasedCheckpoint, load_config_dir
from v41cp.checkpoint.safetensors_io import ReleasedFiles, SafetensorsFile, write_safetensors
from v41cp.checkpoint.writer import write_released

__all__ = ["CheckpointError", "IGNORED_PREFIXES", "params_from_released", "released_to_tree", "convert", "load",
           "ReleasedCheckpoint", "load_config_dir", "load_released_dir", "ReleasedFiles", "SafetensorsFile",
           "write_safetensors", "write_released", "default_checkpoint", "default_released_checkpoint",
           "open_checkpoint"]

_CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"


def default_checkpoint() -> str:
    """The embedded converted tiny checkpoint (``checkpoints/tiny-v41``), or $V41CP_CHECKPOINT."""
    import os

    return os.environ.get("V41CP_CHECKPOINT") or str(_CHECKPOINTS / "tiny-v41")


def default_released_checkpoint() -> str:
    """The embedded tiny checkpoint in the released (quantized) layout: ``checkpoints/tiny-v41-released``."""
    return str(_CHECKPOINTS / "tiny-v41-released")


def load_released_dir(path, mesh=None, rules=None, progress: bool = False, **overrides):
    """(config, parameter tree) straight from a released-layout directory, without converting.

    Without ``mesh`` the leaves are NumPy arrays; with a mesh each tensor is placed with its
    ``NamedSharding`` as soon as it is decoded (host memory: one subtree at a time). ``progress``: a
    progress bar over the subtrees on stderr.
    """
    from tqdm import tqdm

    ckpt = ReleasedCheckpoint(path, **overrides)
    if mesh is None and not progress:
        return ckpt.cfg, ckpt.params()
    import jax

    from v41cp.model import abstract_params
    from v41cp.sharding.rules import TP_RULES, param_shardings

    shardings = param_shardings(abstract_params(ckpt.cfg), mesh, rules or TP_RULES) if mesh is not None else None
    params: dict = {}
    for name, sub in tqdm(ckpt.subtrees(), desc="load", unit="subtree", total=len(ckpt.subtree_names),
                          disable=not progress):
        if shardings is not None:
            sub = jax.device_put(sub, {k: shardings[k] for k in sub} if name == "top" else shardings[name])
        if name == "top":
            params.update(sub)
        else:
            params[name] = sub
    return ckpt.cfg, params


def open_checkpoint(path, mesh=None, rules=None, progress: bool = False, **overrides):
    """(config, params) of a converted checkpoint (has ``manifest.json``) or a released-layout directory."""
    from v41cp.sharding.rules import TP_RULES

    if (Path(path) / "manifest.json").exists():
        return load(path, mesh=mesh, rules=rules or TP_RULES, progress=progress, **overrides)
    return load_released_dir(path, mesh=mesh, rules=rules, progress=progress, **overrides)
