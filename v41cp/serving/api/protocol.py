"""The OpenAI request bodies this server takes: byte-level parsing, the two request schemas, and the field policy.

`parse_request(body, content_type, schema)` turns a POST body into a validated request or raises `ApiError` (a 4xx
in the API's error shape, naming what is wrong): the media type must be JSON (``application/json`` or a
``+json`` type; a body without a ``Content-Type`` is read as JSON), the body at most `MAX_BODY_BYTES`, UTF-8, one
JSON object (no ``NaN`` / ``Infinity``, at most `MAX_DEPTH` levels deep); then the schema.

**Field policy.** Every field a request may carry is declared here. A field is either *honoured* (it changes what
the server does as the API defines), or *accepted only at its neutral value* — the value that means "no change"
(``suffix: ""``, ``include_stop_str_in_output: false`` …; `NEUTRAL`) — and answered 400
naming it otherwise. A field not declared at all is answered 400 naming it. Nothing is silently ignored.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = ["ApiError", "ChatCompletionRequest", "CompletionRequest", "DetokenizeRequest", "MAX_BODY_BYTES",
           "MAX_CHOICES", "MAX_DEPTH",
           "NEUTRAL", "RequestBase", "TokenizeRequest", "parse_request"]

MAX_BODY_BYTES = 32 * 1024 * 1024    # a 1M-token prompt as JSON ids is ~8 MB
MAX_DEPTH = 32                       # the deepest valid request (chat content parts) nests 5 levels
MAX_CHOICES = 64                     # n / best_of at most; a request's prompts × best_of at most too


class ApiError(Exception):
    """An error answer: ``status`` (4xx / 5xx), ``message``, the offending ``param`` (a field name, or None)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


# ---------------------------------------------------------------------------------------------- bytes → JSON
def _media_type(content_type: str | None) -> tuple[str, dict]:
    kind, *params = (content_type or "").split(";")
    args = {}
    for p in params:
        key, _, value = p.partition("=")
        args[key.strip().lower()] = value.strip().strip('"').lower()
    return kind.strip().lower(), args


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _depth(value) -> int:
    """Nesting depth of a parsed JSON value (iterative: a deep value cannot exhaust the stack here)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if d > MAX_DEPTH:
            break
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return deepest


def parse_json_body(body: bytes, content_type: str | None) -> str:
    """The request's JSON object as text, checked (or `ApiError`: 415 media type, 413 size, 400 encoding / syntax /
    shape)."""
    kind, args = _media_type(content_type)
    if content_type is not None and kind != "application/json" and not (kind.startswith("application/")
                                                                           and kind.endswith("+json")):
        raise ApiError(415, f"Content-Type: the body must be JSON (application/json), got {content_type[:100]!r}")
    if args.get("charset", "utf-8") not in ("utf-8", "utf8"):
        raise ApiError(415, f"Content-Type: the body must be UTF-8, got charset={args['charset'][:40]!r}")
    if len(body) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body has {len(body)} bytes, more than the {MAX_BODY_BYTES} accepted")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not UTF-8: byte {body[e.start]:#04x} at offset {e.start}")
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, f"the request body is not valid JSON: nested more than {MAX_DEPTH} levels deep")
    except ValueError as e:                       # json.JSONDecodeError, or a NaN / Infinity constant
        raise ApiError(400, f"the request body is not valid JSON: {str(e)[:200]}")
    if not isinstance(value, dict):
        raise ApiError(400, f"the request body must be a JSON object, got a JSON {_json_kind(value)}")
    if _depth(value) > MAX_DEPTH:
        raise ApiError(400, f"the request body is nested more than {MAX_DEPTH} levels deep")
    return text


def _json_kind(v) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(v), "number")


# ---------------------------------------------------------------------------------------------- schemas
class _Strict(BaseModel):
    # strict: JSON true is not the integer 1, 1.0 is not an integer, "5" is not a number
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class RequestBase(_Strict):
    """Fields both endpoints honour, and those both accept at their neutral value only (typed ``Any``: the value
    is compared with `NEUTRAL`, any other answers 400 naming the field)."""

    model: str
    max_tokens: Optional[int] = Field(default=None, gt=0)
    temperature: Optional[float] = Field(default=None, ge=0.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    seed: Optional[int] = Field(default=None, ge=0, lt=2**63)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False                  # v41cp / vLLM extension: generate past the EOS token
    return_token_ids: bool = False            # v41cp extension: the output token ids in the choice
    # vLLM / SGLang sampling extensions, on the device like temperature and top_p
    top_k: Optional[int] = Field(default=None, ge=-1)        # -1 or 0: off
    min_p: Optional[float] = Field(default=None, ge=0.0, lt=1.0)
    stop_token_ids: Optional[list[int]] = None               # end after any of these ids (hidden from the text)

    n: int = Field(default=1, ge=1, le=MAX_CHOICES)          # choices per prompt (sampled independently)
    logit_bias: Optional[dict[str, float]] = None            # token id (a string) → added to its logit, in [-100, 100]
    min_tokens: int = Field(default=0, ge=0)                 # no EOS / stop id before this many tokens
    # penalties on the device (`v41cp.serving.runner.penalties`): OpenAI's two, vLLM's repetition penalty
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0)
    # structured output (`v41cp.serving.api.structured`): OpenAI's response_format (completions too, as vLLM),
    # vLLM's structured_outputs {json | regex | choice}
    response_format: Any = None
    structured_outputs: Any = None

    # accepted only at the value that means "no change"
    include_stop_str_in_output: Any = None
    prompt_logprobs: Any = None

    @field_validator("temperature", "top_p", "min_p", "repetition_penalty")
    @classmethod
    def _finite(cls, v):
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v


class CompletionRequest(RequestBase):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = Field(default=None, ge=0)     # each token's log-probability and this many alternatives
    echo: bool = False                        # the prompt before the completion (with logprobs: the prompt's too)
    best_of: Optional[int] = Field(default=None, ge=1, le=MAX_CHOICES)    # samples per prompt; the n most likely
    suffix: Any = None


class ChatMessage(BaseModel):
    # extra keys (``name``, ``tool_calls`` …) go to the checkpoint's chat template, which defines what they mean
    model_config = ConfigDict(extra="allow")

    role: str
    content: Union[str, list[dict], None] = None


class ChatCompletionRequest(RequestBase):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = Field(default=None, gt=0)
    add_generation_prompt: bool = True        # vLLM extension: end the chat prompt with the assistant's turn opener
    logprobs: Optional[bool] = None           # each token's log-probability, with top_logprobs alternatives
    top_logprobs: Optional[int] = Field(default=None, ge=0)
    # the chat format's options (vLLM / SGLang): a Jinja template's variables, or the DeepSeek-V4 encoding's
    # {"thinking": bool}; reasoning_effort: the V4 encoding's "high" / "max" (`TextCodec.chat_prompt`)
    chat_template_kwargs: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[str] = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's): a ``prompt`` (with the tokenizer's special tokens unless ``add_special_tokens``
    is false) or chat ``messages`` (the chat format; ``add_generation_prompt``) — exactly one."""
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's): token ids → text."""
    model: Optional[str] = None
    tokens: list[int]


# the values that mean "no change" for each field accepted only at them (null: not sent, always neutral)
NEUTRAL: dict[str, tuple] = {
    "prompt_logprobs": (), "suffix": ("",),
    "include_stop_str_in_output": (False,),
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "parallel_tool_calls": (),
}


def _same(value, neutral) -> bool:
    """``value == neutral`` without Python's bool / int / float mixing (``true`` is not ``1``; ``0.0`` is ``0``)."""
    if isinstance(neutral, bool) or isinstance(value, bool):
        return type(value) is type(neutral) and value == neutral
    if isinstance(neutral, (int, float)):
        return isinstance(value, (int, float)) and value == neutral
    return type(value) is type(neutral) and value == neutral


def check_neutral(req: RequestBase) -> None:
    """400 naming the first field set to a value other than its neutral one (the server does not implement it)."""
    for name in type(req).model_fields:
        if name not in NEUTRAL:
            continue
        value = getattr(req, name)
        if value is None or any(_same(value, v) for v in NEUTRAL[name]):
            continue
        allowed = " or ".join(json.dumps(v) for v in (None, *NEUTRAL[name]))
        raise ApiError(400, f"{name}: not supported by this server (only {allowed}, which change nothing), got "
                            f"{_shown(value)}", name)


def _shown(value, limit: int = 80) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _validation_error(e: ValidationError) -> ApiError:
    first = e.errors(include_url=False)[0]
    loc = [str(x) for x in first.get("loc", ())]
    param = loc[0] if loc else None                # the top-level field (not pydantic's union-member tags)
    if first.get("type") == "extra_forbidden":
        if len(loc) == 1:
            return ApiError(400, f"{param}: not supported by this server (unknown field)", param)
        return ApiError(400, f"{'.'.join(loc)}: unknown field", param)
    got = first.get("input")
    shown = "" if isinstance(got, dict) or got is None else f" (got {_shown(got)})"
    return ApiError(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}{shown}", param)


def parse_request(body: bytes, content_type: str | None, schema: type[_Strict]) -> _Strict:
    """A validated request of ``schema`` from a POST body, or `ApiError` naming what is wrong."""
    text = parse_json_body(body, content_type)
    try:
        req = schema.model_validate_json(text)              # JSON mode: strict types, nested objects from JSON
    except ValidationError as e:
        raise _validation_error(e) from None
    check_neutral(req)
    return req
