"""Converted checkpoints: released layout → orbax in the model's own tree, and sharded restore.

Layout of a converted checkpoint directory::

    config.json        the text config (released field names; dtype = the converted dtype)
    tokenizer.json     copied from the source (Engram's compressed-token map is derived from it), with
                       tokenizer_config.json / chat_template.jinja (the chat format) when present
    params/<subtree>/<k>/  orbax checkpoints of subtree ``top`` (embed, head, norm), ``layers_0`` …, in
                       parts of at most `PART_BYTES` (or one parameter, if larger)
    params/dspark/     ``mtp.*`` tensors as stored in the release (only when present)
    manifest.json      written last: subtrees and the parameters of each part, tensor count, bytes,
                       source, format version

`convert` writes into ``DST.partial-<pid>`` and renames it to ``DST`` only after the manifest is
written, so a failed conversion never leaves a directory that looks complete. Parameters are decoded
one at a time and saved in parts: orbax's save holds a second copy of what it writes, so host memory
stays near ``2 · max(PART_BYTES, largest parameter)`` plus the runtime, whatever the model size; with
``workers > 1`` subtrees convert in parallel processes, each within that bound. `load` restores
every subtree with ``NamedSharding``s derived from the logical axis rules, so each device reads only
its own shard.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh
from tqdm import tqdm

from v41cp.checkpoint.names import CheckpointError, drafter_params_from_released, insert
from v41cp.checkpoint.released import ReleasedCheckpoint, decode_stored, load_config_dir
from v41cp.config import ModelConfig
from v41cp.model import abstract_params
from v41cp.sharding.rules import TP_RULES, AxisRules, param_shardings

__all__ = ["convert", "load", "FORMAT_VERSION"]

FORMAT_VERSION = 1
PART_BYTES = 256 * 2**20


def _checkpointer():
    """A synchronous orbax checkpointer (each save is complete when it returns)."""
    return ocp.Checkpointer(ocp.StandardCheckpointHandler())


def _paths(tree: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for k, v in tree.items():
        out.extend(_paths(v, prefix + (k,)) if isinstance(v, dict) else [prefix + (k,)])
    return out


def _get(tree: dict, path: tuple[str, ...]):
    for p in path:
        tree = tree[p]
    return tree


def _nest(flat: dict[str, np.ndarray]) -> dict:
    tree: dict = {}
    for k, v in flat.items():
        node = tree
        parts = k.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = np.asarray(v)
    return tree


_SOURCE: dict[str, ReleasedCheckpoint] = {}     # the source checkpoint of a conversion worker process


def _open_source(src: str, overrides: dict[str, Any]) -> None:
    """Worker initializer: open (and validate) the source once per worker process."""
    _SOURCE["ckpt"] = ReleasedCheckpoint(src, **overrides)


def _convert_subtree(name: str, tmp: str, ckpt: ReleasedCheckpoint | None = None) -> tuple[list[list[str]], int, int]:
    """Decode subtree ``name`` one parameter at a time and save it in parts of at most `PART_BYTES` under
    ``tmp/params/name/<k>``: (each part's parameter paths, tensors, bytes written)."""
    ckpt = ckpt or _SOURCE["ckpt"]
    ckptr = _checkpointer()
    parts: list[list[str]] = []
    part: dict = {}
    size = n_tensors = n_bytes = 0

    def flush():
        nonlocal part, size
        if part:
            ckptr.save(Path(tmp) / "params" / name / str(len(parts)), part)
            parts.append(["/".join(p) for p in _paths(part)])
            part, size = {}, 0

    for path, leaf in ckpt.leaves(name):
        if size and size + leaf.nbytes > PART_BYTES:
            flush()
        insert(part, path, leaf)
        size += leaf.nbytes
        n_tensors += 1
        n_bytes += leaf.nbytes
        del leaf
    flush()
    return parts, n_tensors, n_bytes


def _peak_rss() -> dict[str, int]:
    """Peak resident memory of this process and of its largest finished child (a conversion worker), bytes."""
    unit = 1 if sys.platform == "darwin" else 1024           # ru_maxrss: bytes on macOS, KiB on Linux
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit,
            "peak_worker_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * unit}


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, dtype: str | None = None, progress: bool = True,
            overwrite: bool = False, keep_quantized: bool | None = None, workers: int = 1) -> dict[str, Any]:
    """Convert a released-layout checkpoint ``src`` into an orbax checkpoint ``dst``.

    ``dtype`` (``"bfloat16"`` / ``"float32"``, default: the source config's) is the storage dtype of
    the backbone; FP32 islands (mHC, sink, router biases, compressor, head) stay FP32. FP8 dense blocks are
    dequantized; routed experts and Engram tables are kept as the source stores them (``keep_quantized=None``):
    packed FP4 experts and FP8 Engram rows (with their e8m0 scales) stay so, and the model decodes them inside
    the jitted forward. ``keep_quantized=False`` dequantizes them too; ``True`` requires a quantized source. ``workers > 1`` converts that many subtrees at once, each in a
    process of its own (host memory: about ``workers`` times one worker's). Returns a summary: tensors, bytes
    read and written, seconds, peak resident memory of this process and of the largest worker.
    """
    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    if dst.exists() and not overwrite:
        raise CheckpointError(f"destination {str(dst)!r} already exists (pass overwrite=True / --overwrite)")
    overrides: dict[str, Any] = {"keep_quantized": keep_quantized}
    if dtype:
        overrides["dtype"] = {"bf16": "bfloat16", "fp32": "float32"}.get(dtype, dtype)
    ckpt = ReleasedCheckpoint(src, **overrides)            # validates everything before reading a weight
    overrides["keep_quantized"] = keep_quantized = ckpt.cfg.keep_quantized      # as stored, resolved
    tmp = dst.parent / f"{dst.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    n_tensors = n_bytes = 0
    try:
        names = ckpt.subtree_names
        parts: dict[str, list[list[str]]] = {}
        bar = tqdm(total=len(names), desc="convert", unit="subtree", disable=not progress)
        if workers > 1:
            ctx = multiprocessing.get_context("spawn")          # a fresh interpreter: no forked XLA runtime
            with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_open_source,
                                     initargs=(str(src), overrides)) as pool:
                done = pool.map(_convert_subtree, names, [str(tmp)] * len(names))
                for name, (sub_parts, tensors, nbytes) in zip(names, done):
                    parts[name] = sub_parts
                    n_tensors, n_bytes = n_tensors + tensors, n_bytes + nbytes
                    bar.update()
                    bar.set_postfix(GB=f"{n_bytes / 1e9:.2f}")
        else:
            for name in names:
                parts[name], tensors, nbytes = _convert_subtree(name, str(tmp), ckpt)
                n_tensors, n_bytes = n_tensors + tensors, n_bytes + nbytes
                bar.update()
                bar.set_postfix(GB=f"{n_bytes / 1e9:.2f}")
        bar.close()
        ckptr = _checkpointer()
        dspark = ckpt.dspark_tensors()
        if dspark:
            ckptr.save(tmp / "params" / "dspark", _nest(dspark))
        # orbax's commit markers spell the temporary folder's absolute path (wrong once renamed, and a path of
        # this machine); a local restore does not read them
        for marker in (tmp / "params").rglob("commit_success.txt"):
            marker.unlink()
        cfg_dict = ckpt.cfg.to_dict()
        (tmp / "config.json").write_text(json.dumps({"model_type": ckpt.cfg.model_type, "text_config": cfg_dict},
                                                    indent=1))
        for extra in TEXT_FILES:              # the tokenizer and the chat format travel with the weights
            if (src / extra).exists():
                shutil.copy2(src / extra, tmp / extra)
        seconds = time.perf_counter() - t0
        summary = {"format_version": FORMAT_VERSION, "source": src.name, "subtrees": names, "parts": parts,
                   "dspark_tensors": len(dspark), "tensors": n_tensors, "bytes_read": ckpt.nbytes,
                   "bytes_written": n_bytes, "dtype": ckpt.cfg.dtype, "keep_quantized": keep_quantized,
                   "workers": workers, "seconds": round(seconds, 3), **_peak_rss()}
        (tmp / "manifest.json").write_text(json.dumps(summary, indent=1))
        if dst.exists():
            shutil.rmtree(dst)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary


TEXT_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _abstract_subtrees(cfg: ModelConfig, mesh: Mesh | None, rules: AxisRules) -> dict[str, Any]:
    boxed = abstract_params(cfg)
    if mesh is None:
        dev = jax.local_devices()[0]            # this process's first (multi-process: each loads its own)
        shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(dev), nn.unbox(boxed))
    else:
        shardings = param_shardings(boxed, mesh, rules)
    tree = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(boxed), shardings)
    out = {"top": {k: v for k, v in tree.items() if not k.startswith("layers_")}}     # embed, head, norm (hc_head)
    out.update({k: v for k, v in tree.items() if k.startswith("layers_")})
    return out


def load_drafter(path: str | os.PathLike, cfg: ModelConfig) -> dict:
    """The drafter's parameter tree (DSpark `v41cp.drafter`, or DeepSeek-V4's MTP layer `v41cp.mtp`; host NumPy)
    of a converted checkpoint: its ``params/dspark`` tensors (the release's ``mtp.*``, stored as released) decoded."""
    where = Path(path) / "params" / "dspark"
    if not where.exists():
        raise CheckpointError(f"{str(path)!r} holds no drafter tensors (mtp.*): speculative decoding with its "
                              f"drafter ('dspark' / 'mtp') needs them")
    flat: dict[str, np.ndarray] = {}

    def walk(node, prefix):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, prefix + (k,))
            else:
                flat[".".join(prefix + (k,))] = np.asarray(v)

    walk(_checkpointer().restore(where), ())
    scale = lambda k: flat.get(k[: -len(".weight")] + ".scale") if k.endswith(".weight") else None
    tensors = {k: decode_stored(k, v, scale(k), cfg.weight_block_size) for k, v in flat.items()
               if not k.endswith(".scale")}
    return drafter_params_from_released(cfg.replace(keep_quantized=False), tensors)


def load(path: str | os.PathLike, cfg: ModelConfig | None = None, mesh: Mesh | None = None,
         rules: AxisRules = TP_RULES, progress: bool = False, **overrides: Any) -> tuple[ModelConfig, dict]:
    """Restore a converted checkpoint: (config, parameter tree of jax.Arrays).

    With ``mesh`` every parameter is restored with the ``NamedSharding`` of ``rules`` (each device
    reads only its shard); without, onto the first device. ``cfg`` defaults to the checkpoint's
    ``config.json`` (``overrides`` such as ``fake_quant=False`` apply to it); a given ``cfg`` must
    have the checkpoint's shapes and dtype. ``progress``: a progress bar over the subtrees on stderr. The weights
    are restored as converted: an override ``keep_quantized`` other than the stored one is an error.
    """
    path = Path(path)
    manifest = path / "manifest.json"
    if not manifest.exists():
        partial = sorted(path.parent.glob(f"{path.name}.partial-*"))
        hint = f" (an interrupted conversion left {partial[0].name})" if partial else ""
        raise CheckpointError(f"{str(path)!r} is not a complete converted checkpoint: no manifest.json{hint}")
    info = json.loads(manifest.read_text())
    if info.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{str(path)!r} has format_version {info.get('format_version')!r}, "
                              f"this v41cp reads {FORMAT_VERSION}")
    keep = overrides.pop("keep_quantized", None)
    if cfg is None:
        cfg = load_config_dir(path, **overrides)
    if keep is not None and keep != cfg.keep_quantized:
        raise CheckpointError(f"{str(path)!r} stores routed experts and Engram tables "
                              f"{'quantized (FP4 / FP8)' if cfg.keep_quantized else 'dequantized'}, but "
                              f"keep_quantized={keep} was asked: convert the release again "
                              f"{'with --dequantize' if cfg.keep_quantized else 'without --dequantize'}")
    abstract = _abstract_subtrees(cfg, mesh, rules)
    if sorted(abstract) != sorted(info["subtrees"]):
        raise CheckpointError(f"{str(path)!r} holds subtrees {info['subtrees'][:3]}…, which do not match the config "
                              f"({len(abstract)} subtrees expected)")
    ckptr = _checkpointer()
    params: dict = {}
    for name, target in tqdm(abstract.items(), desc="restore", unit="subtree", disable=not progress):
        sub: dict = {}
        for k, leaf_paths in enumerate(info["parts"][name]):
            part_target: dict = {}
            try:
                for lp in leaf_paths:
                    insert(part_target, tuple(lp.split("/")), _get(target, tuple(lp.split("/"))))
                restored = ckptr.restore(path / "params" / name / str(k), part_target)
            except Exception as e:  # orbax raises assorted types on shape / dtype / missing-key mismatches
                raise CheckpointError(f"{str(path)!r}: cannot restore part {k} of subtree {name!r} for this config: "
                                      f"{e}") from e
            for lp in leaf_paths:
                insert(sub, tuple(lp.split("/")), _get(restored, tuple(lp.split("/"))))
        missing = set("/".join(p) for p in _paths(target)) - set("/".join(p) for p in _paths(sub))
        if missing:
            raise CheckpointError(f"{str(path)!r}: subtree {name!r} lacks parameter {sorted(missing)[0]!r}")
        if name == "top":
            params.update(sub)
        else:
            params[name] = sub
    return cfg, params
