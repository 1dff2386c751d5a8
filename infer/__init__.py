"""infer: a small KV-cached LLM inference engine for Llama 3, Qwen 2/2.5, Qwen 3 and Gemma 3 checkpoints.

The engine works on token ids; `Tokenizer` turns text into ids and back. Nothing here needs
`transformers`.
"""

from infer.cache import CACHE_KINDS, KVCache, create_cache, register_cache_kind
from infer.config import ModelConfig
from infer.engine import Engine, RequestOutput
from infer.errors import CacheFullError, ChatTemplateError, CheckpointError, InferError
from infer.generation import GenerationResult, generate, snapshot_prefix, stream_generate
from infer.loader import load_model
from infer.models import Transformer
from infer.sampling import SamplingParams
from infer.save_quantized import save_quantized
from infer.tokenizer import Tokenizer

__all__ = [
    "CACHE_KINDS",
    "CacheFullError",
    "ChatTemplateError",
    "CheckpointError",
    "Engine",
    "GenerationResult",
    "InferError",
    "KVCache",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "Tokenizer",
    "Transformer",
    "create_cache",
    "generate",
    "load_model",
    "register_cache_kind",
    "save_quantized",
    "snapshot_prefix",
    "stream_generate",
]
