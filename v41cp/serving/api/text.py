"""Text in, text out: a checkpoint's own tokenizer, its chat format, and streaming detokenization.

* `TextCodec.from_checkpoint(dir)` reads ``tokenizer.json`` (the ``tokenizers`` package) and, when the
  checkpoint provides one, its chat format: ``chat_template`` of ``tokenizer_config.json`` or a
  ``chat_template.jinja`` file (the Hugging Face convention; rendered in Jinja's immutable sandbox, as
  ``transformers`` does); without a template, a vocabulary holding the DeepSeek-V4 chat markers speaks the
  release's encoding (`v41cp.serving.api.chat_v4`: thinking and non-thinking, which is the default). Without
  either, `TextCodec.chat_prompt` raises `ChatFormatError` saying so.
* `TextStream` turns a growing list of output token ids into text deltas whose concatenation is exactly
  ``decode(ids)`` (incremental detokenization by a prefix / read offset, so each token costs a short decode,
  and a token that ends mid-character waits for the next), and applies OpenAI-style stop strings: the text
  ends before the first stop string and the characters that might start one are held back until decided.

Everything here is host-side Python; nothing touches the engine or a device.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from v41cp.serving.api import chat_v4

__all__ = ["ChatFormatError", "TextCodec", "TextStream", "normalize_messages"]

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatFormatError(ValueError):
    """The checkpoint has no chat format, or the messages (or the chat options: ``param``) do not fit it (names the
    offending value)."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


def _token_text(value) -> str | None:
    """``bos_token`` / ``eos_token`` of a tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def normalize_messages(messages) -> list[dict]:
    """Validate chat ``messages`` (a list of ``{"role", "content"}``; content a string or a list of
    ``{"type": "text", "text": ...}`` parts) and return them with string contents. Errors name the message."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatFormatError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatFormatError(f"messages[{i}] must be an object with role and content, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise ChatFormatError(f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {role!r}")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ChatFormatError(f"messages[{i}].content[{j}] must be a text part "
                                          "({\"type\": \"text\", \"text\": ...}); only text is supported")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None and role == "assistant":       # an assistant turn that only called tools
            content = ""
        if not isinstance(content, str):
            raise ChatFormatError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        out.append({**m, "role": role, "content": content})
    return out


@dataclass
class TextCodec:
    """A checkpoint's tokenizer and optional chat template. ``path`` names where they came from (errors)."""

    tokenizer: object                        # tokenizers.Tokenizer
    path: str = ""
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    deepseek_v4: bool = False                # no template, the V4 chat markers in the vocabulary: the V4 encoding
    _compiled: object = field(default=None, repr=False)

    @classmethod
    def from_checkpoint(cls, path) -> "TextCodec":
        """Read ``tokenizer.json`` (required) and the chat format (optional) of checkpoint directory ``path``."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            raise ChatFormatError(f"checkpoint {str(path)!r} has no tokenizer.json: text input and output need it "
                                  "(token ids still work)")
        tok = Tokenizer.from_file(str(tok_file))
        template, bos, eos = None, None, None
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.exists():
            tc = json.loads(cfg_file.read_text())
            template = tc.get("chat_template")
            if isinstance(template, list):          # named templates: [{"name": "default", "template": ...}]
                named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                template = named.get("default")
            bos, eos = _token_text(tc.get("bos_token")), _token_text(tc.get("eos_token"))
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text()
        if template is not None and not isinstance(template, str):
            raise ChatFormatError(f"{str(cfg_file)!r}: chat_template must be a string, got {type(template).__name__}")
        v4 = template is None and all(tok.token_to_id(m) is not None for m in chat_v4.MARKERS)
        return cls(tok, str(path), template, bos, eos, v4)

    # ------------------------------------------------------------------ tokens <-> text
    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens``: what the tokenizer's post-processor adds to a plain
        prompt (a BOS, for DeepSeek's). Chat prompts are encoded without: their template spells them."""
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a string, got {type(text).__name__}")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of output ids; special tokens (EOS, chat markers) are left out, as the OpenAI API does."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def stream(self, stop: Sequence[str] = (), hidden: Sequence[int] = (), min_tokens: int = 0) -> "TextStream":
        return TextStream(self, tuple(stop), tuple(hidden), min_tokens)

    # ------------------------------------------------------------------ chat
    @property
    def has_chat_format(self) -> bool:
        return self.chat_template is not None or self.deepseek_v4

    def chat_prompt(self, messages, add_generation_prompt: bool = True, options: dict | None = None,
                    reasoning_effort: str | None = None) -> str:
        """The prompt text of chat ``messages`` in the checkpoint's own chat format. ``options`` (the API's
        ``chat_template_kwargs``): variables of a Jinja template; for the DeepSeek-V4 encoding only ``thinking``
        (alias ``enable_thinking``, a bool; default False). ``reasoning_effort``: the V4 encoding's ``"high"`` /
        ``"max"`` (a template has none)."""
        messages = normalize_messages(messages)
        options = dict(options or {})
        if self.deepseek_v4:
            return self._v4_prompt(messages, add_generation_prompt, options, reasoning_effort)
        if reasoning_effort is not None:
            raise ChatFormatError(f"reasoning_effort: not supported by the chat template of {self.path!r} (it takes "
                                  f"no reasoning effort), got {reasoning_effort!r}", "reasoning_effort")
        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception",
                    "strftime_now"} & set(options)
        if reserved:
            raise ChatFormatError(f"chat_template_kwargs may not set {sorted(reserved)}", "chat_template_kwargs")
        if self.chat_template is None:
            raise ChatFormatError(f"checkpoint {self.path!r} provides no chat format (no chat_template in "
                                  "tokenizer_config.json, no chat_template.jinja): send a plain prompt instead")
        if self._compiled is None:
            def raise_exception(message):
                raise ChatFormatError(f"chat template: {message}")

            def strftime_now(fmt):
                return datetime.datetime.now().strftime(fmt)

            # the environment transformers renders chat templates in: loop controls, a non-ASCII-escaping
            # tojson, raise_exception and strftime_now
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = strftime_now
            try:
                self._compiled = env.from_string(self.chat_template)
            except TemplateError as e:
                raise ChatFormatError(f"checkpoint {self.path!r}: the chat template does not parse: {e}") from e

        try:
            return self._compiled.render(**options, messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except (TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
            raise ChatFormatError(f"chat template failed on these messages: {type(e).__name__}: {e}") from e

    @staticmethod
    def _v4_prompt(messages, add_generation_prompt: bool, options: dict, reasoning_effort) -> str:
        if "thinking" in options and "enable_thinking" in options and options["thinking"] != options["enable_thinking"]:
            raise ChatFormatError("chat_template_kwargs: thinking and enable_thinking disagree", "chat_template_kwargs")
        thinking = options.pop("thinking", options.pop("enable_thinking", False))
        options.pop("enable_thinking", None)
        if options:
            raise ChatFormatError(f"chat_template_kwargs: the DeepSeek-V4 chat format takes only 'thinking', got "
                                  f"{sorted(options)}", "chat_template_kwargs")
        if type(thinking) is not bool:
            raise ChatFormatError(f"chat_template_kwargs: thinking must be true or false, got {thinking!r}",
                                  "chat_template_kwargs")
        if reasoning_effort not in chat_v4.REASONING_EFFORTS:
            raise ChatFormatError(f"reasoning_effort: the DeepSeek-V4 chat format takes 'high' or 'max', got "
                                  f"{reasoning_effort!r}", "reasoning_effort")
        if reasoning_effort == "max" and not thinking:
            raise ChatFormatError("reasoning_effort: 'max' applies to thinking mode only (chat_template_kwargs "
                                  "{\"thinking\": true})", "reasoning_effort")
        for i, m in enumerate(messages):
            extra = set(m) - {"role", "content", "reasoning_content"}
            if extra:
                raise ChatFormatError(f"messages[{i}]: the DeepSeek-V4 chat format here encodes role, content and "
                                      f"reasoning_content only, got {sorted(extra)}")
        try:
            return chat_v4.encode_messages(messages, thinking, reasoning_effort, add_generation_prompt)
        except ValueError as e:
            raise ChatFormatError(str(e)) from e

    def chat_ids(self, messages, add_generation_prompt: bool = True, options: dict | None = None,
                 reasoning_effort: str | None = None) -> list[int]:
        return self.encode(self.chat_prompt(messages, add_generation_prompt, options, reasoning_effort),
                           add_special_tokens=False)


class TextStream:
    """Incremental detokenization of one request's output, with stop strings.

    `push(token_id)` returns the newly final text (possibly ""), `finish()` the rest; their concatenation is
    ``decode(ids)`` cut before the first stop string. After a stop string appears, ``stopped`` is True and
    later pushes return "". ``hidden`` ids (the EOS that ended the request) are never part of the text.
    ``min_tokens``: stop strings are looked for only once that many tokens are in (as vLLM: the text of the earlier
    tokens is released as it comes and never stops the request). ``text`` is everything returned so far; ``ids``
    every token that makes up the text."""

    def __init__(self, codec: TextCodec, stop: tuple[str, ...] = (), hidden: tuple[int, ...] = (),
                 min_tokens: int = 0):
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self.codec, self.stop, self.hidden = codec, stop, frozenset(int(t) for t in hidden)
        self.min_tokens = min_tokens
        self.ids: list[int] = []
        self._prefix = self._read = 0            # decode window: ids[prefix:read] was already turned into text
        self._raw = ""                           # every detokenized character so far
        self._sent = 0                           # characters of _raw handed out
        self.stopped = False
        self._hold = max((len(s) for s in stop), default=1) - 1

    @property
    def text(self) -> str:
        return self._raw[: self._sent]

    def push(self, token_id: int) -> str:
        if self.stopped or int(token_id) in self.hidden:
            return ""
        self.ids.append(int(token_id))
        before = self.codec.decode(self.ids[self._prefix:self._read])
        after = self.codec.decode(self.ids[self._prefix:])
        if after.startswith(before):
            if len(after) > len(before) and not after.endswith("\ufffd"):
                self._raw += after[len(before):]
                self._prefix, self._read = self._read, len(self.ids)
        else:                                # a decoder that rewrites earlier text: resync on the full decode
            full = self.codec.decode(self.ids)
            if full.startswith(self._raw) and not full.endswith("\ufffd"):
                self._raw = full
                self._prefix, self._read = max(0, len(self.ids) - 1), len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The text still held back (a partial character, or characters that could have begun a stop string)."""
        if not self.stopped:
            full = self.codec.decode(self.ids)
            if full.startswith(self._raw):
                self._raw = full
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        looking = bool(self.stop) and len(self.ids) >= self.min_tokens
        if looking:
            # released characters were already known not to begin a stop string (or came before min_tokens)
            hits = [i for i in (self._raw.find(s, self._sent) for s in self.stop) if i >= 0]
            if hits:
                end = min(hits)
                out = self._raw[self._sent:end]
                self._raw, self._sent, self.stopped = self._raw[:end], end, True
                return out
        end = len(self._raw) if final or not looking else max(self._sent, len(self._raw) - self._hold)
        out = self._raw[self._sent:end]
        self._sent = end
        return out
