"""The OpenAI-compatible server (`python -m v41cp serve`) through real HTTP clients (openai, httpx), one device.

One server subprocess on 127.0.0.1 serves every test here (one compile of its bucket); each test leaves it
idle (every page free), which the next test checks."""

import asyncio
import json
import signal

import httpx
import numpy as np
import openai
import pytest
from helpers import penalized_reference, top_gap
from server_harness import ServerProcess

from v41cp.checkpoint import default_checkpoint
from v41cp.serving.api.text import TextCodec

MODEL = "tiny-v41"
CAPACITY = 128
# after its graceful shutdown uvicorn re-raises the signal it caught, so the exit status reports SIGTERM
CLEAN_EXIT = (0, -signal.SIGTERM)
PROMPTS = ["w1 w2 w3", "W4 w9 w30 W31 w2", "w7", "x200 w5 W5 w6 w6 w100", "w3 w3 w3 w3 w3 w3 w3",
           "W60 w61", "w8 W8 w9 W9 w10", "x255 x254"]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-batch", "8", "--max-context", str(CAPACITY), "--max-waiting", "8",
                        "--max-prefill-tokens", "64",             # one prefill bucket to warm up (64 rows; the
                        "--prefill-bucket-count", "1")            # ladder's warm-up: test_prefill_rounds.py)
    yield srv
    assert srv.stop() in CLEAN_EXIT, srv.output()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def codec():
    return TextCodec.from_checkpoint(default_checkpoint())


def _streamed_text(stream) -> tuple[str, str]:
    parts, reason = [], None
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.text if hasattr(c, "text") else (c.delta.content or ""))
            reason = c.finish_reason or reason
    return "".join(parts), reason


@pytest.mark.fast
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = server.wait_idle()
    assert h["status"] == "ok" and h["total_blocks"] > 0 and h["free_slots"] == 8


@pytest.mark.fast
def test_completion_text_ids_and_stream(server, client, codec):
    args = dict(model=MODEL, max_tokens=9, temperature=0)
    text = client.completions.create(prompt=PROMPTS[1], extra_body={"return_token_ids": True}, **args)
    choice = text.choices[0]
    ids = choice.model_extra["token_ids"]
    assert len(ids) == 9 and choice.finish_reason == "length"
    assert choice.text == codec.decode(ids)
    assert text.usage.prompt_tokens == len(codec.encode(PROMPTS[1])) and text.usage.completion_tokens == 9
    # the same prompt as token ids gives the same completion
    by_ids = client.completions.create(prompt=codec.encode(PROMPTS[1]), **args)
    assert by_ids.choices[0].text == choice.text
    assert client.completions.create(prompt=[PROMPTS[1]], **args).choices[0].text == choice.text   # a batch of one
    # streamed text = plain text, with the usage chunk at the end
    streamed, reason = _streamed_text(client.completions.create(prompt=PROMPTS[1], stream=True, **args))
    assert (streamed, reason) == (choice.text, "length")
    # a stop string cuts the text before it (and frees the request)
    words = choice.text.split(" ")
    stop = " " + words[3]
    cut = client.completions.create(prompt=PROMPTS[1], stop=[stop], **args).choices[0]
    assert cut.text == choice.text[: choice.text.index(stop)] and cut.finish_reason == "stop"
    streamed_cut, reason = _streamed_text(client.completions.create(prompt=PROMPTS[1], stop=stop, stream=True, **args))
    assert (streamed_cut, reason) == (cut.text, "stop")
    server.wait_idle()


def test_chat_plain_and_streamed(server, client, codec):
    messages = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w1 w2 W3"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    msg = plain.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert plain.usage.prompt_tokens == len(codec.chat_ids(messages))
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens and not chunks[-1].choices
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    server.wait_idle()


def test_repeated_prompt_reuses_the_prefix_cache(server, client):
    """With prefix caching (the default) a prompt sent again reuses its whole 16-token blocks (all but the block
    holding its last token): ``usage.prompt_tokens_details.cached_tokens`` says how many, the text is the same."""
    prompt = " ".join(f"w{i}" for i in range(10, 50))
    args = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    first = client.completions.create(**args)
    again = client.completions.create(**args)
    n = first.usage.prompt_tokens
    assert n > 32 and first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    assert again.choices[0].text == first.choices[0].text
    h = server.wait_idle()
    assert h["prefix_cache"]["hits"] >= 1 and h["prefix_cache"]["cached_blocks"] >= 2


def test_concurrent_streams_equal_each_request_alone(server, client):
    """8 streaming clients at once (continuous batching in one engine loop) = each request served alone;
    greedy and seeded sampling."""
    def args(i):
        return dict(model=MODEL, prompt=PROMPTS[i], max_tokens=12 + i, temperature=0 if i % 2 else 0.8, seed=i,
                    top_p=0.9)

    alone = [client.completions.create(**args(i)).choices[0].text for i in range(8)]

    async def together():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(i):
            parts = []
            async for chunk in await aclient.completions.create(stream=True, **args(i)):
                parts.extend(c.text for c in chunk.choices)
            return "".join(parts)

        try:
            return await asyncio.gather(*(one(i) for i in range(8)))
        finally:
            await aclient.close()

    assert asyncio.run(together()) == alone
    assert server.health()["steps"] > 0
    server.wait_idle()


def test_disconnect_cancels_and_frees_pages(server):
    body = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 120, "temperature": 0, "ignore_eos": True,
            "stream": True}
    steps = server.wait_idle()["steps"]
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["text"]
            assert server.health()["in_flight"] == 1
        # the connection is closed here, after one chunk of 120 tokens
    h = server.wait_idle(timeout=20)
    assert h["free_blocks"] == h["total_blocks"]
    # cancelled, not finished: far fewer engine steps than the 120 the request would have taken
    assert h["steps"] - steps < 60, (steps, h)
    # a non-streaming request whose client gives up is cancelled too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=0.1)
    h2 = server.wait_idle(timeout=20)
    assert h2["steps"] - h["steps"] < 110, (h, h2)


def test_full_queue_answers_429(server):
    """20 long requests at once: at most 8 run and 8 wait, so the rest are rejected with 429 and ``Retry-After``;
    nothing leaks."""
    body = {"model": MODEL, "prompt": "w1", "max_tokens": 120, "temperature": 0, "ignore_eos": True}

    async def burst():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(http.post(server.url + "/v1/completions", json=body) for _ in range(20)))

    answers = asyncio.run(burst())
    codes = [r.status_code for r in answers]
    rejected = [r for r in codes if r == 429]
    assert set(codes) <= {200, 429} and len(rejected) >= 4 and codes.count(200) >= 8, codes
    assert all(r.headers["retry-after"] == "1" for r in answers if r.status_code == 429)
    server.wait_idle(timeout=60)


@pytest.mark.fast
def test_invalid_json_answers_400(server):
    r = httpx.post(server.url + "/v1/completions", content=b'{"model": "tiny-v41", "prompt": ', timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", {"prompt": "w1", "max_tokens": -1}, "max_tokens", "greater than 0"),
    ("/v1/completions", {"prompt": "w1", "max_tokens": "many"}, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "w1", "model": "gpt-4"}, "model", "unknown model 'gpt-4'"),
    ("/v1/completions", {"prompt": " ".join(["w1"] * CAPACITY)}, "prompt", f"capacity is {CAPACITY}"),
    ("/v1/completions", {"prompt": "w1", "max_tokens": CAPACITY}, "max_tokens", "beyond the capacity"),
    ("/v1/completions", {"prompt": [5, 256, 7]}, "prompt", "token id 256 is outside the vocabulary"),
    ("/v1/completions", {"prompt": "w1", "temperature": -0.5}, "temperature", "greater than or equal to 0"),
    ("/v1/completions", {"prompt": "w1", "top_p": 1.5}, "top_p", "less than or equal to 1"),
    ("/v1/completions", {"prompt": "w1", "stop": ["a", "b", "c", "d", "e"]}, "stop", "up to 4"),
    ("/v1/completions", {"prompt": "w1", "n": 0}, "n", "greater than or equal to 1"),
    ("/v1/completions", {"prompt": "w1", "n": 3, "best_of": 2}, "best_of", "at least n"),
    ("/v1/completions", {"prompt": "w1", "best_of": 2, "stream": True}, "best_of", "not with stream"),
    ("/v1/completions", {"prompt": [[5], [7, 256]]}, "prompt", "prompt[1]: token id 256"),
    ("/v1/completions", {"prompt": [[5], []]}, "prompt", "prompt[1]: the prompt is empty"),
    ("/v1/completions", {"prompt": ["w1"] * 3, "n": 3}, "prompt", "more than the server queues at once (8"),
    ("/v1/completions", {}, "prompt", "Field required"),
    ("/v1/completions", {"prompt": 5}, "prompt", "valid string"),
    ("/v1/completions", {"prompt": "w1", "seed": -1}, "seed", "greater than or equal to 0"),
    ("/v1/completions", {"prompt": "w1", "tools": [{"type": "function"}]}, "tools", "not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "w1"}]}, "messages", "messages[0].role"),
    ("/v1/chat/completions", {"messages": []}, "messages", "non-empty"),
])
def test_bad_fields_answer_400_naming_the_field(server, path, body, param, words):
    before = server.wait_idle()
    r = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    after = server.wait_idle()
    assert after["free_blocks"] == before["free_blocks"] and after["steps"] == before["steps"]


@pytest.mark.parametrize("content, ctype, status, words", [
    (b'{"model": "tiny-v41", "prompt": "w1", "max_tokens": 2}', "application/x-www-form-urlencoded", 415,
     "application/x-www-form-urlencoded"),                                 # what `curl -d` sends
    (b'{"model": "tiny-v41", "prompt": "w1", "max_tokens": 2}', "text/plain", 415, "text/plain"),
    (b'{"model": "tiny-v41", "prompt": "w1"}', "application/json; charset=latin-1", 415, "latin-1"),
    (b'{"model": "tiny-v41", "prompt": "\xff w1"}', "application/json", 400, "not UTF-8"),
    (b'[{"model": "tiny-v41", "prompt": "w1"}]', "application/json", 400, "got a JSON array"),
    (b'"w1"', "application/json", 400, "got a JSON string"),
    (b'[' * 200_000 + b']' * 200_000, "application/json", 400, "nested more than 32 levels"),
    (b'{"model": "tiny-v41", "prompt": "w1", "x": ' + b'{"a": ' * 40 + b'1' + b'}' * 41, "application/json", 400,
     "nested more than 32 levels"),
    (b'{"model": "tiny-v41", "prompt": "w1", "temperature": NaN}', "application/json", 400, "NaN is not a JSON number"),
    (b'{"model": "tiny-v41", "prompt": "' + b'w1 ' * 12_000_000 + b'"}', "application/json", 413, "more than the 33554432"),
    (b'', "application/json", 400, "not valid JSON"),
])
def test_bodies_that_are_not_a_json_object_answer_4xx(server, content, ctype, status, words):
    """Whatever the body and its media type, the answer is a 4xx in the API's error shape saying what is wrong."""
    before = server.wait_idle()
    r = httpx.post(server.url + "/v1/completions", content=content, headers={"content-type": ctype}, timeout=60)
    assert r.status_code == status and words in r.json()["error"]["message"], (r.status_code, r.text[:300])
    assert r.json()["error"]["code"] == status
    after = server.wait_idle()
    assert after["free_blocks"] == before["free_blocks"] and after["steps"] == before["steps"]


def test_routes_and_methods_answer_in_the_error_shape(server):
    r = httpx.get(server.url + "/v1/completions", timeout=30)
    assert r.status_code == 405 and "GET is not allowed" in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": "w1"}, timeout=30)
    assert r.status_code == 404 and "/v1/embeddings" in r.json()["error"]["message"], r.text
    # no Content-Type at all: read as JSON (what FastAPI and the OpenAI API do)
    r = httpx.post(server.url + "/v1/completions", content=json.dumps({"model": MODEL, "prompt": "w1",
                                                                       "max_tokens": 2}).encode(), timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2, r.text


def _fuzz_requests():
    """(route, media type, body) as clients get them wrong: arbitrary bytes and JSON values, objects whose keys are
    the schemas' fields (and unknown ones) with values of any JSON type, and near-valid requests for each route
    (mostly valid values, a few output tokens) that reach the engine's own checks and run."""
    from hypothesis import strategies as st

    from v41cp.serving.api.protocol import ChatCompletionRequest, CompletionRequest

    routes = st.sampled_from(["/v1/completions", "/v1/chat/completions"])
    ctypes = st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain",
                              "multipart/form-data", "application/vnd.api+json", ""])
    keys = sorted({*CompletionRequest.model_fields, *ChatCompletionRequest.model_fields, "guided_json", "x"} - {"model"})
    scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20)
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8),
                                                                                           inner, max_size=4),
                          max_leaves=12)
    objects = st.fixed_dictionaries({"model": st.sampled_from([MODEL, "other"])}, optional={k: values for k in keys})
    anything = st.tuples(routes, ctypes, st.binary(max_size=200) | (values | objects).map(lambda v: json.dumps(v).encode()))

    def mostly(valid):                      # a valid value three times in four
        return st.one_of(valid, valid, valid, scalars)

    words = st.lists(st.sampled_from(["w1", "W2", "x200", "<eos>", "zz", "é", " "]), max_size=6).map(" ".join)
    optional = {"temperature": mostly(st.floats(0, 2)), "top_p": mostly(st.floats(0.01, 1)),
                "seed": mostly(st.integers(0, 2**63 - 1)), "stop": mostly(st.text(max_size=3)),
                "n": mostly(st.just(1)), "top_k": mostly(st.sampled_from([-1, 0])), "stream": st.booleans(),
                "ignore_eos": st.booleans()}
    common = {"model": st.just(MODEL), "max_tokens": st.integers(-1, 3)}
    completion = st.fixed_dictionaries({**common, "prompt": mostly(words | st.lists(st.integers(-3, 260), max_size=8))},
                                       optional={**optional, "best_of": mostly(st.just(1)), "echo": st.booleans()})
    message = st.fixed_dictionaries({"role": mostly(st.sampled_from(["user", "system", "assistant"])),
                                     "content": mostly(words)})
    chat = st.fixed_dictionaries({**common, "messages": st.lists(message, max_size=3)},
                                 optional={**optional, "add_generation_prompt": st.booleans()})
    near = (st.tuples(st.just("/v1/completions"), st.just("application/json"), completion.map(lambda d: json.dumps(d).encode()))
            | st.tuples(st.just("/v1/chat/completions"), st.just("application/json"), chat.map(lambda d: json.dumps(d).encode())))
    return anything | near


def test_fuzzed_bodies_never_answer_5xx(server):
    """Generated bodies (hypothesis) against the live server: never a 5xx; every 4xx in the error shape; every page
    back afterwards."""
    from hypothesis import HealthCheck, example, given, settings

    before = server.wait_idle()
    seen = {}
    # served requests, run first whatever the generator draws (the share of generated ones that run varies)
    valid = [("/v1/completions", {"prompt": "w1 <eos> W2", "max_tokens": 2, "stream": True, "n": 1, "top_k": -1}),
             ("/v1/completions", {"prompt": [5, 1, 7], "max_tokens": 1, "best_of": 1, "echo": False}),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "é w1"}], "max_tokens": 3,
                                       "temperature": 1.5, "seed": 9, "add_generation_prompt": False}),
             ("/v1/chat/completions", {"messages": [{"role": "system", "content": ""},
                                                    {"role": "user", "content": [{"type": "text", "text": "w2"}]}],
                                       "max_tokens": 2, "stop": "w", "stream": True})]
    with httpx.Client(timeout=60) as http:
        def fuzzed(request):
            route, ctype, body = request
            r = http.post(server.url + route, content=body, headers={"content-type": ctype} if ctype else {})
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (route, ctype, body[:200], r.text[:300])
            if r.status_code >= 400:
                err = r.json()["error"]
                assert err["code"] == r.status_code and err["message"], r.text

        for route, body in valid:
            fuzzed = example(request=(route, "application/json", json.dumps({"model": MODEL, **body}).encode()))(fuzzed)
        one = settings(max_examples=300, deadline=None, database=None, derandomize=True,
                       suppress_health_check=list(HealthCheck))(given(request=_fuzz_requests())(fuzzed))
        one()
    assert seen.get(200, 0) >= len(valid) and seen.get(400, 0) > 50 and seen.get(415, 0) > 0, seen
    after = server.wait_idle()
    assert after["free_blocks"] == before["free_blocks"] == after["total_blocks"]


# Every field of the OpenAI SDK's two request schemas, and the extensions clients of vLLM / SGLang send: the fields
# this server honours (their values here are served: 200), and a value that would change the request for every
# other field (answered 400 naming it). Values that mean "no change" are served.
HONOURED = {
    "completions": {"model": MODEL, "prompt": "w1 w2", "max_tokens": 2, "temperature": 0, "top_p": 0.9, "seed": 3,
                    "stop": ["w99"], "stream": False, "stream_options": {"include_usage": True}, "ignore_eos": True,
                    "return_token_ids": True, "top_k": 5, "min_p": 0.1, "stop_token_ids": [5], "logprobs": 2,
                    "echo": True, "n": 2, "best_of": 3, "logit_bias": {"5": 10}, "min_tokens": 1,
                    "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.2},
    "chat": {"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2,
             "max_completion_tokens": 2, "temperature": 0, "top_p": 0.9, "seed": 3, "stop": "w99", "stream": False,
             "stream_options": {"include_usage": True}, "ignore_eos": True, "return_token_ids": True,
             "add_generation_prompt": False, "top_k": 5, "min_p": 0.1, "stop_token_ids": [5], "logprobs": True,
             "top_logprobs": 2, "n": 2, "logit_bias": {"5": 10}, "min_tokens": 1, "frequency_penalty": 0.5,
             "presence_penalty": -0.5, "repetition_penalty": 1.2, "chat_template_kwargs": {"thinking": True}},
}
NEEDS = {"top_logprobs": {"logprobs": True}}            # a field honoured only with another
CHANGING = {
    "suffix": "w1", "user": "u1", "audio": {"voice": "alloy", "format": "wav"},
    "function_call": "auto", "functions": [{"name": "f"}], "metadata": {"k": "v"}, "modalities": ["text", "audio"],
    "parallel_tool_calls": True, "prediction": {"type": "content", "content": "w1"}, "prompt_cache_key": "k",
    "reasoning_effort": "low", "response_format": {"type": "json_object"}, "safety_identifier": "s",
    "service_tier": "auto", "store": True, "tool_choice": "auto",
    "tools": [{"type": "function", "function": {"name": "f"}}], "verbosity": "low",
    "web_search_options": {},
    "structured_outputs": {"json": {}}, "guided_json": {"type": "object"}, "guided_regex": "w1",
    "guided_choice": ["w1"], "prompt_logprobs": 1, "include_stop_str_in_output": True, "skip_special_tokens": False,
    "chat_template_kwargs": {"thinking": True}, "priority": 1,
}
NO_CHANGE = {"n": 1, "best_of": 1, "logprobs": None, "echo": False, "top_k": -1, "min_p": 0, "repetition_penalty": 1,
             "presence_penalty": 0, "frequency_penalty": 0.0, "stop_token_ids": [], "min_tokens": 0, "logit_bias": {},
             "response_format": {"type": "text"}}


def _schema_fields(kind: str) -> list[str]:
    from openai.types import completion_create_params as cp
    from openai.types.chat import completion_create_params as ccp

    sdk = (cp if kind == "completions" else ccp).CompletionCreateParamsBase.__annotations__
    return sorted({*sdk, "stream", *HONOURED[kind], *CHANGING})


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_every_request_field_is_honoured_or_refused_by_name(server, kind):
    path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
    base = {k: v for k, v in HONOURED[kind].items() if k in ("model", "prompt", "messages", "max_tokens")}
    before = server.wait_idle()
    with httpx.Client(timeout=60) as http:
        for name in _schema_fields(kind):
            if name in HONOURED[kind]:
                r = http.post(server.url + path, json={**base, **NEEDS.get(name, {}), name: HONOURED[kind][name]})
                assert r.status_code == 200, (name, r.text)
                continue
            value = CHANGING.get(name, {"v41cp-probe": 1})       # a field a newer SDK added: any value changes it
            r = http.post(server.url + path, json={**base, name: value})
            assert r.status_code == 400, (name, r.status_code, r.text)
            err = r.json()["error"]
            assert err["param"] == name and name in err["message"] and "not supported" in err["message"], (name, err)
        neutral = {k: v for k, v in NO_CHANGE.items() if kind == "completions" or k not in ("best_of", "echo")}
        plain = http.post(server.url + path, json={**base, "temperature": 0})
        same = http.post(server.url + path, json={**base, "temperature": 0, **neutral})
        assert plain.status_code == same.status_code == 200, same.text
        assert same.json()["choices"][0] == plain.json()["choices"][0]
    after = server.wait_idle()
    assert after["free_blocks"] == before["free_blocks"]


def test_sampling_controls_have_their_effect(server, client, codec):
    """``top_k: 1`` and ``min_p`` near 1 at temperature 1 sample the greedy tokens; ``stop_token_ids`` ends the
    request at the first of them (finish reason ``stop``, the id kept in the ids, hidden from the text); ``logit_bias``
    forces (+100) and bans (−100) tokens; ``min_tokens`` holds a stop id back; with presence, frequency and
    repetition penalties each greedy token is the argmax of the penalized logits (as vLLM defines them) of the
    model's full forward; values outside their ranges and ids outside the vocabulary answer 400 naming the field."""
    args = dict(model=MODEL, prompt=PROMPTS[3], max_tokens=8)
    ids = lambda r: r.choices[0].model_extra["token_ids"]
    greedy = client.completions.create(**args, temperature=0, extra_body={"return_token_ids": True,
                                                                          "ignore_eos": True})
    for extra in ({"top_k": 1}, {"min_p": 0.99999}):
        for seed in (1, 2):
            got = client.completions.create(**args, temperature=1.0, seed=seed,
                                            extra_body={"return_token_ids": True, "ignore_eos": True, **extra})
            assert ids(got) == ids(greedy), (extra, seed)
    g = ids(greedy)
    i = next(j for j in range(2, len(g)) if g[j] not in g[:j])           # a token's first occurrence, past the 2nd
    stopped = client.completions.create(**args, temperature=0,
                                        extra_body={"return_token_ids": True, "stop_token_ids": [g[i]]})
    assert ids(stopped) == g[:i + 1] and stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == TextCodec.from_checkpoint(default_checkpoint()).decode(g[:i])
    # logit_bias: +100 on one token makes it every greedy token; -100 on each greedy token makes greedy avoid them
    forced = client.completions.create(**args, temperature=0, logit_bias={"7": 100},
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    assert ids(forced) == [7] * 8
    banned = client.completions.create(**args, temperature=0, logit_bias={str(t): -100 for t in set(g)},
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    assert not set(ids(banned)) & set(g)
    # min_tokens: a stop id that would end the request at once is held back until min_tokens outputs
    first = client.completions.create(**{**args, "max_tokens": 1}, temperature=0, extra_body={"return_token_ids": True})
    held = client.completions.create(**args, temperature=0, extra_body={
        "return_token_ids": True, "stop_token_ids": ids(first), "min_tokens": 3})
    assert len(ids(held)) >= 3 and ids(held)[:3].count(ids(first)[0]) == 0
    # penalties: the argmax of the reference-penalized logits of a full forward over prompt + output, each token
    # (no decision within the FP8 cache's rounding of the logits, scaled by the repetition penalty)
    from v41cp import model
    from v41cp.checkpoint import load

    cfg, params = load(default_checkpoint())
    pen = client.completions.create(**args, temperature=0, frequency_penalty=1.5, presence_penalty=0.4,
                                    extra_body={"return_token_ids": True, "ignore_eos": True,
                                                "repetition_penalty": 1.6})
    out, prompt = ids(pen), codec.encode(PROMPTS[3])
    logits = np.asarray(model.forward(params, cfg, np.asarray([prompt + out])))[0, len(prompt) - 1:-1]
    tol = 2 * 1.6 * 1e-4 * np.abs(logits).max()
    for j, row in enumerate(logits):
        z = penalized_reference(row, prompt, out[:j], presence=0.4, frequency=1.5, repetition=1.6)
        assert z[out[j]] >= z.max() - tol, (j, out)
    assert out != g
    for field, value, words in (("top_k", -2, "greater than or equal to -1"), ("min_p", 1.0, "less than 1"),
                                ("logit_bias", {"5": 101}, "value in [-100, 100]"),
                                ("logit_bias", {"w1": 1}, "keys are token ids"),
                                ("logit_bias", {"\u00b2": 1}, "keys are token ids"),
                                ("logit_bias", {"1": 1, "01": 2}, "appears twice"),
                                ("logit_bias", {"256": 1}, "token id 256 is outside the vocabulary"),
                                ("min_tokens", 17, "min_tokens must be an integer in [0, max_new_tokens=16]"),
                                ("presence_penalty", 2.5, "less than or equal to 2"),
                                ("frequency_penalty", -3, "greater than or equal to -2"),
                                ("repetition_penalty", 0, "greater than 0"),
                                ("stop_token_ids", [5, 256], "token id 256 is outside the vocabulary"),
                                ("stop_token_ids", "w1", "valid array")):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "w1", field: value},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field and words in r.json()["error"]["message"], \
            (field, r.text)
    server.wait_idle()


def test_logprobs_through_the_openai_client(server, client, codec):
    """``logprobs`` (completions) and ``logprobs`` + ``top_logprobs`` (chat), plain and streamed: each token's
    log-probability is the log-softmax of the model's logits for it (the full forward over prompt + output, within
    the cache quantization's rounding), the alternatives are the most likely tokens in order (the chosen one first
    for greedy), a stream carries exactly the plain answer's entries; counts out of range answer 400 naming the
    field."""
    from v41cp import model
    from v41cp.checkpoint import load

    cfg, params = load(default_checkpoint())
    args = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3)
    extra = {"return_token_ids": True, "ignore_eos": True}
    got = client.completions.create(**args, extra_body=extra).choices[0]
    ids, lp = got.model_extra["token_ids"], got.logprobs
    prompt = codec.encode(PROMPTS[1])
    logits = np.asarray(model.forward(params, cfg, np.asarray([prompt + ids])))[0, len(prompt) - 1:-1]
    want = logits - logits.max(-1, keepdims=True)
    want -= np.log(np.exp(want).sum(-1, keepdims=True))
    tol = 1e-4 * np.abs(logits).max()                 # the logits' bound under the FP8 cache (relative 1e-4)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) == 6
    assert np.abs(np.asarray(lp.token_logprobs) - want[np.arange(6), ids]).max() <= tol
    text = lambda t: codec.tokenizer.decode([t], skip_special_tokens=False)
    for j, top in enumerate(lp.top_logprobs):
        order = np.argsort(-want[j], kind="stable")[:3]
        assert list(top) == [text(int(t)) for t in order] and list(top)[0] == lp.tokens[j] == text(ids[j])
        assert np.abs(np.asarray(list(top.values())) - want[j, order]).max() <= tol
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    streamed = list(client.completions.create(**args, stream=True, extra_body=extra))
    joined = [e for c in streamed for ch in c.choices if ch.logprobs for e in zip(
        ch.logprobs.tokens, ch.logprobs.token_logprobs, ch.logprobs.top_logprobs, ch.logprobs.text_offset)]
    assert joined == list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset))

    # the log-likelihood request of evaluation harnesses: the prompt echoed with its log-probabilities
    echo = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=1, temperature=0, logprobs=1,
                                     echo=True).choices[0]
    full = np.asarray(model.forward(params, cfg, np.asarray([prompt])))[0, :-1]
    want = full - full.max(-1, keepdims=True)
    want -= np.log(np.exp(want).sum(-1, keepdims=True))
    n = len(prompt)
    assert echo.text.startswith(PROMPTS[1]) and len(echo.logprobs.tokens) == n + 1
    assert echo.logprobs.token_logprobs[0] is None and echo.logprobs.top_logprobs[0] is None
    assert echo.logprobs.tokens[:n] == [text(t) for t in prompt]
    assert np.abs(np.asarray(echo.logprobs.token_logprobs[1:n]) - want[np.arange(n - 1), prompt[1:]]).max() <= tol
    assert echo.logprobs.token_logprobs[n] == lp.token_logprobs[0]            # the generated token, as without echo
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=1, temperature=0, logprobs=1,
                                              echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echo.text
    assert [x for c in streamed if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs] \
        == echo.logprobs.token_logprobs

    messages = [{"role": "user", "content": PROMPTS[4]}]
    chat = dict(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    c = client.chat.completions.create(**chat, extra_body=extra).choices[0]
    content = c.logprobs.content
    assert len(content) == len(c.model_extra["token_ids"]) == 5
    for item, t in zip(content, c.model_extra["token_ids"]):
        assert item.token == text(t) and bytes(item.bytes) == item.token.encode()
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].token == item.token
        assert item.top_logprobs[0].logprob == item.logprob >= item.top_logprobs[1].logprob
    streamed = list(client.chat.completions.create(**chat, stream=True, extra_body=extra))
    assert [x for ch in streamed for c in ch.choices if c.logprobs for x in c.logprobs.content] == content
    assert client.chat.completions.create(**{**chat, "logprobs": False, "top_logprobs": None}).choices[0].logprobs \
        is None
    for path, body, param in (("/v1/completions", {"prompt": "w1", "logprobs": 21}, "logprobs"),
                              ("/v1/completions", {"prompt": "w1", "logprobs": -1}, "logprobs"),
                              ("/v1/chat/completions", {"messages": messages, "top_logprobs": 2}, "top_logprobs"),
                              ("/v1/chat/completions", {"messages": messages, "logprobs": True, "top_logprobs": 21},
                               "top_logprobs")):
        r = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    server.wait_idle()


def test_evaluation_harness_and_benchmark_client_requests(server, codec):
    """The requests two standard clients send, as they send them (reproduced with httpx: neither is installed here).
    An evaluation harness's log-likelihood task (lm-evaluation-harness's ``local-completions``): several token-id
    prompts (context + continuation) in one request, ``max_tokens`` 1, ``logprobs`` 1, ``echo``, ``temperature``
    0, ``seed`` 1234 — each continuation's summed log-probability equals the full forward's and its greedy flag
    (the top alternative is the token at every continuation position) is the forward's argmax. A serving
    benchmark's streamed completion (vLLM's ``bench serve``, openai-completions backend: ``repetition_penalty``
    1.0, ``logprobs`` null, ``best_of`` 1, ``stream_options.include_usage``, ``ignore_eos``): every requested token
    arrives as text, then a usage chunk, then ``[DONE]``."""
    from v41cp import model
    from v41cp.checkpoint import load

    cfg, params = load(default_checkpoint())
    pairs = [(PROMPTS[1], " w2 w3"), (PROMPTS[4], " w7"), ("w1", " x200 W4 w9")]
    contexts = [codec.encode(c) for c, _ in pairs]
    whole = [codec.encode(c + x) for c, x in pairs]
    assert all(w[:len(c)] == c for c, w in zip(contexts, whole))
    body = {"model": MODEL, "prompt": whole, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for ctx, ids, choice in zip(contexts, whole, choices, strict=True):
        lp = choice["logprobs"]
        n = len(ctx)
        summed = sum(lp["token_logprobs"][n:-1])                          # the harness's parse: [ctxlen:-1]
        greedy = all(max(top, key=top.get) == tok for tok, top in zip(lp["tokens"][n:-1], lp["top_logprobs"][n:-1]))
        logits = np.asarray(model.forward(params, cfg, np.asarray([ids])), np.float64)[0]
        want = logits - logits.max(-1, keepdims=True)
        want -= np.log(np.exp(want).sum(-1, keepdims=True))
        cont = np.arange(n - 1, len(ids) - 1)                              # the rows predicting the continuation
        tol = 1e-4 * np.abs(logits).max() * len(cont)   # the cache quantization's rounding, as the logprobs test
        assert abs(summed - want[cont, np.asarray(ids)[cont + 1]].sum()) <= tol
        assert min(top_gap(logits[i]) for i in cont) > 1e-3             # (no near-tie for the greedy flag)
        assert greedy == bool((want[cont].argmax(-1) == np.asarray(ids)[cont + 1]).all())

    bench = {"model": MODEL, "prompt": PROMPTS[3], "temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 9,
             "logprobs": None, "best_of": 1, "stream": True, "stream_options": {"include_usage": True},
             "ignore_eos": True}
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json=bench, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9
    assert chunks[-1]["usage"]["prompt_tokens"] == len(codec.encode(PROMPTS[3]))
    assert len(codec.encode(text)) <= 9 and text.strip()
    server.wait_idle()


def test_n_best_of_and_batched_prompts(server, client, codec):
    """Batched prompts (strings, id lists) answer what each prompt answers alone, choice ``i`` for prompt ``i``;
    ``n`` samples of one prompt are the requests with consecutive seeds (plain and streamed alike), and share its
    cached prefix (the prefix cache's reused tokens grow by the later samples' whole blocks); ``best_of`` returns the
    ``n`` of its samples with the highest cumulative log-probability; usage counts a prompt once."""
    args = dict(model=MODEL, max_tokens=4, extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = lambda c: c.model_extra["token_ids"]
    alone = [client.completions.create(prompt=p, temperature=0, **args).choices[0] for p in PROMPTS[:3]]
    for prompt in (PROMPTS[:3], [codec.encode(p) for p in PROMPTS[:3]]):
        batch = client.completions.create(prompt=prompt, temperature=0, **args)
        assert [c.index for c in batch.choices] == [0, 1, 2]
        assert [ids(c) for c in batch.choices] == [ids(c) for c in alone]
        assert batch.usage.prompt_tokens == sum(len(codec.encode(p)) for p in PROMPTS[:3])

    long = " ".join(f"w{i}" for i in range(1, 41))          # a prompt no test sent before: nothing cached
    before = server.wait_idle()["prefix_cache"]["hit_tokens"]
    three = client.completions.create(prompt=long, temperature=1.0, seed=5, n=3, **args)
    reused = server.wait_idle()["prefix_cache"]["hit_tokens"] - before
    assert reused == 2 * ((len(codec.encode(long)) - 1) // 16 * 16)      # samples 2 and 3 reuse the 1st's blocks
    seeded = [client.completions.create(prompt=long, temperature=1.0, seed=5 + j, logprobs=0, **args).choices[0]
              for j in range(3)]
    assert [ids(c) for c in three.choices] == [ids(c) for c in seeded]
    assert len({tuple(ids(c)) for c in three.choices}) > 1
    assert three.usage.prompt_tokens == len(codec.encode(long)) and three.usage.completion_tokens == 12
    streamed = client.completions.create(prompt=long, temperature=1.0, seed=5, n=3, stream=True,
                                         stream_options={"include_usage": True}, **args)
    texts, usage = ["", "", ""], None
    for chunk in streamed:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in three.choices]
    assert usage.prompt_tokens == three.usage.prompt_tokens and usage.completion_tokens == 12
    best = client.completions.create(prompt=long, temperature=1.0, seed=5, n=2, best_of=3, **args)
    score = [sum(c.logprobs.token_logprobs) for c in seeded]
    top = sorted(sorted(range(3), key=lambda j: -score[j])[:2])
    assert [ids(c) for c in best.choices] == [ids(seeded[j]) for j in top] and best.choices[0].logprobs is None
    chat = dict(model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=3, temperature=1.0,
                extra_body={"return_token_ids": True, "ignore_eos": True})
    two = client.chat.completions.create(**chat, seed=5, n=2)
    one = [client.chat.completions.create(**chat, seed=5 + j).choices[0] for j in range(2)]
    assert [c.index for c in two.choices] == [0, 1] and [ids(c) for c in two.choices] == [ids(c) for c in one]
    assert two.usage.completion_tokens == 6
    server.wait_idle()


def test_add_generation_prompt_is_honoured(server, codec):
    messages = [{"role": "user", "content": "w1 w2"}]
    for flag in (True, False):
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1,
                                                                 "add_generation_prompt": flag}, timeout=60)
        assert r.json()["usage"]["prompt_tokens"] == len(codec.chat_ids(messages, flag)), (flag, r.text)
    assert len(codec.chat_ids(messages, True)) == len(codec.chat_ids(messages, False)) + 1


def _concurrent_equal_one_device(url: str, client, indices, max_tokens: int) -> None:
    """Concurrent greedy completions of ``PROMPTS[indices]`` against the server at ``url`` give the one-device
    server's (``client``) token ids, text and log-probabilities (2 alternatives; within the layouts' rounding)."""
    async def concurrent():
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=180)
        return await asyncio.gather(*[aclient.completions.create(
            model=MODEL, prompt=PROMPTS[i], max_tokens=max_tokens, temperature=0, logprobs=2,
            extra_body={"return_token_ids": True, "ignore_eos": True}) for i in indices])

    for i, got in zip(indices, asyncio.run(concurrent())):
        one = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=max_tokens, temperature=0,
                                        logprobs=2, extra_body={"return_token_ids": True, "ignore_eos": True})
        assert got.choices[0].model_extra["token_ids"] == one.choices[0].model_extra["token_ids"]
        assert got.choices[0].text == one.choices[0].text
        a, b = got.choices[0].logprobs, one.choices[0].logprobs
        assert a.tokens == b.tokens and [list(t) for t in a.top_logprobs] == [list(t) for t in b.top_logprobs]
        assert np.allclose(a.token_logprobs, b.token_logprobs, atol=1e-4, rtol=0)


def test_pd_server_across_two_processes_equals_one_device(server, client):
    """``serve --prefill-devices 4`` over two processes (4 devices each): the prefill role and HTTP in process 0, the
    decode role in process 1 following rank 0's broadcast submits / cancels; every request's pages and slot state
    cross by the transfer collective. Concurrent requests answer what the one-device server answers; a client that
    disconnects cancels its request where its role holds it (every page back on both roles). Then the follower is
    killed mid-stream: rank 0 sees it at once (the next collective fails), ends the stream with an error event naming
    it and ``[DONE]``, answers no more, and exits with status 3 (`EXIT_FOLLOWER_LOST`) — nothing waits forever.
    (A clean exit of both processes on SIGTERM: the KVP = DCP = 8 test below.)"""
    import time

    from v41cp.serving.api.server import EXIT_FOLLOWER_LOST

    pd = ServerProcess("--max-batch", "4", "--max-context", str(CAPACITY), "--prefill-devices", "4",
                       "--max-prefill-tokens", "16", devices=4, nnodes=2)
    try:
        _concurrent_equal_one_device(pd.url, client, (0, 1, 3), max_tokens=10)
        body = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 100, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", pd.url + "/v1/completions", json=body) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
        h = pd.wait_idle(timeout=60)
        assert h["free_blocks"] == h["total_blocks"]
        assert h["prefill"]["free_blocks"] == h["prefill"]["total_blocks"]
        events = []
        with httpx.Client(timeout=60) as http, http.stream("POST", pd.url + "/v1/completions",
                                                           json={**body, "max_tokens": 120}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 2:                   # the stream is running: the decode process dies
                    pd.followers[0].kill()
        t0 = time.monotonic()
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
        assert "follower process" in json.loads(events[-2])["error"]["message"]
        assert pd.proc.wait(timeout=60) == EXIT_FOLLOWER_LOST, pd.output()[-3000:]
        assert time.monotonic() - t0 < 60
        assert "follower process is gone" in pd.output()
    finally:
        pd.stop()


def test_kvp_dcp8_server_across_two_processes_equals_one_device(server, client):
    """A KVP = DCP = 8 server over two processes (`jax.distributed` on 127.0.0.1, 4 devices each; rank 0 serves
    HTTP and broadcasts each iteration's submits / cancels, rank 1 follows) answers what the one-device server
    answers, concurrent requests included; a client that disconnects cancels its request on both ranks (the next
    requests still agree); on SIGTERM a request in flight gets an error event and [DONE] (no hang), and both
    processes exit cleanly."""
    # (a 16-row prefill budget: one span-prefill bucket to compile at warm-up across the two processes, not seven)
    dcp = ServerProcess("--max-batch", "8", "--max-context", str(CAPACITY), "--kv-parallel-size", "8",
                        "--decode-context-parallel-size", "8", "--max-prefill-tokens", "16", devices=4, nnodes=2)
    try:
        dclient = openai.OpenAI(base_url=dcp.url + "/v1", api_key="unused", max_retries=0, timeout=180)

        def both(i, max_tokens=12):
            args = dict(model=MODEL, prompt=PROMPTS[i], max_tokens=max_tokens, temperature=0,
                        extra_body={"return_token_ids": True, "ignore_eos": True})
            return client.completions.create(**args), dclient.completions.create(**args)

        _concurrent_equal_one_device(dcp.url, client, (0, 3, 4), max_tokens=12)
        body = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 100, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", dcp.url + "/v1/completions", json=body) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
        h = dcp.wait_idle(timeout=60)            # cancelled on rank 0; rank 1 applied the broadcast cancel
        assert h["free_blocks"] == h["total_blocks"]
        one, two = both(1)
        assert two.choices[0].model_extra["token_ids"] == one.choices[0].model_extra["token_ids"]
        events = []
        with httpx.Client(timeout=60) as http, http.stream("POST", dcp.url + "/v1/completions",
                                                           json={**body, "prompt": "w1"}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 2:
                    dcp.proc.terminate()
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["message"] == "the server is shutting down"
        assert dcp.proc.wait(30) in CLEAN_EXIT, dcp.output()[-3000:]
        assert dcp.stop() in CLEAN_EXIT, dcp.output()[-3000:]        # and the follower exited with 0
    finally:
        dcp.stop()
