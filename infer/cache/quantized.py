"""The quantized cache: K/V stored as int8, int4 or FP4 codes with bf16 scales.

Values take one scale per (token, head) row. Keys take one per row too (`key_scales="row"`), or, as the registered
kinds do, one per channel over each block of `residual_block` tokens (`"channel"`, KIVI): a real model's keys have
a few outlier channels 10-100x the rest, and a row's scale set by them rounds the other channels to zero.
`sink_tokens=N` keeps the first N tokens (BOS and the like, where attention sinks and the largest keys sit) exact.
`key_offsets=True` (keys by channel) also stores each channel's midpoint over the block and quantizes the keys
around it; `rotate_values=True` stores each value row rotated by an orthonormal Hadamard matrix (`quant.value_rotation`)
and rotates it back on reading. The registered kinds centre their keys (int8 over blocks of 64 tokens, the 4-bit
kinds over 32); the 4-bit kinds also rotate their values (README, "Choosing the quantized layout").

Storage is pre-allocated like the contiguous cache, but packed: `[L, B, Hkv, S, D]` int8 or
`[L, B, Hkv, S, D/2]` uint8 (two 4-bit codes per byte), plus bfloat16 scales `[L, B, Hkv, S]` (keys by channel:
`[L, B, Hkv, S / block, D]`, and as many offsets with `key_offsets`). `update` returns the dequantized K/V in the
model dtype, so attention is unchanged.

After the sinks the tokens form a stream. With `residual_window=N` the newest tokens stay in full precision in a
small ring buffer and are quantized a block at a time as they age: after `n` stream tokens the oldest
`num_quantized(n) = block * floor((n - N) / block)` are quantized (0 while n <= N), so between N and
N + block - 1 of the newest tokens are exact. `residual_window=0` quantizes every token on arrival, except that keys
scaled by channel wait for their block to fill (up to block - 1 newest tokens exact). Values, scaled per row, need
no block: they age on their own count, in blocks of `value_block` (default: the keys' block) past the window, with
their own ring (int8 takes blocks of 32 against its keys' 64, so its ring of exact values is half as long).

`update` ages tokens out of the ring as it writes, so call it once per layer per step, then
`advance` (the model's calling pattern); a second `update` of a layer before `advance` is not
supported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
# How keys are scaled: "row", one scale per (token, head) as values are; "channel", one per channel over each
# block of `residual_block` tokens (KIVI), which holds a key's outlier channels.
KEY_SCALES = ("row", "channel")
# The registered kinds' keys: per channel. On SmolLM2-135M-Instruct (512 tokens of prose, fp32) int4 keeps top-1
# 0.925 of the exact cache's predictions with a scale per channel, 0.716 with one per row (README, "KV-cache kinds").
DEFAULT_KEY_SCALES = "channel"
# The registered kinds keep the first 4 tokens exact (attention sinks): int4 top-1 0.925 -> 0.935, mean KL halved.
DEFAULT_SINK_TOKENS = 4
# The registered kinds centre each key channel within its block (keys after RoPE sit off-centre): the 4-bit kinds
# over blocks of 32 (int4 prose top-1 0.942 -> 0.978, KL 0.011 -> 0.003, for 0.5 more bits per key), int8 over blocks
# of 64, where a scale and an offset cost what a scale per 32 tokens did (mean KL 3.3e-5 -> 1.1e-5 on prose, 6.4e-5
# -> 2.4e-5 on code; the exact ring grows to 63 tokens: 0.528x -> 0.532x the bf16 cache at 4k, 0.527x at 8k).
DEFAULT_KEY_OFFSETS = {"int8": True, "int4": True, "fp4": True}
DEFAULT_KEY_BLOCK = {"int8": 64, "int4": DEFAULT_RESIDUAL_BLOCK, "fp4": DEFAULT_RESIDUAL_BLOCK}
# int8's values leave the exact ring 32 at a time, not with their keys' blocks of 64 (a value row's scale needs no
# block): 0.5316x -> 0.5297x the bf16 cache at 4k (blocks of 16: 0.5288x), mean KL 1.1e-5 -> 1.4e-5 on prose and
# 2.4e-5 -> 2.6e-5 on code (16: 1.6e-5 and 3.3e-5), and one step in 32 (not 64) runs layer by layer. The 4-bit
# kinds' values age with their keys (the quality study's layout, values exact for the newest 16-46 tokens).
DEFAULT_VALUE_BLOCK = {"int8": 32, "int4": DEFAULT_RESIDUAL_BLOCK, "fp4": DEFAULT_RESIDUAL_BLOCK}
# The 4-bit kinds also rotate the values; rotating int8's changed nothing measurable (prose mean KL 3.2e-5 either way).
DEFAULT_ROTATE_VALUES = {"int8": False, "int4": True, "fp4": True}
# and keep the newest 16-46 tokens exact (int4 prose top-1 0.964 -> 0.976): at 4k context on the 1B shapes 0.299x the
# bf16 cache, the most the 0.30x budget allows. int8's window stays 0.
DEFAULT_RESIDUAL_WINDOW = {"int8": 0, "int4": 16, "fp4": 16}


@dataclass
class QuantizedLayerRows:
    """One layer's storage as the whole-step native call reads it (infer/models/native_step.py): the exact ring
    (where a step writes its row), the sinks, the codes with their scales (and key offsets), the value rotation."""

    k_ring: torch.Tensor
    v_ring: torch.Tensor
    k_sink: torch.Tensor
    v_sink: torch.Tensor
    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_offset: torch.Tensor | None
    rotation: torch.Tensor | None
    scheme: str
    channel_keys: bool
    sinks: int
    block: int


class QuantizedCache:
    """Every layer keeps every position quantized (keys by row or by channel), but the sinks and the newest."""

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
        key_scales: str = "row",
        sink_tokens: int = 0,
        key_offsets: bool = False,
        rotate_values: bool = False,
        value_block: int | None = None,
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
        if key_scales not in KEY_SCALES:
            raise ValueError(f"key_scales must be one of {', '.join(map(repr, KEY_SCALES))}, got {key_scales!r}")
        if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
            raise ValueError(f"sink_tokens must be an int >= 0, got {sink_tokens!r}")
        for name, flag in (("key_offsets", key_offsets), ("rotate_values", rotate_values)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        if key_offsets and key_scales != "channel":
            raise ValueError("key_offsets=True centres each key channel over a block: it needs key_scales='channel'")
        if residual_window < 0 or residual_block < 1:
            raise ValueError(
                "residual_window must be >= 0 and residual_block >= 1, "
                f"got {residual_window} and {residual_block}"
            )
        if value_block is not None and (isinstance(value_block, bool) or not isinstance(value_block, int)
                                        or value_block < 1):
            raise ValueError(f"value_block must be an int >= 1 (or None: the keys' block), got {value_block!r}")
        self.attention = _attention_path(attention, resolve_device(device, allow_meta=True))
        self.key_scales = key_scales
        self.key_offsets = key_offsets
        # Value rows are stored as codes of `v @ H` and read back as `decoded @ H` (H symmetric, orthonormal).
        self.rotation = quant.value_rotation(config.head_dim, resolve_device(device, allow_meta=True)) \
            if rotate_values else None
        # The first tokens (BOS and the like: attention sinks, with the largest keys) stay exact; the rest of the
        # cache is a stream that starts after them.
        self.sink_tokens = min(sink_tokens, max_seq_len)
        self.scheme = scheme
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.dtype = dtype
        self.residual_window = residual_window
        # Without a window every token is quantized at once (blocks of one), unless keys take a scale per channel
        # over each block: then the newest tokens of a block not yet full stay exact (KIVI's residual).
        self.residual_block = residual_block if residual_window or key_scales == "channel" else 1
        # Values never wait longer than their keys (without a window or channel keys, both come on arrival).
        self.value_block = self.residual_block if value_block is None else min(value_block, self.residual_block)
        self._quantize, self._dequantize = quantize, dequantize
        self._offset = 0
        self._pending = PendingWrites()  # residual-ring writes of the forward in progress

        lbh = (config.num_hidden_layers, batch_size, self.num_kv_heads)
        stream = max_seq_len - self.sink_tokens
        num_slots, value_slots = self.num_quantized(stream), self.num_values_quantized(stream)
        packed_shape = (*lbh, num_slots, self.head_dim // per_element)
        value_shape = (*lbh, value_slots, self.head_dim // per_element)
        # The rings never hold more than N + block - 1 tokens (see num_quantized); stream position p sits
        # at slot p % R (keys), p % Rv (values).
        self.ring_size = min(residual_window + self.residual_block - 1, stream)
        self.value_ring_size = min(residual_window + self.value_block - 1, stream)
        scale_shape, recent_shape = (*lbh, num_slots), (*lbh, self.ring_size, self.head_dim)
        v_recent_shape = (*lbh, self.value_ring_size, self.head_dim)
        # Keys with a scale per channel: one [D] row of scales per block of residual_block tokens.
        k_scale_shape = (*lbh, num_slots // self.residual_block, self.head_dim) if key_scales == "channel" \
            else scale_shape
        k_offset_shape = k_scale_shape if key_offsets else (*lbh, 0, self.head_dim)
        # k_data: [L, B, Hkv, Sq, D or D/2], v_data as many rows as values are quantized (Sv); k_scale: [L, B, Hkv,
        # Sq], v_scale: [L, B, Hkv, Sv]; k_recent: [L, B, Hkv, R, D], v_recent [L, B, Hkv, Rv, D] in the model dtype
        # k_sink, v_sink: [L, B, Hkv, sink_tokens, D] in the model dtype; k_offset as k_scale (empty without)
        sink_shape = (*lbh, self.sink_tokens, self.head_dim)
        (self.k_data, self.v_data, self.k_scale, self.v_scale, self.k_recent, self.v_recent, self.k_sink,
         self.v_sink, self.k_offset) = allocate_zeros(
            f"an {scheme} cache", device, (packed_shape, storage_dtype), (value_shape, storage_dtype),
            (k_scale_shape, quant.SCALE_DTYPE), ((*lbh, value_slots), quant.SCALE_DTYPE), (recent_shape, dtype),
            (v_recent_shape, dtype), (sink_shape, dtype), (sink_shape, dtype), (k_offset_shape, quant.SCALE_DTYPE),
        )

    @property
    def offset(self) -> int:
        """Number of tokens cached."""
        return self._offset

    @property
    def attends_in_kernel(self) -> bool:
        """Whether one-token steps attend through `decode_attention` (codes dequantized in the Triton kernel)
        rather than `update`'s dequantized history (the PyTorch path, the check and the CPU path)."""
        return self.attention in ("triton", "native")

    def num_quantized(self, num_tokens: int) -> int:
        """How many of the oldest of `num_tokens` tokens past the sinks have their keys held quantized."""
        return self._aged(num_tokens, self.residual_block)

    def num_values_quantized(self, num_tokens: int) -> int:
        """How many of the oldest of `num_tokens` tokens past the sinks have their values held quantized."""
        return self._aged(num_tokens, self.value_block)

    def _aged(self, num_tokens: int, block: int) -> int:
        """The oldest of `num_tokens` stream tokens out of the window, in whole blocks of `block`."""
        if num_tokens <= self.residual_window:
            return 0
        return (num_tokens - self.residual_window) // block * block

    def key_positions(self, layer: int, q_len: int) -> torch.Tensor:
        """Keys come back in order from position 0, as in the contiguous cache."""
        return torch.arange(self._offset + q_len, device=self.k_data.device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens (quantizing what ages out of the window); return every valid position
        dequantized, `[B, Hkv, offset + T, D]` in the cache dtype."""
        end = self._store(layer, k, v)
        return (self._read(self.k_data[layer], self.k_scale[layer], self.k_recent[layer], self.k_sink[layer], end,
                           self.residual_block, self.key_scales == "channel",
                           self.k_offset[layer] if self.key_offsets else None),
                self._read(self.v_data[layer], self.v_scale[layer], self.v_recent[layer], self.v_sink[layer], end,
                           self.value_block, rotation=self.rotation))

    def decode_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         softcap: float | None, window: int | None) -> torch.Tensor:
        """Store one token's `k`, `v` as `update` does, then attend the queries `q` `[B, H, 1, D]` over every
        cached position in the Triton kernel that reads the codes and scales where they lie
        (infer/kernels/quantized_attention.py): no dequantized copy of the history. `[B, H, 1, D]`."""
        from infer.kernels.quantized_attention import quantized_decode_attention

        if q.shape[2] != 1 or k.shape[2] != 1:
            raise ValueError(f"decode_attention takes one token, got q {tuple(q.shape)} and k {tuple(k.shape)}")
        if self.attention == "native":
            return self._native_attention(layer, q, k, v, scale, softcap, window)
        end = self._store(layer, k, v)
        stream = self._in_stream(end)
        lengths = torch.full((self.batch_size,), end, dtype=torch.int32, device=q.device)
        # The ring's writes of this step are pending until advance: the kernel reads them where they are.
        out = quantized_decode_attention(
            q[:, :, 0], (self.k_data[layer], self.v_data[layer]), (self.k_scale[layer], self.v_scale[layer]),
            (self.k_recent[layer], self.v_recent[layer]), lengths, self.num_quantized(stream), self.scheme, scale,
            softcap, window, sinks=(self.k_sink[layer], self.v_sink[layer]), num_sinks=end - stream,
            channel_block=self.residual_block if self.key_scales == "channel" else None,
            key_offsets=self.k_offset[layer] if self.key_offsets else None, value_rotation=self.rotation,
            value_quantized=self.num_values_quantized(stream))
        return out[:, :, None]

    def _native_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          softcap: float | None, window: int | None) -> torch.Tensor:
        """`decode_attention` through the native CPU kernel (infer/kernels/cpu_decode.c, `infer_qattn`): every
        layout (keys by row or channel, sinks, a residual window), codes read where they lie."""
        from infer.kernels.native import native_kernels

        kernels = native_kernels()
        if kernels is None:
            raise ValueError("attention='native' needs the native CPU kernels, which did not build here; use 'auto'")
        end = self._store(layer, k, v)
        stream = self._in_stream(end)
        quantized = self.num_quantized(stream)
        # The ring's writes of this step are pending until advance: the kernel reads them where they are.
        out = kernels.quantized_attention(
            q[:, :, 0], (self.k_sink[layer], self.v_sink[layer]), end - stream,
            (self.k_data[layer], self.v_data[layer]), (self.k_scale[layer], self.v_scale[layer]), quantized,
            self.residual_block, self.scheme, self.key_scales == "channel",
            (self.k_recent[layer], self.v_recent[layer]), stream - quantized, scale, softcap, window,
            self.k_offset[layer] if self.key_offsets else None, self.rotation, self.num_values_quantized(stream))
        return out[:, :, None]

    def native_step_codes(self) -> tuple[int, int] | None:
        """For the whole-step native call: how many stream positions a one-token step at the current offset reads
        as key and as value codes, or None where that step runs layer by layer: it writes a sink or fills a key or
        value block (quantized in PyTorch, as `update` does), the cache holds several sequences, or its attention
        is not the native kernel. Any other step writes only ring slots no live token holds, as the per-layer path
        would."""
        if self.attention != "native" or self.batch_size != 1 or not self.sink_tokens <= self._offset < \
                self.max_seq_len or self.ring_size == 0 or self.value_ring_size == 0:
            return None
        stream = self._in_stream(self._offset)
        keys, values = self.num_quantized(stream), self.num_values_quantized(stream)
        if self.num_quantized(stream + 1) != keys or self.num_values_quantized(stream + 1) != values:
            return None
        return keys, values

    def layer_codes(self, layer: int) -> QuantizedLayerRows:
        """Layer `layer`'s storage for the whole-step native call (one sequence: batch dim dropped)."""
        check_layer(layer, self.k_data.shape[0])
        return QuantizedLayerRows(
            self.k_recent[layer, 0], self.v_recent[layer, 0], self.k_sink[layer, 0], self.v_sink[layer, 0],
            self.k_data[layer, 0], self.v_data[layer, 0], self.k_scale[layer, 0], self.v_scale[layer, 0],
            self.k_offset[layer, 0] if self.key_offsets else None, self.rotation, self.scheme,
            self.key_scales == "channel", self.sink_tokens, self.residual_block)

    def _key_scale_rows(self, num_quantized: int) -> int:
        """Rows of k_scale holding the scales of `num_quantized` tokens: one per token, or one per block."""
        return num_quantized // self.residual_block if self.key_scales == "channel" else num_quantized

    def _ring_slots(self, first: int, stop: int, ring: int) -> torch.Tensor:
        """The slots of stream positions first..stop-1 in a ring of `ring` slots."""
        return torch.arange(first, stop, device=self.k_data.device) % max(ring, 1)

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Check and write `k`, `v` `[B, Hkv, T, D]` after the cached tokens (the ring writes pending until
        `advance`); the position after them."""
        check_layer(layer, self.k_data.shape[0])
        check_kv_shape(k, v, self.batch_size, self.num_kv_heads, self.head_dim, self.k_data.device)
        start, end = self._offset, self._offset + k.shape[2]
        if end > self.max_seq_len:
            raise CacheFullError(
                f"{k.shape[2]} new tokens after {start} cached exceed max_seq_len={self.max_seq_len}; "
                "create the cache with a larger max_seq_len"
            )
        self._pending.start_layer(layer)
        sinks = min(end, self.sink_tokens) - start
        if sinks > 0:  # past the committed offset: nothing live is overwritten
            self.k_sink[layer][:, :, start : start + sinks] = k[:, :, :sinks]
            self.v_sink[layer][:, :, start : start + sinks] = v[:, :, :sinks]
            k, v = k[:, :, sinks:], v[:, :, sinks:]
        first, stop = self._in_stream(start), self._in_stream(end)
        self._write(self.k_data[layer], self.k_scale[layer], self.k_recent[layer], k, first, stop,
                    self.residual_block, self.key_scales == "channel",
                    self.k_offset[layer] if self.key_offsets else None)
        self._write(self.v_data[layer], self.v_scale[layer], self.v_recent[layer], v, first, stop,
                    self.value_block, rotation=self.rotation)
        return end

    def _in_stream(self, num_tokens: int) -> int:
        """How many of the first `num_tokens` positions lie past the sinks."""
        return max(num_tokens - self.sink_tokens, 0)

    def _write(
        self,
        data: torch.Tensor,
        scale: torch.Tensor,
        recent: torch.Tensor,
        x: torch.Tensor,
        start: int,
        end: int,
        block: int,
        by_channel: bool = False,
        offsets: torch.Tensor | None = None,
        rotation: torch.Tensor | None = None,
    ) -> None:
        """Store one layer's K or V: data [B, Hkv, Sq, Dp], scale [B, Hkv, Sq] (`by_channel`: [B, Hkv,
        Sq / block, D], and `offsets` as many to fill, or None), recent [B, Hkv, R, D], new x [B, Hkv, T, D] for
        stream positions start..end-1, aging out of the ring in blocks of `block`; rows quantized as
        `x @ rotation` when given."""
        old_quantized, new_quantized = self._aged(start, block), self._aged(end, block)
        ring = recent.shape[2]
        if new_quantized > old_quantized:
            # Positions old_quantized..new_quantized-1 age out: the older ones from the ring (read
            # before the ring is written below), the rest straight from x.
            from_ring = recent[:, :, self._ring_slots(old_quantized, min(new_quantized, start), ring)]
            from_x = x[:, :, : max(new_quantized - start, 0)]
            aged = torch.cat((from_ring, from_x.to(recent.dtype)), dim=2)
            if by_channel:  # whole blocks age together (_aged counts blocks): a scale per channel each
                B, H, M, D = aged.shape
                blocks = aged.reshape(B, H, M // block, block, D)
                centres = None if offsets is None else quant.channel_offsets(blocks)
                codes, channel_scales = quant.quantize_channels(blocks, self.scheme, centres)
                data[:, :, old_quantized:new_quantized] = codes.flatten(2, 3)
                scale[:, :, old_quantized // block : new_quantized // block] = channel_scales
                if offsets is not None and centres is not None:
                    offsets[:, :, old_quantized // block : new_quantized // block] = centres
            else:
                codes, row_scales = self._quantize(aged if rotation is None else quant.rotate(aged, rotation))
                data[:, :, old_quantized:new_quantized] = codes
                scale[:, :, old_quantized:new_quantized] = row_scales
        first_kept = max(new_quantized, start)
        if end > first_kept:
            # Codes and scales past the committed count are never read, but ring slots may hold live tokens.
            kept = x[:, :, first_kept - start :].to(recent.dtype)
            self._pending.write(recent, self._ring_slots(first_kept, end, ring), kept)

    def _read(self, data: torch.Tensor, scale: torch.Tensor, recent: torch.Tensor, sinks: torch.Tensor, end: int,
              block: int, by_channel: bool = False, offsets: torch.Tensor | None = None,
              rotation: torch.Tensor | None = None) -> torch.Tensor:
        """Positions 0..end-1 of one layer's K or V (aged in blocks of `block`), dequantized (with the keys'
        `offsets`, rows rotated back by `rotation`): [B, Hkv, end, D] in the cache dtype."""
        stream = self._in_stream(end)
        quantized = self._aged(stream, block)
        if by_channel:
            codes = data[:, :, :quantized]
            blocks = codes.reshape(*codes.shape[:2], quantized // block, block, codes.shape[-1])
            old = quant.dequantize_channels(blocks, scale[:, :, : quantized // block], self.scheme, self.dtype,
                                            None if offsets is None else offsets[:, :, : quantized // block]
                                            ).flatten(2, 3)
        elif rotation is not None:
            old = quant.rotate(self._dequantize(data[:, :, :quantized], scale[:, :, :quantized], torch.float32),
                               rotation).to(self.dtype)
        else:
            old = self._dequantize(data[:, :, :quantized], scale[:, :, :quantized], self.dtype)
        return torch.cat((sinks[:, :, : min(end, self.sink_tokens)], old,
                          recent[:, :, self._ring_slots(quantized, stream, recent.shape[2])]), dim=2)

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
        tensors = (self.k_data, self.v_data, self.k_scale, self.v_scale, self.k_recent, self.v_recent, self.k_sink,
                   self.v_sink, self.k_offset)
        return sum(t.nbytes for t in tensors)

    def snapshot(self) -> CacheSnapshot:
        """Copies of the sinks, the quantized rows and scales, and of the ring's tokens in position order."""
        self._pending.undo()  # a forward that stopped part-way is not part of the state
        n = self._offset
        stream = self._in_stream(n)
        q, qv = self.num_quantized(stream), self.num_values_quantized(stream)
        return CacheSnapshot(
            kind=self.scheme,
            offset=n,
            tensors={
                "k_data": self.k_data[:, :, :, :q].clone(),
                "v_data": self.v_data[:, :, :, :qv].clone(),
                "k_scale": self.k_scale[:, :, :, : self._key_scale_rows(q)].clone(),
                "k_offset": self.k_offset[:, :, :, : self._key_scale_rows(q) if self.key_offsets else 0].clone(),
                "v_scale": self.v_scale[:, :, :, :qv].clone(),
                # [L, B, Hkv, stream - q (or - qv), D]
                "k_recent": self.k_recent[:, :, :, self._ring_slots(q, stream, self.ring_size)].clone(),
                "v_recent": self.v_recent[:, :, :, self._ring_slots(qv, stream, self.value_ring_size)].clone(),
                "k_sink": self.k_sink[:, :, :, : n - stream].clone(),  # [L, B, Hkv, min(n, sink_tokens), D]
                "v_sink": self.v_sink[:, :, :, : n - stream].clone(),
            },
            meta={"residual_window": self.residual_window, "residual_block": self.residual_block,
                  "key_scales": self.key_scales, "sink_tokens": self.sink_tokens, "key_offsets": self.key_offsets,
                  "rotate_values": self.rotation is not None, "value_block": self.value_block},
        )

    def restore(self, snapshot: CacheSnapshot) -> None:
        """Load a snapshot of a cache with the same scheme, window, layers, batch, heads and head size."""
        check_snapshot(snapshot, self.scheme, self.max_seq_len)
        layout = (snapshot.meta.get("residual_window"), snapshot.meta.get("residual_block"),
                  snapshot.meta.get("key_scales", "row"), snapshot.meta.get("sink_tokens", 0),
                  snapshot.meta.get("key_offsets", False), snapshot.meta.get("rotate_values", False),
                  snapshot.meta.get("value_block", snapshot.meta.get("residual_block")))
        mine = (self.residual_window, self.residual_block, self.key_scales, self.sink_tokens, self.key_offsets,
                self.rotation is not None, self.value_block)
        if layout != mine:
            raise ValueError(
                "the snapshot was taken with residual_window, residual_block, key_scales, sink_tokens, key_offsets, "
                f"rotate_values, value_block = {layout}, "
                f"this cache has {mine}; restore into a cache built the same way"
            )
        n = snapshot.offset
        stream = self._in_stream(n)
        q, qv = self.num_quantized(stream), self.num_values_quantized(stream)
        lbh = tuple(self.k_data.shape[:3])
        data = ((*lbh, q, self.k_data.shape[-1]), self.k_data.dtype)
        v_data = ((*lbh, qv, self.k_data.shape[-1]), self.k_data.dtype)
        k_scale = ((*lbh, self._key_scale_rows(q), self.head_dim), self.k_scale.dtype) \
            if self.key_scales == "channel" else ((*lbh, q), self.k_scale.dtype)
        recent = ((*lbh, stream - q, self.head_dim), FLOAT)
        v_recent = ((*lbh, stream - qv, self.head_dim), FLOAT)
        sinks = ((*lbh, n - stream, self.head_dim), FLOAT)
        k_offset = ((*lbh, self._key_scale_rows(q) if self.key_offsets else 0, self.head_dim), self.k_offset.dtype)
        t = check_snapshot_tensors(snapshot, {"k_data": data, "v_data": v_data, "k_scale": k_scale,
                                              "v_scale": ((*lbh, qv), self.k_scale.dtype), "k_offset": k_offset,
                                              "k_recent": recent, "v_recent": v_recent,
                                              "k_sink": sinks, "v_sink": sinks}, self.k_data.device)
        for name in ("k_scale", "v_scale"):  # absmax / qmax: never negative (a negative one flips signs)
            if t[name].numel() and bool((t[name] < 0).any()):
                raise ValueError(f"snapshot tensor {name!r} holds negative scales: the file is corrupt or edited")
        self._pending.commit()
        self.k_data[:, :, :, :q] = t["k_data"]
        self.v_data[:, :, :, :qv] = t["v_data"]
        self.k_scale[:, :, :, : self._key_scale_rows(q)] = t["k_scale"]
        self.k_offset[:, :, :, : t["k_offset"].shape[3]] = t["k_offset"]
        self.v_scale[:, :, :, :qv] = t["v_scale"]
        self.k_recent[:, :, :, self._ring_slots(q, stream, self.ring_size)] = t["k_recent"]
        self.v_recent[:, :, :, self._ring_slots(qv, stream, self.value_ring_size)] = t["v_recent"]
        self.k_sink[:, :, :, : n - stream] = t["k_sink"]
        self.v_sink[:, :, :, : n - stream] = t["v_sink"]
        self._offset = n


def _attention_path(attention: str, device: torch.device) -> str:
    """"triton", "native" or "dequantize" for `attention` ("auto": on CUDA the Triton kernel, on the CPU the native
    kernel where it built, else dequantize; both read every layout)."""
    from infer.kernels import triton_available

    if attention == "auto":
        if device.type == "cuda":
            return "triton" if triton_available("cuda") else "dequantize"
        return "native" if device.type == "cpu" and _native_available() else "dequantize"
    if attention not in ("triton", "native", "dequantize"):
        raise ValueError(f"attention must be 'auto', 'triton', 'native' or 'dequantize', got {attention!r}")
    if attention == "native" and (device.type != "cpu" or not _native_available()):
        raise ValueError(f"attention='native' runs on the CPU with the native kernels built; this cache is on "
                         f"{device.type}{'' if device.type != 'cpu' else ' and they did not build'}: use 'auto'")
    if attention == "triton" and not triton_available(device.type):
        raise ValueError(f"attention='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 on the CPU, "
                         f"for tests); this cache is on {device.type}: use 'auto'")
    return attention


def _native_available() -> bool:
    from infer.kernels.native import native_kernels

    return native_kernels() is not None


def quantized_cache_factory(scheme: str) -> Callable[..., QuantizedCache]:
    """The registry's factory for one scheme: `QuantizedCache` with `scheme` fixed and the registered layout as
    defaults (keys by channel with offsets where the scheme takes them, sinks, rotated values, a window)."""
    if scheme not in SCHEMES:
        raise ValueError(
            f"unknown quantization scheme {scheme!r}; use one of {', '.join(map(repr, SCHEMES))}"
        )

    def create(config: ModelConfig, *, key_scales: str = DEFAULT_KEY_SCALES, key_offsets: bool | None = None,
               rotate_values: bool | None = None, sink_tokens: int = DEFAULT_SINK_TOKENS,
               residual_window: int = DEFAULT_RESIDUAL_WINDOW[scheme],
               residual_block: int = DEFAULT_KEY_BLOCK[scheme], value_block: int | None = None,
               **options: Any) -> QuantizedCache:
        # Offsets centre a channel over a block: the default only where keys are scaled by channel.
        offsets = DEFAULT_KEY_OFFSETS[scheme] and key_scales == "channel" if key_offsets is None else key_offsets
        rotate = DEFAULT_ROTATE_VALUES[scheme] if rotate_values is None else rotate_values
        vblock = DEFAULT_VALUE_BLOCK[scheme] if value_block is None else value_block
        return QuantizedCache(config, scheme=scheme, key_scales=key_scales, key_offsets=offsets,
                              rotate_values=rotate, sink_tokens=sink_tokens, residual_window=residual_window,
                              residual_block=residual_block, value_block=vblock, **options)

    return create
