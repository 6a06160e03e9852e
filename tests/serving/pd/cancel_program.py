"""Cancels under PD, as a program: run as two processes by ``test_disaggregated.py`` (`server_harness.two_processes`,
``--devices 4`` each: `CrossProcessDisaggregatedEngine`, the prefill role on process 0, the decode role on process 1);
the test runs `drive` on the one-process `DisaggregatedEngine` as well and compares. Rank 0 prints `drive`'s JSON.

The workload (the embedded tiny checkpoint, two batch rows per role): four requests; after two steps ``a`` and ``b``
decode while ``c`` and ``d`` are prefilled and wait for a decode slot. Then ``a`` is cancelled (the decode role holds
it), ``c`` (the prefill role holds it, prefilled) and ``e`` (submitted and cancelled while it waits for admission);
cancelling a cancelled or an unknown request is refused; the rest run to their ends and everything is released.
"""

from __future__ import annotations

import argparse
import json
import os

from v41cp.serving.engine import Capacity, EngineLike, SamplingParams
from v41cp.sharding.topology import ParallelConfig

CAP = Capacity(prefill_bucket_count=1, max_batch=2, max_tokens=32, block_tokens=4, prefill_chunk=8)
PREFILL = ParallelConfig(tp_size=4)
DECODE = ParallelConfig(tp_size=4, kv_parallel_size=4, decode_context_parallel_size=4)
# ragged: a partial last page (13), shorter than a page (3), whole pages (8), one more partial (6)
PROMPTS = {"a": [5 + i for i in range(13)], "b": [9, 8, 7], "c": [40 + 3 * i for i in range(8)],
           "d": [11, 22, 33, 44, 55, 66], "e": [7, 7, 7, 7, 7]}
NEW_TOKENS = 6


def drive(eng) -> dict:
    """The workload of the module docstring through ``eng``: each request's state before the cancels (status,
    tokens so far), every result after release, the engine's load, the refusals' messages and whether ``eng``
    has the whole surface the engine loop drives (`EngineLike`)."""
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, stop_on_eos=False)
    for rid in "abcd":
        eng.submit(rid, PROMPTS[rid], sampling)
    eng.step()
    eng.step()
    before = {rid: [eng.result(rid)["status"], len(eng.result(rid)["output_ids"])] for rid in "abcd"}
    eng.cancel("a")
    eng.cancel("c")
    eng.submit("e", PROMPTS["e"], sampling)
    eng.cancel("e")
    refused = []
    for rid in ("a", "zz"):
        try:
            eng.cancel(rid)
        except ValueError as err:
            refused.append(str(err))
    steps = 2
    while eng.pending:
        eng.step()
        steps += 1
        if steps > 20:
            raise RuntimeError("the workload did not end in 20 steps")
    results = {}
    for rid in "abcde":
        r = eng.release(rid)
        results[rid] = {k: r[k] for k in ("output_ids", "status", "finish_reason")}
    return {"before": before, "results": results, "load": eng.load(), "refused": refused,
            "engine_like": isinstance(eng, EngineLike)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--node-rank", type=int, required=True)
    p.add_argument("--dist-init-addr", required=True)
    a = p.parse_args()
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} " \
                              f"--xla_force_host_platform_device_count={a.devices}".strip()
    from v41cp.checkpoint import default_checkpoint, load
    from v41cp.cli.flags import DistributedFlags
    from v41cp.serving.pd.processes import CrossProcessDisaggregatedEngine

    DistributedFlags(nnodes=a.nnodes, node_rank=a.node_rank, dist_init_addr=a.dist_init_addr).start()
    cfg, params = load(default_checkpoint())
    out = drive(CrossProcessDisaggregatedEngine(params, cfg, CAP, PREFILL, DECODE))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
