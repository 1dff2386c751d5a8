"""infer.tokenizer against transformers' tokenizer on the test checkpoints of every architecture."""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from infer.errors import ChatTemplateError, CheckpointError
from infer.tokenizer import StreamDecoder, Tokenizer
from reference import build_checkpoint
from reference.checkpoints import ARCHS
from reference.tiny_tokenizer import spec_for
from tests.helpers import needs_chat_oracle, time_limit

TEXTS = [
    "Hello world",
    "The lighthouse keeper climbed the stairs.",
    "naïve café 日本語 emoji 🙂",
    "Grüße, привет, 你好, 한국어, Ελληνικά ❤️ 🚀👍🏽",
    "  leading spaces\n\nnew lines\ttabs   trailing  ",
    "numbers 1234567 3.14159 and code: def f(x): return x**2",
    "specials in text: <|eot_id|> <|im_end|> <end_of_turn> <bos>",
    "",
]

CHAT = [
    {"role": "system", "content": "You are brief. Réponds en français si possible."},
    {"role": "user", "content": "Hi there 🙂"},
    {"role": "assistant", "content": "Hello! What's up?"},
    {"role": "user", "content": "  Tell me about 日本語.  "},
]


@cache
def ours(arch: str) -> Tokenizer:
    return Tokenizer(build_checkpoint(arch))


@cache
def theirs(arch: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(build_checkpoint(arch))


def hf_chat_ids(arch: str, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    ids = theirs(arch).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
    )
    return list(ids)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(arch: str, text: str) -> None:
    tok, hf = ours(arch), theirs(arch)
    for add_special in (True, False):
        ids = tok.encode(text, add_special_tokens=add_special)
        assert ids == hf(text, add_special_tokens=add_special)["input_ids"]
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("arch", ARCHS)
def test_bos_follows_the_real_models(arch: str) -> None:
    tok = ours(arch)
    ids = tok.encode("hello")
    if spec_for(arch).bos_token is None:  # Qwen: no BOS token, and none added
        assert tok.bos_token_id is None and ids == tok.encode("hello", add_special_tokens=False)
    else:
        assert tok.bos_token_id is not None and ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


@pytest.mark.parametrize(
    ("arch", "eos_tokens"),
    [
        ("llama", {"<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"}),
        ("qwen2", {"<|im_end|>", "<|endoftext|>"}),
        ("qwen3", {"<|im_end|>", "<|endoftext|>"}),
        ("gemma3_text", {"<eos>", "<end_of_turn>"}),
    ],
)
def test_special_token_ids(arch: str, eos_tokens: set[str]) -> None:
    tok, hf = ours(arch), theirs(arch)
    assert {tok.decode([i]) for i in tok.eos_token_ids} == eos_tokens
    assert len(tok.eos_token_ids) == len(eos_tokens), "eos ids must not repeat"
    assert tok.eos_token_ids[0] == hf.eos_token_id
    generation = json.loads((build_checkpoint(arch) / "generation_config.json").read_text())
    assert set(generation["eos_token_id"]) == set(tok.eos_token_ids)
    assert (tok.bos_token_id, tok.pad_token_id) == (hf.bos_token_id, hf.pad_token_id)
    assert tok.vocab_size == len(hf)


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template_matches_transformers(arch: str) -> None:
    # A fixed date keeps Llama's template (which reads today's date otherwise) comparable.
    kwargs = {"date_string": "26 Jul 2024"} if arch == "llama" else {}
    tok, hf = ours(arch), theirs(arch)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, **kwargs)
    assert ids == hf_chat_ids(arch, CHAT, **kwargs)
    text = tok.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=False, **kwargs)
    assert text == hf.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=False, **kwargs)
    assert ids != tok.apply_chat_template(CHAT, add_generation_prompt=False, **kwargs)


def test_llama_template_reads_todays_date_like_transformers() -> None:
    assert ours("llama").apply_chat_template(CHAT[1:]) == hf_chat_ids("llama", CHAT[1:])


def test_template_variables_and_tools_match_transformers() -> None:
    tools = [{"type": "function", "function": {"name": "météo", "description": "Wetter für 東京"}}]
    messages = [
        *CHAT,
        {"role": "assistant", "content": "Sure.", "tool_calls": None},
        {"role": "user", "content": "?"},
    ]
    tok = ours("qwen3")
    ids = tok.apply_chat_template(messages, tools=tools, enable_thinking=False)
    assert ids == hf_chat_ids("qwen3", messages, tools=tools, enable_thinking=False)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "météo" in tok.decode(ids), "tojson must not escape non-ASCII"


def test_template_errors_raise_like_transformers() -> None:
    not_alternating = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="alternate"):  # a ValueError naming the template's own message
        ours("gemma3_text").apply_chat_template(not_alternating)
    with pytest.raises(jinja2.TemplateError, match="alternate"):
        hf_chat_ids("gemma3_text", not_alternating)
    with pytest.raises(ValueError, match="empty conversation"):
        ours("qwen3").apply_chat_template([])


# Block tags on their own indented lines: only trim_blocks + lstrip_blocks render this without stray
# whitespace. `name` is tested with `is defined`, so a None value must be dropped, not rendered.
# `generation` is transformers' assistant-mask tag, which some real templates contain.
PLAIN_TEMPLATE = """\
{% for m in messages %}
    {% if m.name is defined %}
[{{ m.role }}:{{ m.name }}]
    {% else %}
[{{ m.role }}]
    {% endif %}
    {% generation %}
{{ m.content }}
    {% endgeneration %}
{% endfor %}
"""


@needs_chat_oracle
def test_chat_template_jinja_file_wins_and_renders_like_transformers(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    shutil.copytree(build_checkpoint("qwen3"), target)
    (target / "chat_template.jinja").write_text(PLAIN_TEMPLATE)
    tok = Tokenizer(target)
    messages = [
        {"role": "user", "content": "Hi", "name": None},
        {"role": "assistant", "content": "Yo", "name": "bot"},
    ]
    assert tok.apply_chat_template(messages, tokenize=False) == "[user]\nHi\n[assistant:bot]\nYo\n"
    hf = AutoTokenizer.from_pretrained(target)
    assert tok.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=True, return_dict=False)


@pytest.mark.parametrize("arch", ARCHS)
@given(text=st.text(max_size=40))
def test_encode_matches_transformers_on_any_text(arch: str, text: str) -> None:
    assert ours(arch).encode(text) == theirs(arch)(text)["input_ids"]


def stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    decoder = StreamDecoder(tok, skip_special_tokens=skip_special_tokens)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize("arch", ARCHS)
@given(text=st.text(min_size=1, max_size=40))
def test_stream_decoder_never_emits_partial_characters(arch: str, text: str) -> None:
    tok = ours(arch)
    ids = tok.encode(text, add_special_tokens=False)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces), pieces


@pytest.mark.parametrize("arch", ARCHS)
@given(data=st.data())
def test_stream_decoder_concatenation_equals_decode_for_any_ids(arch: str, data: st.DataObject) -> None:
    """Arbitrary ids may be invalid UTF-8 (U+FFFD in the full decode too) and include special tokens."""
    tok = ours(arch)
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=30), label="ids")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    assert "".join(stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


def test_stream_decoder_holds_back_a_split_character() -> None:
    tok = ours("llama")
    ids = tok.encode("naïve", add_special_tokens=False)
    # 'ï' is two bytes; the trained vocabulary splits it across two tokens ("aÃ" + "¯ve").
    assert len(ids) == 3 and tok.decode(ids[1:2]).endswith("\ufffd")
    assert stream(tok, ids) == ["n", "", "aïve", ""]


def test_missing_tokenizer_json_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json not found.*fast tokenizer"):
        Tokenizer(tmp_path)


def test_missing_chat_template_says_so(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    shutil.copytree(build_checkpoint("llama"), target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    tok = Tokenizer(target)
    assert tok.encode("still works") == ours("llama").encode("still works")
    with pytest.raises(ValueError, match="has no chat_template"):
        tok.apply_chat_template(CHAT)


def test_special_token_missing_from_vocab_is_an_error(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    shutil.copytree(build_checkpoint("gemma3_text"), target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["bos_token"] = {"content": "<s>", "special": True}  # the AddedToken form
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="bos_token='<s>'"):
        Tokenizer(target)


@pytest.mark.parametrize("arch", ARCHS)
@given(data=st.data())
def test_stream_decoder_on_long_runs_of_broken_utf8(arch: str, data: st.DataObject) -> None:
    """Long runs of byte tokens (mostly invalid UTF-8, with whole characters split across tokens in between):
    past MAX_HELD_BACK ids the decoder releases text early, and the pieces still concatenate to decode()."""
    tok = ours(arch)
    lone_bytes = [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"]
    split_chars = st.text(alphabet="ïé€😀ß", min_size=1, max_size=3).map(
        lambda t: tok.encode(t, add_special_tokens=False))
    pieces = st.one_of(st.sampled_from(lone_bytes).map(lambda i: [i]), split_chars)
    ids = [i for piece in data.draw(st.lists(pieces, min_size=20, max_size=80), label="pieces") for i in piece]
    assert "".join(stream(tok, ids)) == tok.decode(ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_stream_decoder_early_release_never_splits_a_character(arch: str) -> None:
    """A long invalid run in which one character is completed by a token that itself ends in half of the next:
    the early release must not cut between the two halves (the cut is tried at every offset that can hold it)."""
    tok = ours(arch)
    text = {i: tok.decode([i]) for i in range(tok.vocab_size)}
    lone = [i for i, t in text.items() if t == "\ufffd"]
    ends_split = [i for i, t in text.items() if t.endswith("\ufffd") and t != "\ufffd"]
    pairs = [(a, b) for b in ends_split for a in lone
             if tok.decode([a, b]).count("\ufffd") < text[a].count("\ufffd") + text[b].count("\ufffd")]
    assert pairs, "the test vocabulary has no token that completes one character and starts another"
    for a, b in pairs[:3]:
        for k in range(8, 16):  # puts the pair at every offset of the first early release
            ids = [lone[0]] * k + [a, b] + [lone[0]] * 8
            assert "".join(stream(tok, ids)) == tok.decode(ids), ids


def test_stream_decoder_is_linear_on_a_run_that_never_completes() -> None:
    """Each push re-decodes a bounded window: 3000 ids of invalid UTF-8 cost O(n) decoded ids, not O(n^2)."""
    tok = ours("llama")
    invalid = next(i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd")
    decoded = 0
    real_decode = tok.decode

    class Counting:
        vocab_size = tok.vocab_size

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            nonlocal decoded
            decoded += len(ids)
            return real_decode(ids, skip_special_tokens=skip_special_tokens)

    pieces = stream(Counting(), [invalid] * 3000)  # type: ignore[arg-type]
    assert "".join(pieces) == tok.decode([invalid] * 3000)
    assert decoded < 100 * 3000, decoded


def test_decode_refuses_unknown_ids_and_non_ints() -> None:
    tok = ours("llama")
    with pytest.raises(ValueError, match=f"token id {tok.vocab_size} is not in the tokenizer's vocabulary"):
        tok.decode([5, tok.vocab_size])
    with pytest.raises(ValueError, match="token id -1"):
        tok.decode([-1])
    with pytest.raises(TypeError, match="token ids must be ints"):
        tok.decode([1.0])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="iterable of token ids"):
        tok.decode("12")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="encode takes a str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        StreamDecoder(tok).push(10**6)


def with_template(tmp_path: Path, template: str) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(build_checkpoint("qwen3"), target)
    (target / "chat_template.jinja").write_text(template)
    return target


def test_template_syntax_error_fails_at_load(tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match=r"does not compile.*chat_template|does not compile"):
        Tokenizer(with_template(tmp_path, "{% for m in messages %}{{ m.content }}"))


@pytest.mark.parametrize(("template", "match"), [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran over"),
    ("{{ 'x' * 10**9 }}", "over the size limit|power over the limit"),
    ("{% for i in range(100000) %}{{ 'xxxxxxxxxx' * 1000 }}{% endfor %}", "rendered over"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "failed"),
], ids=["nested loops", "huge string", "huge output", "unbounded recursion"])
def test_hostile_templates_stop_with_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   template: str, match: str) -> None:
    import infer.tokenizer

    monkeypatch.setattr(infer.tokenizer, "TEMPLATE_TIME_LIMIT_S", 0.5)
    tok = Tokenizer(with_template(tmp_path, template))
    with time_limit(30, "a hostile chat template"), pytest.raises(ChatTemplateError, match=match):
        tok.apply_chat_template(CHAT, tokenize=False)
    # the tokenizer is still usable afterwards
    assert tok.decode(tok.encode("still fine")) == "still fine"


@pytest.mark.parametrize(("file", "content", "match"), [
    ("tokenizer.json", "{broken", "cannot be read as a tokenizer"),
    ("tokenizer_config.json", "[1]", "must hold a JSON object"),
    ("tokenizer_config.json", b"\xff\xfe", "not valid JSON"),
    ("generation_config.json", '{"eos_token_id": "</s>"}', "eos_token_id='</s>' is invalid"),
    ("config.json", '{"eos_token_id": [1, true]}', "eos_token_id=.* is invalid"),
])
def test_broken_tokenizer_files_are_named(tmp_path: Path, file: str, content: str | bytes, match: str) -> None:
    target = tmp_path / "ckpt"
    shutil.copytree(build_checkpoint("llama"), target)
    if isinstance(content, bytes):
        (target / file).write_bytes(content)
    else:
        (target / file).write_text(content)
    with pytest.raises(CheckpointError, match=match) as info:
        Tokenizer(target)
    assert file in str(info.value)
