"""The XLA flags of the test run (`tests/conftest.py`) and of the compiled-structure record (`compiled_structure.py`):
figures and comparisons are between programs compiled alike. Imported before jax.

* ``--xla_backend_optimization_level=0``: LLVM's backend optimization off (XLA's HLO passes still run): the tiny
  test programs compile ~15 % faster (measured on test_decode.py: 71 s vs 85 s) and run fast enough;
* 8 simulated CPU devices;
* pinned (`PINNED`), each only where this jaxlib knows it (an unknown XLA flag is fatal): probed once per run, the
  answer inherited by every child process (``V41CP_TEST_PINNED_XLA_FLAGS``):

  - ``--xla_cpu_experimental_ynn_fusion_type=`` (no YNNPACK fusions): they round a row differently depending on the
    rows beside it (measured: the RMSNorm of [1, 32, 64] vs [2, 32, 64] rows, 4.8e-7; tiny-v4's forward of a
    sequence alone vs beside another), so off, the engine's batch invariance — a prefix hit bit-identical to a cold
    prefill whatever its pass holds — is what the tests see (on a GPU, cuBLAS's kernel choice is the analogous
    caveat: docs/architecture.md §8). YNNPACK also picks its kernels by the CPU it runs on (AVX-512 or AVX2), which
    the next flag does not reach; with it off, dots run on Eigen;
  - ``--xla_cpu_max_isa=AVX2``: the code XLA emits (fusions, reductions, small dots) uses at most AVX2 + FMA on
    every x86 CPU, so an AVX-512 host and an AVX2 host compile the same instructions. Measured on an AMD EPYC with
    AVX-512 (2026-12-07): the V4 record decode's programs give bit-identical logits with and without it, and with
    vector widths 128 / 256 / 512; without FMA (``AVX``) they differ in the last bits, and a DSpark prefix hit is no
    longer bit-identical to a cold prefill (2.2e-7: `test_prefix_cache.py`), so the suite needs an x86 CPU with AVX2
    and FMA (x86-64-v3), which the run's header says when it lacks them.

What stays machine-dependent (docs/architecture.md §5, "Numerics of the CPU test run"): Eigen's contraction blocks
the contracted dimension by the CPU's cache sizes (measured here: K = 640 summed as 320 + 320, K = 1024 in blocks of
344) and some dots are split over the intra-op threads (a [3·7, 1280] × [1280, 64] dot differs between one and two
CPUs). So the exactness tests compare two programs on the same host; where a quantizer's input differs in its last
bits between them, `helpers.record_code_flips` asserts the stored codes are one step apart.
"""

import importlib.metadata
import os
import platform
import subprocess
import sys

PINNED = ("--xla_cpu_experimental_ynn_fusion_type=", "--xla_cpu_max_isa=AVX2")
_ENV = "V41CP_TEST_PINNED_XLA_FLAGS"


def _refused(flag: str) -> str:
    """'' when this jaxlib accepts ``flag``, else why not."""
    try:
        env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
        probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True, text=True,
                               timeout=300, env=env)
        return "" if probe.returncode == 0 else " ".join(probe.stderr.strip().splitlines()[-1:])
    except (OSError, subprocess.TimeoutExpired) as e:
        return repr(e)


def set_test_xla_flags() -> None:
    """Append the test run's flags to ``XLA_FLAGS`` (and default ``JAX_PLATFORMS`` to cpu)."""
    if _ENV not in os.environ:
        kept = list(PINNED)
        if _refused(" ".join(PINNED)):              # one probe when all are known, else one per flag
            kept = []
            for flag in PINNED:
                why = _refused(flag)
                if why:      # the batch-invariance tests (prefix hits bit-identical) may then fail in the last bits
                    print(f"tests/xla_test_flags.py: {flag} refused by this jaxlib, not pinned: {why}",
                          file=sys.stderr)
                else:
                    kept.append(flag)
        os.environ[_ENV] = " ".join(kept)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                               " --xla_force_host_platform_device_count=8 " + os.environ[_ENV]).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def host_description() -> list[str]:
    """What the run's numerics depend on, for the head of its log: the CPU model, its vector extensions, its
    CPUs and caches (Eigen's blocking), and the XLA flags."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = info.get("flags", "").split()
    vector = sorted(f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c", "sse4_2"))
    caches = []
    for index in range(4):
        base = f"/sys/devices/system/cpu/cpu0/cache/index{index}/"
        try:
            with open(base + "level") as lv, open(base + "type") as ty, open(base + "size") as sz:
                caches.append(f"L{lv.read().strip()}{ty.read().strip()[0].lower()} {sz.read().strip()}")
        except OSError:
            pass
    lacking = [f for f in ("avx2", "fma") if flags and f not in flags]
    return [f"host CPU: {info.get('model name', platform.processor() or platform.machine())}, "
            f"{len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} CPUs usable, caches per core {', '.join(caches) or 'unknown'}",
            f"host vector extensions: {' '.join(vector) or 'none listed'}"
            + (f" — WITHOUT {' and '.join(lacking).upper()}: the bit-identity tests were measured to need FMA"
               if lacking else ""),
            f"jax {_version('jax')}, jaxlib {_version('jaxlib')}; XLA_FLAGS: {os.environ.get('XLA_FLAGS', '')}"]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
