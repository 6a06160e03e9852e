"""The OpenAI endpoints' logic (`OpenAIServing`): a request body → checks → the engine loop → a response or an
event stream. `v41cp.serving.api.app` routes HTTP to these handlers.

Each handler reads its body through `read_request` (`v41cp.serving.api.protocol`: bytes, JSON, schema), checks the
model, the stop strings, the prompt (text through the checkpoint's tokenizer, or ids inside the vocabulary) and the
capacity, submits to the engine loop, and answers with the API's shapes: one JSON body, or server-sent events ending
with ``data: [DONE]``. `TextRun` follows one request's events as text (stop strings; the EOS hidden). A client that
goes away cancels its request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from v41cp.serving.api.engine_loop import EngineLoop, LoopClosed, RequestHandle
from v41cp.serving.api.logprobs import chat_logprobs, completion_logprobs, token_texts
from v41cp.serving.api.metrics import RequestTimer, ServerMetrics
from v41cp.serving.api.protocol import (
    MAX_BODY_BYTES,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestBase,
    TokenizeRequest,
    parse_request,
)
from v41cp.serving.api.structured import grammar_of
from v41cp.serving.api.text import ChatFormatError, TextCodec
from v41cp.serving.engine import EngineFull, RequestError, SamplingParams

__all__ = ["OpenAIServing", "TextRun", "read_request"]


async def read_request(request: Request, schema):
    """The validated request of ``schema`` from ``request``'s body (read up to `MAX_BODY_BYTES`; a longer one is
    refused with 413 before it is read whole)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body has {declared} bytes, more than the {MAX_BODY_BYTES} accepted")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body has more than the {MAX_BODY_BYTES} bytes accepted (at least {size})")
        chunks.append(chunk)
    return parse_request(b"".join(chunks), request.headers.get("content-type"), schema)


def stops_of(req: RequestBase) -> tuple[str, ...]:
    return (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())


def _finish(reason: str | None, stopped: bool) -> str:
    return "stop" if stopped or reason == "eos" else ("length" if reason == "length" else (reason or "stop"))


def _usage(runs: list["TextRun"], prompts: int | None = None) -> dict:
    """The usage of a request's runs: every run's completion tokens; the prompt tokens of each prompt once
    (``prompts``: how many distinct prompts the runs sample, None: every run its own)."""
    if len(runs) == 1:
        return runs[0].usage()
    each = len(runs) // prompts if prompts else 1
    n = sum(len(run.handle.prompt_ids) for run in runs[::each])
    out = sum(len(run.ids) for run in runs)
    return {"prompt_tokens": n, "completion_tokens": out, "total_tokens": n + out,
            "prompt_tokens_details": {"cached_tokens": sum(run.cached for run in runs[::each])}}


def _chat_error(e: ChatFormatError) -> str:
    """A chat-format error as the API's message: prefixed by the field it names, once."""
    text = str(e)
    return text if text.startswith(f"{e.param}:") else f"{e.param}: {text}"


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class TextRun:
    """Text of one request as its events arrive (stop strings; the EOS is hidden from the text)."""

    def __init__(self, handle: RequestHandle, req: RequestBase, codec: TextCodec | None, eos: int,
                 timer: RequestTimer | None = None):
        self.handle, self.req, self.timer = handle, req, timer
        hidden = (() if req.ignore_eos else (eos,)) + tuple(req.stop_token_ids or ())
        self.stream = codec.stream(stops_of(req), hidden=hidden, min_tokens=req.min_tokens) if codec else None
        self.ids: list[int] = []
        self.entries: list = []             # log-probability entries of ``ids`` (when the request asks)
        self.prompt_entries: tuple | None = None    # the prompt's (``prompt_logprobs``), from the first event
        self._taken = 0
        self.reason: str | None = None
        self.error: str | None = None
        self.cached = 0

    async def deltas(self):
        """Yields text deltas (``""`` for a step without new text) until the request ends."""
        async for ev in self.handle:
            self.cached = ev.cached_tokens
            if ev.prompt_logprobs is not None:
                self.prompt_entries = ev.prompt_logprobs
            if ev.error is not None:
                self.error = ev.error
                return
            if self.timer is not None:
                self.timer.tokens_arrived(len(ev.ids))
            for k, t in enumerate(ev.ids):
                if self.stream is not None and self.stream.stopped:
                    break
                self.ids.append(t)
                if ev.logprobs is not None:
                    self.entries.append(ev.logprobs[k])
                yield self.stream.push(t) if self.stream is not None else ""
            if self.stream is not None and self.stream.stopped:
                self.reason = "stop"
                self.handle.cancel()
                break
            if ev.finish_reason is not None:
                self.reason = ev.finish_reason
                break
        if self.stream is not None:
            yield self.stream.finish()
            if self.stream.stopped:
                self.reason = "stop"

    def take_logprobs(self) -> tuple[list[int], list]:
        """The ids and log-probability entries not taken before (a stream's next chunk carries them)."""
        k, self._taken = self._taken, len(self.entries)
        return self.ids[k:self._taken], self.entries[k:self._taken]

    @property
    def finish_reason(self) -> str:
        return _finish(self.reason, self.stream is not None and self.stream.stopped)

    def end(self) -> None:
        """Observe the request's metrics once: ``stop`` / ``length``, or ``abort`` (cancelled, disconnected,
        failed)."""
        if self.timer is not None:
            ended = self.error is None and self.reason not in (None, "cancelled")
            self.timer.finish(self.finish_reason if ended else "abort")

    def usage(self) -> dict:
        n = len(self.handle.prompt_ids)
        return {"prompt_tokens": n, "completion_tokens": len(self.ids), "total_tokens": n + len(self.ids),
                "prompt_tokens_details": {"cached_tokens": self.cached}}


class OpenAIServing:
    """The handlers of the OpenAI routes for ``model_name`` over ``loop`` (``codec``: text in / out; None → token ids
    only)."""

    def __init__(self, loop: EngineLoop, codec: TextCodec | None, model_name: str):
        self.loop, self.codec, self.model_name = loop, codec, model_name
        self.engine = loop.engine
        self.capacity = self.engine.capacity.max_tokens
        self.eos = self.engine.cfg.eos_token_id
        self.created = int(time.time())
        self.metrics = ServerMetrics(model_name, loop.counters)

    def run(self, handle: RequestHandle, req: RequestBase, timer: RequestTimer) -> TextRun:
        return TextRun(handle, req, self.codec, self.eos, timer)

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(400, f"model: unknown model {name!r}; this server serves {self.model_name!r}", "model")

    def prompt_ids(self, prompt, param: str) -> list[int]:
        """One prompt's ids: a string (through the tokenizer) or a list of token ids."""
        if isinstance(prompt, str):
            if self.codec is None:
                raise ApiError(400, f"{param}: this checkpoint has no tokenizer.json; send token ids", param)
            ids = self.codec.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ApiError(400, f"{param}: the prompt is empty", param.split("[")[0])
        bad = self.engine.cfg.out_of_vocabulary(ids)
        if bad:
            raise ApiError(400, f"{param}: {bad}", param.split("[")[0])
        return ids

    def prompt_list(self, prompt, param: str = "prompt") -> list[list[int]]:
        """The prompts of a completions request: one (a string, a list of ids) or a batch (a list of strings, a list
        of id lists)."""
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            return [self.prompt_ids(prompt, param)]
        if not prompt:
            raise ApiError(400, f"{param}: the prompt is empty", param)
        return [self.prompt_ids(p, f"{param}[{i}]") for i, p in enumerate(prompt)]

    def logprobs(self, count: int | None, param: str) -> int | None:
        """A request's log-probability alternatives, checked against the engine's ``max_logprobs``."""
        most = self.engine.capacity.max_logprobs
        if count is not None and count > most:
            raise ApiError(400, f"{param}: at most {most} alternatives (the server's --max-logprobs), got {count}",
                           param)
        return count

    @staticmethod
    def logit_bias(bias: dict | None) -> tuple:
        """``{"token id": value}`` → ``((id, value), …)`` (the engine checks ids and values)."""
        out = []
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ApiError(400, f"logit_bias: keys are token ids, got {key[:40]!r}", "logit_bias")
            out.append((int(key), value))
        if len({t for t, _ in out}) < len(out):
            raise ApiError(400, "logit_bias: a token id appears twice (as keys such as \"1\" and \"01\")",
                           "logit_bias")
        return tuple(out)

    def sampling(self, req: RequestBase, n_prompt: int, max_tokens: int | None, logprobs: int | None = None,
                 prompt_logprobs: int | None = None) -> SamplingParams:
        """The request's sampling parameters; ``max_tokens`` defaults to what the capacity leaves after the prompt.
        Whether the request fits is the scheduler's check (`v41cp.serving.scheduler.request.check_request`)."""
        if max_tokens is None:
            max_tokens = max(self.capacity - n_prompt, 1)
        seed = req.seed if req.seed is not None else random.getrandbits(63)
        return SamplingParams(max_new_tokens=max_tokens,
                              temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p,
                              top_k=max(req.top_k or 0, 0), min_p=req.min_p or 0.0, seed=seed,
                              stop_on_eos=not req.ignore_eos, stop_token_ids=tuple(req.stop_token_ids or ()),
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              logit_bias=self.logit_bias(req.logit_bias), min_tokens=req.min_tokens,
                              presence_penalty=req.presence_penalty or 0.0,
                              frequency_penalty=req.frequency_penalty or 0.0,
                              repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                              grammar=grammar_of(req.response_format, req.structured_outputs))

    def echo_text(self, prompt, ids: list[int]) -> str:
        """An echoed prompt: as sent, or its ids' text."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else (self.codec.decode(ids) if self.codec is not None else "")

    def check_text_fields(self, req: RequestBase) -> None:
        stops = stops_of(req)
        if len(stops) > 4 or any(not s for s in stops):
            raise ApiError(400, f"stop: up to 4 non-empty strings, got {list(stops)!r}", "stop")
        if self.codec is None and stops:
            raise ApiError(400, "stop: stop strings need the checkpoint's tokenizer.json, which it lacks", "stop")

    async def start(self, ids: list[int], sp: SamplingParams, prompt_param: str,
                    grammar_param: str = "response_format") -> RequestHandle:
        try:
            return await self.loop.submit(ids, sp)
        except EngineFull as e:
            raise ApiError(429, f"the request queue is full, retry later ({e})", None, "rate_limit_error",
                           {"Retry-After": "1"})
        except RequestError as e:
            param = {"max_new_tokens": "max_tokens", "prompt": prompt_param, "request_id": None,
                     "prompt_logprobs": "echo", "response_format": grammar_param}.get(e.field, e.field)
            raise ApiError(400, f"{param}: {e.detail}" if param else e.detail, param)
        except LoopClosed as e:
            raise ApiError(503, str(e), None, "server_error")

    async def start_all(self, work: list[tuple[list[int], SamplingParams]], prompt_param: str,
                        req: RequestBase | None = None) -> list[RequestHandle]:
        """Submit every (ids, sampling) of one API request ``req``; if one is refused, the others are cancelled (all
        or nothing) and the refusal answered. More than the queue holds at once can never be served: 400."""
        grammar_param = ("structured_outputs" if req is not None and req.structured_outputs is not None
                         else "response_format")
        most = self.engine.capacity.max_waiting
        if len(work) > most:
            raise ApiError(400, f"{prompt_param}: {len(work)} sequences (prompts × best_of / n) are more than the "
                                f"server queues at once ({most}, --max-waiting)", prompt_param)
        handles: list[RequestHandle] = []
        try:
            for ids, sp in work:
                handles.append(await self.start(ids, sp, prompt_param, grammar_param))
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        return handles

    async def collect(self, runs: list[TextRun], request: Request) -> list[str]:
        """Each run's whole text, cancelling every request if the client goes away meanwhile."""
        parts: list[list[str]] = [[] for _ in runs]

        async def consume(i, run):
            async for d in run.deltas():
                parts[i].append(d)

        tasks = [asyncio.ensure_future(consume(i, run)) for i, run in enumerate(runs)]
        try:
            while not all(t.done() for t in tasks):
                await asyncio.wait(set(tasks), timeout=0.1, return_when=asyncio.ALL_COMPLETED)
                if not all(t.done() for t in tasks) and await request.is_disconnected():
                    raise ApiError(499, "client disconnected", None, "client_closed")
            for t in tasks:
                t.result()
        finally:
            for t, run in zip(tasks, runs):
                if not t.done():
                    t.cancel()
                run.handle.cancel()
                run.end()
        failed = next((run.error for run in runs if run.error is not None), None)
        if failed is not None:
            raise ApiError(503, failed, None, "server_error")
        return ["".join(p) for p in parts]

    def stream_response(self, runs: list[TextRun], chunk, first=None, usage: bool = False,
                        prompts: int | None = None) -> StreamingResponse:
        """Server-sent events of ``runs`` (choice ``i`` is run ``i``): ``chunk(i, text, reason, logprobs taken)``
        per non-empty delta and per finish, in arrival order; ``first(i)``: each choice's opening chunk; a usage
        chunk over all runs (``prompts``: as `_usage`); ``[DONE]``."""
        async def body():
            events: asyncio.Queue = asyncio.Queue()

            async def pump(i, run):          # (each delta's log-probabilities taken with it: the pump runs ahead)
                try:
                    async for d in run.deltas():
                        if d:
                            await events.put((i, d, run.take_logprobs()))
                finally:
                    await events.put((i, None, None))

            tasks = []
            try:
                if first is not None:
                    for i in range(len(runs)):
                        yield _sse(first(i))
                tasks = [asyncio.ensure_future(pump(i, run)) for i, run in enumerate(runs)]
                left = len(runs)
                while left:
                    i, d, taken = await events.get()
                    run = runs[i]
                    if d is not None:
                        yield _sse(chunk(i, d, None, taken))
                        continue
                    left -= 1
                    if run.error is not None:
                        yield _sse({"error": {"message": run.error, "type": "server_error", "param": None,
                                              "code": 503}})
                        break
                    yield _sse(chunk(i, None, run.finish_reason, run.take_logprobs()))
                else:
                    if usage:
                        yield _sse({**chunk(0, None, None, ([], [])), "choices": [],
                                    "usage": _usage(runs, prompts)})
                yield "data: [DONE]\n\n"
            finally:                      # normal end, or the client went away (the task is cancelled)
                for t in tasks:
                    t.cancel()
                for run in runs:
                    run.handle.cancel()
                    run.end()

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def health(self):
        if not self.loop.alive:
            raise ApiError(503, "the engine loop is not running", None, "server_error")
        return {"status": "ok", "model": self.model_name, **self.loop.load()}

    def _card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "v41cp",
                "max_model_len": self.capacity}

    async def models(self):
        return {"object": "list", "data": [self._card()]}

    async def model(self, model_id: str):
        if model_id != self.model_name:
            raise ApiError(404, f"model: the model {model_id!r} does not exist; this server serves "
                                f"{self.model_name!r}", "model", "not_found_error")
        return self._card()

    def _codec(self, param: str) -> TextCodec:
        if self.codec is None:
            raise ApiError(400, f"{param}: this checkpoint has no tokenizer.json", param)
        return self.codec

    async def tokenize(self, request: Request):
        """vLLM's ``/tokenize``: ``{count, max_model_len, tokens, token_strs}``."""
        req = await read_request(request, TokenizeRequest)
        if req.model is not None:
            self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "prompt: give exactly one of prompt and messages", "prompt")
        if req.prompt is not None:
            ids = self._codec("prompt").encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            try:
                ids = self._codec("messages").chat_ids([m.model_dump() for m in req.messages],
                                                       req.add_generation_prompt, req.chat_template_kwargs)
            except ChatFormatError as e:
                raise ApiError(400, _chat_error(e), e.param)
        strs = [self.codec.tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.capacity, "tokens": ids, "token_strs": strs}

    async def detokenize(self, request: Request):
        """vLLM's ``/detokenize``: ``{prompt}`` (special tokens left out, as in completions' text)."""
        req = await read_request(request, DetokenizeRequest)
        if req.model is not None:
            self.check_model(req.model)
        codec = self._codec("tokens")
        bad = self.engine.cfg.out_of_vocabulary(req.tokens)
        if bad:
            raise ApiError(400, f"tokens: {bad}", "tokens")
        return {"prompt": codec.decode(req.tokens)}

    @staticmethod
    def _samples(sp: SamplingParams, count: int) -> list[SamplingParams]:
        """``count`` independent samples of one prompt: consecutive seeds from the request's."""
        return [dataclasses.replace(sp, seed=(sp.seed + j) % 2**63) for j in range(count)]

    async def completions(self, request: Request):
        req = await read_request(request, CompletionRequest)
        self.check_model(req.model)
        self.check_text_fields(req)
        best_of = req.n if req.best_of is None else req.best_of
        if best_of < req.n:
            raise ApiError(400, f"best_of: must be at least n ({req.n}), got {best_of}", "best_of")
        if best_of > req.n and self.engine.capacity.max_logprobs == 0:
            raise ApiError(400, "best_of: ranking samples needs log-probabilities, which this server does not compute "
                                "(--max-logprobs 0)", "best_of")
        if req.stream and best_of > req.n:
            raise ApiError(400, "best_of: the n most likely of best_of samples are known only at the end: not with "
                                "stream", "best_of")
        prompts = self.prompt_list(req.prompt)
        count = self.logprobs(req.logprobs, "logprobs")
        ranked = best_of > req.n               # the samples' cumulative log-probabilities pick the n returned
        work = []
        for ids in prompts:
            sp = self.sampling(req, len(ids), req.max_tokens if req.max_tokens is not None else 16,
                               count if count is not None else (0 if ranked else None),
                               count if req.echo and count is not None else None)
            work += [(ids, s) for s in self._samples(sp, best_of)]
        timers = [self.metrics.timer(len(ids)) for ids, _ in work]
        handles = await self.start_all(work, "prompt", req)
        runs = [self.run(h, req, t) for h, t in zip(handles, timers)]
        rid, now = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        text_of = token_texts(self.codec)
        offsets, echoed = [0] * len(runs), [not req.echo] * len(runs)
        prompt_of = lambda i: req.prompt if len(prompts) == 1 else req.prompt[i // best_of]

        def choice(i, index, text, reason, taken):
            run, lp = runs[i], None
            ids = run.handle.prompt_ids
            if not echoed[i]:                  # the first chunk (or the whole answer) starts with the prompt
                echoed[i] = True
                text = self.echo_text(prompt_of(i), ids) + (text or "")
                if req.logprobs is not None:
                    taken = (ids + taken[0], list(run.prompt_entries or [None] * len(ids)) + taken[1])
            if req.logprobs is not None:
                lp = completion_logprobs(*taken, text_of, offsets[i])
                offsets[i] += sum(len(t) for t in lp["tokens"])
            c = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": reason}
            if req.return_token_ids and reason is not None:
                c["token_ids"] = run.ids
            return c

        def chunk(i, text, reason, taken):
            return {"id": rid, "object": "text_completion", "created": now, "model": self.model_name,
                    "choices": [choice(i, i, text, reason, taken)] if text is not None or reason is not None else []}

        if req.stream:
            return self.stream_response(runs, chunk, usage=bool(req.stream_options and req.stream_options.include_usage),
                                        prompts=len(prompts) if best_of > 1 else None)
        texts = await self.collect(runs, request)
        keep = list(range(len(runs)))
        if ranked:                             # per prompt: the n samples of highest cumulative log-probability
            keep = [k for p in range(len(prompts))
                    for k in sorted(range(p * best_of, (p + 1) * best_of),
                                    key=lambda k: -sum(e[0] for e in runs[k].entries))[:req.n]]
            keep.sort()
        choices = [choice(k, j, texts[k], runs[k].finish_reason, runs[k].take_logprobs()) for j, k in enumerate(keep)]
        return {"id": rid, "object": "text_completion", "created": now, "model": self.model_name,
                "choices": choices, "usage": _usage(runs, len(prompts) if best_of > 1 else None)}

    async def chat_completions(self, request: Request):
        req = await read_request(request, ChatCompletionRequest)
        self.check_model(req.model)
        self.check_text_fields(req)
        if self.codec is None:
            raise ApiError(400, "messages: this checkpoint has no tokenizer.json, so no chat format", "messages")
        try:
            ids = self.codec.chat_ids([m.model_dump() for m in req.messages], req.add_generation_prompt,
                                      req.chat_template_kwargs, req.reasoning_effort)
        except ChatFormatError as e:
            raise ApiError(400, _chat_error(e), e.param)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if not ids:
            raise ApiError(400, "messages: the chat prompt is empty", "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        sp = self.sampling(req, len(ids), max_tokens,
                           self.logprobs(req.top_logprobs or 0, "top_logprobs") if req.logprobs else None)
        work = [(ids, s) for s in self._samples(sp, req.n)]
        timers = [self.metrics.timer(len(ids)) for _ in work]
        runs = [self.run(h, req, t) for h, t in zip(await self.start_all(work, "messages", req), timers)]
        rid, now = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        text_of = token_texts(self.codec)

        def logprobs(taken):
            return chat_logprobs(*taken, text_of) if req.logprobs else None

        def chunk(i, text, reason, taken):
            if text is None and reason is None:
                choices = []
            else:
                c = {"index": i, "delta": {"content": text} if text is not None else {}, "logprobs": logprobs(taken),
                     "finish_reason": reason}
                if req.return_token_ids and reason is not None:
                    c["token_ids"] = runs[i].ids
                choices = [c]
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": self.model_name,
                    "choices": choices}

        if req.stream:
            def first(i):
                return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": self.model_name,
                        "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]}
            return self.stream_response(runs, chunk, first,
                                        usage=bool(req.stream_options and req.stream_options.include_usage),
                                        prompts=1 if req.n > 1 else None)
        texts = await self.collect(runs, request)
        choices = []
        for i, (run, text) in enumerate(zip(runs, texts)):
            choice: dict = {"index": i, "message": {"role": "assistant", "content": text},
                            "logprobs": logprobs(run.take_logprobs()), "finish_reason": run.finish_reason}
            if req.return_token_ids:
                choice["token_ids"] = run.ids
            choices.append(choice)
        return {"id": rid, "object": "chat.completion", "created": now, "model": self.model_name,
                "choices": choices, "usage": _usage(runs, 1 if req.n > 1 else None)}
