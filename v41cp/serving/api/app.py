"""OpenAI-compatible HTTP API over an `EngineLoop` (FastAPI app; served by uvicorn in `v41cp.serving.api.server`).

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``.
Request bodies are parsed and checked by `v41cp.serving.api.protocol`: the fields honoured follow the OpenAI
API (``model``, ``prompt`` as text or token ids / ``messages``, ``max_tokens`` (chat also
``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``,
``stream_options.include_usage``), with the extensions ``ignore_eos``, ``return_token_ids`` and (chat)
``add_generation_prompt``; fields the server does not implement are accepted only at the value that changes
nothing, any other value — and any unknown field — answers 400 naming it. Responses and ``usage`` have the API's
shapes; ``stream: true`` answers server-sent events ending with ``data: [DONE]``.

Errors have the API's shape ``{"error": {"message", "type", "param", "code"}}``: a bad field answers 400 and
names it (``param``), a body that is not JSON 400 / 413 / 415, a full queue 429, a server shutting down 503. A
rejected request changes nothing in the engine. A client that disconnects (streaming or not) cancels its request,
which frees its pages.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from v41cp.serving.api.engine_loop import EngineLoop, LoopClosed, RequestHandle
from v41cp.serving.api.protocol import (
    MAX_BODY_BYTES,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    RequestBase,
    parse_request,
)
from v41cp.serving.api.text import ChatFormatError, TextCodec
from v41cp.serving.engine import EngineFull, RequestError, SamplingParams

__all__ = ["build_app"]


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


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


def _stops(req: RequestBase) -> tuple[str, ...]:
    return (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())


def _finish(reason: str | None, stopped: bool) -> str:
    return "stop" if stopped or reason == "eos" else ("length" if reason == "length" else (reason or "stop"))


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def build_app(loop: EngineLoop, codec: TextCodec | None, model_name: str) -> FastAPI:
    """The FastAPI app serving ``model_name`` from ``loop`` (``codec``: text in / out; None → token ids only)."""
    app = FastAPI(title="v41cp", description="DeepSeek-V4.1 inference with context parallelism (OpenAI API)")
    engine = loop.engine
    capacity = engine.capacity.max_tokens
    eos = engine.cfg.eos_token_id
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):      # unknown route, method not allowed
        what = {404: f"no route {request.url.path!r}", 405: f"{request.method} is not allowed on {request.url.path!r}"}
        return JSONResponse(ApiError(exc.status_code, what.get(exc.status_code, str(exc.detail))).body(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    # ------------------------------------------------------------------ helpers
    def check_model(name: str) -> None:
        if name != model_name:
            raise ApiError(400, f"model: unknown model {name!r}; this server serves {model_name!r}", "model")

    def prompt_ids(prompt, param: str) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]                   # a batch of one prompt
        if isinstance(prompt, str):
            if codec is None:
                raise ApiError(400, f"{param}: this checkpoint has no tokenizer.json; send token ids", param)
            ids = codec.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise ApiError(400, f"{param}: one prompt per request (a string or a list of token ids); "
                                "batched prompts are not supported", param)
        if not ids:
            raise ApiError(400, f"{param}: the prompt is empty", param)
        bad = engine.cfg.out_of_vocabulary(ids)
        if bad:
            raise ApiError(400, f"{param}: {bad}", param)
        return ids

    def sampling(req: RequestBase, n_prompt: int, max_tokens: int | None, prompt_param: str) -> SamplingParams:
        if n_prompt >= capacity:
            raise ApiError(400, f"{prompt_param}: the prompt has {n_prompt} tokens; the capacity is {capacity} "
                                "tokens per request (prompt + output)", prompt_param)
        if max_tokens is None:
            max_tokens = capacity - n_prompt
        if n_prompt + max_tokens > capacity:
            raise ApiError(400, f"max_tokens: prompt ({n_prompt}) + max_tokens ({max_tokens}) = "
                                f"{n_prompt + max_tokens} tokens is beyond the capacity of {capacity} per request",
                           "max_tokens")
        seed = req.seed if req.seed is not None else random.getrandbits(63)
        return SamplingParams(max_new_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p, seed=seed, stop_on_eos=not req.ignore_eos)

    def check_text_fields(req: RequestBase) -> None:
        stops = _stops(req)
        if len(stops) > 4 or any(not s for s in stops):
            raise ApiError(400, f"stop: up to 4 non-empty strings, got {list(stops)!r}", "stop")
        if codec is None and stops:
            raise ApiError(400, "stop: stop strings need the checkpoint's tokenizer.json, which it lacks", "stop")

    async def start(ids: list[int], sp: SamplingParams, prompt_param: str) -> RequestHandle:
        try:
            return await loop.submit(ids, sp)
        except EngineFull as e:
            raise ApiError(429, f"the request queue is full, retry later ({e})", None, "rate_limit_error")
        except RequestError as e:
            param = {"max_new_tokens": "max_tokens", "prompt": prompt_param, "request_id": None}.get(e.field, e.field)
            raise ApiError(400, f"{param}: {e}" if param else str(e), param)
        except LoopClosed as e:
            raise ApiError(503, str(e), None, "server_error")

    class _Run:
        """Text of one request as its events arrive (stop strings; the EOS is hidden from the text)."""

        def __init__(self, handle: RequestHandle, req: RequestBase):
            self.handle, self.req = handle, req
            self.stream = codec.stream(_stops(req), hidden=() if req.ignore_eos else (eos,)) if codec else None
            self.ids: list[int] = []
            self.reason: str | None = None
            self.error: str | None = None
            self.cached = 0

        async def deltas(self):
            """Yields text deltas (``""`` for a step without new text) until the request ends."""
            async for ev in self.handle:
                self.cached = ev.cached_tokens
                if ev.error is not None:
                    self.error = ev.error
                    return
                for t in ev.ids:
                    if self.stream is not None and self.stream.stopped:
                        break
                    self.ids.append(t)
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

        @property
        def finish_reason(self) -> str:
            return _finish(self.reason, self.stream is not None and self.stream.stopped)

        def usage(self) -> dict:
            n = len(self.handle.prompt_ids)
            return {"prompt_tokens": n, "completion_tokens": len(self.ids), "total_tokens": n + len(self.ids),
                    "prompt_tokens_details": {"cached_tokens": self.cached}}

    async def collect(run: _Run, request: Request) -> str:
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
        if run.error is not None:
            raise ApiError(503, run.error, None, "server_error")
        return "".join(parts)

    def stream_response(run: _Run, chunk, first=None, usage: bool = False) -> StreamingResponse:
        async def body():
            try:
                if first is not None:
                    yield _sse(first)
                async for d in run.deltas():
                    if d:
                        yield _sse(chunk(d, None))
                if run.error is not None:
                    yield _sse({"error": {"message": run.error, "type": "server_error", "param": None, "code": 503}})
                else:
                    yield _sse(chunk(None, run.finish_reason))
                    if usage:
                        yield _sse({**chunk(None, None), "choices": [], "usage": run.usage()})
                yield "data: [DONE]\n\n"
            finally:                      # normal end, or the client went away (the task is cancelled)
                run.handle.cancel()

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health():
        if not loop.alive:
            raise ApiError(503, "the engine loop is not running", None, "server_error")
        return {"status": "ok", "model": model_name, **loop.load()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "v41cp", "max_model_len": capacity}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await read_request(request, CompletionRequest)
        check_model(req.model)
        check_text_fields(req)
        ids = prompt_ids(req.prompt, "prompt")
        sp = sampling(req, len(ids), req.max_tokens if req.max_tokens is not None else 16, "prompt")
        run = _Run(await start(ids, sp, "prompt"), req)
        rid, now = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def choice(text, reason):
            c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            if req.return_token_ids and reason is not None:
                c["token_ids"] = run.ids
            return c

        def chunk(text, reason):
            return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                    "choices": [choice(text, reason)] if text is not None or reason is not None else []}

        if req.stream:
            return stream_response(run, chunk, usage=bool(req.stream_options and req.stream_options.include_usage))
        text = await collect(run, request)
        return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                "choices": [choice(text, run.finish_reason)], "usage": run.usage()}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await read_request(request, ChatCompletionRequest)
        check_model(req.model)
        check_text_fields(req)
        if codec is None:
            raise ApiError(400, "messages: this checkpoint has no tokenizer.json, so no chat format", "messages")
        try:
            ids = codec.chat_ids([m.model_dump() for m in req.messages], req.add_generation_prompt)
        except ChatFormatError as e:
            raise ApiError(400, f"messages: {e}", "messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if not ids:
            raise ApiError(400, "messages: the chat prompt is empty", "messages")
        sp = sampling(req, len(ids), max_tokens, "messages")
        run = _Run(await start(ids, sp, "messages"), req)
        rid, now = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(text, reason):
            if text is None and reason is None:
                choices = []
            else:
                c = {"index": 0, "delta": {"content": text} if text is not None else {}, "logprobs": None,
                     "finish_reason": reason}
                if req.return_token_ids and reason is not None:
                    c["token_ids"] = run.ids
                choices = [c]
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                    "choices": choices}

        if req.stream:
            first = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}]}
            return stream_response(run, chunk, first,
                                   usage=bool(req.stream_options and req.stream_options.include_usage))
        text = await collect(run, request)
        choice: dict = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                        "finish_reason": run.finish_reason}
        if req.return_token_ids:
            choice["token_ids"] = run.ids
        return {"id": rid, "object": "chat.completion", "created": now, "model": model_name,
                "choices": [choice], "usage": run.usage()}

    app.state.engine_loop = loop
    return app
