"""The GPU program reader (`v41cp.targets.gpu_program`) and the roofline (`v41cp.targets.roofline`) on a small
hand-written dump: a command buffer, a while loop of known trip count and one whose trip count depends on the data,
a slicing fusion, a dot in a loop body, a Pallas call carrying its cost, an all-reduce. No GPU and no CUDA plugin
needed."""

import pytest

from v41cp.targets import TARGETS, get_target
from v41cp.targets.gpu_program import analyse, kernel_cost, parse_thunks, thunk_instructions
from v41cp.targets.roofline import predict, wire_bytes

pytestmark = pytest.mark.fast

THUNKS = """\
000: kCommandBuffer [source        | next=002 (1)] 
    001: kCustomKernel [source       | sink        ] loop_dynamic_slice_fusion grid: [2, 1, 1] threads: [64, 1, 1]  shared_memory: 0 bytes
002: kWhile         [prev=000 (1)  | next=005 (1)]   
condition:
    003: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    004: kCustomKernel [source       | sink        ] gemm_fusion_dot grid: [4, 1, 1] threads: [128, 1, 1]  shared_memory: 512 bytes
005: kAllReduce     [prev=002 (1)  | next=006 (1)] kAllReduce
006: kCustomKernel  [prev=005 (1)  | next=007 (1)] v41cp_sparse_attention grid: [8, 1, 2] threads: [256, 1, 1]  shared_memory: 4096 bytes
007: kWhile         [prev=006 (1)  | sink        ]   
condition:
    008: kCustomKernel [source | sink] loop_compare_fusion_1 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    009: kCustomKernel [source | sink] gemm_fusion_dot_1 grid: [4, 1, 1] threads: [128, 1, 1]  shared_memory: 512 bytes
"""

METADATA = "\n".join(
    f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{name}"\n    thunk_id: {i}\n  }}\n}}'
    for i, name in ((1, "loop_dynamic_slice_fusion"), (2, "while.1"), (3, "loop_compare_fusion"),
                    (4, "gemm_fusion_dot"), (5, "all-reduce"), (6, "pallas_call"), (7, "while.2"),
                    (8, "loop_compare_fusion.1"), (9, "gemm_fusion_dot.1")))

HLO = """\
HloModule jit_probe

%fused_slice (param_0: f32[1024,64], param_1: s32[]) -> f32[1,64] {
  %param_0 = f32[1024,64]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %constant.1 = s32[] constant(0)
  ROOT %dynamic-slice.1 = f32[1,64]{1,0} dynamic-slice(%param_0, %param_1, %constant.1), dynamic_slice_sizes={1,64}
}

%fused_dot (param_0.1: f32[8,16], param_1.1: f32[16,32]) -> f32[8,32] {
  %param_0.1 = f32[8,16]{1,0} parameter(0)
  %param_1.1 = f32[16,32]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,32]{1,0} dot(%param_0.1, %param_1.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_compare (param_0.2: s32[]) -> pred[] {
  %param_0.2 = s32[] parameter(0)
  %constant.2 = s32[] constant(5)
  ROOT %compare.1 = pred[] compare(%param_0.2, %constant.2), direction=LT
}

%cond (p.1: (s32[], f32[8,16], f32[16,32])) -> pred[] {
  %p.1 = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) parameter(0)
  %gte.1 = s32[] get-tuple-element(%p.1), index=0
  ROOT %loop_compare_fusion = pred[] fusion(%gte.1), kind=kLoop, calls=%fused_compare
}

%body (p.2: (s32[], f32[8,16], f32[16,32])) -> (s32[], f32[8,16], f32[16,32]) {
  %p.2 = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) parameter(0)
  %gte.2 = f32[8,16]{1,0} get-tuple-element(%p.2), index=1
  %gte.3 = f32[16,32]{1,0} get-tuple-element(%p.2), index=2
  %gte.4 = s32[] get-tuple-element(%p.2), index=0
  %gemm_fusion_dot = f32[8,32]{1,0} fusion(%gte.2, %gte.3), kind=kCustom, calls=%fused_dot
  ROOT %tuple.1 = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) tuple(%gte.4, %gte.2, %gte.3)
}

%cond2 (p.3: (s32[], f32[8,16], f32[16,32])) -> pred[] {
  %p.3 = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) parameter(0)
  %gte.5 = s32[] get-tuple-element(%p.3), index=0
  ROOT %loop_compare_fusion.1 = pred[] fusion(%gte.5), kind=kLoop, calls=%fused_compare
}

%body2 (p.4: (s32[], f32[8,16], f32[16,32])) -> (s32[], f32[8,16], f32[16,32]) {
  %p.4 = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) parameter(0)
  %gte.6 = f32[8,16]{1,0} get-tuple-element(%p.4), index=1
  %gte.7 = f32[16,32]{1,0} get-tuple-element(%p.4), index=2
  %gte.8 = s32[] get-tuple-element(%p.4), index=0
  %gemm_fusion_dot.1 = f32[8,32]{1,0} fusion(%gte.6, %gte.7), kind=kCustom, calls=%fused_dot
  ROOT %tuple.2 = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) tuple(%gte.8, %gte.6, %gte.7)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

ENTRY %main (x: f32[1024,64], i: s32[], y: f32[8,16], z: f32[16,32], q: bf16[8,64,512]) -> f32[1,64] {
  %x = f32[1024,64]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %y = f32[8,16]{1,0} parameter(2)
  %z = f32[16,32]{1,0} parameter(3)
  %q = bf16[8,64,512]{2,1,0} parameter(4)
  %loop_dynamic_slice_fusion = f32[1,64]{1,0} fusion(%x, %i), kind=kLoop, calls=%fused_slice
  %tuple.0 = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) tuple(%i, %y, %z)
  %while.1 = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) while(%tuple.0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %all-reduce = f32[1,64]{1,0} all-reduce(%loop_dynamic_slice_fusion), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %while.2 = (s32[], f32[8,16]{1,0}, /*index=2*/f32[16,32]{1,0}) while(%tuple.0), condition=%cond2, body=%body2
  %pallas_call = bf16[8,64,512]{2,1,0} custom-call(%q), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(probe)/kernel_cost:bytes=1000:flops=2000:dtype=bfloat16/pallas_call"}
  ROOT %out = f32[1,64]{1,0} add(%all-reduce, %all-reduce)
}
"""


@pytest.fixture()
def dump(tmp_path):
    (tmp_path / "module_0001.jit_probe.thunk_sequence_after_thunk_passes.txt").write_text(THUNKS)
    (tmp_path / "module_0001.jit_probe.thunk_metadata.txt").write_text(METADATA)
    return tmp_path


def test_thunks_nest_in_graphs_loops_and_blocks():
    thunks, counts = parse_thunks(THUNKS)
    assert [t["name"] for t in thunks] == ["loop_dynamic_slice_fusion", "loop_compare_fusion", "gemm_fusion_dot",
                                           "kAllReduce", "v41cp_sparse_attention", "loop_compare_fusion_1",
                                           "gemm_fusion_dot_1"]
    assert [t["in_graph"] for t in thunks] == [True] + [False] * 6
    assert [counts["blocks"][t["block"]][0] if t["block"] >= 0 else None for t in thunks] == \
        [None, "condition", "body", None, None, "condition", "body"]
    assert (counts["kWhile"], counts["kCommandBuffer"]) == (2, 1)
    assert [(c["kind"], c["id"]) for c in counts["containers"]] == [("kCommandBuffer", 0), ("kWhile", 2),
                                                                      ("kWhile", 7)]
    assert thunks[4]["grid"] == (8, 1, 2) and thunks[4]["shared_memory_bytes"] == 4096
    assert thunk_instructions(METADATA)[6] == "pallas_call"


def test_launches_count_loop_trips_and_costs_are_slice_aware(dump):
    pk = analyse(str(dump), HLO, resources=False)
    launches = {k.name: k.launches for k in pk.kernels}
    # the known-trip loop: its body 5 times, its condition never (XLA's while thunk counts the trips itself); the
    # data-dependent loop: one trip counted, its condition evaluated before each trip and after the last
    assert launches == {"loop_dynamic_slice_fusion": 1, "loop_compare_fusion": 0, "gemm_fusion_dot": 5,
                        "kAllReduce": 1, "v41cp_sparse_attention": 1, "loop_compare_fusion_1": 2,
                        "gemm_fusion_dot_1": 1}
    assert pk.launches == 11 and pk.command_buffers == 1
    assert (pk.host_driven_loops, pk.host_synchronizing_loops) == (2, 1)
    # the host launches the graph once and every kernel outside it; the all-reduce is a collective run
    assert pk.graph_launches == 1 and pk.host_launches == 1 + 9 and pk.collective_runs == 1
    by = {k.name: k for k in pk.kernels}
    # the slice reads one 64-float row of the 1024-row operand (+ its s32 index), writes one row
    assert by["loop_dynamic_slice_fusion"].bytes == 64 * 4 + 4 + 64 * 4
    assert by["gemm_fusion_dot"].flops == 2 * 8 * 32 * 16
    assert by["gemm_fusion_dot"].bytes == (8 * 16 + 16 * 32 + 8 * 32) * 4
    # the Pallas call: the count its op recorded in the metadata, not its operands
    assert (by["v41cp_sparse_attention"].bytes, by["v41cp_sparse_attention"].flops) == (1000.0, 2000.0)
    assert by["v41cp_sparse_attention"].dot_dtype == "bf16"


def test_only_this_compiles_files_are_read(dump):
    """A dump folder holding another compile: its sequence is not mixed in."""
    (dump / "module_0002.jit_other.thunk_sequence_after_thunk_passes.txt").write_text(
        "001: kCustomKernel  [source | sink] other_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes\n")
    assert "other_fusion" not in {k.name for k in analyse(str(dump), HLO, resources=False).kernels}


def test_a_pallas_call_without_a_recorded_cost_is_uncounted():
    line = '  %pc = f32[4]{0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton"'
    assert kernel_cost(line, {"a": "f32[1000000]{0}"}, {}) == (None, None, None)


def test_roofline_adds_kernels_launches_and_collectives(dump):
    h200 = get_target("h200")
    pk = analyse(str(dump), HLO, resources=False)
    coll = [{"op": "all-reduce", "bytes": 256, "group_size": 8}]
    got = predict(pk, coll, h200, 8)
    by = {k.name: k for k in pk.kernels}
    kernels = sum(k.launches * max(k.bytes / h200.hbm_bytes_per_s,
                                   k.flops / h200.peak_flops("f32" if k.dot_dtype == "f32" else "bf16"))
                  for k in by.values() if k.kind != "kAllReduce")
    assert got["kernels_s"] == pytest.approx(kernels, rel=1e-12)
    # the command buffer once, the 9 kernel launches outside it (the collective pays its own latency)
    assert got["host_launches"] == 10 and got["launches_s"] == pytest.approx(10 * h200.launch_s)
    assert got["collective_wire_bytes"] == wire_bytes("all-reduce", 256, 8) == 256 * 2 * 7 / 8
    assert got["collectives_s"] == pytest.approx(h200.collective_latency_s + 448 / h200.link_bytes_per_s)
    assert got["predicted_step_s"] == pytest.approx(got["kernels_s"] + got["launches_s"] + got["collectives_s"])
    assert got["uncosted"] == {}


def test_wire_bytes_per_collective_kind():
    assert wire_bytes("all-gather", 800, 8) == 700
    assert wire_bytes("reduce-scatter", 100, 8) == 700
    assert wire_bytes("all-to-all", 800, 4) == 600
    assert wire_bytes("collective-permute", 800, 8) == 800
    assert wire_bytes("all-reduce", 800, 1) == 0


def test_targets_are_named_and_bad_names_refused():
    assert set(TARGETS) == {"h100", "h200"}
    assert "NVIDIA H200" in TARGETS["h200"].spec_text and TARGETS["h200"].hbm_bytes_per_s == 4.8e12
    with pytest.raises(ValueError, match="'b200'"):
        get_target("b200")
