"""Tools given to a chat template as Python functions: the JSON schema transformers builds for them.

A function becomes `{"type": "function", "function": {"name", "description", "parameters", ["return"]}}`
from its type hints and its Google-style docstring (a description, an `Args:` block, an optional
`Returns:` block; `(choices: [...])` at the end of an argument's description makes an enum), exactly as
`transformers.utils.get_json_schema` writes it, so templates render the same text.
"""

from __future__ import annotations

import inspect
import json
import re
import types
from collections.abc import Callable
from enum import Enum
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

_DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
_ARGS = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
# One argument: "name: description", continued on lines indented deeper than the name.
_ARG = re.compile(r"(?:^|\n)([ \t]*)(\w+):\s*(.*?)\s*(?=\n(?!\1[ \t])[ \t]*\w+:|\Z)", re.DOTALL)
_RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)

_JSON_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_BARE_TYPES: dict[Any, dict[str, Any]] = {
    **{t: {"type": name} for t, name in _JSON_SCALARS.items()},
    list: {"type": "array"},
    tuple: {"type": "array"},
    dict: {"type": "object"},
    Any: {},
}


def tool_schema(func: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of a tool function, as transformers' `get_json_schema` builds it."""
    name = getattr(func, "__name__", "operation")
    doc = inspect.getdoc(func)
    if not doc:
        raise ValueError(f"tool {name} has no docstring; describe it and its Args: in a Google-style docstring")
    description, arg_docs, return_doc = _parse_docstring(doc.strip())
    parameters = _parameters_schema(func, name)
    returns = parameters["properties"].pop("return", None)
    if returns is not None and return_doc is not None:
        returns["description"] = return_doc
    for arg, schema in parameters["properties"].items():
        if arg not in arg_docs:
            raise ValueError(f"tool {name}: the docstring's Args: block does not describe argument {arg!r}")
        text = arg_docs[arg]
        if choices := _CHOICES.search(text):
            schema["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices.group(1))]
            text = text[: choices.start()].strip()
        schema["description"] = text
    function: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if returns is not None:
        function["return"] = returns
    return {"type": "function", "function": function}


def _parse_docstring(doc: str) -> tuple[str | None, dict[str, str], str | None]:
    description = m.group(1).strip() if (m := _DESCRIPTION.search(doc)) else None
    returns = m.group(1).strip() if (m := _RETURNS.search(doc)) else None
    args: dict[str, str] = {}
    if m := _ARGS.search(doc):
        block = "\n".join(line for line in m.group(1).split("\n") if line.strip())
        args = {name: re.sub(r"\s*\n+\s*", " ", text.strip()) for _, name, text in _ARG.findall(block)}
    return description, args, returns


def _parameters_schema(func: Callable[..., Any], name: str) -> dict[str, Any]:
    hints = get_type_hints(func)
    params = inspect.signature(func).parameters
    first = next(iter(params), None)
    # A method's self/cls without a hint is the receiver, not an argument.
    receiver = first if first in {"self", "cls"} and params[first].annotation is inspect.Parameter.empty else None
    required = []
    for arg, param in params.items():
        if arg == receiver:
            continue
        if param.annotation is inspect.Parameter.empty:
            raise ValueError(f"tool {name}: argument {arg!r} has no type hint")
        if param.default is inspect.Parameter.empty:
            required.append(arg)
    properties: dict[str, Any] = {}
    for arg, hint in hints.items():
        if arg == receiver:
            continue
        try:
            properties[arg] = _type_schema(hint)
        except ValueError as e:
            if arg != "return":  # the model never writes the return value: an odd return hint is left out
                raise ValueError(f"tool {name}: argument {arg!r}: {e}") from e
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def _enum_schema(values: list[Any]) -> dict[str, Any]:
    if any(type(v) not in _JSON_SCALARS for v in values):
        raise ValueError(f"enum values {values!r} are not all JSON scalars (int, float, str, bool, None)")
    kinds = list(dict.fromkeys(_JSON_SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def _type_schema(hint: Any) -> dict[str, Any]:
    origin, args = get_origin(hint), get_args(hint)
    if origin is None:
        if isinstance(hint, type) and issubclass(hint, Enum):
            if not list(hint):
                raise ValueError(f"the Enum {hint.__name__} has no members")
            return _enum_schema([member.value for member in hint])
        if hint in _BARE_TYPES:
            return dict(_BARE_TYPES[hint])
        raise ValueError(f"type hint {hint!r} has no JSON schema; use basic types, Enum, Literal, list, tuple, dict")
    if origin is Union or origin is types.UnionType:
        subtypes = [_type_schema(t) for t in args if t is not type(None)]
        if len(subtypes) == 1:
            out = subtypes[0]
        elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subtypes):
            names = sorted({s["type"] for s in subtypes})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": subtypes}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is Literal and args:
        return _enum_schema(list(args))
    if origin is list:
        return {"type": "array", "items": _type_schema(args[0])} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1 or ... in args:
            raise ValueError(f"{hint!r}: write a one-element or variable-length tuple as list[...]")
        return {"type": "array", "prefixItems": [_type_schema(t) for t in args]}
    if origin is dict:
        if len(args) == 2:  # JSON object keys are strings; only the values' type can be stated
            return {"type": "object", "additionalProperties": _type_schema(args[1])}
        return {"type": "object"}
    raise ValueError(f"type hint {hint!r} has no JSON schema")
