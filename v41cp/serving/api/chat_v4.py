"""The DeepSeek-V4 release's chat encoding (thinking and non-thinking), written from its public description
(the release's ``encoding/README.md`` and its golden test files): the released checkpoints ship this encoding as
code, not as a Jinja chat template, so `v41cp.serving.api.text.TextCodec` uses it for a checkpoint whose vocabulary
holds the V4 chat markers and which has no template.

A prompt is one line of text, nothing between turns:

* ``<｜begin▁of▁sentence｜>`` once at the start; with ``reasoning_effort="max"`` in thinking mode, `EFFORT_MAX`
  right after it (before the first message);
* a system message: its content as it is;
* a user message: ``<｜User｜>`` + content + ``<｜Assistant｜>``, then ``<think>`` when thinking and it is the last
  user message, else ``</think>`` (so the generation prompt ends ``<｜Assistant｜><think>`` or
  ``<｜Assistant｜></think>``);
* an assistant message: in thinking mode and after the last user message, its ``reasoning_content`` +
  ``</think>``; then its content and ``<｜end▁of▁sentence｜>`` (earlier turns' reasoning is dropped). With
  ``add_generation_prompt=False`` a final assistant message gets no EOS (the model continues it).

Tools, the ``tool`` / ``developer`` / ``latest_reminder`` roles and the internal task tokens are not encoded here
(`ChatFormatError` naming the message).
"""

from __future__ import annotations

__all__ = ["BOS", "EOS", "USER", "ASSISTANT", "THINK", "END_THINK", "EFFORT_MAX", "MARKERS", "encode_messages",
           "REASONING_EFFORTS"]

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
MARKERS = (BOS, EOS, USER, ASSISTANT, THINK, END_THINK)        # a vocabulary with all of these speaks this format
REASONING_EFFORTS = (None, "high", "max")                        # "high" renders as None does

EFFORT_MAX = ("Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
              "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
              "root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
              "adversarial scenarios.\n"
              "Explicitly write out your entire deliberation process, documenting every intermediate step, "
              "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
              "unchecked.\n\n")


def encode_messages(messages: list[dict], thinking: bool = False, reasoning_effort: str | None = None,
                    add_generation_prompt: bool = True) -> str:
    """The prompt text of ``messages`` (``{"role", "content"[, "reasoning_content"]}``, string contents) in
    thinking or non-thinking mode (see the module docstring). Raises ValueError naming an unsupported role or
    effort (the caller turns it into its own error type)."""
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {list(REASONING_EFFORTS)}, got {reasoning_effort!r}")
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    last_user = users[-1] if users else -1
    out = [BOS]
    if thinking and reasoning_effort == "max":
        out.append(EFFORT_MAX)
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if role == "system":
            out.append(content)
        elif role == "user":
            out += [USER, content, ASSISTANT, THINK if thinking and i == last_user else END_THINK]
        elif role == "assistant":
            if thinking and i > last_user:
                reasoning = m.get("reasoning_content") or ""
                if not isinstance(reasoning, str):
                    raise ValueError(f"messages[{i}].reasoning_content must be a string")
                out += [reasoning, END_THINK]
            out.append(content)
            if add_generation_prompt or i < len(messages) - 1:
                out.append(EOS)
        else:
            raise ValueError(f"messages[{i}].role {role!r} is not encoded by v41cp's DeepSeek-V4 chat format "
                             "(system, user and assistant messages only)")
    return "".join(out)
