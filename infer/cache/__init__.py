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
from infer.cache.sliding import SlidingWindowCache
from infer.config import ModelConfig


@dataclass(frozen=True)
class ErrorBounds:
    """The error a lossy kind promises against the exact cache, teacher-forced over 64+ decode steps
    of the test checkpoints (fp32): the conformance suite asserts each one."""

    max_logit_error: float
    min_top1_agreement: float
    max_mean_kl: float


@dataclass(frozen=True)
class CacheKind:
    """A registered cache kind: how to build it, and whether it reproduces attention exactly."""

    name: str
    factory: Callable[..., KVCache]
    is_exact: bool
    description: str
    error_bounds: ErrorBounds | None = None


CACHE_KINDS: dict[str, CacheKind] = {}


def register_cache_kind(
    name: str,
    factory: Callable[..., KVCache],
    *,
    is_exact: bool,
    description: str,
    error_bounds: ErrorBounds | None = None,
) -> None:
    """Make `factory(config, *, max_seq_len, batch_size, dtype, device, **options)` available by `name`.

    A lossy kind (`is_exact=False`) must state its `error_bounds`.
    """
    if not is_exact and error_bounds is None:
        raise ValueError(f"cache kind {name!r} is lossy: register it with the error_bounds it guarantees")
    CACHE_KINDS[name] = CacheKind(name, factory, is_exact, description, error_bounds)


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
