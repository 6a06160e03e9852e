"""Prefill / decode disaggregation on 8 simulated devices (`v41cp.serving.pd.engines`): prefill on devices 0-3,
decode on 4-7, the request's cache moved by the page-owner transfer plan — equal to the aggregated engine of the
decode topology bit for bit (logits, tokens, every cache byte), the bytes moved equal to the plan's count."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from helpers import TOKEN_MAP, assert_same_request_state, perturbed

from v41cp import model
from v41cp.config import preset
from v41cp.serving.engine import Capacity, Engine, SamplingParams
from v41cp.serving.pd.transfer import plan_transfer
from v41cp.serving.pd.wire import check_pairing
from v41cp.sharding.topology import ParallelConfig

CAP = Capacity(prefill_bucket_count=1, max_batch=3, max_tokens=32, block_tokens=4, prefill_chunk=8)
# ragged prompts: a partial last page (13), one shorter than a page (2: most ranks own none of its pages), whole
# pages (8), a late arrival that reuses a freed slot
PROMPTS = {"a": (13, 5, 0), "b": (2, 3, 0), "c": (8, 6, 0), "late": (11, 4, 3)}
W = 8


@pytest.fixture(scope="module")
def tiny_tp8():
    cfg = preset("tiny-tp8", engram_token_map=TOKEN_MAP)
    return cfg, perturbed(model.init_params(cfg, jax.random.key(0)))


# penalized requests: the decode role rebuilds their token counts from the adopted history (prompt + first token)
PENALIZED = {"a": dict(frequency_penalty=0.8, repetition_penalty=1.3), "c": dict(presence_penalty=1.5)}
DECODE = ParallelConfig(tp_size=4, kv_parallel_size=2, decode_context_parallel_size=2)   # 2 TP replicas per owner


def _drive(eng, prompts, check, schedule=None, penalized=None):
    """The workload through ``eng`` (submissions at their steps: ``schedule`` rid → (length, new tokens, step),
    default `PROMPTS`, with `PENALIZED`'s penalties); ``check(step, eng)`` after every step."""
    schedule, penalized = (PROMPTS, PENALIZED) if schedule is None else (schedule, penalized or {})
    step = 0
    while step == 0 or eng.pending:
        for rid, (_, new, at) in schedule.items():
            if at == step:
                eng.submit(rid, prompts[rid], SamplingParams(max_new_tokens=new, stop_on_eos=False,
                                                             **penalized.get(rid, {})))
        eng.step()
        step += 1
        check(step, eng)
    assert step < 20


@pytest.fixture(scope="module")
def aggregated(tiny_tp8):
    """The aggregated engine on the decode topology: per step, every request's output, status, last logits and
    (running) cache bytes."""
    cfg, params = tiny_tp8
    rng = np.random.default_rng(4)
    prompts = {rid: rng.integers(3, cfg.vocab_size, n).tolist() for rid, (n, _, _) in PROMPTS.items()}
    record = []
    _drive(Engine(params, cfg, CAP, parallel=DECODE, record_logits=True), prompts, _recorder(record))
    return prompts, record


def _recorder(record: list):
    """A per-step check that appends every request's output, status, last logits and (running) cache bytes."""
    def keep(step, eng):
        record.append({rid: (list(r.output), r.status, r.last_logits,
                             eng.request_state(rid) if r.status == "running" else None)
                       for rid, r in eng.requests.items()})
    return keep


@pytest.mark.parametrize("prefill_kvp,transport", [(2, "copy"), (1, "copy"), (2, "collective"), (1, "collective")])
def test_disaggregated_equals_aggregated(tiny_tp8, aggregated, prefill_kvp, transport):
    """Decode KVP = DCP 2 in decode TP 4 (each owner's pages on two TP replicas). Prefill KVP 2: rank-matched, every
    page stays on its rank index; prefill KVP 1: relayout from the one prefill rank to the two decode owners. Moved
    by per-device copies, or by the collective PD across processes uses (packed byte vectors, one ppermute from
    prefill device i to decode device i). Step by step against the aggregated engine on the decode topology: every
    request's tokens, every logits row and every running request's cache bytes are equal."""
    from v41cp.serving.pd.engines import DisaggregatedEngine

    cfg, params = tiny_tp8
    prompts, record = aggregated
    pre = ParallelConfig(tp_size=4, kv_parallel_size=prefill_kvp, decode_context_parallel_size=prefill_kvp)
    pd = DisaggregatedEngine(params, cfg, CAP, pre, DECODE, transport=transport, record_logits=True)
    assert {d.id for d in pd.prefill.mesh.devices.flat} == {0, 1, 2, 3}
    assert {d.id for d in pd.decode.mesh.devices.flat} == {4, 5, 6, 7}

    def compare(step, eng):
        for rid, (output, status, logits, state) in record[step - 1].items():
            got = eng.result(rid)
            assert got["output_ids"] == output and got["status"] == status, (rid, step)
            if rid in eng.requests and logits is not None:
                np.testing.assert_array_equal(eng.requests[rid].last_logits, logits, err_msg=f"{rid} step {step}")
            if state is not None:
                assert rid in eng.decode.requests               # every running request decodes on devices 4-7
                assert_same_request_state(eng.decode.request_state(rid), state, rid, W)

    _drive(pd, prompts, compare)
    assert not pd.prefill.requests
    assert pd.prefill.load()["free_blocks"] == pd.prefill.num_blocks     # free, or cached and reclaimable
    t = pd.transfers
    assert [x["id"] for x in t] == list(PROMPTS)
    for x in t:
        assert x["bytes"] == x["planned_bytes"] > 0, x
        assert x["mode"] == ("rank-matched" if prefill_kvp == 2 else "relayout")
        assert all((s == d) if prefill_kvp == 2 else s == 0 for s, d in x["rank_pairs"]), x
    # the 2-token prompt: one page, one ratio-2 entry, two ratio-1 entries, one destination rank
    short = next(x for x in t if x["id"] == "b")
    assert short["pages"] == 1 and sorted(short["entries"].values()) == [1, 2] and len(short["rank_pairs"]) == 1


@pytest.mark.fast
def test_transfer_plan_counts_and_refusals():
    """Entries of a partial last page stop at the true token count; each decode rank receives exactly the pages it
    owns; unsupported size pairs are refused naming them."""
    # 13 tokens in pages of 4: ratio 2 -> 6 complete entries (2 per page), ratio 1 -> 13
    plan = plan_transfer([5, 9, 2, 7], [8, 1, 10, 3], 13, 4, {"g2": 2, "g1": 1}, 1, 4)
    assert plan.entries("g2") == 6 and plan.entries("g1") == 13 and plan.pages == 4
    for group in ("g1", "g2"):
        for (src_rank, dst_rank), (s_rows, d_rows, _) in plan.copies[group].items():
            assert src_rank == 0
            owned = {b // 4 for b in (8, 1, 10, 3) if b % 4 == dst_rank}
            assert set(d_rows.tolist()) <= owned
    assert plan.rank_pairs() == {(0, 0), (0, 1), (0, 2), (0, 3)}
    with pytest.raises(ValueError, match="prefill KVP 2 cannot feed decode KVP = DCP 4"):
        plan_transfer([0], [0], 3, 4, {"g": 1}, 2, 4)
    with pytest.raises(ValueError, match="must continue the prefill's page cycle"):
        plan_transfer([0, 1], [1, 2], 8, 4, {"g": 1}, 2, 2)
    with pytest.raises(ValueError, match="needs 2 pages: the prefill holds 1"):
        plan_transfer([0], [0, 1], 5, 4, {"g": 1}, 1, 1)
    # the collective pairs prefill device i with decode device i: rank-matched needs the same rank on both
    check_pairing([0, 0, 1, 1], [0, 0, 1, 1], 2, 2)
    check_pairing([0, 0, 0, 0], [0, 1, 0, 1], 1, 2)
    with pytest.raises(ValueError, match=r"prefill device ranks \[0, 1, 0, 1\] and decode device ranks \[0, 0, 1, 1\]"):
        check_pairing([0, 1, 0, 1], [0, 0, 1, 1], 2, 2)
    with pytest.raises(ValueError, match="4 prefill devices, 2 decode devices"):
        check_pairing([0, 0, 0, 0], [0, 1], 1, 2)


def test_disaggregation_refuses_bad_topologies(tiny_tp8):
    from v41cp.serving.pd.engines import DisaggregatedEngine

    cfg, params = tiny_tp8
    with pytest.raises(ValueError, match="prefill KVP 4 cannot feed decode KVP = DCP 2"):
        DisaggregatedEngine(params, cfg, CAP, ParallelConfig(tp_size=4, kv_parallel_size=4,
                                                              decode_context_parallel_size=4), DECODE)
    with pytest.raises(ValueError, match="8 prefill \\+ 4 decode devices, but only 8 are given"):
        DisaggregatedEngine(params, cfg, CAP, ParallelConfig(tp_size=8), DECODE)


def test_cancel_in_every_role_across_processes_equals_one_process():
    """`cancel` under PD, the one-process engine and across two processes (`cancel_program.py`): a request cancelled
    while it decodes, while it waits prefilled for a decode slot and while it waits for admission keeps the tokens
    it had; cancelling it again or an unknown id is refused naming it; the other requests run to their ends with the
    tokens they have without the cancels; every page and slot of both roles comes back. Both processes' results, loads
    and refusals equal the one-process engine's."""
    import json
    from pathlib import Path

    import cancel_program as prog
    from server_harness import two_processes

    from v41cp.checkpoint import default_checkpoint, load
    from v41cp.serving.pd.engines import DisaggregatedEngine

    cfg, params = load(default_checkpoint())
    one = json.loads(json.dumps(prog.drive(DisaggregatedEngine(params, cfg, prog.CAP, prog.PREFILL, prog.DECODE))))
    # where the cancels found them: a decoding (first token + 2 decode rounds), c prefilled (its first token only)
    assert one["before"] == {"a": ["running", 3], "b": ["running", 3], "c": ["running", 1], "d": ["running", 1]}
    res = one["results"]
    assert [res[r]["status"] for r in "abcde"] == ["cancelled", "done", "cancelled", "done", "cancelled"]
    assert len(res["a"]["output_ids"]) == 3 and len(res["c"]["output_ids"]) == 1 and res["e"]["output_ids"] == []
    assert len(res["b"]["output_ids"]) == len(res["d"]["output_ids"]) == prog.NEW_TOKENS
    assert one["refused"] == ["cannot cancel unknown or finished request 'a'",
                              "cannot cancel unknown or finished request 'zz'"]
    assert one["engine_like"]
    load_ = one["load"]
    assert load_["waiting"] == load_["running"] == 0
    assert all(load_[r]["free_blocks"] == load_[r]["total_blocks"] for r in ("prefill", "decode"))
    # the requests not cancelled have the tokens of the same requests alone
    alone = Engine(params, cfg, prog.CAP)
    for rid in "bd":
        alone.submit(rid, prog.PROMPTS[rid], SamplingParams(max_new_tokens=prog.NEW_TOKENS, stop_on_eos=False))
    while alone.pending:
        alone.step()
    assert [alone.result(r)["output_ids"] for r in "bd"] == [res["b"]["output_ids"], res["d"]["output_ids"]]

    (rc0, out0, err0), (rc1, out1, err1) = two_processes("--devices", "4",
                                                         program=str(Path(prog.__file__).resolve()))
    assert rc0 == 0 and rc1 == 0, (err0[-3000:], err1[-3000:])
    assert out1 == ""
    two = json.loads(out0)
    for rid in "abcde":
        assert two["results"][rid] == res[rid], rid
    assert two == one


V4_PROMPTS = {"a": (27, 5, 0), "b": (5, 3, 0), "c": (16, 6, 0), "late": (21, 4, 3)}


@functools.lru_cache(maxsize=None)
def _v4_aggregated(dtype: str):
    """DeepSeek-V4 (`tiny-v4`, pages of 8 tokens: one HCA entry, two CSA entries; FP32, BF16 with its value stores
    as 16-bit words, or ``records``: FP32 with the release's byte records — the cache fake-quant on, ``head_dim`` 80
    for whole FP8 blocks of 64) on the decode topology, aggregated: per step, every request's output, status, last
    logits and (running) cache bytes."""
    cfg = (preset("tiny-v4", fake_quant=True, head_dim=80) if dtype == "records" else preset("tiny-v4", dtype=dtype))
    params = perturbed(model.init_params(cfg, jax.random.key(0)))
    rng = np.random.default_rng(4)
    prompts = {rid: rng.integers(3, cfg.vocab_size, n).tolist() for rid, (n, _, _) in V4_PROMPTS.items()}
    cap = Capacity(prefill_bucket_count=1, max_batch=3, max_tokens=64, block_tokens=8, prefill_chunk=8)
    record = []
    _drive(Engine(params, cfg, cap, parallel=DECODE, record_logits=True), prompts, _recorder(record), V4_PROMPTS)
    return cfg, params, cap, prompts, record


@pytest.mark.parametrize("dtype,prefill_kvp,transport", [("float32", 2, "collective"), ("float32", 1, "copy"),
                                                           ("bfloat16", 2, "collective"), ("records", 2, "collective")])
def test_v4_disaggregated_equals_aggregated(dtype, prefill_kvp, transport):
    """DeepSeek-V4 through PD: the CSA / HCA pages (index keys of CSA only) by the page-owner transfer plan and every
    compressor's ring (the C4 overlap state of the main and index compressors, the open C128 window) with the slot
    state; the bytes moved equal the plan's. Rank-matched (prefill KVP 2; the collective with FP32 and with BF16
    through the 16-bit word stores, and with the release's 584 B / 68 B records): every token, logits row and
    running request's cache bytes equal the aggregated engine's.
    Relayout (prefill KVP 1): the prefill runs another program, and tiny-v4's rows round differently between
    programs on XLA:CPU (`docs/architecture.md` §8): the same tokens, logits within 1e-5."""
    from v41cp.serving.pd.engines import DisaggregatedEngine

    cfg, params, cap, prompts, record = _v4_aggregated(dtype)
    pre = ParallelConfig(tp_size=4, kv_parallel_size=prefill_kvp, decode_context_parallel_size=prefill_kvp)
    pd = DisaggregatedEngine(params, cfg, cap, pre, DECODE, transport=transport, record_logits=True)
    worst = 0.0

    def compare(step, eng):
        nonlocal worst
        for rid, (output, status, logits, state) in record[step - 1].items():
            got = eng.result(rid)
            assert got["output_ids"] == output and got["status"] == status, (rid, step)
            if rid in eng.requests and logits is not None:
                mine = eng.requests[rid].last_logits
                worst = max(worst, float(np.abs(mine - logits).max() / np.abs(logits).max()))
                if prefill_kvp == 2:
                    np.testing.assert_array_equal(mine, logits, err_msg=f"{rid} step {step}")
            if state is not None and prefill_kvp == 2:
                assert_same_request_state(eng.decode.request_state(rid), state, rid, cfg.sliding_window, cfg)

    _drive(pd, prompts, compare, V4_PROMPTS)
    moved = sum(x["bytes"] for x in pd.transfers)
    print(f"\n[v4 pd] {dtype} stores, prefill KVP {prefill_kvp} ({transport}): logits vs aggregated {worst:.2e}; "
          f"{len(pd.transfers)} transfers, {moved:,} B, each as planned")
    assert worst <= 1e-5
    for x in pd.transfers:
        assert x["bytes"] == x["planned_bytes"] > 0, x
    # the 5-token prompt: one page, one CSA entry per CSA layer, no HCA entry
    short = next(x for x in pd.transfers if x["id"] == "b")
    assert short["pages"] == 1 and set(short["entries"].values()) == {0, 1}
