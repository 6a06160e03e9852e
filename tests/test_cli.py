"""The main job: ``python -m v41cp info`` / ``forward`` on the embedded tiny checkpoint."""

import json
import subprocess
import sys

import numpy as np

from v41cp import model
from v41cp.checkpoint import default_checkpoint, load


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "v41cp", *args], capture_output=True, text=True, timeout=600)


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


def test_forward_rejects_bad_token_id():
    res = _cli("forward", "--tokens", "1 2 999")
    assert res.returncode != 0 and "token id 999" in res.stderr


def test_generate_json_batch_matches_engine_greedy():
    res = _cli("generate", "--json", "--prompt-ids", "5,17,42", "--prompt-ids", "9,8,7,6", "--max-new-tokens", "3")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert [r["prompt_ids"] for r in out["requests"]] == [[5, 17, 42], [9, 8, 7, 6]]
    assert all(1 <= len(r["output_ids"]) <= 3 for r in out["requests"])
    assert out["timings"]["compiles"] == {"decode_step": 1, "prefill_chunk": 1}
    cfg, params = load(default_checkpoint())
    for r in out["requests"]:
        seq = list(r["prompt_ids"])
        for tok in r["output_ids"]:
            assert tok == int(np.argmax(np.asarray(model.forward(params, cfg, np.asarray([seq])))[0, -1]))
            seq.append(tok)
