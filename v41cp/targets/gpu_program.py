"""What a program compiled for a GPU target executes: its kernels, launches, loops and kernel resources.

Read from XLA's own dump of the compile (``--xla_dump_to``, given per compile: `compile_with_dump`):

* the thunk sequence after XLA's thunk passes (``*.thunk_sequence_after_thunk_passes.txt``): every kernel the
  GPU runs, in order, with its grid, threads per block and shared memory, nested in the command buffers (CUDA
  graphs), while loops (``condition`` / ``body``) and conditionals (``*_branch``) that hold it; the thunk metadata
  (``*.thunk_metadata.txt``) names each thunk's HLO instruction (a kernel's own name can be another fusion's
  whose identical kernel it reuses);
* the optimized HLO (`compiled.as_text()`): each loop's ``known_trip_count``, so a kernel in a loop body counts once
  per trip (a condition's kernels run only where the trip count is not known: then once more), and each kernel's
  operands, result and fused computation, from which its bytes and FLOPs are counted (`kernel_cost`);
* the PTX of every kernel (``*.ptx``), assembled by the nvcc wheel's ``ptxas -v`` for the target's architecture:
  registers per thread and spill bytes (`ptx_resources`).

`analyse(dump_dir, hlo_text)` → `ProgramKernels`: one `Kernel` row per launch site, with its launches per program
execution. A while loop outside a command buffer is driven by the host, which launches each trip's kernels:
`ProgramKernels.host_driven_loops` counts the while loops outside command buffers, which no CUDA graph
holds; of them, `host_synchronizing_loops` have no known trip count, so the host also reads the condition back every
trip (XLA's while thunk runs a loop of known trip count without evaluating its condition). A conditional outside a
command buffer is likewise driven by the host (it reads the predicate). A conditional's branches are both listed and
both counted: the launch count is an upper bound by the smaller branches' kernels.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from v41cp.sharding.hlo_stats import _CALLEES, _WHILE, _arrays, _computations, _dims, _trip_count

__all__ = ["Kernel", "ProgramKernels", "compile_with_dump", "parse_thunks", "thunk_instructions", "kernel_cost",
           "ptx_resources", "ptx_global_loads",
           "analyse", "ptxas_path"]

# thunks that hold others or only order them: no kernel of their own
_CONTAINERS = {"kCommandBuffer", "kWhile", "kConditional", "kSequential", "kAsyncStart", "kAsyncDone",
               "kWaitForStreams", ""}
_COLLECTIVES = {"kAllReduce", "kAllGather", "kReduceScatter", "kAllToAll", "kCollectivePermute", "kRaggedAllToAll",
                "kCollectiveBroadcast", "kSend", "kRecv"}
_THUNK = re.compile(r"^(?P<indent>\s*)(?P<id>\d+): (?P<kind>k\w+)\s+\[[^\]]*\]\s*(?P<rest>.*)$")
_BLOCK = re.compile(r"^(?P<indent>\s*)(?P<block>condition|body|\w*branch\w*):\s*$")
_DTYPE_NAMES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "float8_e4m3fn": "f8e4m3fn"}
# an HLO instruction, tuple-shaped ones included (their element comments /*index=5*/ and layouts' S(1) too)
_DEF = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<shape>\((?:[^()]|\([^()]*\))*\)|\S+?)(?:\{[^}]*\})? "
                  r"(?P<op>[\w\-]+)\((?P<args>[^)]*)\)")
_LAUNCH = re.compile(r"(?P<name>[\w.\-]+) grid: \[(?P<grid>[\d, ]+)\] threads: \[(?P<threads>[\d, ]+)\]\s+"
                     r"shared_memory: (?P<smem>\d+) bytes")


@dataclass
class Kernel:
    """One launch site: ``launches`` per program execution; ``bytes`` / ``flops`` per launch (None: not counted,
    a custom kernel whose operands say nothing of what it reads); ``in_graph``: inside a command buffer."""

    name: str
    kind: str
    launches: int = 1
    grid: tuple = ()
    threads: tuple = ()
    shared_memory_bytes: int = 0
    in_graph: bool = False
    hlo: str | None = None
    bytes: float | None = None
    flops: float | None = None
    dot_dtype: str | None = None
    registers: int | None = None
    spill_bytes: int | None = None


@dataclass
class ProgramKernels:
    """The kernels of one compiled program (see the module docstring)."""

    kernels: list = field(default_factory=list)
    host_driven_loops: int = 0
    host_synchronizing_loops: int = 0
    host_driven_conditionals: int = 0
    command_buffers: int = 0
    graph_launches: int = 0

    @property
    def launches(self) -> int:
        """Kernel launches per execution (collectives included; loop trips counted)."""
        return sum(k.launches for k in self.kernels)

    @property
    def host_launches(self) -> int:
        """Kernel launches the host issues one by one per execution: the kernels outside command buffers and one per
        command-buffer (CUDA graph) execution (collectives apart: `collective_runs`)."""
        return sum(k.launches for k in self.kernels if not k.in_graph and k.kind not in _COLLECTIVES) + \
            self.graph_launches

    @property
    def collective_runs(self) -> int:
        """Collective executions per execution of the program."""
        return sum(k.launches for k in self.kernels if k.kind in _COLLECTIVES)

    def by_name(self, prefix: str) -> list[dict]:
        """The launch sites whose kernel name starts with ``prefix``, merged by name (launches summed)."""
        out: dict[str, dict] = {}
        for k in self.kernels:
            if not k.name.startswith(prefix):
                continue
            row = out.setdefault(k.name, {"name": k.name, "launches": 0, "grid": list(k.grid),
                                          "threads": list(k.threads), "shared_memory_bytes": k.shared_memory_bytes,
                                          "registers": k.registers, "spill_bytes": k.spill_bytes})
            row["launches"] += k.launches
        return list(out.values())


def ptxas_path() -> str | None:
    """``ptxas`` from the nvcc wheel (the gpu-plan extra), else from ``PATH``."""
    try:
        import nvidia.cuda_nvcc as nvcc          # optional: the nvcc wheel of the gpu-plan extra

        p = Path(list(nvcc.__path__)[0]) / "bin" / "ptxas"
        if p.exists():
            return str(p)
    except ImportError:
        pass
    return shutil.which("ptxas")


# XLA's default backend optimization level: a deployment's. The process's XLA_FLAGS may lower it (the test suite
# does, for its CPU programs), which changes the GPU kernels' registers and spills (measured: the sparse-attention
# kernel at V4.1-Flash's shapes spills 1,708 B at level 3 and none at level 0).
_DEPLOYED = {"xla_backend_optimization_level": 3}


def compile_with_dump(lowered, dump_dir: str | None = None):
    """``(compiled, dump_dir)``: ``lowered.compile()`` at XLA's default optimization level (`_DEPLOYED`) with XLA's
    dump of this compile in ``dump_dir`` (default: a new temporary folder, the caller's to remove). (JAX's persistent
    compilation cache, where a process turned it on, stores a compile-only executable but cannot load it back: it
    warns and compiles again. ``plan --target`` does not turn the cache on.)"""
    dump_dir = dump_dir or tempfile.mkdtemp(prefix="v41cp-gpu-plan-")
    return lowered.compile(compiler_options={"xla_dump_to": dump_dir, **_DEPLOYED}), dump_dir


def parse_thunks(text: str) -> tuple[list[dict], dict]:
    """The thunk sequence's lines → ``(thunks, counts)``: each thunk ``{"kind", "name", "grid", "threads",
    "shared_memory_bytes", "block", "in_graph"}`` (``block``: the index of the innermost loop condition / body /
    branch holding it, -1 at the top; ``in_graph``: inside a command buffer) and the blocks ``[(kind, parent)]`` in
    ``counts["blocks"]``, with the number of thunks of each kind (a while / conditional inside a command buffer, a
    CUDA graph's conditional node, counted as ``kWhileInGraph`` / ``kConditionalInGraph``); ``counts["containers"]``:
    the while and command-buffer thunks ``{"kind", "id", "block", "in_graph"}``."""
    thunks, blocks = [], []
    stack: list[tuple[int, str, int]] = []           # (indent, "thunk kind" or "block", block index)
    counts = {"kWhile": 0, "kConditional": 0, "kCommandBuffer": 0}
    last_while = 0
    for line in text.splitlines():
        b, t = _BLOCK.match(line), _THUNK.match(line)
        if not (b or t):
            continue
        indent = len((b or t).group("indent"))
        if b and b.group("block") == "condition":
            indent = last_while + 2                  # XLA prints a loop's "condition:" unindented
        if t and t.group("kind") == "kWhile":
            last_while = indent
        while stack and stack[-1][0] >= indent:
            stack.pop()
        block = next((s[2] for s in reversed(stack) if s[1] == "block"), -1)
        if b:
            blocks.append((b.group("block"), block))
            stack.append((indent, "block", len(blocks) - 1))
            continue
        kind = t.group("kind")
        in_graph = any(s[1] == "kCommandBuffer" for s in stack)
        if kind in ("kWhile", "kConditional") and in_graph:
            kind_key = kind + "InGraph"               # a graph's conditional node: not driven by the host
        else:
            kind_key = kind
        counts[kind_key] = counts.get(kind_key, 0) + 1
        stack.append((indent, kind, block))
        if kind in ("kWhile", "kCommandBuffer"):
            counts.setdefault("containers", []).append({"kind": kind, "id": int(t.group("id")), "block": block,
                                                        "in_graph": in_graph})
        if kind in _CONTAINERS:
            continue
        m = _LAUNCH.search(t.group("rest"))
        ints = lambda s: tuple(int(x) for x in s.split(","))
        thunks.append({"kind": kind, "name": m.group("name") if m else kind, "id": int(t.group("id")),
                       "block": block, "in_graph": in_graph,
                       "grid": ints(m.group("grid")) if m else (), "threads": ints(m.group("threads")) if m else (),
                       "shared_memory_bytes": int(m.group("smem")) if m else 0})
    counts["blocks"] = blocks
    counts.setdefault("containers", [])
    return thunks, counts


def _executions(hlo_text: str) -> tuple[dict, dict, dict]:
    """``(runs, where, comps)``: how many times each computation runs per execution (while bodies × trips; a
    condition × (trips + 1) where the trip count depends on the data, never where it is known: XLA's while thunk
    then runs the body that many times without evaluating the condition; fusions and branches as their caller),
    which computation defines each instruction (and its line), and the computations' lines. A loop of unknown trip
    count is counted as one trip, as XLA's cost analysis counts it."""
    comps, entry = _computations(hlo_text)
    runs: dict[str, int] = {}
    todo = [(entry, 1)] if entry else []
    while todo:
        c, m = todo.pop()
        if c not in comps:
            continue
        runs[c] = runs.get(c, 0) + m
        for line in comps[c]:
            w = _WHILE.search(line)
            if w:
                trips = _trip_count(line)
                known = '"known_trip_count"' in line
                todo += [(w.group("body"), m * trips), (w.group("cond"), 0 if known else m * (trips + 1))]
                continue
            for one, many in _CALLEES.findall(line):
                todo += [(x, m) for x in ([one] if one else re.findall(r"%([\w.\-]+)", many))]
    where = {}
    for c, lines in comps.items():
        for line in lines:
            d = _DEF.match(line)
            if d:
                where[d.group("name")] = (c, line)
    return runs, where, comps


def thunk_instructions(metadata: str) -> dict[int, str]:
    """``{thunk id: HLO instruction name}`` from the thunk metadata text."""
    return {int(i): name for name, i in re.findall(r'profile_annotation: "([^"]*)"\s*thunk_id: (\d+)', metadata)}


def _shape_bytes(shape: str) -> int:
    return sum(b for b, _ in _arrays(shape)) if shape else 0


def _dot_cost(line: str, shapes: dict) -> tuple[float, str]:
    d = _DEF.match(line)
    operands = re.findall(r"%([\w.\-]+)", d.group("args"))
    contract = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line)
    lhs = shapes.get(operands[0], "")
    lhs_dims = _dims(lhs)
    k = int(np.prod([lhs_dims[int(i)] for i in contract.group(1).split(",") if i])) if contract and lhs_dims else 1
    dtype = re.match(r"\(?([a-z0-9]+)\[", lhs)
    return 2.0 * float(np.prod(_dims(d.group("shape")))) * k, dtype.group(1) if dtype else "bf16"


def _fused_flops(comps: dict, name: str, seen=None) -> tuple[float, str | None]:
    """Dot FLOPs of a fused computation (nested fusions / calls followed) and the first dot's operand dtype."""
    seen = seen if seen is not None else set()
    if name in seen or name not in comps:
        return 0.0, None
    seen.add(name)
    flops, dtype, shapes = 0.0, None, {}
    for line in comps[name]:
        d = _DEF.match(line)
        if d is None:
            continue
        shapes[d.group("name")] = d.group("shape")
        if d.group("op") in ("dot", "convolution"):
            f, dt = _dot_cost(line, shapes)
            flops, dtype = flops + f, dtype or dt
        for one, many in _CALLEES.findall(line):
            for callee in [one] if one else re.findall(r"%([\w.\-]+)", many):
                f, dt = _fused_flops(comps, callee, seen)
                flops, dtype = flops + f, dtype or dt
    return flops, dtype


def _read_bytes(comps: dict, fused: str, index: int, full: int) -> int:
    """Bytes a fusion reads of its operand ``index``: the slices it takes where every use of the parameter is a
    slice / dynamic-slice / gather of it (a gather counts the rows it reads), else the whole operand."""
    lines = comps.get(fused, [])
    param = None
    for line in lines:
        d = _DEF.match(line)
        if d and d.group("op") == "parameter" and re.search(rf"parameter\({index}\)", line):
            param = d.group("name")
    if param is None:
        return full
    taken, whole = 0, False
    for line in lines:
        d = _DEF.match(line)
        if d is None or d.group("op") == "parameter":
            continue
        args = re.findall(r"%([\w.\-]+)", d.group("args"))
        if param not in args:
            continue
        if d.group("op") in ("slice", "dynamic-slice", "gather") and args[0] == param and param not in args[1:]:
            taken += _shape_bytes(d.group("shape"))
        elif d.group("op") == "dynamic-update-slice" and args[0] == param:
            continue                                       # written in place: the update, counted as written
        else:
            whole = True
    return full if whole else min(taken, full)


def kernel_cost(line: str, shapes: dict, comps: dict) -> tuple[float | None, float | None, str | None]:
    """``(bytes, flops, dot dtype)`` of one launch of the HLO instruction ``line`` (``shapes``: its computation's
    instruction shapes): a fusion reads each operand (slice-aware, `_read_bytes`) and writes its result (an in-place
    ``dynamic-update-slice`` root writes its update); its FLOPs are its dots'. A copy reads and writes its result;
    a cuBLAS GEMM reads its operands and writes its result. A Triton custom call (a Pallas kernel) counts what its
    op recorded in the call's metadata (`v41cp.kernels.cost_scope`; its operands are the whole buffers it indexes
    into), or nothing (None) without it."""
    d = _DEF.match(line)
    if d is None:
        return None, None, None
    op, shape = d.group("op"), d.group("shape")
    operands = re.findall(r"%([\w.\-]+)", d.group("args"))
    sizes = [_shape_bytes(shapes.get(o, "")) for o in operands]
    if op == "fusion":
        fused = re.search(r"calls=%([\w.\-]+)", line)
        fused = fused.group(1) if fused else ""
        read = sum(_read_bytes(comps, fused, i, s) for i, s in enumerate(sizes))
        root = next((l for l in comps.get(fused, []) if l.lstrip().startswith("ROOT")), "")
        rd = _DEF.match(root)
        written = _shape_bytes(shape)
        if rd is not None and rd.group("op") == "dynamic-update-slice":
            fshapes = {m.group("name"): m.group("shape") for m in map(_DEF.match, comps[fused]) if m}
            upd = re.findall(r"%([\w.\-]+)", rd.group("args"))
            written = _shape_bytes(fshapes.get(upd[1], "")) if len(upd) > 1 else written
        flops, dtype = _fused_flops(comps, fused)
        return float(read + written), flops, dtype
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]*)"', line)
        target = target.group(1) if target else ""
        if "triton" in target:                     # a Pallas kernel: the count its op recorded (kernels.cost_scope)
            cost = re.search(r"kernel_cost:bytes=(\d+):flops=(\d+):dtype=(\w+)", line)
            if cost is None:
                return None, None, None
            return float(cost.group(1)), float(cost.group(2)), _DTYPE_NAMES.get(cost.group(3), "bf16")
        if "gemm" in target.lower() or "matmul" in target.lower():        # cuBLAS: (result, workspace)
            out = _arrays(shape)[0][0] if _arrays(shape) else 0
            lhs = _dims(shapes.get(operands[0], "")) if operands else []
            contract = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', line)
            k = int(np.prod([lhs[int(i)] for i in re.findall(r"\d+", contract.group(1))])) if contract and lhs else 1
            result_dims = _dims(shape)
            dtype = re.match(r"\(?([a-z0-9]+)\[", shapes.get(operands[0], "")) if operands else None
            return float(sum(sizes[:2]) + out), 2.0 * float(np.prod(result_dims)) * k, \
                dtype.group(1) if dtype else None
        return float(sum(sizes) + _shape_bytes(shape)), 0.0, None
    if op in ("copy", "copy-start"):
        return 2.0 * _shape_bytes(shape), 0.0, None
    return float(sum(sizes) + _shape_bytes(shape)), 0.0, None


def ptx_resources(dump_dir: str, ptxas: str | None = None, arch: str = "sm_90a", prefix: str = "") -> dict[str, dict]:
    """``{kernel name: {"registers", "spill_bytes"}}`` of every kernel in the dump's PTX files (those whose name
    starts with ``prefix``: one compile's), from ``ptxas -v`` (``spill_bytes``: spill stores + spill loads). Empty
    where no ``ptxas`` is installed."""
    ptxas = ptxas or ptxas_path()
    files = [f for f in sorted(Path(dump_dir).glob(f"{prefix}*.ptx")) if f.stat().st_size]  # (empty: no kernel)
    if ptxas is None or not files:
        return {}

    def one(path):
        r = subprocess.run([ptxas, f"-arch={arch}", "-v", str(path), "-o", os.devnull], capture_output=True,
                           text=True, timeout=600)
        if r.returncode:
            raise RuntimeError(f"ptxas failed on {path.name}: {r.stderr.strip()[-500:]}")
        out, current = {}, None
        for line in r.stderr.splitlines():
            m = re.search(r"(?:Compiling entry function|Function properties for) '?([\w.$]+)'?", line)
            if m:
                current = m.group(1)
                out.setdefault(current, {"registers": None, "spill_bytes": 0})
            m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
            if m and current:
                out[current]["spill_bytes"] = int(m.group(1)) + int(m.group(2))
            m = re.search(r"Used (\d+) registers", line)
            if m and current:
                out[current]["registers"] = int(m.group(1))
        return out

    found = {}
    with concurrent.futures.ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
        for got in pool.map(one, files):
            found.update(got)
    return found


def ptx_global_loads(dump_dir: str, prefix: str = "") -> dict[str, dict]:
    """``{kernel name: {load kind: count}}`` for each PTX file of the dump that holds one kernel: its global loads
    by width (``v4.b32`` = 16-byte vector loads, ``u8`` = single bytes; ``cp.async.NB``: asynchronous global →
    shared copies of N bytes, which Triton's pipelining issues for loads inside loops). Static instruction counts."""
    out = {}
    for f in Path(dump_dir).glob(f"{prefix}*.ptx"):
        ptx = f.read_text()
        entries = re.findall(r"\.entry\s+([\w.$]+)\(", ptx)
        if len(entries) != 1:
            continue
        loads: dict[str, int] = {}
        for m in re.finditer(r"\bld\.global((?:\.[a-z0-9]+)*)", ptx):
            loads[m.group(1).lstrip(".")] = loads.get(m.group(1).lstrip("."), 0) + 1
        for m in re.finditer(r"cp\.async\.c[ag]\.shared\.global\s+\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-f]+|\d+)", ptx):
            key = f"cp.async.{int(m.group(1), 0)}B"
            loads[key] = loads.get(key, 0) + 1
        out[entries[0]] = loads
    return out


def analyse(dump_dir: str, hlo_text: str, resources: bool = True) -> ProgramKernels:
    """The kernels of the program compiled into ``dump_dir`` (see the module docstring); ``hlo_text``: its
    optimized HLO (`compiled.as_text()`). ``resources``: read registers and spills with ptxas."""
    # this program's files (a dump folder may hold other compiles): module_NNNN.<HloModule name>.*, the newest
    name = re.match(r"HloModule ([\w.\-]+)", hlo_text)
    stem = f".{name.group(1)}." if name else "."
    seqs = [p for p in Path(dump_dir).glob("module_*.thunk_sequence*.txt") if stem in p.name]
    if not seqs:
        raise FileNotFoundError(f"no thunk sequence of {stem.strip('.')} in {dump_dir}: was it compiled for a GPU?")
    module = max(p.name.split(".")[0] for p in seqs)              # module_NNNN
    prefix = f"{module}{stem}"
    # the sequence after the thunk passes (command buffers formed); XLA writes it only where a pass ran
    after = Path(dump_dir) / f"{prefix}thunk_sequence_after_thunk_passes.txt"
    seq = after if after.exists() else Path(dump_dir) / f"{prefix}thunk_sequence.txt"
    thunks, counts = parse_thunks(seq.read_text())
    meta = Path(dump_dir) / f"{prefix}thunk_metadata.txt"
    instr = thunk_instructions(meta.read_text()) if meta.exists() else {}
    runs, where, comps = _executions(hlo_text)
    blocks = counts["blocks"]
    # each loop body / condition / branch runs as often as the HLO computation of any named kernel it holds
    block_runs: dict[int, int] = {}
    for t in thunks:
        hit = where.get(instr.get(t["id"], ""))
        if hit and t["block"] not in block_runs:
            block_runs[t["block"]] = runs.get(hit[0], 1)

    def runs_of(block):
        b = block
        while b != -1 and b not in block_runs:
            b = blocks[b][1]                       # a block with no named kernel: as its parent
        return block_runs.get(b, 1)

    res = ptx_resources(dump_dir, prefix=prefix) if resources else {}
    loops = [c for c in counts["containers"] if c["kind"] == "kWhile" and not c["in_graph"]]
    unknown = [c for c in loops
               if '"known_trip_count"' not in where.get(instr.get(c["id"], ""), ("", '"known_trip_count"'))[1]]
    out = ProgramKernels(host_driven_loops=len(loops), host_synchronizing_loops=len(unknown),
                         host_driven_conditionals=counts.get("kConditional", 0),
                         command_buffers=counts.get("kCommandBuffer", 0),
                         graph_launches=sum(runs_of(c["block"]) for c in counts["containers"]
                                            if c["kind"] == "kCommandBuffer" and not c["in_graph"]))
    shapes_of: dict[str, dict] = {}
    for t in thunks:
        hit = where.get(instr.get(t["id"], ""))
        k = Kernel(name=t["name"], kind=t["kind"], launches=runs.get(hit[0], 1) if hit else runs_of(t["block"]),
                   grid=t["grid"], threads=t["threads"], shared_memory_bytes=t["shared_memory_bytes"],
                   in_graph=t["in_graph"])
        if hit and t["kind"] not in _COLLECTIVES:
            comp, line = hit
            if comp not in shapes_of:
                shapes_of[comp] = {m.group("name"): m.group("shape") for m in map(_DEF.match, comps[comp]) if m}
            k.hlo = _DEF.match(line).group("name")
            k.bytes, k.flops, k.dot_dtype = kernel_cost(line, shapes_of[comp], comps)
        r = res.get(t["name"])
        if r:
            k.registers, k.spill_bytes = r["registers"], r["spill_bytes"]
        out.kernels.append(k)
    return out
