"""The contiguous cache: two pre-allocated tensors `[L, B, Hkv, max_seq_len, D]` and a fill counter."""

from __future__ import annotations

import torch

from infer.cache.base import (
    FLOAT,
    CacheSnapshot,
    allocate_zeros,
    check_advance,
    check_cache_size,
    check_kv_shape,
    check_layer,
    check_snapshot,
    check_snapshot_tensors,
)
from infer.config import ModelConfig
from infer.errors import CacheFullError


class ContiguousCache:
    """Every layer keeps every position, in order, up to `max_seq_len`."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        max_seq_len: int,
        batch_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        check_cache_size(max_seq_len, batch_size, dtype)
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        shape = (config.num_hidden_layers, batch_size, self.num_kv_heads, max_seq_len, self.head_dim)
        # k_cache, v_cache: [L, B, Hkv, S, D]
        self.k_cache, self.v_cache = allocate_zeros("a contiguous cache", device, (shape, dtype), (shape, dtype))
        self._offset = 0

    @property
    def offset(self) -> int:
        """Number of tokens cached."""
        return self._offset

    def key_positions(self, layer: int, q_len: int) -> torch.Tensor:
        """Keys come back in order from position 0."""
        return torch.arange(self._offset + q_len, device=self.k_cache.device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write at `offset` and return views of every valid position of this layer."""
        check_layer(layer, self.k_cache.shape[0])
        check_kv_shape(k, v, self.batch_size, self.num_kv_heads, self.head_dim, self.k_cache.device)
        end = self._offset + k.shape[2]
        if end > self.max_seq_len:
            raise CacheFullError(
                f"{k.shape[2]} new tokens after {self._offset} cached exceed max_seq_len={self.max_seq_len}; "
                "create the cache with a larger max_seq_len"
            )
        self.k_cache[layer, :, :, self._offset : end] = k
        self.v_cache[layer, :, :, self._offset : end] = v
        return self.k_cache[layer, :, :, :end], self.v_cache[layer, :, :, :end]

    def layer_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Layer `layer`'s K and V storage `[B, Hkv, max_seq_len, D]`, position p at slot p (not a ring): for a
        kernel that writes a step's row and attends in place (infer/models/native_step.py)."""
        check_layer(layer, self.k_cache.shape[0])
        return self.k_cache[layer], self.v_cache[layer], False

    def advance(self, n: int) -> None:
        """Count `n` more tokens as cached."""
        self._offset += check_advance(n, self._offset, self.max_seq_len)

    def discard_step(self) -> None:
        """Nothing to undo: a step writes only past the offset, which nothing reads."""

    def reset(self) -> None:
        """Empty the cache; stale values stay in memory but are never read (positions >= offset)."""
        self._offset = 0

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the two tensors."""
        return self.k_cache.nbytes + self.v_cache.nbytes

    def snapshot(self) -> CacheSnapshot:
        """Copies of the filled part of both tensors."""
        n = self._offset
        return CacheSnapshot(
            kind="contiguous",
            offset=n,
            tensors={"k": self.k_cache[:, :, :, :n].clone(), "v": self.v_cache[:, :, :, :n].clone()},
        )

    def restore(self, snapshot: CacheSnapshot) -> None:
        """Load a snapshot of a contiguous cache with the same layers, batch, heads and head size."""
        check_snapshot(snapshot, "contiguous", self.max_seq_len)
        shape = (*self.k_cache.shape[:3], snapshot.offset, self.head_dim)
        t = check_snapshot_tensors(snapshot, {"k": (shape, FLOAT), "v": (shape, FLOAT)}, self.k_cache.device)
        k, v = t["k"], t["v"]
        n = snapshot.offset
        self.k_cache[:, :, :, :n] = k
        self.v_cache[:, :, :, :n] = v
        self._offset = n
