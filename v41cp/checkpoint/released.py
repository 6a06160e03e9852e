"""Reader for the released DeepSeek-V4.1 checkpoint layout (docs/architecture.md).

`ReleasedCheckpoint(path)` opens a directory holding ``config.json`` (composite or text-only),
``tokenizer.json`` (needed for Engram's compressed-token map) and safetensors shards, and checks the
whole checkpoint against the config from the headers alone — presence per layer role, shapes,
dtypes, scale companions — before any weight is read. Tensors are then decoded one at a time from
memory maps (FP8 block weights, packed FP4 experts, FP8 Engram rows, BF16/FP16/FP32 tensors),
one subtree (``top`` or ``layers_{i}``) at a time, so host memory stays bounded by one layer.

Accepted per tensor (``W`` = ``<name>.weight``, ``S`` = ``<name>.scale``):

* FP8 e4m3 ``W`` with an e8m0 ``S`` over b×b blocks (dense; b = ``cfg.weight_block_size``: V4.1 32, V4 128) or
  per row / 32 columns (Engram table);
* int8-packed FP4 ``W`` ``[out, in/2]`` with an e8m0 ``S`` ``[out, in/32]`` (routed experts);
* unquantized BF16 / FP16 / FP32 ``W`` with no ``S`` (other frameworks' exports);
* integer tables (V4's hash-routing ``ffn.gate.tid2eid``).

Vision / aligner tensors are skipped with a log line; ``mtp.*`` (DSpark) tensors are listed in
`dspark_tensors`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import flax.linen as nn
import jax
import numpy as np

from v41cp.checkpoint.formats import (
    FP4_TABLE,
    block_scale_shape,
    dequant_fp4_rows,
    dequant_fp8_blocks,
    dequant_fp8_rows,
    row_scale_shape,
)
from v41cp.checkpoint.layouts import index_arrays
from v41cp.checkpoint.names import (
    IGNORED_PREFIXES,
    CheckpointError,
    check_expert_table,
    drafter_params_from_released,
    insert,
    released_to_tree,
    role_note,
)
from v41cp.checkpoint.safetensors_io import ReleasedFiles, SafetensorsError
from v41cp.config import ConfigError, ModelConfig
from v41cp.engram_hash import compressed_token_map
from v41cp.model import abstract_params

__all__ = ["ReleasedCheckpoint", "load_config_dir", "stores_quantized"]

log = logging.getLogger(__name__)

_FLOAT = ("F32", "BF16", "F16")
_INT = ("I32", "I64")


def _take(array: np.ndarray, ids: np.ndarray, axis: int) -> np.ndarray:
    """``array`` at ascending ``ids`` along ``axis``: a view when they are contiguous (a shard's usual case)."""
    if len(ids) == 0 or ids[-1] - ids[0] + 1 == len(ids):
        start = int(ids[0]) if len(ids) else 0
        return array[(slice(None),) * axis + (slice(start, start + len(ids)),)]
    return np.take(array, ids, axis=axis)


def load_config_dir(path: str | os.PathLike, **overrides: Any) -> ModelConfig:
    """``config.json`` of a checkpoint directory, with the Engram token map from ``tokenizer.json``."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise CheckpointError(f"checkpoint directory {str(path)!r} has no config.json")
    cfg = ModelConfig.from_json(path / "config.json", **overrides)
    if cfg.engram_layer_ids and cfg.engram_token_map is None:
        tok = path / "tokenizer.json"
        if not tok.exists():
            raise CheckpointError(f"{str(path)!r}: Engram layers {list(cfg.engram_layer_ids)} need tokenizer.json "
                                  f"to build the compressed-token map")
        token_map, n = compressed_token_map(tok)
        if n != cfg.engram_compressed_vocab_size:
            raise ConfigError(f"tokenizer.json gives an Engram compressed vocabulary of {n}, but config.json says "
                              f"engram_compressed_vocab_size={cfg.engram_compressed_vocab_size}")
        cfg = cfg.replace(engram_token_map=token_map)
    return cfg


def decode_stored(key: str, raw: np.ndarray, scale: np.ndarray | None, block: int = 32) -> np.ndarray:
    """A stored tensor decoded to FP32 by its format: FP4 rows (packed int8), FP8 rows (Engram tables) or FP8
    ``block``×``block`` blocks; as stored when it has no scale."""
    if scale is None:
        return raw
    if raw.dtype == np.int8:
        return dequant_fp4_rows(raw, scale)
    if ".engram.embed." in key:
        return dequant_fp8_rows(raw, scale)
    return dequant_fp8_blocks(raw, scale, block=block)


def stores_quantized(files: ReleasedFiles, cfg: ModelConfig) -> bool:
    """Whether ``files`` store every routed expert as packed FP4 and every Engram table as FP8 rows, each with
    its e8m0 scale, in shapes that hold whole scale blocks: then ``keep_quantized`` keeps them as stored."""
    if not cfg.storable_quantized:
        return False
    for keys, _, raw in released_to_tree(cfg.replace(keep_quantized=True)).values():
        for key in keys if raw else ():
            if key.endswith(".scale"):
                continue
            info, scale = files.tensors.get(key), files.tensors.get(key[: -len(".weight")] + ".scale")
            want = "I8" if ".ffn.experts." in key else "F8_E4M3"
            if info is None or info.dtype != want or scale is None or scale.dtype != "F8_E8M0":
                return False
    return True


class ReleasedCheckpoint:
    """A validated released-layout checkpoint. ``overrides`` replace config fields (``dtype``, ``fake_quant``,
    ``keep_quantized``). Without a ``cfg`` or a ``keep_quantized``, the weights are kept as stored: FP4 experts
    and FP8 Engram rows stay quantized when the checkpoint stores them so (`stores_quantized`), the
    dequantized tree otherwise (an unquantized export)."""

    def __init__(self, path: str | os.PathLike, cfg: ModelConfig | None = None, **overrides: Any):
        self.path = Path(path)
        keep = overrides.pop("keep_quantized", None)
        as_stored = cfg is None and keep is None
        if keep is not None:
            overrides["keep_quantized"] = keep
        self.cfg = cfg if cfg is not None else load_config_dir(self.path, **overrides)
        try:
            self.files = ReleasedFiles(self.path)
        except SafetensorsError as e:
            raise CheckpointError(str(e)) from e
        if as_stored:
            self.cfg = self.cfg.replace(keep_quantized=stores_quantized(self.files, self.cfg))
        self.abstract = nn.unbox(abstract_params(self.cfg))
        self.mapping = released_to_tree(self.cfg)
        self._validate()

    # ------------------------------------------------------------------ validation (headers only)
    def logical_shape(self, key: str) -> tuple[int, ...]:
        """Shape of tensor ``key`` once decoded (FP4 packs two values per stored byte)."""
        info = self.files.tensors[key]
        if info.dtype == "I8":
            return (info.shape[0], info.shape[1] * 2)
        return info.shape

    def _check_tensor(self, key: str) -> None:
        if key not in self.files:
            raise CheckpointError(f"checkpoint is missing tensor {key!r} (needed for layer role "
                                  f"{role_note(self.cfg, key)})")
        info = self.files.tensors[key]
        scale_key = key[: -len(".weight")] + ".scale" if key.endswith(".weight") else None
        scale = self.files.tensors.get(scale_key) if scale_key else None
        if scale is None:
            if info.dtype in ("F8_E4M3", "I8"):
                raise CheckpointError(f"quantized tensor {key!r} ({info.dtype}) is missing its scale {scale_key!r}")
            if key.endswith(".tid2eid"):
                if info.dtype not in _INT:
                    raise CheckpointError(f"tensor {key!r} has dtype {info.dtype}; expected an integer table "
                                          f"(I32 / I64)")
                return
            if info.dtype not in _FLOAT:
                raise CheckpointError(f"tensor {key!r} has dtype {info.dtype}; expected BF16/F16/F32, or F8_E4M3 / "
                                      f"I8 (packed FP4) with a .scale")
            return
        if info.dtype not in ("F8_E4M3", "I8") or len(info.shape) != 2:
            raise CheckpointError(f"tensor {key!r} has a scale but dtype {info.dtype} shape {list(info.shape)}; "
                                  f"expected a 2-D F8_E4M3 or I8 (packed FP4) weight")
        if scale.dtype not in ("F8_E8M0", "F32", "BF16"):
            raise CheckpointError(f"scale {scale_key!r} has dtype {scale.dtype}, expected F8_E8M0")
        if info.dtype == "I8" and ".ffn.experts." not in key:
            raise CheckpointError(f"tensor {key!r} is packed FP4 (I8), which the release uses only for routed experts")
        rowwise = info.dtype == "I8" or ".engram.embed." in key
        logical = self.logical_shape(key)
        want = row_scale_shape(logical) if rowwise else block_scale_shape(logical, self.cfg.weight_block_size)
        if tuple(scale.shape) != want:
            raise CheckpointError(f"scale {scale_key!r} has shape {list(scale.shape)}, expected {list(want)} for "
                                  f"weight {key!r} of logical shape {list(logical)}")

    def _check_raw(self, key: str) -> None:
        """A ``keep_quantized`` source must be stored quantized: FP4 / FP8 payload or its e8m0 scale."""
        if key.endswith(".scale"):
            weight = key[: -len(".scale")] + ".weight"
            self._check_tensor(weight)
            if self.files.tensors[key].dtype != "F8_E8M0":
                raise CheckpointError(f"keep_quantized needs e8m0 scales; {key!r} is {self.files.tensors[key].dtype}")
            return
        self._check_tensor(key)
        dtype = self.files.tensors[key].dtype
        want = "I8" if ".ffn.experts." in key else "F8_E4M3"
        if dtype != want:
            raise CheckpointError(f"keep_quantized keeps the release's storage, but {key!r} is {dtype} (expected "
                                  f"{want} with a scale); convert without keep_quantized to dequantize instead")

    def _validate(self) -> None:
        used: set[str] = set()
        for path, (keys, fn, raw) in self.mapping.items():
            for k in keys:
                self._check_raw(k) if raw else self._check_tensor(k)
            node = self._node(path)
            structs = [jax.ShapeDtypeStruct(self.files.tensors[k].shape if raw else self.logical_shape(k), np.float32)
                       for k in keys]
            got = jax.eval_shape(fn, *structs).shape
            if tuple(got) != tuple(node.shape):
                raise CheckpointError(f"tensor {keys[0]!r} has shape {list(self.files.tensors[keys[0]].shape)}, which "
                                      f"does not fit the config (parameter {'/'.join(path)} must be "
                                      f"{list(node.shape)}; {role_note(self.cfg, keys[0])})")
            used.update(keys)
            used.update(k[: -len(".weight")] + ".scale" for k in keys if k.endswith(".weight"))
        ignored = [k for k in self.files if k.startswith(IGNORED_PREFIXES)]
        skipped = [k for k in ignored if not k.startswith("mtp.")]
        if skipped:
            log.info("%s: ignoring %d vision/aligner tensors (e.g. %s)", self.path, len(skipped), skipped[0])
        extra = sorted(k for k in self.files if k not in used and not k.startswith(IGNORED_PREFIXES))
        if extra:
            raise CheckpointError(f"unexpected tensor {extra[0]!r}: the config gives it no place "
                                  f"({len(extra)} unexpected in all; does config.json match the checkpoint?)")

    def _node(self, path):
        node = self.abstract
        for p in path:
            node = node[p]
        return node

    # ------------------------------------------------------------------ reading
    def read(self, key: str) -> np.ndarray:
        """Tensor ``key`` decoded to FP32 (quantized) or as stored (unquantized), from the memory map."""
        scale_key = key[: -len(".weight")] + ".scale"
        return decode_stored(key, self.files.read(key), self.files.read(scale_key) if scale_key in self.files else None,
                             self.cfg.weight_block_size)

    def drafter_params(self) -> dict:
        """The drafter's parameter tree (DSpark `v41cp.drafter`, or DeepSeek-V4's MTP layer `v41cp.mtp`) from the
        ``mtp.*`` tensors, decoded (host)."""
        keys = [k for k in self.files if k.startswith("mtp.") and not k.endswith(".scale")]
        if not keys:
            raise CheckpointError(f"{str(self.path)!r} holds no drafter tensors (mtp.*): speculative decoding "
                                  f"with its drafter ('dspark' / 'mtp') needs them")
        return drafter_params_from_released(self.cfg.replace(keep_quantized=False), {k: self.read(k) for k in keys})

    @property
    def subtree_names(self) -> list[str]:
        """``top`` (embed, head, norm) then ``layers_0`` … in order."""
        return ["top"] + [f"layers_{i}" for i in range(self.cfg.num_hidden_layers)]

    def read_region(self, key: str, index: Sequence[np.ndarray], dtype, raw: bool = False) -> np.ndarray:
        """Elements ``index`` (one ascending int array per axis, in the logical shape) of stored tensor ``key``:
        decoded to ``dtype``, or (``raw``) the stored bytes as uint8. Only those elements are read from the
        memory map; quantized tensors are decoded in row chunks of about 4M elements, so FP32 temporaries stay
        bounded whatever the region's size."""
        data = self.files.read(key)
        scale_key = key[: -len(".weight")] + ".scale"
        if raw or scale_key not in self.files:
            if raw:
                data = data.view(np.uint8)
            for axis, ids in enumerate(index):
                data = _take(data, ids, axis)
            return np.array(data, np.uint8 if raw else dtype)
        rows, cols = index
        scale = np.asarray(self.files.read(scale_key), np.float32)
        fp4 = self.files.tensors[key].dtype == "I8"
        rowwise = fp4 or ".engram.embed." in key
        out = np.empty((len(rows), len(cols)), dtype)
        step = max(32, (4 * 2**20 // max(1, len(cols))) // 32 * 32)
        if fp4:                                             # two codes per byte, even column in the low nibble
            packed_cols = np.unique(cols // 2)
            local = np.searchsorted(packed_cols, cols // 2)
            high = (cols % 2 == 1)[None, :]
        for a in range(0, len(rows), step):
            r = rows[a: a + step]
            if fp4:
                byte = _take(_take(data.view(np.uint8), r, 0), packed_cols, 1)[:, local]
                values = FP4_TABLE[np.where(high, byte >> 4, byte & 15)]
            else:
                values = np.asarray(_take(_take(data, r, 0), cols, 1), np.float32)
            block = 32 if rowwise else self.cfg.weight_block_size
            s = scale[np.ix_(r if rowwise else r // block, cols // block)]
            out[a: a + len(r)] = values * s
        return out

    def read_shard(self, path: tuple[str, ...], index: Sequence[slice] | None = None) -> np.ndarray:
        """Parameter ``path`` of the tree (its dtype; uint8 for stored bytes), or only its region ``index`` (slices,
        as `jax.make_array_from_callback` passes a device's shard): only the stored elements of that region
        are read and decoded."""
        keys, layout, raw = self.mapping[path]
        node = self._node(path)
        index = index_arrays(index if index is not None else (slice(None),) * len(node.shape), node.shape)
        reader = lambda key, region: self.read_region(key, region, node.dtype, raw)
        value = np.ascontiguousarray(layout.read(reader, keys, index), node.dtype)
        if path[-1] == "gate_tid2eid":
            check_expert_table(keys[0], value, self.cfg.n_routed_experts)
        return value

    def leaves(self, name: str) -> Iterator[tuple[tuple[str, ...], np.ndarray]]:
        """Decode subtree ``name`` one parameter at a time: (path inside the subtree, NumPy array)."""
        for path in self.mapping:
            if (path[0] if path[0].startswith("layers_") else "top") != name:
                continue
            yield (path if name == "top" else path[1:]), self.read_shard(path)

    def subtree(self, name: str) -> dict:
        """The parameter subtree ``name`` (NumPy, in the model's dtypes): the tree's ``layers_i`` entry, or
        for ``top`` a dict with ``embed``, ``head`` and ``norm``."""
        out: dict = {}
        for path, value in self.leaves(name):
            insert(out, path, value)
        return out

    def subtrees(self) -> Iterator[tuple[str, dict]]:
        for name in self.subtree_names:
            yield name, self.subtree(name)

    def params(self) -> dict:
        """The whole parameter tree (host memory: the whole model; fine for small checkpoints)."""
        tree: dict = {}
        for name, sub in self.subtrees():
            if name == "top":
                tree.update(sub)
            else:
                tree[name] = sub
        return tree

    def dspark_tensors(self) -> dict[str, np.ndarray]:
        """The DSpark drafter's ``mtp.*`` tensors as stored (memory maps)."""
        return {k: self.files.read(k) for k in self.files if k.startswith("mtp.")}

    @property
    def nbytes(self) -> int:
        return self.files.nbytes
