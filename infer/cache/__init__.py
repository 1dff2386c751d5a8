"""KV-cache kinds behind one interface (`KVCache`), and the factory that builds them by name.

A new kind registers itself with `register_cache_kind`; the conformance suite in
`tests/test_cache_conformance.py` then runs against it automatically.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from infer.cache.base import CacheSnapshot, KVCache
from infer.cache.contiguous import ContiguousCache
from infer.cache.paged import create_paged_cache
from infer.cache.quantized import quantized_cache_factory
from infer.cache.sliding import SlidingWindowCache
from infer.config import ModelConfig


@dataclass(frozen=True)
class ErrorBounds:
    """The error a lossy kind promises against the exact cache, teacher-forced (fp32) as `infer.quality`
    measures it; `tests/test_cache_conformance.py` asserts each figure."""

    max_logit_error: float
    min_top1_agreement: float
    max_mean_kl: float
    max_perplexity_ratio: float | None = None  # of the text under the kind over the exact cache's


@dataclass(frozen=True)
class CacheKind:
    """A registered cache kind: how to build it, and whether it reproduces attention exactly."""

    name: str
    factory: Callable[..., KVCache]
    is_exact: bool
    description: str
    error_bounds: ErrorBounds | None = None  # on the real default model (SmolLM2-135M-Instruct), real text
    stress_bounds: ErrorBounds | None = None  # on the random-weight checkpoints of every architecture


CACHE_KINDS: dict[str, CacheKind] = {}


def register_cache_kind(
    name: str,
    factory: Callable[..., KVCache],
    *,
    is_exact: bool,
    description: str,
    error_bounds: ErrorBounds | None = None,
    stress_bounds: ErrorBounds | None = None,
) -> None:
    """Make `factory(config, *, max_seq_len, batch_size, dtype, device, **options)` available by `name`.

    A lossy kind (`is_exact=False`) states its error twice: `error_bounds` on the real default model over real
    text (`infer.quality`: prose and code; a trained model's outlier channels), `stress_bounds` on the
    random-weight test checkpoints, whose large weights and sharpened QK-norms amplify any K/V perturbation.
    """
    if not is_exact and (error_bounds is None or stress_bounds is None):
        raise ValueError(f"cache kind {name!r} is lossy: register it with error_bounds and stress_bounds")
    CACHE_KINDS[name] = CacheKind(name, factory, is_exact, description, error_bounds, stress_bounds)


def create_cache(
    kind: str,
    config: ModelConfig,
    *,
    max_seq_len: int,
    batch_size: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    **options: Any,
) -> KVCache:
    """Build an empty cache of the named kind for a model with `config`."""
    if not isinstance(kind, str):
        raise TypeError(f"kind must be a cache kind name (str), got {type(kind).__name__}")
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig (model.config), got {type(config).__name__}")
    if kind not in CACHE_KINDS:
        raise ValueError(f"unknown cache kind {kind!r}; available: {', '.join(sorted(CACHE_KINDS))}")
    return CACHE_KINDS[kind].factory(
        config, max_seq_len=max_seq_len, batch_size=batch_size, dtype=dtype, device=device, **options
    )



def _contiguous(config: ModelConfig, *, bound_sliding_layers: bool = False, **kwargs: Any) -> KVCache:
    # Asked to, a model with sliding layers keeps only their window (the hybrid "sliding" layout).
    if bound_sliding_layers and config.has_sliding_layers:
        return SlidingWindowCache(config, **kwargs)
    return ContiguousCache(config, **kwargs)


register_cache_kind(
    "contiguous", _contiguous, is_exact=True, description="pre-allocated [L, B, Hkv, S, D] tensors"
)
register_cache_kind(
    "sliding",
    SlidingWindowCache,
    is_exact=True,
    description="ring buffer of sliding_window slots for sliding layers, contiguous for global ones",
)
register_cache_kind(
    "paged",
    create_paged_cache,
    is_exact=True,
    description="fixed-size blocks in a shared pool: ref-counted, full prompt blocks shared, copy-on-write",
)
# Quantized K/V (infer/cache/quantized.py): keys with a bf16 scale and bf16 offset (the channel's midpoint) per channel
# over each block of tokens (KIVI, centred), values one scale per (token, head); the first 4 tokens (attention sinks)
# and the newest blocks not yet full stay exact. int8's key blocks are 64 tokens and its values leave the exact ring
# 32 at a time, the 4-bit kinds' blocks are 32 for both; the 4-bit kinds also store value rows rotated (Hadamard) and
# keep the newest 16 tokens exact. Bounds, with margin, from measurements. Real model (SmolLM2-135M-Instruct, fp32,
# `python -m infer quality`, 512 tokens, prose / code; max logit error / top-1 / mean KL / ppl ratio): int8 0.17 /
# 0.998 / 1.4e-5 / 1.0002 and 0.23 / 0.996 / 2.6e-5 / 1.0001 (over the suite's 256 tokens: KL 1.1e-5 / 2.2e-5;
# 1.7e-5 / 5.3e-5 with its keys uncentred and values aging with them); int4 1.9 / 0.976 / 2.0e-3 / 1.004 and 6.2 /
# 0.992 / 4.9e-3 / 1.003; fp4 (key channels' extreme coded as 4) 2.7 / 0.974 / 2.9e-3 / 1.000 and 5.3 / 0.982 /
# 7.1e-3 / 1.005 (over the suite's 256 tokens: 0.979 / 2.1e-3 / 1.004 and 0.983 / 5.1e-3 / 1.005) (README "KV-cache
# kinds" has the schemes measured). Worst random-weight checkpoint, 2 x 64 sampled steps: int8 0.53 / 0.961 / 5.9e-4
# (0.51 / 0.992 / 4.1e-4 with values aging with the keys, 0.85 / 0.945 / 1.3e-3 uncentred over blocks of 32), int4
# 8.3 / 0.898 / 0.091, fp4 10.2 / 0.812 / 0.17 (8.7 / 0.867 / 0.17 with key channels to 6). The stress bounds
# also hold the engine's pool (no sinks, no window, blocks of 4 in its test, int8's
# keys uncentred: worst top-1 0.719 int4, 0.656 fp4 over 64 greedy tokens of vocabulary 64, where near-ties abound).
register_cache_kind(
    "int8",
    quantized_cache_factory("int8"),
    is_exact=False,
    description="int8 codes; keys centred, a bf16 scale and offset per channel per 64 tokens, values per (token, "
                "head); the first 4, the newest 0-63 keys and 0-31 values exact: 0.530x a bf16 cache at 4k",
    error_bounds=ErrorBounds(max_logit_error=0.6, min_top1_agreement=0.99, max_mean_kl=3e-5,
                             max_perplexity_ratio=1.002),
    stress_bounds=ErrorBounds(max_logit_error=1.5, min_top1_agreement=0.9, max_mean_kl=4e-3),
)
register_cache_kind(
    "int4",
    quantized_cache_factory("int4"),
    is_exact=False,
    description="int4 codes (-7..7, two per byte); keys by channel around a per-block offset, values rotated; "
                "the first 4 and the newest 16-46 tokens exact: 0.30x at 4k",
    error_bounds=ErrorBounds(max_logit_error=10.0, min_top1_agreement=0.95, max_mean_kl=0.012,
                             max_perplexity_ratio=1.015),
    stress_bounds=ErrorBounds(max_logit_error=11.0, min_top1_agreement=0.7, max_mean_kl=0.15),
)
register_cache_kind(
    "fp4",
    quantized_cache_factory("fp4"),
    is_exact=False,
    description="FP4 E2M1 codes (two per byte; key channels' extreme coded as 4), laid out as int4's: 0.30x at 4k",
    error_bounds=ErrorBounds(max_logit_error=10.0, min_top1_agreement=0.96, max_mean_kl=0.012,
                             max_perplexity_ratio=1.015),
    stress_bounds=ErrorBounds(max_logit_error=12.0, min_top1_agreement=0.62, max_mean_kl=0.25),
)

__all__ = [
    "CACHE_KINDS",
    "CacheKind",
    "CacheSnapshot",
    "ErrorBounds",
    "ContiguousCache",
    "KVCache",
    "SlidingWindowCache",
    "create_cache",
    "register_cache_kind",
]
