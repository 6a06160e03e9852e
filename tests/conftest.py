"""Test setup: 8 simulated CPU devices (set before jax is imported), one JAX compilation cache per test run, and
the live NeMo oracle.

The compilation cache: the run's processes (the xdist workers, the CLI / server / notebook subprocesses they
start) compile many of the same programs (the tiny checkpoint's steps); the first compile of a program is
stored in a fresh temporary folder and later processes load it instead of compiling again. The folder is made
by the first process that loads this file (the xdist controller; workers and subprocesses inherit it through
the environment) and removed when that process ends the run. A folder given in $JAX_COMPILATION_CACHE_DIR is
used as it is and kept. Compile counts the tests assert are the jit caches' (one entry per traced program),
which a cache hit does not change.

Compiled programs are released after every test module (`jax.clear_caches`): an XLA:CPU executable holds its own
memory mappings, and a worker that kept every program of half the suite passed the kernel's 65,530-mapping limit
(`vm.max_map_count`; measured: the speculative-decoding module alone leaves 16,888 mappings, 706 after the
release) and died inside a compile with a segmentation fault. Later modules reload programs from the compilation
cache. Keeping them instead until a worker neared the mapping limit was measured and bought nothing (2026-12-07:
eight runner / engine modules in one process, side by side, 431 s kept vs 425 s released, peak memory 4.0 GB vs
2.6 GB; in the whole suite 0.9 k fewer cache loads, 1.3 GB more resident summed): the programs a later module uses
again are few, and most of a module's programs are its own."""

import os
import shutil
import tempfile

from xla_test_flags import host_description, set_test_xla_flags

set_test_xla_flags()               # before jax is imported (tests/xla_test_flags.py)
# cache every compiled program (default: only those that took over 1 s), so the run's other processes reuse them
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
_OWN_COMPILE_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_COMPILE_CACHE = tempfile.mkdtemp(prefix="v41cp-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_COMPILE_CACHE

import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO / "tests" / "oracle" / "nemo_oracle.py"
# the DeepSeek-V4 oracle (transformers' DeepseekV4ForCausalLM), in the same virtual environment
V4_HARNESS = REPO / "tests" / "oracle" / "transformers_v4_oracle.py"


def oracle_python() -> str | None:
    """The oracle venv's interpreter: $V41CP_ORACLE_PYTHON, else the venv tests/oracle/setup_venv.sh builds
    ($V41CP_ORACLE_VENV, default <repo>/.oracle-venv)."""
    venv = os.environ.get("V41CP_ORACLE_VENV") or str(REPO / ".oracle-venv")
    p = os.environ.get("V41CP_ORACLE_PYTHON") or str(Path(venv) / "bin" / "python")
    return p if os.path.exists(p) else None


class Oracle:
    """Runs an oracle harness (the NeMo V4.1 one by default; ``harness=V4_HARNESS`` for transformers' V4) once per
    (harness, sub-command, arguments) and caches the output directory."""

    def __init__(self, root: Path):
        self.root = root
        self.cache: dict[tuple, Path] = {}

    def run(self, cmd: str, *args: str, harness: Path = HARNESS) -> Path:
        key = (harness.name, cmd, *args)
        if key not in self.cache:
            py = oracle_python()
            if py is None:
                msg = ("NeMo oracle venv not found (run tests/oracle/setup_venv.sh or set V41CP_ORACLE_PYTHON)")
                if os.environ.get("CI"):
                    pytest.fail(msg + " — CI must run the oracle live")
                pytest.skip(msg)
            out = self.root / f"o{len(self.cache)}"
            env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
            res = subprocess.run([py, str(harness), cmd, "--out", str(out), *args], capture_output=True,
                                 text=True, env=env, timeout=900)
            if res.returncode:
                raise RuntimeError(f"oracle harness failed ({cmd} {args}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
            self.cache[key] = out
        return self.cache[key]


# (xdist's --dist loadfile sends the files with the most tests first — `--loadscope-reorder`, its default; a run
# measured 2026-12-05 left the two workers 2,014 s and 1,986 s of tests: balanced without an order of our own.)


def pytest_report_header(config):
    """The host the numerics ran on (CPU model, vector extensions, CPUs, caches, XLA flags): a failure that depends
    on the machine is recognisable from the log (tests/xla_test_flags.py)."""
    return host_description()


def pytest_sessionstart(session):
    """Under ``-q`` pytest prints no header: the host lines go out anyway (once, from the controller)."""
    rep = session.config.pluginmanager.get_plugin("terminalreporter")
    if rep is not None and session.config.get_verbosity() < 0 and not hasattr(session.config, "workerinput"):
        for line in host_description():
            rep.write_line(line)


_MEASURED: list[str] = []


def pytest_runtest_logreport(report):
    """Keep the figures a passing test printed (its lines that open with ``[``: errors against the oracles and the
    single-device path, collective bytes, ...) for the run's summary; under xdist the controller sees each worker's
    reports with their captured output."""
    if report.when == "call" and report.passed:
        _MEASURED.extend(line for line in report.capstdout.splitlines() if line.startswith("["))


def pytest_terminal_summary(terminalreporter):
    """The kept figures, in one section at the end of the run (``-q`` hides a passing test's output)."""
    if _MEASURED:
        terminalreporter.section("figures the tests measured")
        for line in sorted(_MEASURED):
            terminalreporter.write_line(line)


def pytest_unconfigure(config):
    if _OWN_COMPILE_CACHE is not None:
        shutil.rmtree(_OWN_COMPILE_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def oracle(tmp_path_factory) -> Oracle:
    return Oracle(tmp_path_factory.mktemp("oracle"))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module: drop the jit caches so its compiled programs (and their memory mappings) go."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
