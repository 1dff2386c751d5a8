"""Stopping against the oracle: every id of a list `eos_token_id`, from config.json or from
generation_config.json, ends generation where Hugging Face's generation config says it does."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from transformers import AutoTokenizer

import infer
from infer.families import ARCHITECTURES
from infer.generation import GenerationResult, generate, stream_generate
from infer.sampling import SamplingParams
from infer.tokenizer import Tokenizer
from reference import Oracle, build_checkpoint

REPLACEMENT_CHAR = "\ufffd"  # what a decoder gives for an incomplete UTF-8 sequence
N = 24


def with_eos_list(arch: str, tmp_path: Path, source: str, eos: list[int]) -> Path:
    """A copy of the tiny checkpoint whose `eos_token_id` list lives in `source` (config.json, with no
    generation_config.json; or generation_config.json, with config.json naming one other id)."""
    directory = tmp_path / arch
    shutil.copytree(build_checkpoint(arch), directory)
    config = json.loads((directory / "config.json").read_text())
    generation_file = directory / "generation_config.json"
    if source == "config":
        config["eos_token_id"] = eos
        generation_file.unlink()
    else:
        generation = json.loads(generation_file.read_text())
        generation["eos_token_id"] = eos
        generation_file.write_text(json.dumps(generation))
        config["eos_token_id"] = max(eos) + 1
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("source", ["config", "generation_config"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_eos_id_of_a_list_stops_as_hf_does(arch: str, source: str, position: int, tmp_path: Path) -> None:
    base = build_checkpoint(arch)
    prompt = torch.randint(3, 400, (9,), generator=torch.Generator().manual_seed(position)).tolist()
    free_run = Oracle(base).greedy(prompt, N)
    stop_at = 3 + 4 * position  # the token generated at this step becomes one of the EOS ids
    target = free_run[stop_at]
    unused = [t for t in range(5, 500) if t not in free_run][:2]
    eos = unused[:position] + [target] + unused[position:]
    path = with_eos_list(arch, tmp_path, source, eos)

    oracle = Oracle(path)
    hf_eos = oracle.model.generation_config.eos_token_id
    assert sorted(hf_eos if isinstance(hf_eos, list) else [hf_eos]) == sorted(eos), "HF reads the list elsewhere"
    expected = oracle.greedy(prompt, N, eos_token_ids=eos)
    assert expected[-1] == target and len(expected) <= stop_at + 1

    model = infer.load_model(path)
    ours = generate(model, None, prompt, SamplingParams(max_new_tokens=N))
    assert (ours.token_ids, ours.finish_reason) == (expected, "eos"), f"{arch}: stopped wrongly without a tokenizer"
    tokenizer = Tokenizer(path)
    assert set(eos) <= set(tokenizer.eos_token_ids), "the tokenizer lost ids of the list"
    if source == "generation_config":  # which replaces config.json's, as in HF
        assert max(eos) + 1 not in tokenizer.eos_token_ids
    # With a tokenizer, its own eos_token stops too (it is in the HF list of every real checkpoint).
    with_tok = generate(model, tokenizer, prompt, SamplingParams(max_new_tokens=N))
    extra = set(tokenizer.eos_token_ids) - set(eos)
    expected_tok = oracle.greedy(prompt, N, eos_token_ids=[*eos, *extra])
    assert (with_tok.token_ids, with_tok.finish_reason) == (expected_tok, "eos"), f"{arch}: with a tokenizer"
    assert with_tok.text == tokenizer.decode(expected_tok[:-1])


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_ignore_eos_and_explicit_stop_ids(arch: str, tmp_path: Path) -> None:
    base = build_checkpoint(arch)
    prompt = [7, 8, 9, 10, 11]
    free_run = Oracle(base).greedy(prompt, N)
    path = with_eos_list(arch, tmp_path, "generation_config", [free_run[2]])
    model = infer.load_model(path)
    ignored = generate(model, None, prompt, SamplingParams(max_new_tokens=N, ignore_eos=True))
    assert (ignored.token_ids, ignored.finish_reason) == (free_run, "length")
    explicit = generate(model, None, prompt, SamplingParams(max_new_tokens=N, stop_token_ids=(free_run[5],)))
    first = free_run.index(free_run[5])
    assert (explicit.token_ids, explicit.finish_reason) == (free_run[: first + 1], "eos")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_generation_config_eos_replaces_config_json_eos_as_in_hf(arch: str, tmp_path: Path) -> None:
    """config.json names a token the greedy run produces; generation_config.json names another id:
    HF's generate stops only on generation_config.json's, and so does the engine."""
    base = build_checkpoint(arch)
    prompt = [7, 8, 9, 10, 11]
    free_run = Oracle(base).greedy(prompt, N)
    unused = next(t for t in range(5, 500) if t not in free_run)
    path = with_eos_list(arch, tmp_path, "generation_config", [unused])
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = free_run[3]
    (path / "config.json").write_text(json.dumps(config))
    oracle = Oracle(path)
    hf_eos = oracle.model.generation_config.eos_token_id
    expected = oracle.greedy(prompt, N, eos_token_ids=hf_eos if isinstance(hf_eos, list) else [hf_eos])
    assert expected == free_run, "HF stopped on config.json's eos: the premise changed"
    ours = generate(infer.load_model(path), None, prompt, SamplingParams(max_new_tokens=N))
    assert (ours.token_ids, ours.finish_reason) == (expected, "length")


def test_malformed_generation_config_eos_is_a_named_error(tmp_path: Path) -> None:
    path = with_eos_list("llama", tmp_path, "generation_config", [3])
    generation = json.loads((path / "generation_config.json").read_text())
    generation["eos_token_id"] = ["</s>"]
    (path / "generation_config.json").write_text(json.dumps(generation))
    with pytest.raises(infer.CheckpointError, match=r"generation_config\.json.*eos_token_id"):
        infer.load_model(path)


@functools.cache
def reference_continuation(arch: str, seed: int) -> tuple[list[int], list[int], str, tuple[int, ...]]:
    """HF's greedy continuation of a text prompt, its text by HF's tokenizer (special tokens kept, as the
    engine's result text keeps them), and the character offsets
    where token boundaries fall in that text."""
    path = build_checkpoint(arch)
    hf_tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = hf_tokenizer.encode(f"The keeper wrote {seed} lines: naïve 世界 ", add_special_tokens=False)
    ids = Oracle(path).greedy(prompt, 40)
    text = hf_tokenizer.decode(ids, skip_special_tokens=False)
    boundaries = {len(hf_tokenizer.decode(ids[:j], skip_special_tokens=False)) for j in range(1, len(ids))}
    return prompt, ids, text, tuple(sorted(b for b in boundaries if 0 < b < len(text)))


def text_at_stop(ids: list[int], stops: list[str], decode: Callable[[list[int]], str]) -> str | None:
    """Where generation must stop, by HF's decoding alone: after each token, the final text so far (the
    decoded text, unless it ends in an incomplete character, U+FFFD, which a later token may complete) is
    searched; the first time any stop string is in it, the text is cut at the earliest occurrence."""
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        if text.endswith(REPLACEMENT_CHAR) and k < len(ids):
            continue
        hits = [i for s in stops if (i := text.find(s)) >= 0]
        if hits:
            return text[: min(hits)]
    return None


@given(data=st.data())
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_stop_string_at_any_offset(arch: str, data: st.DataObject) -> None:
    """One or two stop strings cut from the reference text anywhere (across token boundaries, inside multi-byte
    characters' tokens): generation stops on the first token that completes one (a longer stop string starting
    earlier but not yet complete does not hold it up), the text ends right before the earliest occurrence,
    finish_reason is "stop", and the streamed pieces concatenate to the result's text."""
    prompt, ids, text, boundaries = reference_continuation(arch, data.draw(st.integers(0, 2), label="prompt"))
    where = data.draw(st.sampled_from(["anywhere", "across a token boundary", "at a non-ASCII character"]))
    if where == "across a token boundary" and boundaries:
        start = data.draw(st.sampled_from(boundaries)) - 1
        length = data.draw(st.integers(2, 6))
    elif where == "at a non-ASCII character" and any(ord(c) > 127 for c in text):
        start = data.draw(st.sampled_from([i for i, c in enumerate(text) if ord(c) > 127]))
        length = data.draw(st.integers(1, 4))
    else:
        start = data.draw(st.integers(0, len(text) - 1))
        length = data.draw(st.integers(1, 8))
    stop = text[start : start + length]
    assume(stop)
    stops = [stop]
    second = data.draw(st.sampled_from(["none", "its own suffix", "inside it", "anywhere"]),
                       label="a second stop string")
    if second == "its own suffix" and len(stop) > 1:  # both complete on the same token: the earlier start wins
        stops.append(stop[1:])
    elif second == "inside it" and len(stop) > 2:  # completes first unless in the same token as the end
        stops.append(stop[1:-1])
    elif second == "anywhere":
        other = data.draw(st.integers(0, len(text) - 1), label="its offset")
        stops.append(text[other : other + data.draw(st.integers(1, 5))])
    model = load_cached(arch)
    tokenizer = Tokenizer(build_checkpoint(arch))
    pieces = list(stream_generate(model, tokenizer, prompt, SamplingParams(max_new_tokens=40, stop=tuple(stops),
                                                                           ignore_eos=True)))
    result = pieces.pop()
    assert isinstance(result, GenerationResult)
    hf_tokenizer = AutoTokenizer.from_pretrained(build_checkpoint(arch))
    expected = text_at_stop(ids, stops, functools.partial(hf_tokenizer.decode, skip_special_tokens=False))
    assert result.text == expected, f"stop {stops!r}: text ends wrongly"
    assert result.finish_reason == "stop"
    assert "".join(str(p) for p in pieces) == result.text, "streamed pieces do not add up to the text"
    assert result.token_ids == ids[: len(result.token_ids)], "tokens differ from the oracle's"


@functools.cache
def load_cached(arch: str) -> infer.Transformer:
    return infer.load_model(build_checkpoint(arch))
