"""Dequantization of llama.cpp's tensor encodings (ggml block types) into float32, vectorised in torch.

Each quantized type stores a tensor row by row as fixed-size blocks of bytes; a function here turns an
`[n_blocks, type_size]` uint8 tensor into `[n_blocks, block_size]` float32. The layouts and the order of the
float operations follow ggml's reference (`ggml-quants.c`, and `gguf.quants` in Python), so the results are
bit-identical to llama.cpp's own dequantization.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

QK_K = 256  # elements per super-block of the k-quants


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scale at byte `start` of every block, as a float32 column `[n_blocks, 1]`."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor, group: int) -> torch.Tensor:
    """Split bytes into 4-bit values: in each run of `group` bytes, the low nibbles come first, then the
    high ones (ggml's order: element j is byte j's low nibble, element j + group its high nibble)."""
    n = packed.shape[0]
    runs = packed.reshape(n, -1, 1, group)
    return torch.cat((runs & 0x0F, runs >> 4), dim=2).reshape(n, -1)


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


def _f16_plain(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).float()


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    # bf16 is the top half of an fp32: widening it is exact (ggml shifts the 16 bits up).
    return blocks.contiguous().view(torch.bfloat16).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """32 signed bytes scaled by one fp16 `d`."""
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _f16(blocks, 0)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """32 nibbles offset by 8, scaled by `d`."""
    q = _nibbles(blocks[:, 2:], 16).to(torch.int8) - 8
    return _f16(blocks, 0) * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """32 nibbles scaled by `d`, plus the block's minimum `m`."""
    q = _nibbles(blocks[:, 4:], 16).float()
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _fifth_bits(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Q5_0 / Q5_1: the 32 high bits at byte `start` (a little-endian uint32), bit j for element j, as `[n, 32]`."""
    qh = blocks[:, start : start + 4].clone(memory_format=torch.contiguous_format).view(torch.int32)  # aligned
    return (qh >> torch.arange(32, dtype=torch.int32)) & 1


def _q5_0_codes(blocks: torch.Tensor) -> torch.Tensor:
    """A Q5_0 block's 32 codes in element order, in -16..15: five-bit values (nibbles plus a high bit each)
    offset by 16."""
    return (_nibbles(blocks[:, 6:], 16).to(torch.int32) | (_fifth_bits(blocks, 2) << 4)) - 16


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """The codes scaled by the block's fp16 `d`."""
    return _f16(blocks, 0) * _q5_0_codes(blocks).float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """32 five-bit values scaled by `d`, plus the block's minimum `m`."""
    q = _nibbles(blocks[:, 8:], 16).to(torch.int32) | (_fifth_bits(blocks, 4) << 4)
    return _f16(blocks, 0) * q.float() + _f16(blocks, 2)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of a Q4_K / Q5_K super-block, packed in 12 bytes: bytes 0-3 hold
    scales 0-3 (low 6 bits), 4-7 mins 0-3; scales and mins 4-7 take their low 4 bits from bytes 8-11 and
    their top 2 bits from the spare top bits of bytes 0-3 and 4-7."""
    n = packed.shape[0]
    d, m, m_d = packed.reshape(n, 3, 4).unbind(dim=1)
    scales = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mins = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return scales.float(), mins.float()


def _k_dequant(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """`d * scale * q - dmin * min` per sub-block of 32, for Q4_K and Q5_K (q: `[n, 8, 32]`)."""
    n = blocks.shape[0]
    scales, mins = _k_scales(blocks[:, 4:16])
    d = (_f16(blocks, 0) * scales).reshape(n, -1, 1)
    dm = (_f16(blocks, 2) * mins).reshape(n, -1, 1)
    return (d * q.float() - dm).reshape(n, QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """256 nibbles in 8 sub-blocks of 32, each with its own 6-bit scale and min."""
    q = _nibbles(blocks[:, 16:], 32).reshape(blocks.shape[0], 8, 32)
    return _k_dequant(blocks, q)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K's layout plus a fifth bit per element: bit j of `qh` byte i is element i of sub-block j."""
    n = blocks.shape[0]
    low = _nibbles(blocks[:, 48:], 32).reshape(n, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
    high = (blocks[:, 16:48].reshape(n, 1, 32) >> shifts) & 0x01
    return _k_dequant(blocks, low | (high << 4))


def _q6_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """A Q6_K block's 256 codes in element order, int8 in -32..31: 6-bit values (low 4 bits in `ql`, top 2 in
    `qh`) offset by 32."""
    n = blocks.shape[0]
    low = _nibbles(blocks[:, :128], 64).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 0x03).reshape(n, 8, 32)
    return ((low | (high << 4)).to(torch.int8) - 32).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """The codes in 16 sub-blocks of 16 with an int8 scale each, times one fp16 `d` at the end of the block."""
    n = blocks.shape[0]
    q = _q6_k_codes(blocks).reshape(n, 16, 16)
    d = (_f16(blocks, 208) * blocks[:, 192:208].contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    return (d * q.float()).reshape(n, QK_K)


# ggml type name -> (elements per block, bytes per block, dequantize one batch of blocks)
BLOCK_TYPES: dict[str, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "F32": (1, 4, _f32),
    "F16": (1, 2, _f16_plain),
    "BF16": (1, 2, _bf16),
    "Q8_0": (32, 34, _q8_0),
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),  # llama.cpp's fallback in Q4_K_M files whose rows are not whole 256-blocks
    "Q5_1": (32, 24, _q5_1),
    "Q4_K": (QK_K, 144, _q4_k),
    "Q5_K": (QK_K, 176, _q5_k),
    "Q6_K": (QK_K, 210, _q6_k),
}


def dequantize(data: torch.Tensor, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 tensor of `shape` that the raw bytes `data` (uint8, row-major blocks) encode as `kind`."""
    block_size, type_size, decode = BLOCK_TYPES[kind]
    numel = 1
    for size in shape:
        numel *= size
    blocks = data.reshape(-1).view(torch.uint8).reshape(-1, type_size)
    if blocks.shape[0] * block_size != numel:
        raise ValueError(f"{blocks.shape[0]} {kind} blocks hold {blocks.shape[0] * block_size} values, not {numel}")
    return decode(blocks).reshape(shape)
