"""The sliding-window cache: a ring buffer of `sliding_window` slots for sliding layers, a full
contiguous buffer for global ones, so the local layers' memory stays bounded however long the
sequence grows (Gemma 3: five local layers in six).

Ring slot of position p is p % W. A single-token step writes first and attends over the ring as it
stands (order does not matter to attention); a chunk attends over the W-1 previous positions, put
in order, followed by its own keys, and only then are its last W positions written.
"""

from __future__ import annotations

import torch

from infer.cache.base import (
    FLOAT,
    CacheSnapshot,
    PendingWrites,
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


class SlidingWindowCache:
    """Ring buffers for sliding layers, contiguous buffers for full-attention layers."""

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
        self.window = config.sliding_window or max_seq_len
        self.is_sliding = [config.is_sliding(i) for i in range(config.num_hidden_layers)]
        # Index of each layer inside the buffer of its kind.
        self.slot_of = [sum(self.is_sliding[:i]) if s else sum(not x for x in self.is_sliding[:i])
                        for i, s in enumerate(self.is_sliding)]
        num_sliding = sum(self.is_sliding)
        kv = (batch_size, self.num_kv_heads)
        # ring_k: [Ls, B, Hkv, W, D]; full_k: [Lg, B, Hkv, max_seq_len, D]
        ring_shape = (num_sliding, *kv, min(self.window, max_seq_len), self.head_dim)
        full_shape = (len(self.is_sliding) - num_sliding, *kv, max_seq_len, self.head_dim)
        self.ring_k, self.ring_v, self.full_k, self.full_v = allocate_zeros(
            "a sliding cache", device, (ring_shape, dtype), (ring_shape, dtype), (full_shape, dtype),
            (full_shape, dtype),
        )
        self._offset = 0
        self._pending = PendingWrites()  # ring writes of the forward in progress

    @property
    def offset(self) -> int:
        """Number of tokens seen (not all of them kept by sliding layers)."""
        return self._offset

    @property
    def ring_size(self) -> int:
        """Slots per sliding layer."""
        return self.ring_k.shape[3]

    def key_positions(self, layer: int, q_len: int) -> torch.Tensor:
        """Full layers: 0 .. offset+q_len-1. Sliding layers: see `update`."""
        device = self.full_k.device
        end = self._offset + q_len
        if not self.is_sliding[layer]:
            return torch.arange(end, device=device)
        W = self.ring_size
        if q_len == 1:
            # After writing position p = offset, slot s holds the latest position <= p congruent to s.
            slots = torch.arange(min(end, W), device=device)
            return self._offset - (self._offset - slots) % W
        start = max(0, self._offset - (W - 1))
        return torch.arange(start, end, device=device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v `[B, Hkv, T, D]`; return what the new queries attend to."""
        check_layer(layer, len(self.is_sliding))
        check_kv_shape(k, v, self.batch_size, self.num_kv_heads, self.head_dim, self.full_k.device)
        T = k.shape[2]
        end = self._offset + T
        if end > self.max_seq_len:
            raise CacheFullError(
                f"{T} new tokens after {self._offset} cached exceed max_seq_len={self.max_seq_len}; "
                "create the cache with a larger max_seq_len"
            )
        self._pending.start_layer(layer)
        i = self.slot_of[layer]
        if not self.is_sliding[layer]:
            self.full_k[i, :, :, self._offset : end] = k
            self.full_v[i, :, :, self._offset : end] = v
            return self.full_k[i, :, :, :end], self.full_v[i, :, :, :end]
        ring_k, ring_v, W = self.ring_k[i], self.ring_v[i], self.ring_size
        if T == 1:
            slot = self._offset % W
            self._pending.write(ring_k, slot, k[:, :, 0])
            self._pending.write(ring_v, slot, v[:, :, 0])
            return ring_k[:, :, : min(end, W)], ring_v[:, :, : min(end, W)]
        # A chunk: the previous W-1 positions in order, then the chunk itself.
        start = max(0, self._offset - (W - 1))
        order = torch.arange(start, self._offset, device=k.device) % W
        keys = torch.cat([ring_k[:, :, order], k], dim=2)
        values = torch.cat([ring_v[:, :, order], v], dim=2)
        keep = min(T, W)
        slots = torch.arange(end - keep, end, device=k.device) % W
        self._pending.write(ring_k, slots, k[:, :, T - keep :])
        self._pending.write(ring_v, slots, v[:, :, T - keep :])
        return keys, values

    def layer_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Layer `layer`'s K and V storage `[B, Hkv, slots, D]` for a kernel that writes a step's row and attends in
        place (infer/models/native_step.py): a full layer's position p at slot p; a sliding layer's ring (True),
        p at slot p % slots, every filled slot a key of the newest position."""
        check_layer(layer, len(self.is_sliding))
        i = self.slot_of[layer]
        if self.is_sliding[layer]:
            return self.ring_k[i], self.ring_v[i], True
        return self.full_k[i], self.full_v[i], False

    def advance(self, n: int) -> None:
        """Count `n` more tokens as seen (the forward's ring writes are kept)."""
        self._offset += check_advance(n, self._offset, self.max_seq_len)
        self._pending.commit()

    def discard_step(self) -> None:
        """Put back the ring slots a stopped forward overwrote."""
        self._pending.undo()

    def reset(self) -> None:
        """Empty the cache (stale slots are never read: positions are recomputed from the offset)."""
        self._pending.commit()
        self._offset = 0

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the ring and full buffers."""
        return sum(t.nbytes for t in (self.ring_k, self.ring_v, self.full_k, self.full_v))

    def snapshot(self) -> CacheSnapshot:
        """Copies of the filled part of the full buffers and of the rings' last min(offset, window) positions
        in position order, so the snapshot restores into a sliding cache of any max_seq_len."""
        self._pending.undo()  # a forward that stopped part-way is not part of the state
        n = self._offset
        slots = self._ring_slots(n, min(n, self.ring_size))
        tensors = {
            "ring_k": self.ring_k[:, :, :, slots].clone(),  # [Ls, B, Hkv, min(n, W), D]
            "ring_v": self.ring_v[:, :, :, slots].clone(),
            "full_k": self.full_k[:, :, :, :n].clone(),
            "full_v": self.full_v[:, :, :, :n].clone(),
        }
        return CacheSnapshot(kind="sliding", offset=n, tensors=tensors, meta={"window": self.window})

    def _ring_slots(self, n: int, m: int) -> torch.Tensor:
        """Ring slots of positions n - m .. n - 1, in position order."""
        return torch.arange(n - m, n, device=self.ring_k.device) % self.ring_size

    def restore(self, snapshot: CacheSnapshot) -> None:
        """Load a snapshot taken from a sliding cache of the same model and batch size."""
        check_snapshot(snapshot, "sliding", self.max_seq_len)
        n = snapshot.offset
        full = (*self.full_k.shape[:3], n, self.head_dim)
        ring = (*self.ring_k.shape[:3], min(n, self.window), self.head_dim)
        t = check_snapshot_tensors(snapshot, {"ring_k": (ring, FLOAT), "ring_v": (ring, FLOAT),
                                              "full_k": (full, FLOAT), "full_v": (full, FLOAT)}, self.ring_k.device)
        self._pending.commit()
        m = min(n, self.ring_size)  # this ring may be shorter than the snapshot's (a smaller max_seq_len)
        slots = self._ring_slots(n, m)
        self.ring_k[:, :, :, slots] = t["ring_k"][:, :, :, ring[3] - m :]
        self.ring_v[:, :, :, slots] = t["ring_v"][:, :, :, ring[3] - m :]
        self.full_k[:, :, :, :n] = t["full_k"]
        self.full_v[:, :, :, :n] = t["full_v"]
        self._offset = n
