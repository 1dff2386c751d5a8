"""infer: a small KV-cached LLM inference engine for Llama 3, Qwen 3 and Gemma 3 checkpoints.

The engine works on token ids; `Tokenizer` turns text into ids and back. Nothing here needs
`transformers`.
"""

from infer.cache import CACHE_KINDS, KVCache, create_cache, register_cache_kind
from infer.config import ModelConfig
from infer.errors import CacheFullError, CheckpointError, InferError
from infer.loader import load_model
from infer.models import Transformer

__all__ = [
    "CACHE_KINDS",
    "CacheFullError",
    "CheckpointError",
    "InferError",
    "KVCache",
    "ModelConfig",
    "Transformer",
    "create_cache",
    "load_model",
    "register_cache_kind",
]
