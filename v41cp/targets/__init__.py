"""GPU compile targets: the programs compiled for an H100 / H200 on a host without one (deviceless AOT).

JAX compiles for a GPU it cannot see through the CUDA PJRT plugin's compile-only topology
(``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=SPEC, topology=...)``), given the
GPU's description: the ``GpuTargetConfigProto`` text files next to this module (`GpuTarget.spec_text`), from XLA's
own GPU specs (see each file's header). Nothing runs; the compiled program shows what the GPU would execute: its
kernels (grids, shared memory, registers: `v41cp.targets.gpu_program`), loops, collectives and memory. Installed by
the ``gpu-plan`` extra (``pip install -e ".[gpu-plan]"``: ``jax-cuda12-plugin`` at jax's version and the
``nvidia-cuda-nvcc-cu12`` wheel's ``ptxas``; no CUDA runtime, no GPU).

The plugin must not try to open a GPU: the host's JAX platforms are set to ``cpu`` before its backends start
(`compile_devices` does it; a process whose backends already started without that gets a clear error).

`GpuTarget` also keeps the published figures the roofline prediction uses (`v41cp.targets.roofline`; sources in
``docs/gpu-plan.md``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GpuTarget", "TARGETS", "get_target", "compile_devices", "use_cpu_host"]

_HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class GpuTarget:
    """One GPU model: its XLA target description and the published figures of its roofline.

    ``hbm_bytes_per_s``: HBM bandwidth (spec sheet); ``dense_flops_per_s``: dense peak by dot operand
    dtype (BF16 / FP8, without 2:4 sparsity; FP32 on the non-tensor units); ``link_bytes_per_s``: NVLink bandwidth
    per direction per GPU; ``collective_latency_s``: one NCCL collective's fixed cost; ``launch_s``: one kernel
    launch's fixed cost;
    ``memory_bytes``: device memory (GB = 10⁹ B as the spec sheets count)."""

    name: str
    spec_file: str
    memory_bytes: int
    hbm_bytes_per_s: float
    dense_flops_per_s: dict
    link_bytes_per_s: float
    collective_latency_s: float
    launch_s: float

    @property
    def spec_text(self) -> str:
        """The ``GpuTargetConfigProto`` text XLA compiles for."""
        return (_HERE / self.spec_file).read_text()

    def peak_flops(self, dtype: str = "bf16") -> float:
        """Dense FLOP/s for dot operands of ``dtype``: ``bf16`` / ``fp8`` (tensor cores), ``f32`` (the plan compiles
        FP32 models at the highest precision: the FP32 units)."""
        return self.dense_flops_per_s.get(dtype, self.dense_flops_per_s["bf16"])

    def describe(self) -> dict:
        """The figures as a JSON-ready dict."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "spec_file"}


# NVIDIA's H100 SXM5 / H200 SXM spec sheets (HBM, dense tensor peaks, NVLink 900 GB/s bidirectional = 450 per
# direction); the fixed costs are the planning figures of docs/gpu-plan.md (NCCL small-message collective ~10 µs,
# kernel launch ~2 µs outside a CUDA graph)
TARGETS: dict[str, GpuTarget] = {
    "h100": GpuTarget("h100", "h100.txtpb", memory_bytes=80_000_000_000, hbm_bytes_per_s=3.35e12,
                      dense_flops_per_s={"bf16": 989e12, "fp8": 1979e12, "f32": 67e12}, link_bytes_per_s=450e9,
                      collective_latency_s=10e-6, launch_s=2e-6),
    "h200": GpuTarget("h200", "h200.txtpb", memory_bytes=141_000_000_000, hbm_bytes_per_s=4.8e12,
                      dense_flops_per_s={"bf16": 989e12, "fp8": 1979e12, "f32": 67e12}, link_bytes_per_s=450e9,
                      collective_latency_s=10e-6, launch_s=2e-6),
}


def get_target(name: str) -> GpuTarget:
    """The target called ``name`` (``h100`` / ``h200``); the error names the value."""
    if name not in TARGETS:
        raise ValueError(f"target must be one of {sorted(TARGETS)}, got {name!r}")
    return TARGETS[name]


def use_cpu_host() -> None:
    """Make the host's JAX platform the CPU before any backend starts (the CUDA plugin would otherwise try to open
    a GPU, fail and drop out); refuse if backends already started without the CPU only."""
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        if jax.config.jax_platforms != "cpu" and jax.default_backend() != "gpu":
            raise RuntimeError("target: JAX's backends started before the GPU target was set up; set "
                               "JAX_PLATFORMS=cpu before the first JAX computation (the CLI's --target does)")
        return
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    jax.config.update("jax_platforms", "cpu")


def compile_devices(target: GpuTarget | str, count: int) -> list:
    """``count`` compile-only devices of ``target`` (hosts of up to 8 GPUs: ``1 × ⌈count/8⌉ × min(count, 8)``),
    to build a mesh over and compile for; nothing can run on them."""
    target = get_target(target) if isinstance(target, str) else target
    if type(count) is not int or count <= 0 or (count > 8 and count % 8):
        raise ValueError(f"target: device count must be 1-8 or a multiple of 8 (hosts of 8 GPUs), got {count!r}")
    use_cpu_host()
    try:
        from jax.experimental import topologies

        topo = topologies.get_topology_desc(platform="cuda", target_config=target.spec_text,
                                            topology=f"1x{max(1, count // 8)}x{min(count, 8)}")
    except Exception as e:                 # the plugin missing, or its version not jax's
        raise RuntimeError(f"target {target.name!r}: no CUDA compile-only topology ({type(e).__name__}: {e}); "
                           "install the gpu-plan extra: pip install -e \".[gpu-plan]\"") from e
    return list(topo.devices)[:count]
