"""The server's operational endpoints and headers, in process (the FastAPI app over a real engine loop on the tiny
checkpoint, through httpx): ``/metrics`` parsed by prometheus-client's own parser with counters that move as
requests end, ``--api-key``, ``X-Request-Id``, ``/tokenize`` / ``/detokenize`` (vLLM's shapes),
``GET /v1/models/{id}``, ``HEAD /health``. (The live-server tests in `tests/e2e/test_server.py` check ``Retry-After``
on 429 and the request id over a real socket.)"""

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from v41cp.checkpoint import default_checkpoint, load
from v41cp.serving.api.app import build_app
from v41cp.serving.api.engine_loop import EngineLoop
from v41cp.serving.api.text import TextCodec
from v41cp.serving.engine import Capacity, Engine

pytestmark = pytest.mark.fast           # the developer tier (`pytest -m fast`)

MODEL, KEY = "tiny-v41", "sk-test-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def api():
    cfg, params = load(default_checkpoint())
    loop = EngineLoop(Engine(params, cfg, Capacity(max_batch=2, max_tokens=64))).start()
    codec = TextCodec.from_checkpoint(default_checkpoint())
    with TestClient(build_app(loop, codec, MODEL, api_key=KEY)) as http:
        yield http, codec
    loop.shutdown(join=True)


def _metrics(http) -> dict:
    """``{(sample name, sorted labels without model_name): value}`` of ``/metrics`` (no key needed)."""
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            if s.labels.get("model_name") not in (None, MODEL):
                raise AssertionError(f"{s.name} has model_name {s.labels.get('model_name')!r}")
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def _idle(http) -> dict:
    import time

    for _ in range(200):
        h = http.get("/health").json()
        if h["running"] == 0 and h["waiting"] == 0 and h["in_flight"] == 0:
            return h
        time.sleep(0.05)
    raise AssertionError(f"the server did not go idle: {h}")


def test_metrics_move_as_requests_end(api):
    """Two greedy 4-token completions (one streamed) and one repeated prompt: the request, token, latency and
    prefix-cache series move by exactly what they served; the gauges read an idle engine."""
    http, codec = api
    before = _metrics(http)
    prompt = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18"
    n_prompt = len(codec.encode(prompt))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=AUTH) as s:
        assert s.status_code == 200
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    _idle(http)
    after = _metrics(http)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert moved("vllm:request_success_total", finished_reason="length") == 2
    assert moved("vllm:prompt_tokens_total") == 2 * n_prompt
    assert moved("vllm:generation_tokens_total") == 8
    assert moved("vllm:time_to_first_token_seconds_count") == 2
    assert moved("vllm:inter_token_latency_seconds_count") == 6                # 3 gaps per 4-token request
    assert moved("vllm:e2e_request_latency_seconds_count") == 2
    assert moved("vllm:e2e_request_latency_seconds_sum") > 0
    assert after[("vllm:num_requests_running", ())] == after[("vllm:num_requests_waiting", ())] == 0
    assert after[("vllm:kv_cache_usage_perc", ())] == 0.0                      # cached blocks count as free
    # the repeated prompt found its whole blocks in the prefix cache (prefix caching is on by default)
    assert moved("vllm:prefix_cache_queries_total") == 2 * n_prompt
    assert 0 < moved("vllm:prefix_cache_hits_total") < n_prompt
    assert ("vllm:num_preemptions_total", ()) in after


def test_api_key_guards_the_api_routes(api):
    """``--api-key``: the /v1 and tokenizer routes answer 401 in the error shape without the key or with a wrong one
    (any scheme but Bearer too); /health and /metrics stay open."""
    http, _ = api
    body = {"model": MODEL, "prompt": "w1", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": f"Bearer {KEY}x"}):
        for method, path, kw in (("POST", "/v1/completions", {"json": body}), ("GET", "/v1/models", {}),
                                 ("POST", "/tokenize", {"json": {"prompt": "w1"}})):
            r = http.request(method, path, headers=headers, **kw)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["param"] == "Authorization" and r.headers["www-authenticate"] == "Bearer"
    assert http.get("/v1/models", headers=AUTH).status_code == 200
    assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
    with pytest.raises(ValueError, match="empty key"):
        build_app(None, None, MODEL, api_key="")


def test_request_id_is_returned(api):
    """``X-Request-Id``: the client's comes back on success and on errors; without one a fresh id is made; an
    unusable one (too long, control characters) answers 400 naming the header."""
    http, _ = api
    r = http.get("/v1/models", headers={**AUTH, "X-Request-Id": "req-42"})
    assert r.headers["x-request-id"] == "req-42"
    r = http.get("/v1/models/nope", headers={**AUTH, "X-Request-Id": "req-43"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "req-43"
    a, b = http.get("/health").headers["x-request-id"], http.get("/health").headers["x-request-id"]
    assert a and b and a != b
    r = http.get("/health", headers={"X-Request-Id": "x" * 129})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"


def test_tokenize_and_detokenize(api):
    """vLLM's shapes: ``/tokenize`` of a prompt (special tokens or not, token strings on request) and of chat
    messages (the chat format's ids), ``/detokenize`` back; exactly one of prompt / messages; ids outside the
    vocabulary and an unknown model answer 400 naming the field."""
    http, codec = api
    r = http.post("/tokenize", json={"prompt": "w1 W2 x255"}, headers=AUTH).json()
    assert r == {"count": 3, "max_model_len": 64, "tokens": codec.encode("w1 W2 x255"), "token_strs": None}
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "w1 W2", "add_special_tokens": False,
                                     "return_token_strs": True}, headers=AUTH).json()
    assert r["tokens"] == codec.encode("w1 W2", add_special_tokens=False) and r["token_strs"] == ["w1", "W2"]
    msgs = [{"role": "user", "content": "w1 w2"}]
    r = http.post("/tokenize", json={"messages": msgs}, headers=AUTH).json()
    assert r["tokens"] == codec.chat_ids(msgs, True) and r["count"] == len(r["tokens"])
    r = http.post("/detokenize", json={"tokens": codec.encode("w7 W8 x255")}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"prompt": "w7 W8 x255"}
    for path, body, param in (("/tokenize", {"prompt": "w1", "messages": msgs}, "prompt"),
                              ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "w1", "model": "gpt-4"}, "model"),
                              ("/tokenize", {"prompt": "w1", "echo": True}, "echo"),
                              ("/detokenize", {"tokens": [5, 256]}, "tokens"),
                              ("/detokenize", {"tokens": "w1"}, "tokens")):
        r = http.post(path, json=body, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)


def test_model_card_and_head_health(api):
    http, _ = api
    r = http.get(f"/v1/models/{MODEL}", headers=AUTH)
    assert r.status_code == 200 and r.json()["id"] == MODEL and r.json()["max_model_len"] == 64
    r = http.get("/v1/models/other-model", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = http.head("/health")
    assert r.status_code == 200 and r.content == b""


def test_a_follower_that_stops_answering_ends_the_requests_in_flight():
    """The engine loop's watchdog: a control plane whose exchange stops returning (a follower process that hangs —
    here its exchange blocks after the first iterations) is given up after ``follower_timeout``; the request in
    flight gets an error event naming the cause, ``on_fatal`` is called once, and no new request is taken. (A
    follower that dies: `tests/e2e/test_server.py::test_pd_server_across_two_processes_equals_one_device`.)"""
    import asyncio
    import threading
    import time

    from v41cp.serving.api.engine_loop import LoopClosed
    from v41cp.serving.engine import SamplingParams

    class HangingFollowers:
        leader, calls, hang = True, 0, threading.Event()

        def exchange(self, commands):
            self.calls += 1
            if self.calls > 3:                   # the followers stop answering
                self.hang.wait()

    cfg, params = load(default_checkpoint())
    fatal = []
    loop = EngineLoop(Engine(params, cfg, Capacity(max_batch=2, max_tokens=64)), control=HangingFollowers(),
                      follower_timeout=1.0, on_fatal=fatal.append).start()

    async def run():
        handle = await loop.submit([5, 6, 7], SamplingParams(max_new_tokens=40, stop_on_eos=False))
        t0 = time.monotonic()
        events = [ev async for ev in handle]
        return events, time.monotonic() - t0

    events, waited = asyncio.run(run())
    assert events[-1].error is not None and "stopped answering: no exchange within 1 s" in events[-1].error
    deadline = time.monotonic() + 10                  # on_fatal follows the error events
    while not fatal and time.monotonic() < deadline:
        time.sleep(0.05)
    assert waited < 120 and fatal == [events[-1].error] and not loop.alive      # (the first step compiles)
    with pytest.raises(LoopClosed):
        asyncio.run(loop.submit([5], SamplingParams(max_new_tokens=1)))
    HangingFollowers.hang.set()


def test_a_loop_that_dies_under_a_control_plane_ends_the_server():
    """Any other failure of the engine loop across processes (here the exchange raises a ``BaseException`` the loop
    does not take for a lost follower) also calls ``on_fatal``: the followers would wait in the next exchange
    forever, so the server must exit; without a control plane the loop just stops (its callers get the error)."""
    import time

    from v41cp.serving.api.engine_loop import LoopClosed

    class Broken:
        leader = True

        def exchange(self, commands):
            raise SystemExit("the control plane broke")

    cfg, params = load(default_checkpoint())
    fatal = []
    loop = EngineLoop(Engine(params, cfg, Capacity(max_batch=2, max_tokens=64)), control=Broken(),
                      on_fatal=fatal.append).start()
    deadline = time.monotonic() + 30
    while not fatal and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fatal == ["the engine loop stopped: SystemExit: the control plane broke"] and not loop.alive
    import asyncio

    from v41cp.serving.engine import SamplingParams
    with pytest.raises(LoopClosed):
        asyncio.run(loop.submit([5], SamplingParams(max_new_tokens=1)))
