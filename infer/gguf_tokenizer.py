"""A `tokenizers.Tokenizer` rebuilt from a GGUF file's tokenizer metadata (llama.cpp's `tokenizer.ggml.*` keys).

A GGUF carries no tokenizer.json: the vocabulary, merges, token types, special token ids and chat template are
metadata. They are assembled here the way transformers' GGUF converter does (its byte-level BPE tokenizer: GPT-2's
pre-tokenizer, or the split regex llama.cpp names in `tokenizer.ggml.pre`; BOS/EOS added as the file's
`add_bos_token` / `add_eos_token` say), so both read a file into the same token ids. Two kinds are rebuilt:
byte-level BPE (`tokenizer.ggml.model` "gpt2": Llama 3, Qwen, SmolLM), and Gemma's SentencePiece vocabulary
("llama" in a `gemma3` file): BPE with byte fallback over text whose spaces are "▁", with the merges the file
implies (it lists none: a merge's rank is the merged token's position in the vocabulary, which follows Gemma's
merge order where its scores do not), as transformers' GemmaTokenizer. Other SentencePiece files (Llama 2's
"llama" vocabulary) are refused with a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from infer.errors import CheckpointError
from infer.gguf import GGUFFile

# llama.cpp's token types (tokenizer.ggml.token_type).
CONTROL = 3
USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regex that splits text before BPE (the one its merges were learned with). Any other
# name ("default", "gpt2", "smollm", ...) gets GPT-2's own regex, inside the ByteLevel pre-tokenizer.
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Architectures whose "llama" (SentencePiece) vocabulary is rebuilt, and the space SentencePiece writes.
SENTENCEPIECE_ARCHITECTURES = ("gemma3",)
SPACE = "\u2581"
# The named special tokens and the metadata key of each one's id.
SPECIAL_TOKEN_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


@dataclass(frozen=True)
class GGUFTokenizer:
    """What `infer.Tokenizer` needs from a GGUF file."""

    backend: BackendTokenizer
    config: dict[str, Any]  # tokenizer_config.json's shape: the named special tokens and the chat template
    eos_token_ids: list[int]  # eos, then the end-of-turn token where the file names one


def read_gguf_tokenizer(path: Path) -> GGUFTokenizer:
    """The tokenizer described by the metadata of the GGUF file `path`."""
    gguf = GGUFFile(path)
    model = gguf.require("tokenizer.ggml.model")
    architecture = gguf.get("general.architecture")
    sentencepiece = model == "llama" and architecture in SENTENCEPIECE_ARCHITECTURES
    if model != "gpt2" and not sentencepiece:
        raise CheckpointError(
            f"{path}: tokenizer.ggml.model={model!r} is not supported for general.architecture={architecture!r}; "
            "this engine rebuilds byte-level BPE tokenizers ('gpt2': Llama 3, Qwen, SmolLM) and Gemma 3's "
            "SentencePiece vocabulary ('llama' in a gemma3 file) from GGUF files. Pass a directory with the "
            "model's tokenizer.json instead"
        )
    tokens = gguf.require("tokenizer.ggml.tokens")
    types = gguf.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(
            f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens; the file is corrupt"
        )
    ids = _special_token_ids(gguf, len(tokens))
    config: dict[str, Any] = {name: tokens[i] for name, i in ids.items()}
    merges = gguf.get("tokenizer.ggml.merges", [])
    if sentencepiece:
        backend = _sentencepiece_bpe(path, tokens, merges, config.get("unk_token"))
    else:
        backend = _byte_level_bpe(path, tokens, merges, gguf.get("tokenizer.ggml.pre"))
    _add_special_tokens(backend, tokens, types, config, byte_level=not sentencepiece)
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise (older files lack the flag).
    backend.post_processor = _post_processor(gguf, config, ids, add_bos_default=sentencepiece)
    config["chat_template"] = gguf.get("tokenizer.chat_template")
    eos = [gguf.get("tokenizer.ggml.eos_token_id"), gguf.get("tokenizer.ggml.eot_token_id")]
    return GGUFTokenizer(backend, config, list(dict.fromkeys(i for i in eos if i is not None)))


def _special_token_ids(gguf: GGUFFile, vocab_size: int) -> dict[str, int]:
    """The id of each named special token the file gives (bos_token, eos_token, unk_token, pad_token)."""
    ids: dict[str, int] = {}
    for name, key in SPECIAL_TOKEN_IDS.items():
        token_id = gguf.get(key)
        if token_id is None:
            continue
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
            raise CheckpointError(f"{gguf.path}: {key}={token_id!r} is not a token id (0..{vocab_size - 1})")
        ids[name] = token_id
    return ids


@cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's spelling of bytes as printable characters (byte-level BPE vocabularies are written in it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _spelled(token: str, alphabet: set[str]) -> str:
    """A token in the byte alphabet; one written as plain text (an added token with a space, say) is respelled
    byte by byte, as transformers does."""
    if set(token) <= alphabet:
        return token
    spelling = byte_to_unicode()
    return "".join(spelling[b] for b in token.encode("utf-8"))


def _byte_level_bpe(path: Path, tokens: list[str], merges: list[str], pre: str | None) -> BackendTokenizer:
    alphabet = set(byte_to_unicode().values())
    vocab = {_spelled(token, alphabet): i for i, token in enumerate(tokens)}
    pairs = [_merge_pair(merge) for merge in merges]
    try:
        backend = BackendTokenizer(BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                                       end_of_word_suffix="", fuse_unk=False))
    except Exception as e:  # the tokenizers library raises a bare Exception for a bad vocabulary or merge
        raise CheckpointError(f"{path}: tokenizer.ggml.tokens / tokenizer.ggml.merges do not form a BPE: {e}") from e
    split = PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(path: Path, tokens: list[str], merges: list[str], unk: str | None) -> BackendTokenizer:
    """Gemma's vocabulary as transformers' GemmaTokenizer holds it: a token of spaces (and other white space),
    which the file spells with real spaces, is looked up as that many "▁"; merges from the file, or implied by
    the vocabulary."""
    respelled = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: i for i, token in enumerate(respelled)}
    pairs = [_merge_pair(merge) for merge in merges] if merges else merges_from_vocabulary(respelled)
    try:
        backend = BackendTokenizer(BPE(vocab=vocab, merges=pairs, dropout=None, fuse_unk=True, byte_fallback=True,
                                       unk_token=unk if unk is not None else "<unk>"))
    except Exception as e:  # the tokenizers library raises a bare Exception for a bad vocabulary or merge
        raise CheckpointError(f"{path}: tokenizer.ggml.tokens do not form a SentencePiece BPE: {e}") from e
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def merges_from_vocabulary(tokens: list[str]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a token into two tokens of the
    vocabulary, best first by the merged token's position (earlier is better), then by the longer left and right
    parts; a token's own splits in the order of their parts' ids. transformers derives Gemma's merges so."""
    vocab = {token: i for i, token in enumerate(tokens)}
    rank = {token: -i for i, token in enumerate(tokens)}
    merges: list[tuple[str, str, int]] = []
    for token, score in rank.items():
        local = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((left, right, score) for left, right in local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _merge_pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _add_special_tokens(backend: BackendTokenizer, tokens: list[str], types: list[int],
                        config: dict[str, Any], byte_level: bool) -> None:
    """Control tokens (`<|im_end|>`) become special added tokens, matched whole and dropped by
    `skip_special_tokens`; user-defined ones (`<think>`) plain added tokens, matched whole but kept. In a
    byte-level vocabulary a control token outside the byte alphabet is a llama.cpp mislabel and is skipped (as
    transformers does)."""
    alphabet = set(byte_to_unicode().values())
    control = [t for t, kind in zip(tokens, types, strict=True)
               if kind == CONTROL and (not byte_level or set(t) <= alphabet)]
    named = [t for t in config.values() if t not in control]  # bos/eos/unk/pad are special whatever their type
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control + named])
    vocab = backend.get_vocab()
    plain = [t for t, kind in zip(tokens, types, strict=True) if kind == USER_DEFINED and t in vocab]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])


def _post_processor(gguf: GGUFFile, config: dict[str, Any], ids: dict[str, int],
                    add_bos_default: bool) -> processors.TemplateProcessing:
    """BOS / EOS around the text as `tokenizer.ggml.add_bos_token` / `add_eos_token` say (absent: no EOS, and
    BOS as `add_bos_default`)."""
    add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", add_bos_default)) and "bos_token" in config
    add_eos = bool(gguf.get("tokenizer.ggml.add_eos_token", False)) and "eos_token" in config
    bos, eos = config.get("bos_token"), config.get("eos_token")
    single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
    pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
    special = [(config[name], ids[name]) for name, wanted in (("bos_token", add_bos), ("eos_token", add_eos))
               if wanted]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
