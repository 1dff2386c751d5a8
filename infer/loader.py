"""Load a Hugging Face checkpoint directory into a `Transformer`, without `transformers`.

Reads `config.json` and `model.safetensors` or the shards named by `model.safetensors.index.json`.
Every tensor the model needs must be present with the right shape; the error names it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from infer.config import ModelConfig
from infer.errors import CheckpointError
from infer.models import Transformer

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"


def resolve_dtype(dtype: torch.dtype | str | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """A torch dtype from a dtype or one of the names in `DTYPES`."""
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index (no weight_map): {e}") from e
        files = sorted({path / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"shards named in {index.name} are missing from {path}: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(
        f"no model.safetensors or model.safetensors.index.json in {path}; "
        "the engine loads safetensors checkpoints (convert .bin/.pth files with safetensors first)"
    )


def _read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    tensors[name] = f.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {file}: corrupt or truncated safetensors file ({e})") from e
    return tensors


def load_model(
    path: str | Path | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    compute_dtype: torch.dtype | str | None = None,
) -> Transformer:
    """Load the checkpoint in directory `path` (the shipped default model when None), in eval mode.

    `dtype` defaults to float32; the weights are cast to it. `compute_dtype` sets the dtype of
    multi-token matmuls (prefill): None or "exact" keeps the weights' dtype (bit-exact to HF's eager
    path), "auto" picks float32 for half-precision weights on a CPU, where bf16 GEMMs are slow.
    """
    path = DEFAULT_MODEL_DIR if path is None else Path(path)
    torch_dtype = resolve_dtype(dtype)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    config = ModelConfig.from_file(path)
    files = _weight_files(path)
    tensors = _read_tensors(files)
    # Some exports prefix the decoder with "model."; the engine's modules sit at the top level.
    tensors = {name.removeprefix("model."): t for name, t in tensors.items()}

    with torch.device("meta"):
        model = Transformer(config)
    expected = dict(model.state_dict())
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
        tensors.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint {path} lacks tensors the model needs: {shown}")
    for name, param in expected.items():
        if tuple(tensors[name].shape) != tuple(param.shape):
            raise CheckpointError(
                f"tensor {name} in {path} has shape {tuple(tensors[name].shape)}, "
                f"but config.json implies {tuple(param.shape)}"
            )
    state = {name: tensors[name].to(device=device, dtype=torch_dtype) for name in expected}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.compute_dtype = _resolve_compute_dtype(compute_dtype, torch_dtype, torch.device(device))
    model.eos_token_ids = _generation_eos_ids(path, config.eos_token_ids)
    return model.eval().requires_grad_(False)


def _generation_eos_ids(path: Path, config_eos: tuple[int, ...]) -> tuple[int, ...]:
    """The ids HF's `generate` stops on: generation_config.json's eos_token_id (an int or a list) when
    it names one, replacing config.json's (Qwen 3 names only <|im_end|> in config.json, both ids in
    the other); config.json's otherwise. (HF stops on none when generation_config.json exists without
    the field; falling back to config.json's is the one deliberate difference.)"""
    file = path / "generation_config.json"
    if not file.is_file():
        return config_eos
    try:
        value = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{file} is not a readable JSON object ({e}); fix or remove it") from e
    values = [value] if not isinstance(value, list) else value
    if value is not None and any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise CheckpointError(
            f"{file}: eos_token_id={value!r} is invalid; expected a non-negative int or a list of them"
        )
    if value is None:
        return config_eos
    return tuple(dict.fromkeys(values))


def _resolve_compute_dtype(
    compute_dtype: torch.dtype | str | None, dtype: torch.dtype, device: torch.device
) -> torch.dtype | None:
    if compute_dtype is None or compute_dtype == "exact":
        return None
    if compute_dtype == "auto":
        return torch.float32 if device.type == "cpu" and dtype != torch.float32 else None
    resolved = resolve_dtype(compute_dtype)
    return None if resolved == dtype else resolved
