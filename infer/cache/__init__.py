"""KV-cache kinds behind one interface (`KVCache`), and the factory that builds them by name.

A new kind registers itself with `register_cache_kind`; the conformance suite in
`tests/test_cache_conformance.py` then runs against it automatically.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from infer.cache.base import KVCache
from infer.cache.contiguous import ContiguousCache
from infer.config import ModelConfig


@dataclass(frozen=True)
class CacheKind:
    """A registered cache kind: how to build it and whether it reproduces attention exactly."""

    name: str
    factory: Callable[..., KVCache]
    is_exact: bool
    description: str


CACHE_KINDS: dict[str, CacheKind] = {}


def register_cache_kind(name: str, factory: Callable[..., KVCache], *, is_exact: bool, description: str) -> None:
    """Make `factory(config, *, max_seq_len, batch_size, dtype, device, **options)` available by `name`."""
    CACHE_KINDS[name] = CacheKind(name, factory, is_exact, description)


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


register_cache_kind(
    "contiguous", ContiguousCache, is_exact=True, description="pre-allocated [L, B, Hkv, S, D] tensors"
)

__all__ = ["CACHE_KINDS", "CacheKind", "ContiguousCache", "KVCache", "create_cache", "register_cache_kind"]
