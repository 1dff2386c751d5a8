"""`save_quantized`: a model with quantized weights written as a safetensors checkpoint that `load_model` reads
back as stored, in one step each way.

The folder holds config.json (the source's, with a `quantization_config` naming the schemes), model.safetensors
and the source's tokenizer files (rebuilt from the metadata for a GGUF source). In model.safetensors each
quantized weight is `<module>.codes`, `.scales` and, for 4-bit formats, `.mins`, described by module name in the
file's `infer.quantized` metadata; norms, biases and any dense weight are stored as usual; the decoder's tensors
sit under `model.`, as Hugging Face names them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from infer.config import ModelConfig
from infer.errors import CheckpointError
from infer.loader import QUANTIZED_METADATA
from infer.models import Transformer
from infer.models.transformer import QuantizedEmbedding, QuantizedLinear

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def save_quantized(model: Transformer, path: str | Path) -> Path:
    """Write `model` (loaded by `load_model`, quantized or not) to the new or empty folder `path`; returns it."""
    if not isinstance(model, Transformer) or model.source is None:
        raise TypeError("save_quantized takes a model from infer.load_model (it copies the source's config and "
                        "tokenizer)")
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder; pick a new path")
    raw = _config_dict(model)
    tensors: dict[str, torch.Tensor] = {}
    layouts: dict[str, dict[str, Any]] = {}
    tied = model.config.tie_word_embeddings
    for name, module in model.named_modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            if name == "lm_head" and tied:
                continue  # the embedding's codes
            weight = module.qweight
            layouts[name] = {"scheme": weight.scheme, "group": weight.group, "shape": list(weight.shape)}
            for part, tensor in zip(("codes", "scales", "mins"), weight.tensors(), strict=False):
                tensors[f"{name}.{part}"] = tensor.detach().cpu().contiguous().clone()
    for name, tensor in model.state_dict().items():
        module = name.rpartition(".")[0]
        if module in layouts or (tied and name.startswith("lm_head.")) or name.endswith((".codes", ".scales", ".mins")):
            continue
        tensors[name] = tensor.detach().cpu().contiguous().clone()
    out.mkdir(parents=True, exist_ok=True)
    schemes = sorted({layout["scheme"] for layout in layouts.values()})
    raw = {**raw, "torch_dtype": DTYPE_NAMES[model.dtype]}
    raw.pop("dtype", None)
    if schemes:
        raw["quantization_config"] = {"quant_method": "infer", "schemes": schemes}
    metadata = {"format": "pt", **({QUANTIZED_METADATA: json.dumps(layouts)} if layouts else {})}
    # Hugging Face's names: the decoder under "model." (the loader strips it; transformers and converters expect it).
    named = {name if name.startswith("lm_head.") else f"model.{name}": t for name, t in tensors.items()}
    save_file(named, str(out / "model.safetensors"), metadata=metadata)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    _write_tokenizer(model.source, out, model.eos_token_ids)
    return out


def _config_dict(model: Transformer) -> dict[str, Any]:
    """The source's config.json dict; for a GGUF source, the one its metadata implies (checked to parse back to
    the model's config: llama.cpp's per-frequency RoPE factors have no config.json spelling)."""
    source = model.source
    if source is None:
        raise TypeError("the model has no source checkpoint to take the config from")
    if source.is_dir() and (source / "config.json").is_file():
        return dict(json.loads((source / "config.json").read_text(encoding="utf-8")))
    from infer.gguf import GGUFFile, config_dict, find_gguf

    gguf_path = find_gguf(source)
    if gguf_path is None:
        raise CheckpointError(f"{source}: neither config.json nor a GGUF file to take the config from")
    raw = config_dict(GGUFFile(gguf_path))
    if ModelConfig.from_dict(raw) != model.config:
        raise CheckpointError(f"{gguf_path}: its config has no config.json spelling (per-frequency RoPE factors); "
                              "save from the Hugging Face checkpoint instead")
    return raw


def _write_tokenizer(source: Path, out: Path, eos_token_ids: tuple[int, ...]) -> None:
    """The tokenizer files beside the weights: copied from a checkpoint folder, rebuilt from a GGUF file."""
    if source.is_dir() and (source / "tokenizer.json").is_file():
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)
        return
    from infer.gguf import find_gguf
    from infer.gguf_tokenizer import read_gguf_tokenizer

    gguf_path = find_gguf(source)
    if gguf_path is None:
        return
    tokenizer = read_gguf_tokenizer(gguf_path)
    (out / "tokenizer.json").write_text(tokenizer.backend.to_str(), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer.config, indent=2) + "\n", encoding="utf-8")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": list(eos_token_ids)}) + "\n",
                                                encoding="utf-8")
