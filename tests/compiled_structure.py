"""The engine's compiled programs at tiny sizes, measured exactly: per-device FLOPs (loop bodies counted per
iteration), temporaries, argument / output / alias bytes and collective bytes of the decode step, the verify step,
the span prefill and the model-wide QCP prefill, on one device and on the 8-device topologies the engine runs.

Refactors of the engine must leave these programs alone: `tests/data/compiled_structure.json` holds the figures
recorded before a refactor and `test_compiled_structure.py` compares the programs of the code under test with them.
``python tests/compiled_structure.py --record`` rewrites the file (the jax version is stored with it: figures of
another XLA are not comparable). The programs are compiled from abstract weights and caches
(`v41cp.plan.plan_program`: the same per-device program as real ones)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "compiled_structure.json"
PRESET = "tiny-tp8"
FIGURES = ("flops_per_device", "temp_bytes_per_device", "argument_bytes_per_device", "output_bytes_per_device",
           "alias_bytes_per_device", "collective_bytes_per_device")

# name → (mode, batch, context, topology keyword arguments or None for one device, extra plan arguments)
PROGRAMS = {
    "decode-1dev": ("decode", 4, 64, None, {}),
    "decode-tp8": ("decode", 4, 64, {"tp_size": 8}, {}),
    "decode-kvp8-ag_rs": ("decode", 4, 64, {"tp_size": 8, "kv_parallel_size": 8, "decode_context_parallel_size": 8,
                                            "dcp_merge": "ag_rs"}, {}),
    "decode-kvp8-heads": ("decode", 4, 64, {"tp_size": 8, "kv_parallel_size": 8, "decode_context_parallel_size": 8,
                                            "dcp_merge": "heads"}, {}),
    "verify3-1dev": ("verify", 4, 64, None, {}),
    "verify3-kvp8": ("verify", 4, 64, {"tp_size": 8, "kv_parallel_size": 8, "decode_context_parallel_size": 8,
                                       "dcp_merge": "ag_rs"}, {}),
    "prefill-1dev": ("prefill", 2, 40, None, {}),
    "prefill-kvp8": ("prefill", 2, 40, {"tp_size": 8, "kv_parallel_size": 8, "decode_context_parallel_size": 8}, {}),
    "prefill-qcp8-kvp8": ("prefill", 2, 40, {"tp_size": 8, "query_context_parallel_size": 8, "kv_parallel_size": 8,
                                             "decode_context_parallel_size": 8}, {}),
    "prefill-qcp8-kvp8-ced": ("prefill", 1, 40, {"tp_size": 8, "query_context_parallel_size": 8,
                                                 "kv_parallel_size": 8, "decode_context_parallel_size": 8},
                              {"ced": True}),
    "prefill-operator-qcp8": ("prefill", 1, 40, {"tp_size": 8, "indexer_query_parallel_size": 8,
                                                 "attention_query_parallel_size": 8, "indexer_query_min_tokens": 16,
                                                 "attention_query_min_tokens": 16,
                                                 "attention_query_swa_min_tokens": 16}, {}),
}


def _verify_program(cfg, batch, context, parallel, rows=3, block_tokens=16):
    """The engine's verify step (``rows`` rows per request, with the drafts' acceptance) lowered from abstract weights
    and cache."""
    import jax
    import jax.numpy as jnp

    from v41cp.plan import abstract_sharded_params
    from v41cp.serving.attention.dcp import DCPPlan
    from v41cp.serving.cache.device_cache import cache_layout
    from v41cp.serving.capacity import Capacity
    from v41cp.serving.runner.grammar import mask_words
    from v41cp.serving.runner.penalties import TokenCounts
    from v41cp.serving.runner.sampling import SamplingRows
    from v41cp.serving.runner.steps import verify_and_accept
    from v41cp.serving.step_batch import StepBatch

    mesh = parallel.make_mesh(jax.devices()[:parallel.num_devices]) if parallel is not None else None
    params = abstract_sharded_params(cfg, mesh, parallel.rules() if parallel is not None else None)
    plan = DCPPlan.build(cfg, parallel, mesh) if parallel is not None and parallel.kv_parallel_size > 1 else None
    n = plan.n if plan is not None else 1
    max_blocks = -(-context // block_tokens)
    num_blocks = n * batch * -(-max_blocks // n)
    rep = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if mesh is not None
           else jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    cache = cache_layout(cfg, num_blocks, block_tokens, batch, None if plan else rep, plan=plan)
    if plan is None and mesh is not None and mesh.shape["tp"] * mesh.shape["cp"] > 1:
        plan = DCPPlan.split_selection(mesh)
    n_eng = len(cfg.engram_layer_ids)
    arg = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rep)
    meta = StepBatch(arg((batch, rows)), arg((batch,)), arg((batch,)), arg((batch,)), arg((batch, max_blocks)),
                    arg((batch, rows, n_eng, cfg.engram_hash_heads if n_eng else 0)), batch, max_blocks, rows)
    with jax.default_matmul_precision("highest" if cfg.dtype == "float32" else "default"):
        sampling = SamplingRows.abstract(batch, rep, mask_words(cfg.vocab_size), verify_rows=rows)
        counts = TokenCounts.abstract(batch, cfg.vocab_size, mesh, rep)
        return verify_and_accept.lower(params, cache, meta, sampling, counts, cfg, plan,
                                       logprobs=Capacity().max_logprobs).compile()


def measure(names=None) -> dict:
    """``{name: {figure: value}}`` for the programs ``names`` (default: all of `PROGRAMS`)."""
    import jax

    from v41cp.config import preset
    from v41cp.plan import plan_program
    from v41cp.sharding.hlo_stats import collectives, program_cost
    from v41cp.sharding.topology import ParallelConfig

    cfg = preset(PRESET)
    out = {}
    for name in names or PROGRAMS:
        mode, batch, context, topo, extra = PROGRAMS[name]
        parallel = ParallelConfig(**topo) if topo is not None else None
        if mode == "verify":
            compiled = _verify_program(cfg, batch, context, parallel)
            mem = compiled.memory_analysis()
            rep = {"flops_per_device": float(program_cost(compiled).get("flops", 0.0)),
                   "temp_bytes_per_device": int(mem.temp_size_in_bytes),
                   "argument_bytes_per_device": int(mem.argument_size_in_bytes),
                   "output_bytes_per_device": int(mem.output_size_in_bytes),
                   "alias_bytes_per_device": int(mem.alias_size_in_bytes),
                   "collective_bytes_per_device": int(sum(c["bytes"] for c in collectives(compiled.as_text())))}
        else:
            rep = plan_program(cfg, mode, batch, context, parallel, **extra)
        out[name] = {k: rep[k] for k in FIGURES}
        jax.clear_caches()
    return out


def recorded() -> dict:
    return json.loads(DATA.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--record", action="store_true", help="write the figures to tests/data/compiled_structure.json")
    p.add_argument("names", nargs="*", help="programs to measure (default: all)")
    a = p.parse_args()
    # the flags of the test run (tests/conftest.py): figures are compared between programs compiled alike
    from xla_test_flags import set_test_xla_flags

    set_test_xla_flags()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import jax

    figures = measure(a.names or None)
    doc = {"jax": jax.__version__, "preset": PRESET, "programs": figures}
    print(json.dumps(doc, indent=1))
    if a.record:
        DATA.parent.mkdir(exist_ok=True)
        DATA.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
