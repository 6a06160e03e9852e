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


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class TextRun:
    """Text of one request as its events arrive (stop strings; the EOS is hidden from the text)."""

    def __init__(self, handle: RequestHandle, req: RequestBase, codec: TextCodec | None, eos: int,
                 timer: RequestTimer | None = None):
        self.handle, self.req, self.timer = handle, req, timer
        hidden = (() if req.ignore_eos else (eos,)) + tuple(req.stop_token_ids or ())
        self.stream = codec.stream(stops_of(req), hidden=hidden) if codec else None
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
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]                   # a batch of one prompt
        if isinstance(prompt, str):
            if self.codec is None:
                raise ApiError(400, f"{param}: this checkpoint has no tokenizer.json; send token ids", param)
            ids = self.codec.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise ApiError(400, f"{param}: one prompt per request (a string or a list of token ids); "
                                "batched prompts are not supported", param)
        if not ids:
            raise ApiError(400, f"{param}: the prompt is empty", param)
        bad = self.engine.cfg.out_of_vocabulary(ids)
        if bad:
            raise ApiError(400, f"{param}: {bad}", param)
        return ids

    def logprobs(self, count: int | None, param: str) -> int | None:
        """A request's log-probability alternatives, checked against the engine's ``max_logprobs``."""
        most = self.engine.capacity.max_logprobs
        if count is not None and count > most:
            raise ApiError(400, f"{param}: at most {most} alternatives (the server's --max-logprobs), got {count}",
                           param)
        return count

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
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs)

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

    async def start(self, ids: list[int], sp: SamplingParams, prompt_param: str) -> RequestHandle:
        try:
            return await self.loop.submit(ids, sp)
        except EngineFull as e:
            raise ApiError(429, f"the request queue is full, retry later ({e})", None, "rate_limit_error",
                           {"Retry-After": "1"})
        except RequestError as e:
            param = {"max_new_tokens": "max_tokens", "prompt": prompt_param, "request_id": None,
                     "prompt_logprobs": "echo"}.get(e.field, e.field)
            raise ApiError(400, f"{param}: {e.detail}" if param else e.detail, param)
        except LoopClosed as e:
            raise ApiError(503, str(e), None, "server_error")

    async def collect(self, run: TextRun, request: Request) -> str:
        """The whole text, cancelling the request if the client goes away meanwhile."""
        parts: list[str] = []

        async def consume():
            async for d in run.deltas():
                parts.append(d)

        task = asyncio.ensure_future(consume())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.1)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    run.handle.cancel()
                    raise ApiError(499, "client disconnected", None, "client_closed")
            task.result()
        finally:
            if not task.done():
                task.cancel()
            run.handle.cancel()
            run.end()
        if run.error is not None:
            raise ApiError(503, run.error, None, "server_error")
        return "".join(parts)

    def stream_response(self, run: TextRun, chunk, first=None, usage: bool = False) -> StreamingResponse:
        async def body():
            try:
                if first is not None:
                    yield _sse(first)
                async for d in run.deltas():
                    if d:
                        yield _sse(chunk(d, None, run.take_logprobs()))
                if run.error is not None:
                    yield _sse({"error": {"message": run.error, "type": "server_error", "param": None, "code": 503}})
                else:
                    yield _sse(chunk(None, run.finish_reason, run.take_logprobs()))
                    if usage:
                        yield _sse({**chunk(None, None, ([], [])), "choices": [], "usage": run.usage()})
                yield "data: [DONE]\n\n"
            finally:                      # normal end, or the client went away (the task is cancelled)
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
                                                       req.add_generation_prompt)
            except ChatFormatError as e:
                raise ApiError(400, f"messages: {e}", "messages")
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

    async def completions(self, request: Request):
        req = await read_request(request, CompletionRequest)
        self.check_model(req.model)
        self.check_text_fields(req)
        ids = self.prompt_ids(req.prompt, "prompt")
        count = self.logprobs(req.logprobs, "logprobs")
        sp = self.sampling(req, len(ids), req.max_tokens if req.max_tokens is not None else 16, count,
                           count if req.echo and count is not None else None)
        timer = self.metrics.timer(len(ids))
        run = self.run(await self.start(ids, sp, "prompt"), req, timer)
        rid, now = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        text_of, offset, echo = token_texts(self.codec), [0], [req.echo]

        def choice(text, reason, taken):
            lp = None
            if echo[0]:                        # the first chunk (or the whole answer) starts with the prompt
                echo[0] = False
                text = self.echo_text(req.prompt, ids) + (text or "")
                if req.logprobs is not None:
                    taken = (ids + taken[0], list(run.prompt_entries or [None] * len(ids)) + taken[1])
            if req.logprobs is not None:
                lp = completion_logprobs(*taken, text_of, offset[0])
                offset[0] += sum(len(t) for t in lp["tokens"])
            c = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": reason}
            if req.return_token_ids and reason is not None:
                c["token_ids"] = run.ids
            return c

        def chunk(text, reason, taken):
            return {"id": rid, "object": "text_completion", "created": now, "model": self.model_name,
                    "choices": [choice(text, reason, taken)] if text is not None or reason is not None else []}

        if req.stream:
            return self.stream_response(run, chunk, usage=bool(req.stream_options and req.stream_options.include_usage))
        text = await self.collect(run, request)
        return {"id": rid, "object": "text_completion", "created": now, "model": self.model_name,
                "choices": [choice(text, run.finish_reason, run.take_logprobs())], "usage": run.usage()}

    async def chat_completions(self, request: Request):
        req = await read_request(request, ChatCompletionRequest)
        self.check_model(req.model)
        self.check_text_fields(req)
        if self.codec is None:
            raise ApiError(400, "messages: this checkpoint has no tokenizer.json, so no chat format", "messages")
        try:
            ids = self.codec.chat_ids([m.model_dump() for m in req.messages], req.add_generation_prompt)
        except ChatFormatError as e:
            raise ApiError(400, f"messages: {e}", "messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if not ids:
            raise ApiError(400, "messages: the chat prompt is empty", "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        sp = self.sampling(req, len(ids), max_tokens,
                           self.logprobs(req.top_logprobs or 0, "top_logprobs") if req.logprobs else None)
        timer = self.metrics.timer(len(ids))
        run = self.run(await self.start(ids, sp, "messages"), req, timer)
        rid, now = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        text_of = token_texts(self.codec)

        def logprobs(taken):
            return chat_logprobs(*taken, text_of) if req.logprobs else None

        def chunk(text, reason, taken):
            if text is None and reason is None:
                choices = []
            else:
                c = {"index": 0, "delta": {"content": text} if text is not None else {}, "logprobs": logprobs(taken),
                     "finish_reason": reason}
                if req.return_token_ids and reason is not None:
                    c["token_ids"] = run.ids
                choices = [c]
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": self.model_name,
                    "choices": choices}

        if req.stream:
            first = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": self.model_name,
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}]}
            return self.stream_response(run, chunk, first,
                                   usage=bool(req.stream_options and req.stream_options.include_usage))
        text = await self.collect(run, request)
        choice: dict = {"index": 0, "message": {"role": "assistant", "content": text},
                        "logprobs": logprobs(run.take_logprobs()), "finish_reason": run.finish_reason}
        if req.return_token_ids:
            choice["token_ids"] = run.ids
        return {"id": rid, "object": "chat.completion", "created": now, "model": self.model_name,
                "choices": [choice], "usage": run.usage()}
