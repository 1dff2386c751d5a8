"""Every value a checkpoint directory can get wrong is refused at load with a CheckpointError naming the file,
the field (or tensor) and what was expected: config.json fields of the wrong type or out of range, a layer count
that disagrees with the tensors, non-float or non-finite weights, dtypes that contradict the declared one, and
sizes that do not fit in memory. Nothing here loads silently into NaN or wrong logits."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import infer
import infer.loader
import infer.memory
from infer.config import ModelConfig
from infer.errors import CheckpointError
from reference import build_checkpoint
from tests.helpers import time_limit


def copy_of(tmp_path: Path, arch: str, config_format: str = "v5") -> Path:
    target = tmp_path / f"{arch}-{config_format}"
    shutil.copytree(build_checkpoint(arch, config_format=config_format), target)
    return target


def edit_config(path: Path, **changes: Any) -> None:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        node = config
        *parents, leaf = key.split(".")
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    (path / "config.json").write_text(json.dumps(config))


NAN = float("nan")
INF = float("inf")

# (architecture, config format, field (dotted for nested), bad value, what the message must say)
BAD_FIELDS = [
    ("llama", "v5", "hidden_size", 0, "an integer >= 1"),
    ("llama", "v5", "hidden_size", -32, "an integer >= 1"),
    ("llama", "v5", "hidden_size", "48", "an integer >= 1"),
    ("llama", "v5", "hidden_size", 48.0, "an integer >= 1"),
    ("llama", "v5", "num_hidden_layers", True, "an integer >= 1"),
    ("llama", "v5", "num_attention_heads", 0, "an integer >= 1"),
    ("llama", "v5", "num_key_value_heads", -1, "an integer >= 1"),
    ("llama", "v5", "head_dim", 0, "an integer >= 1"),
    ("llama", "v5", "vocab_size", [512], "an integer >= 1"),
    ("llama", "v5", "intermediate_size", None, "has no 'intermediate_size'"),
    ("llama", "v5", "max_position_embeddings", 0, "an integer >= 1"),
    ("llama", "v5", "rms_norm_eps", 0, "a finite number > 0"),
    ("llama", "v5", "rms_norm_eps", -1e-6, "a finite number > 0"),
    ("llama", "v5", "rms_norm_eps", NAN, "a finite number > 0"),
    ("llama", "v5", "rms_norm_eps", "1e-6", "a finite number > 0"),
    ("llama", "v5", "tie_word_embeddings", "false", "true or false"),
    ("llama", "v5", "attention_bias", 1, "true or false"),
    ("llama", "v5", "rope_parameters", [1, 2], "a JSON object or null"),
    ("llama", "v5", "rope_parameters.rope_theta", 0, "rope_parameters.rope_theta"),
    ("llama", "v5", "rope_parameters.rope_theta", INF, "a finite number > 0"),
    ("llama", "v5", "rope_parameters.factor", -8.0, "rope_parameters.factor"),
    ("llama", "v5", "rope_parameters.rope_type", "yarn", "unsupported rope type 'yarn'"),
    ("llama", "legacy", "rope_theta", -1, "rope_theta"),
    ("llama", "legacy", "rope_scaling", "llama3", "a JSON object or null"),
    ("llama", "legacy", "rope_scaling.original_max_position_embeddings", 0, "original_max_position_embeddings"),
    ("llama", "v5", "eos_token_id", "</s>", "a token id"),
    ("llama", "v5", "eos_token_id", [2, "3"], "a token id"),
    ("llama", "v5", "eos_token_id", 10**9, "a token id"),
    ("llama", "v5", "eos_token_id", 512, "a token id"),  # the vocabulary's size: one past the last id
    ("llama", "v5", "eos_token_id", True, "a token id"),
    ("llama", "v5", "eos_token_id", [2, False], "a token id"),
    ("llama", "v5", "bos_token_id", -1, "a token id"),
    ("llama", "v5", "hidden_act", "relu", "unsupported activation 'relu'"),
    ("llama", "v5", "layer_types", "full_attention", "layer_types"),
    ("llama", "v5", "layer_types", 5, "layer_types"),
    ("llama", "v5", "layer_types", ["full_attention"] * 3, "layer_types must list 2 entries"),  # 2 layers
    ("llama", "v5", "torch_dtype", "float8", "torch_dtype='float8'"),
    ("gemma3_text", "v5", "sliding_window", 0, "an integer >= 1"),
    ("gemma3_text", "v5", "sliding_window", None, "no 'sliding_window'"),
    ("gemma3_text", "v5", "query_pre_attn_scalar", 0, "query_pre_attn_scalar"),
    ("gemma3_text", "v5", "final_logit_softcapping", 0.0, "final_logit_softcapping"),
    ("gemma3_text", "v5", "attn_logit_softcapping", -50.0, "attn_logit_softcapping"),
    ("gemma3_text", "v5", "rope_parameters.sliding_attention.rope_theta", NAN, "sliding_attention.rope_theta"),
    ("gemma3_text", "legacy", "rope_local_base_freq", 0, "rope_local_base_freq"),
    ("gemma3_text", "legacy", "sliding_window_pattern", 0, "sliding_window_pattern"),
    ("qwen3", "v5", "num_key_value_heads", 3, "not a multiple of num_key_value_heads"),
]


@pytest.mark.parametrize(("arch", "fmt", "field", "value", "expected"), BAD_FIELDS,
                         ids=[f"{a}-{f}-{k}={v!r}" for a, f, k, v, _ in BAD_FIELDS])
def test_bad_config_field_is_named(tmp_path: Path, arch: str, fmt: str, field: str, value: Any,
                                   expected: str) -> None:
    path = copy_of(tmp_path, arch, fmt)
    if field == "torch_dtype":
        edit_config(path, dtype=None)
    edit_config(path, **{field: value})
    with pytest.raises(CheckpointError, match="config.json") as info:
        infer.load_model(path)
    assert expected in str(info.value), str(info.value)


def test_the_multimodal_gemma3_is_named_as_such() -> None:
    """model_type "gemma3" is the multimodal wrapper, not an unknown family: the message says which checkpoints
    to use instead."""
    raw = json.loads((build_checkpoint("gemma3_text") / "config.json").read_text())
    with pytest.raises(CheckpointError, match="multimodal Gemma 3.*'gemma3_text'"):
        ModelConfig.from_dict({**raw, "model_type": "gemma3"})


def test_llama3_scaling_needs_high_above_low_frequency_factor() -> None:
    raw = json.loads((build_checkpoint("llama", config_format="legacy") / "config.json").read_text())
    raw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64}
    with pytest.raises(CheckpointError, match="high_freq_factor"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("text", ["[1, 2]", '"config"', "\udcff", "[" * 100_000])
def test_config_json_that_is_not_an_object(tmp_path: Path, text: str) -> None:
    path = copy_of(tmp_path, "llama")
    (path / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(CheckpointError, match="config.json"):
        infer.load_model(path)


@pytest.mark.parametrize("layers", [1, 3, 1_000_000])
def test_layer_count_must_match_the_tensors(tmp_path: Path, layers: int) -> None:
    """Too few drops layers silently, too many builds a huge model before failing: both refused at once."""
    path = copy_of(tmp_path, "llama")
    assert ModelConfig.from_file(path).num_hidden_layers == 2
    edit_config(path, num_hidden_layers=layers, layer_types=["full_attention"] * min(layers, 4))
    if layers == 1_000_000:
        edit_config(path, layer_types=None)
    with time_limit(60, "loading a checkpoint whose config.json claims a million layers"), \
            pytest.raises(CheckpointError, match=rf"num_hidden_layers={layers}, but the weights hold layers 0\.\.1"):
        infer.load_model(path)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool])
def test_integer_or_bool_weights_are_refused(tmp_path: Path, dtype: torch.dtype) -> None:
    path = copy_of(tmp_path, "llama")
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(dtype)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"norm\.weight.*must be floating point"):
        infer.load_model(path)


def test_dtype_that_contradicts_the_declared_one(tmp_path: Path) -> None:
    path = copy_of(tmp_path, "llama")
    edit_config(path, dtype="bfloat16")
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].half()
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"norm\.weight.*F16.*declares"):
        infer.load_model(path)
    # fp32 tensors beside a half-precision declaration are common (norms kept in fp32): accepted.
    tensors["model.norm.weight"] = tensors["model.norm.weight"].float()
    save_file(tensors, path / "model.safetensors")
    infer.load_model(path)


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_non_finite_weights_are_refused_unless_asked(tmp_path: Path, bad: float) -> None:
    path = copy_of(tmp_path, "llama")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = bad
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.down_proj\.weight.*NaN or infinite.*check_finite"):
        infer.load_model(path)
    model = infer.load_model(path, check_finite=False)
    value = model.layers[1].mlp.down_proj.weight[3, 5].item()
    assert math.isnan(value) if math.isnan(bad) else value == bad


def test_weights_that_overflow_the_target_dtype_are_refused(tmp_path: Path) -> None:
    path = copy_of(tmp_path, "llama")
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"][0] = 1e6  # finite in fp32 and bf16, infinite in fp16
    save_file(tensors, path / "model.safetensors")
    infer.load_model(path, dtype="bfloat16")
    with pytest.raises(CheckpointError, match=r"norm\.weight.*float16"):
        infer.load_model(path, dtype="float16")


def test_sizes_are_checked_against_free_memory_before_loading(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = copy_of(tmp_path, "llama")
    needed = sum(t.numel() for t in load_file(path / "model.safetensors").values()) * 4
    monkeypatch.setattr(infer.memory, "available_memory", lambda device: needed // 2)
    read: list[str] = []
    monkeypatch.setattr(infer.loader, "_read_tensors", lambda *a: read.append("read") or {})
    with pytest.raises(ValueError, match=r"needs 0\.\d+ GiB, but only 0\.\d+ GiB is free on cpu"):
        infer.load_model(path)
    assert read == [], "tensor data was read before the memory check"


@pytest.mark.parametrize(("path", "error", "match"), [
    (42, TypeError, "path must be a checkpoint directory"),
    ("meta-llama/Llama-3.2-1B", CheckpointError, "only local directories are read"),
])
def test_bad_model_paths(path: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        infer.load_model(path)


def test_a_file_given_as_the_checkpoint(tmp_path: Path) -> None:
    path = copy_of(tmp_path, "llama")
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint directory"):
        infer.load_model(path / "config.json")


@pytest.mark.parametrize(("device", "match"), [("meta", "not supported"), ("gpu", "unknown device"),
                                               (3.5, "device must be")])
def test_bad_devices(device: Any, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        infer.load_model(build_checkpoint("llama"), device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="no CUDA device"):
        infer.load_model(build_checkpoint("llama"), device="cuda")
