"""Stopping against the oracle: every id of a list `eos_token_id`, from config.json or from
generation_config.json, ends generation where Hugging Face's generation config says it does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import infer
from infer.generation import generate
from infer.sampling import SamplingParams
from infer.tokenizer import Tokenizer
from reference import Oracle, build_checkpoint

ARCHS = ["llama", "qwen3", "gemma3"]
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
@pytest.mark.parametrize("arch", ARCHS)
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
    # With a tokenizer, its own eos_token stops too (it is in the HF list of every real checkpoint).
    with_tok = generate(model, tokenizer, prompt, SamplingParams(max_new_tokens=N))
    extra = set(tokenizer.eos_token_ids) - set(eos)
    expected_tok = oracle.greedy(prompt, N, eos_token_ids=[*eos, *extra])
    assert (with_tok.token_ids, with_tok.finish_reason) == (expected_tok, "eos"), f"{arch}: with a tokenizer"
    assert with_tok.text == tokenizer.decode(expected_tok[:-1])


@pytest.mark.parametrize("arch", ARCHS)
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


def test_malformed_generation_config_eos_is_a_named_error(tmp_path: Path) -> None:
    path = with_eos_list("llama", tmp_path, "generation_config", [3])
    generation = json.loads((path / "generation_config.json").read_text())
    generation["eos_token_id"] = ["</s>"]
    (path / "generation_config.json").write_text(json.dumps(generation))
    with pytest.raises(infer.CheckpointError, match=r"generation_config\.json.*eos_token_id"):
        infer.load_model(path)
