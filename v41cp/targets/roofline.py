"""A roofline prediction of one execution of a program compiled for a GPU target (derivation: docs/gpu-plan.md).

``predicted_step_s = Σ_kernels launches · max(bytes / HBM bandwidth, FLOPs / peak)
                   + host launches · launch cost
                   + Σ_collectives (executions · latency + wire bytes / link bandwidth)``

per device, with the target's published figures (`v41cp.targets.GpuTarget`). Host launches are the kernels the
host launches one by one (outside command buffers) and one per command-buffer (CUDA graph) execution: a kernel
inside a graph pays no launch of its own. A kernel's bytes and FLOPs are
`v41cp.targets.gpu_program.kernel_cost`'s (slice-aware reads; the dots' FLOPs at the peak of their operand dtype).
A collective's wire bytes per device, from its result bytes ``R`` over a group of ``n`` (ring algorithms):
all-gather and all-to-all ``R · (n−1)/n``, all-reduce ``2 · R · (n−1)/n``, reduce-scatter ``R · (n−1)``,
collective-permute ``R``. Kernels whose bytes are not counted (custom kernels with no cost of their own) are listed
in ``uncosted``: the prediction leaves their time out.
"""

from __future__ import annotations

from v41cp.targets import GpuTarget
from v41cp.targets.gpu_program import _COLLECTIVES, ProgramKernels

__all__ = ["wire_bytes", "predict"]

_PEAK_DTYPE = {"f8e4m3fn": "fp8", "f8e5m2": "fp8", "f8e4m3": "fp8", "bf16": "bf16", "f16": "bf16", "f32": "f32"}


def wire_bytes(op: str, result_bytes: float, group: int) -> float:
    """Bytes one device sends for a collective of ``result_bytes`` per device over ``group`` devices."""
    n = max(int(group), 1)
    if n == 1:
        return 0.0
    factor = {"all-gather": (n - 1) / n, "all-to-all": (n - 1) / n, "all-reduce": 2 * (n - 1) / n,
              "reduce-scatter": n - 1, "collective-permute": 1.0}[op]
    return result_bytes * factor


def predict(kernels: ProgramKernels, collectives: list[dict], target: GpuTarget, devices: int) -> dict:
    """The prediction and its parts (seconds; see the module docstring). ``collectives``:
    `v41cp.sharding.hlo_stats.collectives` of the program (bytes per execution); ``devices``: the program's
    devices (a group of "all")."""
    compute = memory = kernel_s = 0.0
    launches, collective_runs = kernels.host_launches, kernels.collective_runs
    uncosted: dict[str, int] = {}
    for k in kernels.kernels:
        if k.kind in _COLLECTIVES:
            continue
        if k.bytes is None:
            uncosted[k.name] = uncosted.get(k.name, 0) + k.launches
            continue
        peak = target.peak_flops(_PEAK_DTYPE.get(k.dot_dtype or "bf16", "bf16"))
        t_mem, t_flop = k.bytes / target.hbm_bytes_per_s, (k.flops or 0.0) / peak
        memory += k.launches * t_mem
        compute += k.launches * t_flop
        kernel_s += k.launches * max(t_mem, t_flop)
    wire = sum(wire_bytes(c["op"], c["bytes"], c["group_size"] or devices) for c in collectives)
    collective_s = collective_runs * target.collective_latency_s + wire / target.link_bytes_per_s
    launch_s = launches * target.launch_s
    return {
        "predicted_step_s": kernel_s + launch_s + collective_s,
        "kernels_s": kernel_s, "kernels_memory_bound_s": memory, "kernels_compute_bound_s": compute,
        "launches_s": launch_s, "host_launches": launches, "collectives_s": collective_s,
        "collective_wire_bytes": wire,
        "uncosted": uncosted,
    }
