"""Text <-> token ids for a Hugging Face checkpoint directory, without `transformers`.

tokenizer.json goes through the `tokenizers` library (its post-processor decides BOS, as in transformers 5);
tokenizer_config.json supplies the named special tokens and the chat template, which is rendered the way
transformers renders it. The engine itself only ever sees token ids.
"""

from __future__ import annotations

import contextvars
import inspect
import json
import math
import time
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
from infer.errors import ChatTemplateError, CheckpointError

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
        """Read the tokenizer of checkpoint directory `path`, or of a GGUF file (or a directory holding one
        `.gguf` and no tokenizer.json), whose metadata carries it."""
        if not isinstance(path, (str, Path)):
            raise TypeError(f"Tokenizer takes a checkpoint directory (str or Path), got {type(path).__name__}")
        self.path = Path(path)
        tokenizer_file = self.path / "tokenizer.json"
        gguf_eos_ids: list[int] | None = None
        if not tokenizer_file.is_file() and (gguf_file := _find_gguf(self.path)) is not None:
            from infer.gguf_tokenizer import read_gguf_tokenizer

            parts = read_gguf_tokenizer(gguf_file)
            self._backend, self._config, gguf_eos_ids = parts.backend, parts.config, parts.eos_token_ids
        else:
            self._backend = _read_tokenizer_json(tokenizer_file)
            self._config = _read_json(self.path / "tokenizer_config.json")
        self.special_tokens: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            token = _token_content(self._config.get(name))
            if token is not None:
                self._require_in_vocab(token, name)
                self.special_tokens[name] = token
        self.chat_template = self._find_chat_template()
        # Compiled now, so a template with a syntax error fails at load rather than at first use.
        self._compiled_template = None if self.chat_template is None else _compile_template(
            self.chat_template, self.path)
        self._eos_token_ids = self._collect_eos_ids() if gguf_eos_ids is None else gguf_eos_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: tokenizer_config's eos_token, then generation_config.json's
        eos_token_id (an int or a list), or config.json's where generation_config.json names none."""
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
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__} (decode bytes to text first)")
        _check_encodable(text)
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; every id must be one the tokenizer knows (the backend would drop others silently)."""
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise TypeError(f"decode takes an iterable of token ids, got {type(ids).__name__}")
        ids = list(ids)
        _check_ids(ids, self.vocab_size)
        return str(self._backend.decode(ids, skip_special_tokens=skip_special_tokens))

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
        if self._compiled_template is None:
            raise ValueError(
                f"the checkpoint at {self.path} has no chat_template (looked in tokenizer_config.json and "
                "chat_template.jinja); encode plain text with encode() instead"
            )
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or any(
                not isinstance(m, Mapping) for m in messages):
            raise TypeError("messages must be a list of dicts with 'role' and 'content' keys")
        if add_generation_prompt is not None and not isinstance(add_generation_prompt, bool):
            raise TypeError(f"add_generation_prompt must be True, False or None, got {add_generation_prompt!r}")
        if not isinstance(continue_final_message, (bool, str)):
            raise TypeError(f"continue_final_message must be a bool or a field name, got {continue_final_message!r}")
        for name, value in (("tools", tools), ("documents", documents)):
            if value is not None and not isinstance(value, (list, tuple)):
                raise TypeError(f"{name} must be a list or None, got {type(value).__name__}")
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message continues the last message; add_generation_prompt starts a new one: "
                "pass only one of them"
            )
        # transformers drops None-valued keys: templates test for a key's presence, not for None.
        chat = [_alias_reasoning({k: v for k, v in message.items() if v is not None}) for message in messages]
        field = ""
        if continue_final_message:
            field, final = _mark_final_message(chat, continue_final_message, self.chat_template or "")
        variables = {
            **self.special_tokens,
            **template_kwargs,
            "tools": [_tool_dict(t) for t in tools] if tools is not None else None,
            "documents": _documents(documents),
            "add_generation_prompt": bool(
                add_generation_prompt if add_generation_prompt is not None else not continue_final_message
            ),
        }
        try:
            text = _render_bounded(self._compiled_template, messages=chat, **variables)
        except (jinja2.TemplateError, RecursionError) as e:
            raise ChatTemplateError(f"the chat template of {self.path} failed: {e}") from e
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as e:
            # A message field of a type the template cannot handle (e.g. a role that is not a string).
            raise ChatTemplateError(
                f"the chat template of {self.path} failed on these messages ({type(e).__name__}: {e}); check "
                "that every message has a string 'role' and string or list 'content'"
            ) from e
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
            try:
                return template_file.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise CheckpointError(f"{template_file} is not UTF-8 text ({e})") from e
        template = self._config.get("chat_template")
        if template is None or isinstance(template, str):
            return template
        # An older form: a list of named templates, of which "default" is the one used for chat.
        if not isinstance(template, list) or any(
            not isinstance(e, dict) or not isinstance(e.get("name"), str) or not isinstance(e.get("template"), str)
            for e in template
        ):
            raise CheckpointError(
                f"{self.path / 'tokenizer_config.json'}: chat_template must be a string or a list of "
                "{'name': str, 'template': str} entries"
            )
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
        # generation_config.json's eos_token_id replaces config.json's, as in HF's generate (and the loader).
        found = []
        for name in ("generation_config.json", "config.json"):
            value = _read_json(self.path / name).get("eos_token_id")
            values = [] if value is None else value if isinstance(value, list) else [value]
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
                raise CheckpointError(
                    f"{self.path / name}: eos_token_id={value!r} is invalid; expected a token id or a list of them"
                )
            found.append(values)
        ids.extend(found[0] or found[1])
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

    # A UTF-8 character is at most 4 bytes: past this many held-back ids, all but the last few are final.
    MAX_HELD_BACK = 16

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now final (possibly empty)."""
        _check_ids([token_id], self.tokenizer.vocab_size)  # before it joins the stream
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            if len(self._ids) - self._read_offset > self.MAX_HELD_BACK:
                return self._release_final(prefix_text, full_text)
            return ""
        # Keep only the ids that will be re-decoded, so a long stream costs the same per token.
        self._ids = self._ids[self._read_offset :]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return full_text[len(prefix_text) :]

    def _release_final(self, prefix_text: str, full_text: str) -> str:
        """A long run of ids that never completes a character (invalid UTF-8): emit the text of all but the
        last few ids, at a cut whose text is a prefix of the whole (so no character is split), so each push
        costs the same however long the run. Without this, every push re-decodes the whole run."""
        for cut in range(len(self._ids) - 4, self._read_offset, -1):
            text = self._decode(self._ids[self._prefix_offset : cut])
            if len(text) > len(prefix_text) and full_text.startswith(text):
                self._ids = self._ids[cut - 1 :]  # one id of context for decoders that look at neighbours
                self._prefix_offset, self._read_offset = 0, 1
                return text[len(prefix_text) :]
        return ""

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


# A chat template is code from the checkpoint: it renders in jinja2's sandbox, within these bounds.
TEMPLATE_TIME_LIMIT_S = 5.0
TEMPLATE_MAX_CHARS = 10_000_000
_deadline: contextvars.ContextVar[float] = contextvars.ContextVar("template_deadline", default=math.inf)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, plus a clock checked at every call (every loop over range() makes one) and string or list
    repetition capped, so a hostile template can neither loop forever nor build a huge value."""

    intercepted_binops = frozenset({"*", "**"})

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807 (jinja's name)
        _check_deadline()
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_deadline()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > TEMPLATE_MAX_CHARS:
                    raise jinja2.exceptions.SecurityError("the chat template builds a value over the size limit")
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 1000:
            raise jinja2.exceptions.SecurityError("the chat template raises to a power over the limit")
        return super().call_binop(context, operator, left, right)


def _check_deadline() -> None:
    if time.monotonic() > _deadline.get():
        raise jinja2.exceptions.SecurityError(f"the chat template ran over {TEMPLATE_TIME_LIMIT_S:g} s")


def _render_bounded(template: jinja2.Template, **variables: Any) -> str:
    """Render within TEMPLATE_TIME_LIMIT_S and TEMPLATE_MAX_CHARS (a ChatTemplateError past either)."""
    token = _deadline.set(time.monotonic() + TEMPLATE_TIME_LIMIT_S)
    try:
        pieces, size = [], 0
        for piece in template.generate(**variables):
            size += len(piece)
            if size > TEMPLATE_MAX_CHARS:
                raise jinja2.exceptions.SecurityError(f"the chat template rendered over {TEMPLATE_MAX_CHARS} chars")
            _check_deadline()
            pieces.append(piece)
        return "".join(pieces)
    finally:
        _deadline.reset(token)


def _compile_template(source: str, path: Path) -> jinja2.Template:
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

    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except (jinja2.TemplateSyntaxError, RecursionError) as e:
        raise ChatTemplateError(f"the chat template of {path} does not compile: {e}") from e


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


def _check_encodable(text: str) -> None:
    """Text must be valid Unicode to encode: a lone surrogate (from a bad decode upstream) has no UTF-8 form."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text holds a lone surrogate {text[e.start]!r} at index {e.start}, which is not valid "
                         "Unicode: decode the source with errors='replace' (or fix it) first") from None


def _check_ids(ids: list[Any], vocab: int) -> None:
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"token ids must be ints, got {i!r} ({type(i).__name__})")
        if not 0 <= i < vocab:
            raise ValueError(f"token id {i} is not in the tokenizer's vocabulary (ids 0..{vocab - 1})")


def _find_gguf(path: Path) -> Path | None:
    from infer.gguf import find_gguf  # torch and the gguf reader load only for GGUF files

    return find_gguf(path)


def _read_tokenizer_json(tokenizer_file: Path) -> _BackendTokenizer:
    if not tokenizer_file.is_file():
        raise FileNotFoundError(
            f"{tokenizer_file} not found: the checkpoint needs a fast tokenizer (tokenizer.json), or pass a GGUF "
            "file. Pass the model directory itself; if it only has a slow tokenizer, convert it once with "
            "transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir)."
        )
    try:
        return _BackendTokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # the tokenizers library raises a bare Exception for malformed files
        raise CheckpointError(f"{tokenizer_file} cannot be read as a tokenizer: {e}") from e


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with "content"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise CheckpointError(f"unrecognised special token entry in tokenizer_config.json: {value!r}")
