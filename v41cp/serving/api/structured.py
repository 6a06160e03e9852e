"""The structured-output fields of a request → one llguidance grammar (`SamplingParams.grammar`,
`v41cp.serving.runner.grammar`), or a 400 naming the field.

* ``response_format`` (the OpenAI API; chat, and completions as vLLM takes it): ``{"type": "text"}`` (nothing),
  ``{"type": "json_object"}`` (any JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema",
  "strict", "description"}}`` (JSON matching ``schema``);
* ``structured_outputs`` (vLLM's): exactly one of ``json`` (a schema, or its JSON text), ``regex`` (the whole
  output matches it) or ``choice`` (one of these strings).

JSON is compact (no whitespace between tokens: a model cannot pad its output forever), as llguidance writes it with
``whitespace_flexible`` off. The grammar is checked against the checkpoint's tokenizer when the engine takes the
request (an invalid schema or regex: 400 with llguidance's message).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from v41cp.serving.api.protocol import ApiError

__all__ = ["grammar_of", "JSON_OPTIONS"]

JSON_OPTIONS = {"whitespace_flexible": False}


def _json(schema: Any, field: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ApiError(400, f"{field}: the schema is not JSON: {e}", field) from None
    if not isinstance(schema, dict):
        raise ApiError(400, f"{field}: a JSON schema is an object, got {type(schema).__name__}", field)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise ApiError(400, f"{field}: {e}", field) from None


def _response_format(rf: Any) -> str | None:
    field = "response_format"
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise ApiError(400, f"{field}: an object with a type (\"text\", \"json_object\" or \"json_schema\")", field)
    kind, extra = rf["type"], set(rf) - {"type"}
    if kind in ("text", "json_object") and extra:
        raise ApiError(400, f"{field}: type {kind!r} takes no other keys, got {sorted(extra)}", field)
    if kind == "text":
        return None
    if kind == "json_object":
        return _json({"type": "object"}, field)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if extra != {"json_schema"} or not isinstance(spec, dict):
            raise ApiError(400, f"{field}: type 'json_schema' needs a json_schema object (name, schema)", field)
        unknown = set(spec) - {"name", "schema", "strict", "description"}
        if unknown:
            raise ApiError(400, f"{field}: json_schema has unknown keys {sorted(unknown)}", field)
        if "schema" not in spec:
            raise ApiError(400, f"{field}: json_schema.schema is missing", field)
        return _json(spec["schema"], field)
    raise ApiError(400, f"{field}: type must be \"text\", \"json_object\" or \"json_schema\", got {kind!r}", field)


def _structured_outputs(so: Any) -> str:
    field = "structured_outputs"
    if not isinstance(so, dict):
        raise ApiError(400, f"{field}: an object with one of json, regex, choice", field)
    given = {k: v for k, v in so.items() if v is not None}
    unknown = set(given) - {"json", "regex", "choice"}
    if unknown or len(given) != 1:
        raise ApiError(400, f"{field}: give exactly one of json, regex, choice (got {sorted(given)})", field)
    (kind, value), = given.items()
    if kind == "json":
        return _json(value, field)
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise ApiError(400, f"{field}: regex must be a non-empty string", field)
        return llguidance.LLMatcher.grammar_from_regex(value)
    if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
        raise ApiError(400, f"{field}: choice must be a non-empty list of non-empty strings", field)
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))


def grammar_of(response_format: Any, structured_outputs: Any) -> str | None:
    """The request's grammar (None: free text). At most one of the two fields may ask for structure."""
    a = _response_format(response_format) if response_format is not None else None
    b = _structured_outputs(structured_outputs) if structured_outputs is not None else None
    if a is not None and b is not None:
        raise ApiError(400, "structured_outputs: give it or a structured response_format, not both",
                       "structured_outputs")
    return a if a is not None else b
