"""The main job: ``python -m v41cp info`` / ``forward`` on the embedded tiny checkpoint."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from server_harness import subprocess_env, two_processes

from v41cp import model
from v41cp.checkpoint import default_checkpoint, load
from v41cp.serving.api.text import TextCodec


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "v41cp", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.fast
def test_info_lists_every_layer_role():
    res = _cli("info", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert [row["role"] for row in out["layers"]] == ["swa", "full", "reuse", "reindex", "full", "reindex"]


def test_forward_matches_the_library():
    prompt = "5 17 42 99 3 200 7 8 9 10 11 12"
    res = _cli("forward", "--json", "--tokens", prompt)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    cfg, params = load(default_checkpoint())
    logits = np.asarray(model.forward(params, cfg, np.array([[int(t) for t in prompt.split()]])))
    assert out["next_token"] == int(np.argmax(logits[0, -1]))
    assert out["greedy_per_position"] == logits[0].argmax(-1).tolist()
    # operator-local indexer + attention QCP over attention TP 4 (the tiny model's 4 heads), thresholds 1 row, with the
    # cache fake-quant off: with it on, a rounding-level difference can move a value across an FP8 / NVFP4 / MXFP4
    # rounding boundary (one code apart, docs/architecture.md §6) — on this prompt it does on some CPUs (Intel Xeon:
    # 5.7e-5 on the logits; 3.9e-7 with the fake-quant off), so the 1e-5 bound would measure that boundary
    qcp = _cli("forward", "--json", "--tokens", prompt, "--devices", "4", "--no-fake-quant",
               "--deepseek-v41-indexer-query-parallel-size", "4", "--deepseek-v41-attention-query-parallel-size", "4",
               "--deepseek-v41-indexer-query-min-tokens", "1", "--deepseek-v41-attention-query-min-tokens", "1",
               "--deepseek-v41-attention-query-swa-min-tokens", "1")
    assert qcp.returncode == 0, qcp.stderr
    got = json.loads(qcp.stdout)
    cfg_nf, params_nf = load(default_checkpoint(), fake_quant=False)
    want = np.asarray(model.forward(params_nf, cfg_nf, np.array([[int(t) for t in prompt.split()]])))[0]
    assert got["greedy_per_position"] == want.argmax(-1).tolist()
    np.testing.assert_allclose([t["logit"] for t in got["top"]], want[-1, [t["id"] for t in got["top"]]], rtol=1e-5)


@pytest.mark.fast
def test_forward_rejects_bad_token_id():
    res = _cli("forward", "--tokens", "1 2 999")
    assert res.returncode != 0 and "token id 999" in res.stderr


REFERENCE_WIDTH = 32                                   # the padded length of `_assert_greedy_of_forward`'s forward


def _assert_greedy_of_forward(out):
    """Every generated token is the argmax of the XLA full forward over the sequence so far."""
    cfg, params = load(default_checkpoint())
    width = REFERENCE_WIDTH                            # one width for every test: one compiled reference
    assert max(len(r["prompt_ids"]) + len(r["output_ids"]) - 1 for r in out["requests"]) <= width
    for r in out["requests"]:
        seq = list(r["prompt_ids"])
        for tok in r["output_ids"]:
            padded = np.zeros((1, width), np.int32)      # causal: right padding keeps the logits; one compile
            padded[0, :len(seq)] = seq
            assert tok == int(np.argmax(np.asarray(model.forward(params, cfg, padded))[0, len(seq) - 1]))
            seq.append(tok)


def test_generate_json_batch_matches_engine_greedy():
    """``generate`` with the Pallas kernels (``--attention-backend / --indexer-backend pallas``, interpret mode
    here) prints the greedy tokens of the XLA full forward, for a chat prompt (``--prompt --chat``, text out)
    and token-id prompts. (The topology flags run end to end in
    `test_bench_decode_kvp_json`; DCP generation equals one device in `test_dcp_decode`.)"""
    prompts = ("--prompt", "w1 w2", "--chat", "--system", "w9", "--prompt-ids", "5,17,42", "--prompt-ids", "9,8,7,6",
               "--max-new-tokens", "3")
    res = _cli("generate", "--json", "--attention-backend", "pallas", "--indexer-backend", "pallas", *prompts)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    codec = TextCodec.from_checkpoint(default_checkpoint())
    chat = codec.chat_ids([{"role": "system", "content": "w9"}, {"role": "user", "content": "w1 w2"}])
    assert chat == codec.encode("W0 w9 W1 w1 w2 W2")               # the checkpoint's (synthetic) chat format
    assert [r["prompt_ids"] for r in out["requests"]] == [chat, [5, 17, 42], [9, 8, 7, 6]]
    for r in out["requests"]:
        eos = r["finish_reason"] == "eos"
        assert r["text"] == codec.decode(r["output_ids"][:-1] if eos else r["output_ids"])
    assert all(1 <= len(r["output_ids"]) <= 3 for r in out["requests"])
    assert out["timings"]["compiles"] == {"decode_step": 1, "prefill_chunk": 0, "prefill_span": 1, "verify_step": 0,
                                          "draft_step": 0}
    _assert_greedy_of_forward(out)


def test_generate_with_dspark_speculative_decoding():
    """``generate --speculative-algorithm dspark --speculative-num-draft-tokens 3``: the embedded checkpoint's
    drafter (mtp.*) proposes, the target verifies 4 rows per step: the greedy tokens of the full forward, the
    speculative counters in the JSON, one verification and one draft compile, no plain decode step; a draft count
    beyond the block size is refused naming it."""
    res = _cli("generate", "--json", "--prompt-ids", "5,17,42", "--prompt-ids", "9,8,7,6",
               "--max-new-tokens", "4", "--speculative-algorithm", "dspark", "--speculative-num-draft-tokens", "3")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    spec = out["timings"]["speculative"]
    assert spec["target_steps"] >= 1 and spec["drafts_proposed"] >= spec["drafts_accepted"] >= 0
    assert all("speculative" in r for r in out["requests"])
    c = out["timings"]["compiles"]
    assert (c["verify_step"], c["draft_step"], c["decode_step"]) == (1, 1, 0), c
    _assert_greedy_of_forward(out)
    res = _cli("generate", "--speculative-algorithm", "dspark", "--speculative-num-draft-tokens", "9")
    assert res.returncode == 2 and "num_draft_tokens must be an integer in [1, dspark_block_size=4], got 9" in res.stderr


def test_generate_with_prefix_caching():
    """``generate`` (prefix caching on by default): the second prompt starts with the first one's two whole 4-token
    blocks; both arrive together, so it waits a round for the first to cache them and reuses them (``cached_tokens``
    in its JSON row, the counters in the timings); tokens as the full forward."""
    first = [5, 17, 42, 9, 8, 7, 6, 11, 12, 13]
    res = _cli("generate", "--json", "--block-tokens", "4", "--max-new-tokens", "3",
               "--prompt-ids", ",".join(map(str, first)), "--prompt-ids", ",".join(map(str, first[:9] + [99, 98])))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert [r["cached_tokens"] for r in out["requests"]] == [0, 8]
    st = out["timings"]["prefix_cache"]
    assert (st["hits"], st["hit_tokens"], st["prompt_tokens"]) == (1, 8, 21)
    assert out["timings"]["prefill_tokens"] == 21 - 8
    _assert_greedy_of_forward(out)


# PD with relayout (prefill KVP 1 -> decode KVP = DCP 4) and DSpark (both roles run the drafter; the transfer carries
# its context window); a prompt shorter than a page and one of 19 tokens (two pages, the last partial): one process,
# then two (the prefill role in process 0, the decode role in process 1)
PD = ("generate", "--json", "--prefill-devices", "4", "--kv-parallel-size", "4", "--prefill-kv-parallel-size", "1",
      "--prompt-ids", "5,17,42", "--prompt-ids", "9,8,7,6,5,4,3,2,1,2,3,4,5,6,7,8,9,10,11", "--max-new-tokens", "5",
      "--speculative-algorithm", "dspark", "--speculative-num-draft-tokens", "2")


@pytest.fixture(scope="module")
def pd_one_process():
    res = _cli(*PD, "--devices", "8")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_generate_disaggregated_prefill_and_decode(pd_one_process):
    """``generate --devices 8 --prefill-devices 4 --kv-parallel-size 4 --prefill-kv-parallel-size 1`` with DSpark:
    prefill on devices 0-3 (KVP 1), decode on 4-7 (KVP = DCP 4), each request's pages relaid out to their decode
    owners and its drafter context window moved with its slot state; the decode role drafts and verifies; the greedy
    tokens of the full forward; the bytes moved are the plans' count. A prefill KVP that can feed neither way is
    refused naming both sizes."""
    out = pd_one_process
    t = out["timings"]["transfers"]
    assert t["requests"] == 2 and t["modes"] == ["relayout"] and t["pages"] == 3
    assert t["bytes"] == t["planned_bytes"]
    spec = out["timings"]["speculative"]
    assert spec["target_steps"] >= 1 and spec["drafts_proposed"] > 0
    assert out["timings"]["compiles"]["verify_step"] == 1 and out["timings"]["compiles"]["decode_step"] == 0
    _assert_greedy_of_forward(out)
    res = _cli("generate", "--devices", "8", "--prefill-devices", "4", "--kv-parallel-size", "4",
               "--prefill-kv-parallel-size", "2")
    assert res.returncode == 2 and "prefill KVP 2 cannot feed decode KVP = DCP 4" in res.stderr


def test_pd_across_two_processes_equals_one_process(pd_one_process):
    """PD across processes: the prefill role on process 0's 4 devices, the decode role on process 1's; each
    request's pages and slot state (with DSpark's context window) cross in one transfer collective (a ppermute over
    both processes' devices) as stored bytes. Tokens, each request's speculative counters, transfer counts, bytes
    moved (= the plans' count) and compiles equal the one-process run; rank 0 prints, rank 1 prints nothing."""
    (rc0, out0, err0), (rc1, out1, err1) = two_processes(*PD, "--devices", "4")
    assert rc0 == 0 and rc1 == 0, (err0[-3000:], err1[-3000:])
    assert out1 == ""
    two = json.loads(out0)
    assert two["requests"] == pd_one_process["requests"]
    assert two["timings"]["transfers"] == pd_one_process["timings"]["transfers"]
    load = two["timings"]["engine_load"]                  # every request released, every page and slot back, both roles
    assert load == pd_one_process["timings"]["engine_load"]
    assert load["waiting"] == load["running"] == 0
    assert all(load[r]["free_blocks"] == load[r]["total_blocks"] for r in ("prefill", "decode"))
    assert two["timings"]["compiles"] == pd_one_process["timings"]["compiles"]
    assert two["timings"]["speculative"] == pd_one_process["timings"]["speculative"]


def test_bench_with_pd_across_two_processes():
    """``bench decode`` with PD across two processes (prefill on process 0's 4 devices, decode on process 1's): rank 0
    reports the rows with the prefill rate and every request's transfer, rank 1 prints nothing; both exit cleanly."""
    (rc0, out0, err0), (rc1, out1, err1) = two_processes("bench", "decode", "--json", "--devices", "4",
                                                          "--prefill-devices", "4", "--kv-parallel-size", "4",
                                                          "--lengths", "9,20", "--steps", "2")
    assert rc0 == 0 and rc1 == 0, (err0[-3000:], err1[-3000:])
    assert out1 == ""
    out = json.loads(out0)
    assert [r["context"] for r in out["rows"]] == [9, 20]
    assert all(r["prefill_tokens_per_s"] > 0 and r["decode_step_ms_p50"] > 0 for r in out["rows"])
    assert out["transfers"]["requests"] == 2 and out["transfers"]["bytes"] == out["transfers"]["planned_bytes"] > 0
    assert out["topology"]["prefill_devices"] == 4 and "kvp1" not in out


def test_generate_without_a_chat_format_says_so(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((Path(default_checkpoint()) / "tokenizer.json").read_bytes())
    res = _cli("generate", "--checkpoint", str(tmp_path), "--prompt", "w1", "--chat")
    assert res.returncode == 2 and "provides no chat format" in res.stderr, res.stderr


# model-wide QCP 8 prefill (CED on, passes of 2 rows: the prompts over several rounds) and DCP decode over KVP 8: one process, then two (test_multihost)
QCP8 = ("generate", "--json", "--query-context-parallel-size", "8", "--kv-parallel-size", "8", "--ced",
        "--max-prefill-tokens", "2", "--prompt-ids", "5,17,42", "--prompt-ids", "9,8,7,6",
        "--max-new-tokens", "4", "--ignore-eos")


@pytest.fixture(scope="module")
def qcp8_one_process():
    res = _cli(*QCP8, "--devices", "8")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_generate_with_model_wide_qcp_and_kvp(qcp8_one_process):
    """``generate --query-context-parallel-size 8 --kv-parallel-size 8 --ced --max-prefill-tokens 2``: span prefill
    under QCP 8 (CED on) in 2-row passes, DCP decode over the KVP 8 pages; the greedy tokens of the full forward; two
    span-prefill compiles (one row bucket: the first passes, the continuing passes)."""
    out = qcp8_one_process
    assert out["timings"]["compiles"]["prefill_span"] == 2 and out["timings"]["compiles"]["prefill_chunk"] == 0
    assert [len(r["output_ids"]) for r in out["requests"]] == [4, 4]
    _assert_greedy_of_forward(out)


def test_two_processes_equal_one_process(qcp8_one_process):
    """Two processes on 127.0.0.1 through `jax.distributed` (gloo between CPU processes), 4 devices each, one global
    mesh of 8: the QCP 8 prefill's zigzag rows and the KVP 8 pages span both processes (the DCP merge and the
    distributed top-k through gloo); rank 0 prints the one-process run's tokens, rank 1 prints nothing. Bounded in
    time, both processes killed on failure."""
    (rc0, out0, err0), (rc1, out1, err1) = two_processes(*QCP8, "--devices", "4")
    assert rc0 == 0 and rc1 == 0, (err0[-3000:], err1[-3000:])
    assert out1 == ""
    two = json.loads(out0)
    assert two["requests"] == qcp8_one_process["requests"]
    assert two["timings"]["compiles"] == qcp8_one_process["timings"]["compiles"]


@pytest.mark.fast
def test_distributed_flags_are_validated():
    res = _cli("generate", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "127.0.0.1:1")
    assert res.returncode == 2 and "--node-rank 2 is outside [0, --nnodes 2)" in res.stderr
    res = _cli("generate", "--nnodes", "2", "--dist-init-addr", "localhost")
    assert res.returncode == 2 and "--dist-init-addr must be HOST:PORT" in res.stderr


def test_topology_flags_are_validated():
    res = _cli("generate", "--devices", "8", "--kv-parallel-size", "4", "--decode-context-parallel-size", "2")
    assert res.returncode == 2 and "decode_context_parallel_size=2 must equal kv_parallel_size=4" in res.stderr
    res = _cli("generate", "--devices", "8", "--tp-size", "3")
    assert res.returncode == 2 and "--tp-size 3 does not divide --devices 8" in res.stderr
    res = _cli("generate", "--devices", "8", "--deepseek-v41-indexer-query-parallel-size", "4")
    assert res.returncode == 2 and "indexer_query_parallel_size=4 must be 1 or the attention tp_size=8" in res.stderr
    res = _cli("generate", "--devices", "8", "--query-context-parallel-size", "8", "--kv-parallel-size", "2")
    assert res.returncode == 2 and "kv_parallel_size=2 must be" in res.stderr
    res = _cli("forward", "--devices", "8", "--query-context-parallel-size", "8",
               "--deepseek-v41-indexer-query-parallel-size", "8")
    assert res.returncode == 2 and "cannot be combined with model-wide" in res.stderr


def test_bench_decode_kvp_json():
    """The KVP benchmark reports exact structure: per-rank pages fall by the group size and resident capacity at
    a fixed budget grows by it. (The tiny model's 2 output groups do not split over TP 4, so GSPMD adds an
    output-layout gather over cp on top of the analytical DCP payload; the exact equality is checked on
    tiny-tp8 in test_dcp_decode.)"""
    res = _cli("bench", "decode", "--json", "--devices", "8", "--tp-size", "4", "--kv-parallel-size", "2",
               "--lengths", "20", "--steps", "2")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    for key in ("per_rank_cache_bytes", "max_resident_tokens", "collective_bytes_per_step", "context_capacity"):
        assert key in out
    base = out["kvp1"]
    assert out["max_resident_tokens"] == 2 * base["max_resident_tokens"]
    assert out["per_rank_cache_bytes"]["pages_per_device"] * 2 == base["per_rank_cache_bytes"]["pages_per_device"]
    coll = out["collective_bytes_per_step"]
    assert coll["cp_group"] >= coll["cp_group_analytic"]["total"] > 0
    assert len(out["step_time_vs_kvp1"]) == 1


def test_bench_kernels_json(capsys):
    """``bench kernels`` (toy shapes, interpret mode here): every case reports time, bytes, roofline and the XLA
    comparison; the kernels agree with the XLA path."""
    from v41cp.__main__ import main

    assert main(["bench", "kernels", "--json", "--shapes", "tiny", "--contexts", "64", "--batches", "2",
                 "--expert-tokens", "8", "--reps", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["interpret"] and [c["kernel"] for c in out["cases"]] == ["indexer_topk", "sparse_attention",
                                                                        "grouped_fp4_matmul"]
    for case in out["cases"]:
        assert case["bytes"] > 0 and case["pallas"]["ms"] > 0 and case["xla"]["ms"] > 0
        assert "roofline_ms" in case["pallas"] and "speedup_vs_xla" in case
    assert out["cases"][0]["ids_equal_xla"] and out["cases"][1]["max_rel_err_vs_xla"] <= 1e-5
    experts = out["cases"][2]
    assert experts["max_rel_err_vs_xla"] <= 1e-5 and experts["tile_rows"] >= 16
    assert 0 < experts["live_tiles"] <= experts["tiles"] and experts["experts_used"] <= 16


def test_the_compilation_cache_is_on_by_default_and_a_second_run_compiles_nothing_new(tmp_path):
    """The commands keep every program they compile in the user's cache folder by default ($XDG_CACHE_HOME/v41cp/jax);
    a second identical run loads them all (the folder gains no entry) and prints the same result;
    `--no-compilation-cache` reads and writes nothing; `--compilation-cache-dir` moves the folder."""
    env = subprocess_env()
    env.pop("JAX_COMPILATION_CACHE_DIR", None)              # the suite's shared cache: not what a user has
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    run = lambda *extra: subprocess.run([sys.executable, "-m", "v41cp", "forward", "--json", "--tokens", "5 17 42",
                                         *extra], capture_output=True, text=True, timeout=600, env=env)
    folder = tmp_path / "xdg" / "v41cp" / "jax"
    first = run()
    assert first.returncode == 0, first.stderr
    entries = sorted(p.name for p in folder.iterdir())
    assert entries                                          # every program compiled was kept
    second = run()
    assert second.returncode == 0, second.stderr
    result = lambda res: {k: v for k, v in json.loads(res.stdout).items() if k != "seconds"}
    assert sorted(p.name for p in folder.iterdir()) == entries and result(second) == result(first)
    env["XDG_CACHE_HOME"] = str(tmp_path / "other")
    off = run("--no-compilation-cache")
    assert off.returncode == 0, off.stderr
    assert result(off) == result(first) and not (tmp_path / "other").exists()
    moved = run("--compilation-cache-dir", str(tmp_path / "moved"))
    assert moved.returncode == 0, moved.stderr
    assert result(moved) == result(first) and any((tmp_path / "moved").iterdir())
    assert not (tmp_path / "other").exists()
