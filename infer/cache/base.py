"""The one interface every KV-cache kind implements.

A cache stores, per layer, the keys and values of the tokens seen so far (post QK-norm, post RoPE).
The model calls `update(layer, k, v)` once per layer per forward, then `advance(n)` once: the new
tokens sit at absolute positions `offset .. offset + n - 1`. Every row of a batch holds the same
number of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class KVCache(Protocol):
    """What the model needs from a cache, and nothing more."""

    batch_size: int
    max_seq_len: int

    @property
    def offset(self) -> int:
        """Number of tokens already cached (the position of the next token)."""
        ...

    def key_positions(self, layer: int, q_len: int) -> torch.Tensor:
        """Absolute positions `[S]` of the keys `update(layer, ...)` returns for a step of `q_len`
        new tokens; -1 marks a slot that holds nothing."""
        ...

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `k`, `v` `[B, Hkv, T, D]` for the next T positions of `layer`; return the keys and
        values `[B, Hkv, S, D]` the new queries attend to. Raises `CacheFullError` (changing
        nothing) when the tokens do not fit."""
        ...

    def advance(self, n: int) -> None:
        """Mark `n` more tokens as cached, after every layer has been updated."""
        ...

    def reset(self) -> None:
        """Forget every cached token (the memory stays allocated)."""
        ...

    @property
    def memory_bytes(self) -> int:
        """Bytes of the tensors the cache holds."""
        ...

    def snapshot(self) -> CacheSnapshot:
        """Copy the cached tokens' state out, so `restore` can bring it back later."""
        ...

    def restore(self, snapshot: CacheSnapshot) -> None:
        """Replace the contents with a snapshot taken from a cache of the same kind and shape."""
        ...


def check_cache_size(max_seq_len: int, batch_size: int) -> None:
    """Raise a ValueError unless a cache is asked for at least one position and one sequence."""
    if max_seq_len < 1 or batch_size < 1:
        raise ValueError(f"max_seq_len and batch_size must be >= 1, got {max_seq_len} and {batch_size}")


def check_kv_shape(k: torch.Tensor, v: torch.Tensor, batch_size: int, num_kv_heads: int, head_dim: int) -> None:
    """Raise a ValueError naming the mismatch when `k`/`v` are not `[batch, kv_heads, T, head_dim]`."""
    expected = (batch_size, num_kv_heads, k.shape[2] if k.dim() == 4 else -1, head_dim)
    if k.dim() != 4 or tuple(k.shape) != expected or k.shape != v.shape:
        raise ValueError(
            f"k/v must be [batch={batch_size}, kv_heads={num_kv_heads}, T, head_dim={head_dim}], "
            f"got k {tuple(k.shape)} and v {tuple(v.shape)}: was the cache built for this model and batch size?"
        )


@dataclass
class CacheSnapshot:
    """A copy of a cache's contents after some tokens, to restore later (prompt caching).

    `tensors` are whatever the kind needs to rebuild its state (copies, never views of live
    storage); `token_ids`, when known, let a caller check that a new prompt starts with them.
    """

    kind: str
    offset: int
    tensors: dict[str, torch.Tensor]
    token_ids: list[int] | None = None
    meta: dict[str, int | float | str] = field(default_factory=dict)


def check_snapshot(snapshot: CacheSnapshot, kind: str, max_seq_len: int) -> None:
    """Raise a ValueError when a snapshot cannot be restored into a `kind` cache of `max_seq_len`."""
    if snapshot.kind != kind:
        raise ValueError(f"cannot restore a '{snapshot.kind}' snapshot into a '{kind}' cache")
    if snapshot.offset > max_seq_len:
        raise ValueError(
            f"the snapshot holds {snapshot.offset} tokens but the cache's max_seq_len is {max_seq_len}"
        )
