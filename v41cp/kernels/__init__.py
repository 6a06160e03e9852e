"""GPU kernels for V4.1 decode and prefill: sparse attention over paged caches and the indexer scan + top-k.

One folder per kernel (tokamax-style op / reference / kernel split):

* ``reference.py`` — the pure-``jnp`` definition the kernel must reproduce (the XLA path);
* ``pallas_triton.py`` — the Pallas kernel, Triton backend (explicit ``pltriton.CompilerParams``);
* ``__init__.py`` — the op: dispatch on a `Backend` and the wrapper logic shared by both.

Backends (`BACKENDS`): ``"xla"`` (the reference, default) and ``"pallas"`` (the Pallas Triton kernel on a
GPU; on any other platform the same kernel runs in Pallas interpret mode, which is how CPU CI checks it). Which of
the two a program holds is decided when it is lowered, for the platform it is compiled for (`on_platform`), so a
plan compiled for a GPU target on a CPU host (`v41cp.targets`) holds the Triton kernels.
The model config's ``attention_backend`` / ``indexer_backend`` fields select them; the serving engine,
the decode step and the DCP path pass them down. Record formats are decoded inside the kernels
(`v41cp.kernels.dequant`). jax_triton is not used (Pallas lowers to Triton itself), so nothing here
imports it.
"""

from __future__ import annotations

import jax

__all__ = ["BACKENDS", "GRID_TARGET", "check_backend", "interpret_mode", "on_platform", "cost_scope", "nbytes",
           "row_bytes", "match_varying", "out_struct", "pow2_at_least",
           "default_splits"]

BACKENDS = ("xla", "pallas")
GRID_TARGET = 512       # programs per kernel call that keep an H200's 132 SMs busy (≈ 4 per SM)


def check_backend(name: str, field: str = "backend") -> str:
    """Validate a backend name; the error names the field and the value."""
    if name not in BACKENDS:
        raise ValueError(f"{field} must be one of {BACKENDS}, got {name!r}")
    return name


def interpret_mode(mesh=None) -> bool:
    """Whether a Pallas kernel of a program over ``mesh`` (default: this host's default backend) is lowered in
    interpret mode: its devices are not GPUs. (A mesh of a GPU target's compile-only devices is a GPU mesh on a CPU
    host; what a program holds is chosen at lowering: `on_platform`.)"""
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    return platform != "gpu"


def on_platform(call, *operands, interpret: bool | None = None):
    """``call(*operands, interpret=...)`` — a Pallas kernel — compiled (Triton) where the program is lowered for a
    GPU (``cuda`` / ``rocm``) and in interpret mode for any other platform. The choice is made at lowering for the
    program's own platform (``jax.lax.platform_dependent``: the other branch is not lowered), not from
    ``jax.default_backend()``, so a program compiled for a GPU target on a CPU host holds the kernels themselves.
    ``interpret`` True / False forces one. ``operands``: arrays (pytrees; None allowed); static parameters go in
    ``call``."""
    if interpret is not None:
        return call(*operands, interpret=interpret)
    compiled = lambda *ops: call(*ops, interpret=False)
    return jax.lax.platform_dependent(*operands, cuda=compiled, rocm=compiled,
                                      default=lambda *ops: call(*ops, interpret=True))


def nbytes(*arrays) -> int:
    """Bytes of arrays (or their abstract values; None skipped)."""
    import numpy as np

    return int(sum(np.prod(a.shape, dtype=np.int64) * np.dtype(a.dtype).itemsize for a in arrays if a is not None))


def row_bytes(arrays) -> int:
    """Bytes of one row (leading index) of each of ``arrays`` together: a store's record per entry."""
    import numpy as np

    return int(sum(np.prod(a.shape[1:], dtype=np.int64) * np.dtype(a.dtype).itemsize for a in arrays))


def cost_scope(read: int, written: int, flops: int, dot_dtype):
    """A name scope that carries a Pallas call's cost — ``read`` + ``written`` bytes and ``flops`` of one call,
    counted from its operands' shapes by the op — into the compiled program's metadata (the custom call's
    ``op_name``): XLA cannot see into a custom kernel, and the GPU plan reads the count back
    (`v41cp.targets.gpu_program.kernel_cost`)."""
    import numpy as np

    return jax.named_scope(f"kernel_cost:bytes={int(read) + int(written)}:flops={int(flops)}:"
                           f"dtype={np.dtype(dot_dtype).name}")


def pow2_at_least(n: int, minimum: int = 16) -> int:
    """The smallest power of two ≥ ``n`` and ≥ ``minimum`` (Triton block sizes; 16 = the tensor-core minimum)."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def default_splits(programs: int, tiles: int) -> int:
    """How many parts to split a key list of ``tiles`` tiles into, when ``programs`` programs exist without
    splitting: enough to reach `GRID_TARGET` programs, never more than the tiles (static shapes only)."""
    return max(1, min(tiles, -(-GRID_TARGET // max(programs, 1))))


def _varying(x) -> frozenset:
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ())) if mat is not None else frozenset()


def match_varying(operands: list) -> tuple[list, frozenset]:
    """Inside ``jax.shard_map`` (``check_vma`` on): cast every operand to the union of the mesh axes they vary
    over, so a kernel sees one varying-axes type; returns (operands, that union). A no-op outside."""
    axes = frozenset().union(*(_varying(x) for x in operands))
    out = [x if _varying(x) == axes else jax.lax.pcast(x, tuple(sorted(axes - _varying(x))), to="varying")
           for x in operands]
    return out, axes


def out_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """A ``pallas_call`` output type varying over the same mesh axes as operand ``like`` (as `check_vma`
    requires inside ``jax.shard_map``)."""
    mat = getattr(jax.typeof(like), "manual_axis_type", None)
    if mat is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    try:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
    except TypeError:                      # releases that name it by its varying axes
        return jax.ShapeDtypeStruct(shape, dtype, vma=frozenset(mat.varying))
