"""Small byte-level BPE tokenizers shaped like Llama 3's, Qwen 2.5's, Qwen 3's and Gemma 3's, trained
deterministically. Keyed by `model_type`, as the engine's family table is.

They carry each family's special tokens, BOS rule, EOS ids and chat template (shortened; Qwen 2.5's whole), so
the engine's tokenizer and chat handling can be checked against `transformers` without downloading anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

TINY_VOCAB_SIZE = 512

# Training text: English prose, code, digits, and multi-byte UTF-8 so that some learned tokens are partial
# characters (the case a streaming detokenizer has to hold back on).
CORPUS = """\
The lighthouse keeper climbed the spiral stairs every evening at dusk. She carried a small lamp, a notebook
and a flask of tea, and she counted the steps as she went: one hundred and twelve, always one hundred and
twelve. At the top she trimmed the wick, polished the great lens and wrote the weather in her notebook. The
wind came from the west that night, and the sea was grey and restless under a low sky.

In the morning the fishing boats went out before sunrise. The harbour smelled of salt, tar and diesel, and
the gulls followed the boats far past the breakwater. Children ran along the quay, shouting the names of the
boats they knew; the old men sat on upturned crates and argued about the tides, the price of fuel and the
weather.

Language models read text as a sequence of tokens. A tokenizer splits the text into pieces, maps every piece
to an integer id and later turns the ids back into text. Byte-level tokenizers never meet an unknown
character, because every string is a sequence of bytes, and every byte has a token of its own. Common words
become single tokens, while rare words are spelled out from smaller pieces.

The cache stores the keys and values of every layer, so each new token only needs one step of attention over
the past. Without the cache, the model would recompute the whole prefix for every token it generates, which
is slow. Sliding window layers keep only the most recent positions; global layers keep everything.

def greedy(model, ids, steps):
    for _ in range(steps):
        logits = model(ids)[-1]
        ids.append(int(logits.argmax()))
    return ids

Numbers and dates: 3.14159, 2.71828, 1024, 65536, 2024-07-26, 12:45, 100%, $19.99, #42, user@example.com.

A naïve café owner in Zürich served crème brûlée and a piña colada to a façade painter. Grüße aus München!
Ελληνικά γράμματα, русский текст: привет мир, до свидания.
日本語のテキストです。中文文本，你好世界。한국어 문장입니다。
Emoji too: 🙂 😀 🎉 👍 🚀 ❤️ — and the naïve café again: naïve café 日本語 emoji 🙂.
"""

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

LLAMA3_CHAT_TEMPLATE = """\
{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim }}
    {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Qwen 2.5-Instruct's chat template, whole and verbatim: the `chat_template` of Qwen2.5-Instruct's
# tokenizer_config.json, as quoted (the JSON line itself) in the Berkeley Function Calling Leaderboard's
# Qwen handler (GitHub ShishirPatil/gorilla, berkeley-function-call-leaderboard/bfcl/model_handler/
# local_inference/qwen.py), JSON-decoded. Tools, tool calls and tool responses included; no think tags.
QWEN2_CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501 (verbatim)

QWEN3_CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (loop.first and message.role == 'system') %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

GEMMA3_CHAT_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set first_user_prefix = "" %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif %}
    {%- if message['role'] == 'assistant' %}
        {%- set role = "model" %}
    {%- else %}
        {%- set role = message['role'] %}
    {%- endif %}
    {{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\\n' }}
{%- endif %}
"""


@dataclass(frozen=True)
class TokenizerSpec:
    """What distinguishes one model family's tokenizer from another's."""

    special_tokens: tuple[str, ...]
    # Gemma numbers its special tokens from 0; Llama 3 and Qwen append them after the BPE vocabulary.
    specials_first: bool
    split_pattern: str | None  # None: GPT-2's regex inside the ByteLevel pre-tokenizer
    bos_token: str | None
    eos_token: str
    pad_token: str | None
    unk_token: str | None
    add_bos_token: bool | None  # None: the real tokenizer_config.json has no such key
    generation_eos_tokens: tuple[str, ...]  # config / generation_config eos_token_id, in the real order
    chat_template: str
    # Added tokens that are not special (Qwen 3's think tags): kept by decode(skip_special_tokens=True).
    plain_added_tokens: tuple[str, ...] = ()
    nfc: bool = False


SPECS: dict[str, TokenizerSpec] = {
    "llama": TokenizerSpec(
        special_tokens=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eom_id|>",
            "<|eot_id|>",
        ),
        specials_first=False,
        split_pattern=LLAMA3_SPLIT,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token=None,
        unk_token=None,
        add_bos_token=True,
        generation_eos_tokens=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        chat_template=LLAMA3_CHAT_TEMPLATE,
    ),
    "qwen3": TokenizerSpec(
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        specials_first=False,
        split_pattern=QWEN_SPLIT,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        add_bos_token=None,
        generation_eos_tokens=("<|im_end|>", "<|endoftext|>"),
        chat_template=QWEN3_CHAT_TEMPLATE,
        plain_added_tokens=("<think>", "</think>"),
        nfc=True,
    ),
    "gemma3_text": TokenizerSpec(
        special_tokens=("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
        specials_first=True,
        split_pattern=None,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        add_bos_token=True,
        generation_eos_tokens=("<eos>", "<end_of_turn>"),
        chat_template=GEMMA3_CHAT_TEMPLATE,
    ),
}
# Qwen 2.5: Qwen 3's special tokens and BOS rule, its own (real, whole) template, no think tags; its tool-call
# tags are added tokens that are not special, as in the real vocabulary.
SPECS["qwen2"] = replace(SPECS["qwen3"], chat_template=QWEN2_CHAT_TEMPLATE,
                         plain_added_tokens=("<tool_call>", "</tool_call>"))


@dataclass(frozen=True)
class TokenIds:
    """The ids a model config needs from its tokenizer."""

    vocab_size: int
    bos_token_id: int | None  # config.json's bos_token_id (Qwen names <|endoftext|> there, with no BOS rule)
    eos_token_ids: list[int]
    pad_token_id: int | None


def spec_for(arch: str) -> TokenizerSpec:
    if arch not in SPECS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(SPECS)}")
    return SPECS[arch]


@cache
def _trained_json(arch: str, vocab_size: int) -> str:
    """Train once per process; callers get a fresh Tokenizer from the JSON so none can mutate the cache."""
    spec = spec_for(arch)
    tok = HFTokenizer(BPE())
    if spec.nfc:
        tok.normalizer = normalizers.NFC()
    if spec.split_pattern is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(spec.split_pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    num_appended = 0 if spec.specials_first else len(spec.special_tokens) + len(spec.plain_added_tokens)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - num_appended,
        special_tokens=[_special(t) for t in spec.special_tokens] if spec.specials_first else [],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte gets a token: nothing is unknown
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    if not spec.specials_first:
        tok.add_special_tokens([_special(t) for t in spec.special_tokens])
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.plain_added_tokens])
    if spec.add_bos_token and spec.bos_token is not None:
        bos_id = tok.token_to_id(spec.bos_token)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos_token} $A",
            pair=f"{spec.bos_token} $A {spec.bos_token} $B:1",
            special_tokens=[(spec.bos_token, bos_id)],
        )
    return tok.to_str()


def _special(content: str) -> AddedToken:
    return AddedToken(content, special=True, normalized=False)


def train_tokenizer(arch: str, vocab_size: int = TINY_VOCAB_SIZE) -> HFTokenizer:
    """A byte-level BPE tokenizer for `arch`, identical on every call (same corpus, same settings)."""
    return HFTokenizer.from_str(_trained_json(arch, vocab_size))


def _id(tok: HFTokenizer, token: str | None) -> int | None:
    if token is None:
        return None
    token_id = tok.token_to_id(token)
    if token_id is None:
        raise ValueError(f"token {token!r} is missing from the trained vocabulary")
    return token_id


def token_ids(arch: str, tok: HFTokenizer) -> TokenIds:
    spec = spec_for(arch)
    eos_ids = [_id(tok, t) for t in spec.generation_eos_tokens]
    # Qwen's config names <|endoftext|> as bos_token_id although its tokenizer adds no BOS.
    bos = spec.bos_token if spec.bos_token is not None else spec.pad_token
    return TokenIds(
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        bos_token_id=_id(tok, bos),
        eos_token_ids=[i for i in eos_ids if i is not None],
        pad_token_id=_id(tok, spec.pad_token),
    )


def tokenizer_config(arch: str, tok: HFTokenizer, model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json in the shape the hub checkpoints ship (chat template inline)."""
    spec = spec_for(arch)
    added = {
        str(token_id): {
            "content": t.content,
            "lstrip": t.lstrip,
            "normalized": t.normalized,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "special": t.special,
        }
        for token_id, t in sorted(tok.get_added_tokens_decoder().items())
    }
    config: dict[str, Any] = {"added_tokens_decoder": added}
    if spec.add_bos_token is not None:
        config["add_bos_token"] = spec.add_bos_token
        config["add_eos_token"] = False
    config.update(
        {
            "bos_token": spec.bos_token,
            "chat_template": spec.chat_template,
            # transformers 5 ignores this for BPE tokenizers anyway; False keeps every reader in agreement.
            "clean_up_tokenization_spaces": False,
            "eos_token": spec.eos_token,
            "model_max_length": model_max_length,
            "pad_token": spec.pad_token,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
    )
    if spec.unk_token is not None:
        config["unk_token"] = spec.unk_token
    return config


def save_tokenizer(arch: str, directory: Path, model_max_length: int) -> TokenIds:
    """Write tokenizer.json and tokenizer_config.json into `directory`; return the ids for config.json."""
    tok = train_tokenizer(arch)
    tok.save(str(directory / "tokenizer.json"))
    config = tokenizer_config(arch, tok, model_max_length)
    write_json(directory / "tokenizer_config.json", config)
    return token_ids(arch, tok)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """JSON the way transformers writes it: sorted keys, two-space indent, trailing newline."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
