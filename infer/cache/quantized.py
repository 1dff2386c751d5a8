"""The quantized cache: K/V stored as int8, int4 or FP4 rows with one scale per (token, head).

Storage is pre-allocated like the contiguous cache, but packed: `[L, B, Hkv, S, D]` int8 or
`[L, B, Hkv, S, D/2]` uint8 (two 4-bit codes per byte), plus bfloat16 scales `[L, B, Hkv, S]`.
`update` returns the dequantized K/V in the model dtype, so attention is unchanged.

With `residual_window=N` the newest tokens stay in full precision in a small ring buffer and are
quantized a block at a time as they age: after `n` tokens the oldest
`num_quantized(n) = block * floor((n - N) / block)` are quantized (0 while n <= N), so between N and
N + block - 1 of the newest tokens are exact. `residual_window=0` quantizes every token on arrival.

`update` ages tokens out of the ring as it writes, so call it once per layer per step, then
`advance` (the model's calling pattern); a second `update` of a layer before `advance` is not
supported.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from infer.cache import quant
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
from infer.memory import resolve_device

Quantize = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Dequantize = Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]

# scheme -> (quantize, dequantize, values per stored element along head_dim, storage dtype)
SCHEMES: dict[str, tuple[Quantize, Dequantize, int, torch.dtype]] = {
    "int8": (quant.quantize_int8, quant.dequantize_int8, 1, torch.int8),
    "int4": (quant.quantize_int4, quant.dequantize_int4, 2, torch.uint8),
    "fp4": (quant.quantize_fp4, quant.dequantize_fp4, 2, torch.uint8),
}
DEFAULT_RESIDUAL_BLOCK = 32


class QuantizedCache:
    """Every layer keeps every position, quantized per (token, head) row; optionally the newest exact."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        max_seq_len: int,
        batch_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        scheme: str = "int8",
        residual_window: int = 0,
        residual_block: int = DEFAULT_RESIDUAL_BLOCK,
        attention: str = "auto",
    ) -> None:
        if scheme not in SCHEMES:
            raise ValueError(
                f"unknown quantization scheme {scheme!r}; use one of {', '.join(map(repr, SCHEMES))}"
            )
        quantize, dequantize, per_element, storage_dtype = SCHEMES[scheme]
        check_cache_size(max_seq_len, batch_size, dtype)
        if config.head_dim % per_element:
            raise ValueError(
                f"scheme {scheme!r} packs two values per byte and needs an even head_dim, "
                f"got {config.head_dim}; use scheme='int8' (or the contiguous cache) for this model"
            )
        if residual_window < 0 or residual_block < 1:
            raise ValueError(
                "residual_window must be >= 0 and residual_block >= 1, "
                f"got {residual_window} and {residual_block}"
            )
        self.attention = _attention_path(attention, resolve_device(device, allow_meta=True))
        self.scheme = scheme
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.dtype = dtype
        self.residual_window = residual_window
        # Without a window every token is quantized at once: blocks of one.
        self.residual_block = residual_block if residual_window else 1
        self._quantize, self._dequantize = quantize, dequantize
        self._offset = 0
        self._pending = PendingWrites()  # residual-ring writes of the forward in progress

        lbh = (config.num_hidden_layers, batch_size, self.num_kv_heads)
        num_slots = self.num_quantized(max_seq_len)
        packed_shape = (*lbh, num_slots, self.head_dim // per_element)
        # k_data, v_data: [L, B, Hkv, Sq, D or D/2]; k_scale, v_scale: [L, B, Hkv, Sq]
        # The ring never holds more than N + block - 1 tokens (see num_quantized); position p sits
        # at slot p % R.
        self.ring_size = min(residual_window + self.residual_block - 1, max_seq_len)
        scale_shape, recent_shape = (*lbh, num_slots), (*lbh, self.ring_size, self.head_dim)
        # k_data, v_data: [L, B, Hkv, Sq, D or D/2]; k_scale, v_scale: [L, B, Hkv, Sq];
        # k_recent, v_recent: [L, B, Hkv, R, D] in the model dtype
        (self.k_data, self.v_data, self.k_scale, self.v_scale, self.k_recent, self.v_recent) = allocate_zeros(
            f"an {scheme} cache", device, (packed_shape, storage_dtype), (packed_shape, storage_dtype),
            (scale_shape, quant.SCALE_DTYPE), (scale_shape, quant.SCALE_DTYPE), (recent_shape, dtype),
            (recent_shape, dtype),
        )

    @property
    def offset(self) -> int:
        """Number of tokens cached."""
        return self._offset

    @property
    def attends_in_kernel(self) -> bool:
        """Whether one-token steps attend through `decode_attention` (codes dequantized in the Triton kernel)
        rather than `update`'s dequantized history (the PyTorch path, the check and the CPU path)."""
        return self.attention == "triton"

    def num_quantized(self, num_tokens: int) -> int:
        """How many of the oldest of `num_tokens` cached tokens are held quantized."""
        if num_tokens <= self.residual_window:
            return 0
        block = self.residual_block
        return (num_tokens - self.residual_window) // block * block

    def key_positions(self, layer: int, q_len: int) -> torch.Tensor:
        """Keys come back in order from position 0, as in the contiguous cache."""
        return torch.arange(self._offset + q_len, device=self.k_data.device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens (quantizing what ages out of the window); return every valid position
        dequantized, `[B, Hkv, offset + T, D]` in the cache dtype."""
        end = self._store(layer, k, v)
        return (self._read(self.k_data[layer], self.k_scale[layer], self.k_recent[layer], end),
                self._read(self.v_data[layer], self.v_scale[layer], self.v_recent[layer], end))

    def decode_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         softcap: float | None, window: int | None) -> torch.Tensor:
        """Store one token's `k`, `v` as `update` does, then attend the queries `q` `[B, H, 1, D]` over every
        cached position in the Triton kernel that reads the codes and scales where they lie
        (infer/kernels/quantized_attention.py): no dequantized copy of the history. `[B, H, 1, D]`."""
        from infer.kernels.quantized_attention import quantized_decode_attention

        if q.shape[2] != 1 or k.shape[2] != 1:
            raise ValueError(f"decode_attention takes one token, got q {tuple(q.shape)} and k {tuple(k.shape)}")
        end = self._store(layer, k, v)
        lengths = torch.full((self.batch_size,), end, dtype=torch.int32, device=q.device)
        out = quantized_decode_attention(
            q[:, :, 0], (self.k_data[layer], self.v_data[layer]), (self.k_scale[layer], self.v_scale[layer]),
            (self.k_recent[layer], self.v_recent[layer]), lengths, self.num_quantized(end), self.scheme, scale,
            softcap, window)
        return out[:, :, None]

    def _ring_slots(self, first: int, stop: int) -> torch.Tensor:
        return torch.arange(first, stop, device=self.k_data.device) % max(self.ring_size, 1)

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Check and write `k`, `v` `[B, Hkv, T, D]` after the cached tokens (the ring writes pending until
        `advance`); the position after them."""
        check_layer(layer, self.k_data.shape[0])
        check_kv_shape(k, v, self.batch_size, self.num_kv_heads, self.head_dim)
        start, end = self._offset, self._offset + k.shape[2]
        if end > self.max_seq_len:
            raise CacheFullError(
                f"{k.shape[2]} new tokens after {start} cached exceed max_seq_len={self.max_seq_len}; "
                "create the cache with a larger max_seq_len"
            )
        self._pending.start_layer(layer)
        self._write(self.k_data[layer], self.k_scale[layer], self.k_recent[layer], k, start, end)
        self._write(self.v_data[layer], self.v_scale[layer], self.v_recent[layer], v, start, end)
        return end

    def _write(
        self,
        data: torch.Tensor,
        scale: torch.Tensor,
        recent: torch.Tensor,
        x: torch.Tensor,
        start: int,
        end: int,
    ) -> None:
        """Store one layer's K or V: data [B, Hkv, Sq, Dp], scale [B, Hkv, Sq], recent [B, Hkv, R, D],
        new x [B, Hkv, T, D] for positions start..end-1."""
        old_quantized, new_quantized = self.num_quantized(start), self.num_quantized(end)
        if new_quantized > old_quantized:
            # Positions old_quantized..new_quantized-1 age out: the older ones from the ring (read
            # before the ring is written below), the rest straight from x.
            from_ring = recent[:, :, self._ring_slots(old_quantized, min(new_quantized, start))]
            from_x = x[:, :, : max(new_quantized - start, 0)]
            codes, row_scales = self._quantize(torch.cat((from_ring, from_x.to(recent.dtype)), dim=2))
            data[:, :, old_quantized:new_quantized] = codes
            scale[:, :, old_quantized:new_quantized] = row_scales
        first_kept = max(new_quantized, start)
        if end > first_kept:
            # Codes and scales past the committed count are never read, but ring slots may hold live tokens.
            kept = x[:, :, first_kept - start :].to(recent.dtype)
            self._pending.write(recent, self._ring_slots(first_kept, end), kept)

    def _read(self, data: torch.Tensor, scale: torch.Tensor, recent: torch.Tensor, end: int) -> torch.Tensor:
        """Positions 0..end-1 of one layer's K or V, dequantized: [B, Hkv, end, D] in the cache dtype."""
        quantized = self.num_quantized(end)
        old = self._dequantize(data[:, :, :quantized], scale[:, :, :quantized], self.dtype)
        return torch.cat((old, recent[:, :, self._ring_slots(quantized, end)]), dim=2)

    def advance(self, n: int) -> None:
        """Count `n` more tokens as cached (the forward's ring writes are kept)."""
        self._offset += check_advance(n, self._offset, self.max_seq_len)
        self._pending.commit()

    def discard_step(self) -> None:
        """Put back the ring slots a stopped forward overwrote."""
        self._pending.undo()

    def reset(self) -> None:
        """Empty the cache; stale values stay in memory but are never read."""
        self._pending.commit()
        self._offset = 0

    @property
    def memory_bytes(self) -> int:
        """Bytes held: packed codes, scales and the full-precision ring, for K and V."""
        tensors = (self.k_data, self.v_data, self.k_scale, self.v_scale, self.k_recent, self.v_recent)
        return sum(t.nbytes for t in tensors)

    def snapshot(self) -> CacheSnapshot:
        """Copies of the quantized rows and scales, and of the ring's tokens in position order."""
        self._pending.undo()  # a forward that stopped part-way is not part of the state
        n = self._offset
        q = self.num_quantized(n)
        slots = self._ring_slots(q, n)
        return CacheSnapshot(
            kind=self.scheme,
            offset=n,
            tensors={
                "k_data": self.k_data[:, :, :, :q].clone(),
                "v_data": self.v_data[:, :, :, :q].clone(),
                "k_scale": self.k_scale[:, :, :, :q].clone(),
                "v_scale": self.v_scale[:, :, :, :q].clone(),
                "k_recent": self.k_recent[:, :, :, slots].clone(),  # [L, B, Hkv, n - q, D]
                "v_recent": self.v_recent[:, :, :, slots].clone(),
            },
            meta={"residual_window": self.residual_window, "residual_block": self.residual_block},
        )

    def restore(self, snapshot: CacheSnapshot) -> None:
        """Load a snapshot of a cache with the same scheme, window, layers, batch, heads and head size."""
        check_snapshot(snapshot, self.scheme, self.max_seq_len)
        window = (snapshot.meta.get("residual_window"), snapshot.meta.get("residual_block"))
        if window != (self.residual_window, self.residual_block):
            raise ValueError(
                f"the snapshot was taken with residual_window, residual_block = {window}, this cache has "
                f"{(self.residual_window, self.residual_block)}; restore into a cache built the same way"
            )
        n = snapshot.offset
        q = self.num_quantized(n)
        lbh = tuple(self.k_data.shape[:3])
        data = ((*lbh, q, self.k_data.shape[-1]), self.k_data.dtype)
        scale = ((*lbh, q), self.k_scale.dtype)
        recent = ((*lbh, n - q, self.head_dim), FLOAT)
        t = check_snapshot_tensors(snapshot, {"k_data": data, "v_data": data, "k_scale": scale, "v_scale": scale,
                                              "k_recent": recent, "v_recent": recent}, self.k_data.device)
        self._pending.commit()
        self.k_data[:, :, :, :q] = t["k_data"]
        self.v_data[:, :, :, :q] = t["v_data"]
        self.k_scale[:, :, :, :q] = t["k_scale"]
        self.v_scale[:, :, :, :q] = t["v_scale"]
        slots = self._ring_slots(q, n)
        self.k_recent[:, :, :, slots] = t["k_recent"]
        self.v_recent[:, :, :, slots] = t["v_recent"]
        self._offset = n


def _attention_path(attention: str, device: torch.device) -> str:
    """"triton" or "dequantize" for `attention` ("auto": the kernel on CUDA with Triton, else dequantize)."""
    from infer.kernels import triton_available

    if attention == "auto":
        return "triton" if device.type == "cuda" and triton_available("cuda") else "dequantize"
    if attention not in ("triton", "dequantize"):
        raise ValueError(f"attention must be 'auto', 'triton' or 'dequantize', got {attention!r}")
    if attention == "triton" and not triton_available(device.type):
        raise ValueError(f"attention='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 on the CPU, "
                         f"for tests); this cache is on {device.type}: use 'auto'")
    return attention


def quantized_cache_factory(scheme: str) -> Callable[..., QuantizedCache]:
    """The registry's factory for one scheme: `QuantizedCache` with `scheme` fixed."""
    if scheme not in SCHEMES:
        raise ValueError(
            f"unknown quantization scheme {scheme!r}; use one of {', '.join(map(repr, SCHEMES))}"
        )
    return partial(QuantizedCache, scheme=scheme)
