"""OpenAI-compatible HTTP API over an `EngineLoop` (FastAPI app; served by uvicorn in `v41cp.serving.api.server`).

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (handlers:
`v41cp.serving.api.serving.OpenAIServing`). Request bodies are parsed and checked by `v41cp.serving.api.protocol`:
the fields honoured follow the OpenAI API (``model``, ``prompt`` as text or token ids / ``messages``,
``max_tokens`` (chat also ``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``,
``stream_options.include_usage``), with the extensions ``ignore_eos``, ``return_token_ids`` and (chat)
``add_generation_prompt``; fields the server does not implement are accepted only at the value that changes
nothing, any other value — and any unknown field — answers 400 naming it. Responses and ``usage`` have the API's
shapes; ``stream: true`` answers server-sent events ending with ``data: [DONE]``.

Errors have the API's shape ``{"error": {"message", "type", "param", "code"}}``: a bad field answers 400 and
names it (``param``), a body that is not JSON 400 / 413 / 415, a full queue 429, a server shutting down 503, an
unknown route 404 and a method not allowed 405. A rejected request changes nothing in the engine. A client that
disconnects (streaming or not) cancels its request, which frees its pages.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from v41cp.serving.api.engine_loop import EngineLoop
from v41cp.serving.api.protocol import ApiError
from v41cp.serving.api.serving import OpenAIServing
from v41cp.serving.api.text import TextCodec

__all__ = ["build_app"]


def build_app(loop: EngineLoop, codec: TextCodec | None, model_name: str) -> FastAPI:
    """The FastAPI app serving ``model_name`` from ``loop`` (``codec``: text in / out; None → token ids only)."""
    app = FastAPI(title="v41cp", description="DeepSeek-V4.1 inference with context parallelism (OpenAI API)")
    serving = OpenAIServing(loop, codec, model_name)

    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):      # unknown route, method not allowed
        what = {404: f"no route {request.url.path!r}", 405: f"{request.method} is not allowed on {request.url.path!r}"}
        return JSONResponse(ApiError(exc.status_code, what.get(exc.status_code, str(exc.detail))).body(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.get("/health")
    async def health():
        return await serving.health()

    @app.get("/v1/models")
    async def models():
        return await serving.models()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serving.chat_completions(request)

    app.state.engine_loop = loop
    app.state.serving = serving
    return app
