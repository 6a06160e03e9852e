"""OpenAI-compatible HTTP API over an `EngineLoop` (FastAPI app; served by uvicorn in `v41cp.serving.api.server`).

Routes: ``GET|HEAD /health``, ``GET /metrics`` (Prometheus, `v41cp.serving.api.metrics`), ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /tokenize`` and
``POST /detokenize`` (vLLM's shapes) (handlers: `v41cp.serving.api.serving.OpenAIServing`). Request bodies are parsed and checked by `v41cp.serving.api.protocol`:
the fields honoured follow the OpenAI API (``model``, ``prompt`` as text or token ids / ``messages``,
``max_tokens`` (chat also ``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``,
``stream_options.include_usage``), with the extensions ``top_k``, ``min_p``, ``stop_token_ids``, ``ignore_eos``,
``return_token_ids`` and (chat) ``add_generation_prompt``; fields the server does not implement are accepted only at the value that changes
nothing, any other value — and any unknown field — answers 400 naming it. Responses and ``usage`` have the API's
shapes; ``stream: true`` answers server-sent events ending with ``data: [DONE]``.

Errors have the API's shape ``{"error": {"message", "type", "param", "code"}}``: a bad field answers 400 and
names it (``param``), a body that is not JSON 400 / 413 / 415, a full queue 429, a server shutting down 503, an
unknown route 404 and a method not allowed 405; a 429 carries ``Retry-After``. A rejected request changes nothing
in the engine. A client that disconnects (streaming or not) cancels its request, which frees its pages.

Headers (`RequestHeaders`, an ASGI middleware: it leaves streaming and disconnect detection untouched): every
response carries ``X-Request-Id`` — the client's (up to 128 visible ASCII characters; another value answers 400),
else a new one. With ``api_key`` (``serve --api-key``) the ``/v1/*``, ``/tokenize`` and ``/detokenize`` routes need
``Authorization: Bearer <key>`` (compared in constant time); a missing or wrong one answers 401 in the error shape
with ``WWW-Authenticate: Bearer``. ``/health`` and ``/metrics`` stay open (probes and scrapers), as in vLLM.
"""

from __future__ import annotations

import hmac
import re
import uuid

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from v41cp.serving.api.engine_loop import EngineLoop
from v41cp.serving.api.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from v41cp.serving.api.protocol import ApiError
from v41cp.serving.api.serving import OpenAIServing
from v41cp.serving.api.text import TextCodec

__all__ = ["build_app", "RequestHeaders"]

_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")
_PROTECTED = ("/v1/", "/tokenize", "/detokenize")


class RequestHeaders:
    """ASGI middleware: ``X-Request-Id`` honoured and returned; the API key checked (see the module docstring)."""

    def __init__(self, app, api_key: str | None = None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        given = headers.get("x-request-id")
        rid = given if given is not None and _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", rid.encode())]}
            await send(message)

        refusal = None
        if given is not None and rid != given:
            refusal = ApiError(400, "X-Request-Id: up to 128 visible ASCII characters, got "
                                    f"{given[:40]!r}{'…' if len(given) > 40 else ''}", "X-Request-Id")
        elif self.api_key is not None and scope["path"].startswith(_PROTECTED) and not self._authorized(headers):
            refusal = ApiError(401, "Authorization: a valid 'Bearer' API key is required", "Authorization",
                               "authentication_error", {"WWW-Authenticate": "Bearer"})
        if refusal is not None:
            response = JSONResponse(refusal.body(), status_code=refusal.status, headers=refusal.headers)
            return await response(scope, receive, send_with_id)
        await self.app(scope, receive, send_with_id)

    def _authorized(self, headers: dict) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())


def build_app(loop: EngineLoop, codec: TextCodec | None, model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``model_name`` from ``loop`` (``codec``: text in / out; None → token ids only;
    ``api_key``: required on the API routes, None: open)."""
    if api_key is not None and not api_key:
        raise ValueError("api_key: an empty key would accept every request; give a key or none")
    app = FastAPI(title="v41cp", description="DeepSeek-V4.1 inference with context parallelism (OpenAI API)")
    serving = OpenAIServing(loop, codec, model_name)
    app.add_middleware(RequestHeaders, api_key=api_key)

    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):      # unknown route, method not allowed
        what = {404: f"no route {request.url.path!r}", 405: f"{request.method} is not allowed on {request.url.path!r}"}
        return JSONResponse(ApiError(exc.status_code, what.get(exc.status_code, str(exc.detail))).body(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return await serving.health()

    @app.get("/metrics")
    async def metrics():
        return Response(serving.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return await serving.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return await serving.model(model_id)

    # the POST routes: each handler reads its own body (`serving.read_request`)
    for path, handler in (("/v1/completions", serving.completions), ("/v1/chat/completions", serving.chat_completions),
                          ("/tokenize", serving.tokenize), ("/detokenize", serving.detokenize)):
        app.add_api_route(path, handler, methods=["POST"])

    app.state.engine_loop = loop
    app.state.serving = serving
    return app
