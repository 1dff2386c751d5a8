"""Text <-> token ids for a Hugging Face checkpoint directory, without `transformers`.

tokenizer.json goes through the `tokenizers` library (its post-processor decides BOS, as in transformers 5);
tokenizer_config.json supplies the named special tokens and the chat template, which is rendered the way
transformers renders it. The engine itself only ever sees token ids.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, overload

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _BackendTokenizer

from infer.chat_tools import tool_schema
from infer.errors import ChatTemplateError

# The named special tokens transformers passes to a chat template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """A checkpoint's tokenizer: encode, decode, chat template, special token ids."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        tokenizer_file = self.path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found: the checkpoint needs a fast tokenizer (tokenizer.json). "
                "Pass the model directory itself; if it only has a slow tokenizer, convert it once with "
                "transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir)."
            )
        self._backend = _BackendTokenizer.from_file(str(tokenizer_file))
        self._config = _read_json(self.path / "tokenizer_config.json")
        self.special_tokens: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            token = _token_content(self._config.get(name))
            if token is not None:
                self._require_in_vocab(token, name)
                self.special_tokens[name] = token
        self.chat_template = self._find_chat_template()
        self._compiled_template: jinja2.Template | None = None
        self._eos_token_ids = self._collect_eos_ids()

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: tokenizer_config's eos_token, then generation_config.json's and
        config.json's eos_token_id (an int or a list), without repeats."""
        return list(self._eos_token_ids)

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added tokens included (the model's vocab_size may be larger)."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies tokenizer.json's post-processor (e.g. BOS)."""
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool | None = ...,
        tokenize: Literal[True] = ...,
        *,
        tools: Sequence[Mapping[str, Any] | Callable[..., Any]] | None = ...,
        continue_final_message: bool | str = ...,
        documents: Sequence[Mapping[str, Any]] | None = ...,
        **template_kwargs: Any,
    ) -> list[int]: ...

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool | None,
        tokenize: Literal[False],
        *,
        tools: Sequence[Mapping[str, Any] | Callable[..., Any]] | None = ...,
        continue_final_message: bool | str = ...,
        documents: Sequence[Mapping[str, Any]] | None = ...,
        **template_kwargs: Any,
    ) -> str: ...

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool | None = ...,
        *,
        tokenize: Literal[False],
        tools: Sequence[Mapping[str, Any] | Callable[..., Any]] | None = ...,
        continue_final_message: bool | str = ...,
        documents: Sequence[Mapping[str, Any]] | None = ...,
        **template_kwargs: Any,
    ) -> str: ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool | None = None,
        tokenize: bool = True,
        *,
        tools: Sequence[Mapping[str, Any] | Callable[..., Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool | str = False,
        **template_kwargs: Any,
    ) -> list[int] | str:
        """Render `messages` with the checkpoint's chat template, as transformers does; token ids by default.

        Extra keyword arguments reach the template as variables (e.g. enable_thinking=False for Qwen 3).
        The rendered text already holds its special tokens, so it is encoded without adding any.
        `add_generation_prompt` defaults to True, or to False with `continue_final_message` (which leaves the
        last message open, to be continued: True for its "content", or the name of another field). `tools`
        are JSON-schema dicts or functions with type hints and a Google-style docstring (see
        `infer.chat_tools`). Template errors, its own `raise_exception` included, raise `ChatTemplateError`.
        """
        if self.chat_template is None:
            raise ValueError(
                f"the checkpoint at {self.path} has no chat_template (looked in tokenizer_config.json and "
                "chat_template.jinja); encode plain text with encode() instead"
            )
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message continues the last message; add_generation_prompt starts a new one: "
                "pass only one of them"
            )
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        # transformers drops None-valued keys: templates test for a key's presence, not for None.
        chat = [_alias_reasoning({k: v for k, v in message.items() if v is not None}) for message in messages]
        field = ""
        if continue_final_message:
            field, final = _mark_final_message(chat, continue_final_message, self.chat_template)
        variables = {**self.special_tokens, **template_kwargs}
        try:
            text = self._compiled_template.render(
                messages=chat,
                tools=[_tool_dict(t) for t in tools] if tools is not None else None,
                documents=_documents(documents),
                add_generation_prompt=bool(add_generation_prompt if add_generation_prompt is not None
                                           else not continue_final_message),
                **variables,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template of {self.path} failed: {e}") from e
        if field:
            text = _cut_at_continue_tag(text, final)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self._backend.token_to_id(token)

    def _require_in_vocab(self, token: str, name: str) -> None:
        if self._backend.token_to_id(token) is None:
            raise ValueError(
                f"{self.path / 'tokenizer_config.json'} names {name}={token!r}, which tokenizer.json does not contain"
            )

    def _find_chat_template(self) -> str | None:
        # transformers 5 saves the template as its own file, which wins over tokenizer_config.json.
        template_file = self.path / "chat_template.jinja"
        if template_file.is_file():
            return template_file.read_text(encoding="utf-8")
        template = self._config.get("chat_template")
        if template is None or isinstance(template, str):
            return template
        # An older form: a list of named templates, of which "default" is the one used for chat.
        named = {entry["name"]: entry["template"] for entry in template}
        if "default" not in named:
            raise ValueError(
                f"{self.path / 'tokenizer_config.json'} names chat templates {sorted(named)}, none 'default'"
            )
        return str(named["default"])

    def _collect_eos_ids(self) -> list[int]:
        ids: list[int] = []
        eos_id = self._special_id("eos_token")
        if eos_id is not None:
            ids.append(eos_id)
        for name in ("generation_config.json", "config.json"):
            value = _read_json(self.path / name).get("eos_token_id")
            ids.extend([value] if isinstance(value, int) else value or [])
        return list(dict.fromkeys(ids))


class StreamDecoder:
    """Turns a stream of token ids into text pieces, never splitting a multi-byte character.

    A token may end inside a UTF-8 character (byte-level BPE); such a tail decodes to U+FFFD, so the text
    is held back until a later token completes it (or `flush` gives up at the end of the stream).
    Concatenating every `push` and the final `flush` gives `tokenizer.decode(all ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        # Decoding restarts at prefix_offset, where the emitted text ended on a whole character; the ids
        # from prefix_offset to read_offset are re-decoded only so decoders that look at neighbours agree.
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now final (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        # Keep only the ids that will be re-decoded, so a long stream costs the same per token.
        self._ids = self._ids[self._read_offset :]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes to U+FFFD here), then reset."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._ids, self._prefix_offset, self._read_offset = [], 0, 0
        return full_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text in some templates: render the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _compile_template(source: str) -> jinja2.Template:
    """A Jinja environment configured like transformers' chat template renderer."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)  # surfaces as ChatTemplateError from the render

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


# Names a message's reasoning comes under; templates read the first (transformers 5 fills it from the others,
# and fills "thinking" for templates that read that).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _mark_final_message(chat: list[dict[str, Any]], which: bool | str, template: str) -> tuple[str, str]:
    """Append transformers' continue tag to the last message's field (or its last text block), in place on
    `chat` (a copy of the caller's messages); the render is cut at the tag. Returns (field, its text)."""
    if not chat:
        raise ValueError("continue_final_message is set but the conversation is empty")
    field = which if isinstance(which, str) else "content"
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f"continue_final_message: the final message has no {field!r} to continue")
    fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final] if field in _REASONING_FIELDS else [field]
    if not any(f in template for f in fields):
        raise ValueError(f"continue_final_message={field!r}, but the chat template never reads that field")
    if isinstance(final, (list, tuple)):
        blocks = [dict(b) for b in final]
        for block in reversed(blocks):
            if "text" in block:
                final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
                break
        else:
            raise ValueError("continue_final_message: the final message has no text block to continue")
        chat[-1] = {**chat[-1], field: blocks}
    else:
        chat[-1] = {**chat[-1], **{f: chat[-1][f] + _CONTINUE_TAG for f in fields}}
    return field, str(final)


def _cut_at_continue_tag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError("continue_final_message: the chat template dropped part of the final message")
    at = text.rindex(tag)
    # Where the template trimmed the message's trailing spaces, the cut trims them too (as transformers does).
    return text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


def _tool_dict(tool: Mapping[str, Any] | Callable[..., Any]) -> Mapping[str, Any]:
    if isinstance(tool, Mapping):
        return tool
    if inspect.isfunction(tool) or inspect.ismethod(tool):
        return tool_schema(tool)
    raise TypeError(f"a tool must be a JSON-schema dict or a function with type hints, got {type(tool).__name__}")


def _documents(documents: Sequence[Mapping[str, Any]] | None) -> list[Mapping[str, Any]] | None:
    if documents is None:
        return None
    if any(not isinstance(d, Mapping) for d in documents):
        raise TypeError("documents must be a list of dicts (with 'title' and 'text' keys)")
    return list(documents)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with "content"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise ValueError(f"unrecognised special token entry in tokenizer_config.json: {value!r}")
