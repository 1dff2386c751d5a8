"""Decode attention over a quantized KV cache in Triton, dequantizing in the kernel: one query token per
sequence reads int8, int4 or FP4 (E2M1) codes and their per-row scales where they lie and never
materialises the history in the model's dtype, so the lossy kinds cost a quarter to a half of the bytes a
bf16 cache costs per step instead of adding a dequantized copy on top.

Layout (one layer of `infer.cache.quantized.QuantizedCache`, every one of its layouts): exact sink tokens first,
then codes `[B, Hkv, Sq, Dp]` (int8, or uint8 with two 4-bit codes per byte, element 2i in the low nibble) with
bf16 scales (values per row `[B, Hkv, Sq]`; keys per row, or per channel over blocks with optional offsets `[B,
Hkv, Sq / block, D]`; value rows optionally stored rotated), and the exact ring of the newest tokens `[B, Hkv, R,
D]` in the model dtype (values may age on their own count, with their own ring: a part where keys are exact and
values coded lies between). Each part (sinks, codes, ring) gets its own splits. Grid: (sequence, KV head, split); each
program keeps an online softmax over its split's tiles, with the query heads of a KV group packed into one tile
(GQA), causal and sliding-window masks and softcap as in infer.kernels.paged_attention, whose split combine this
shares. The PyTorch path (dequantize, then attention) is the check: tests/test_triton_kernels.py.

`quantized_paged_decode_attention` reads the batched engine's quantized pool (infer/cache/paged_quantized.py) the
same way, through each sequence's block table: a full block's codes with per-channel key scales (and offsets) and
per-row value scales, value rows rotated back per tile; a table entry past the pool names a staged block, read
exact. The pool's dequantizing gather, then attention, is its check (tests/test_native_quantized_attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels.paged_attention import (
    _attend_tile,
    _load_query_group,
    _pow2,
    _split_blocks,
    _store_split,
    combine_splits_triton,
)

SCHEME_CODES = {"int8": 0, "int4": 1, "fp4": 2, "none": 3}


@triton.jit
def _dequantize(raw, scheme: tl.constexpr, odd):
    """Values (fp32, before the row scale) of codes loaded as `raw`: int8 codes, or bytes holding two 4-bit
    codes (the high nibble where `odd`), signed int4 or E2M1; scheme 3 is unquantized values."""
    if scheme == 0:
        return raw.to(tl.float32)
    if scheme == 3:
        return raw.to(tl.float32)
    nibble = (raw.to(tl.int32) >> tl.where(odd, 4, 0)) & 0xF
    if scheme == 1:
        return (nibble - ((nibble & 0x8) << 1)).to(tl.float32)  # sign-extend the two's complement
    exponent = (nibble >> 1) & 0x3
    mantissa = (nibble & 0x1).to(tl.float32)
    magnitude = tl.where(exponent == 0, mantissa * 0.5,
                         tl.exp2((exponent - 1).to(tl.float32)) * (1.0 + mantissa * 0.5))
    return tl.where((nibble & 0x8) != 0, -magnitude, magnitude)


@triton.jit
def _quantized_decode_split(
    Q, K, V, KS, VS, KO, Lengths, Acc, M, L,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ksb, stride_ksh, stride_ksr,
    stride_sb, stride_sh,
    stride_ab, stride_ah, stride_as,
    stride_mb, stride_mh,
    start, stop, k_ring, v_ring, base, channel_block, split_base,
    scale, softcap, window,
    K_SCHEME: tl.constexpr, V_SCHEME: tl.constexpr, CHANNEL: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(Lengths + b)
    end = tl.minimum(stop, length)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    q, heads, g_ok = _load_query_group(Q, b, kvh, stride_qb, stride_qh, offs_d, d_ok, GROUP, BLOCK_G)
    # Element d of a row lies in byte d // 2 (high nibble for odd d) when two codes share a byte (int4, fp4).
    k_col = offs_d // 2 if K_SCHEME == 1 or K_SCHEME == 2 else offs_d
    v_col = offs_d // 2 if V_SCHEME == 1 or V_SCHEME == 2 else offs_d
    odd = (offs_d % 2) == 1

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    first = start + split * TILES_PER_SPLIT * BLOCK_N
    for t in range(TILES_PER_SPLIT):
        pos = first + t * BLOCK_N + offs_n
        visible = (pos < end) & (pos >= start)
        if HAS_WINDOW:
            visible = visible & (pos > length - 1 - window)
        # The part's rows start at position `base` (the sinks come first); a ring holds stream position p at p % ring.
        k_row = tl.where(k_ring > 0, (pos - base) % tl.maximum(k_ring, 1), pos - base)
        v_row = tl.where(v_ring > 0, (pos - base) % tl.maximum(v_ring, 1), pos - base)
        kv_ok = visible[:, None] & d_ok[None, :]
        k_raw = tl.load(K + b * stride_kb + kvh * stride_kh + k_row[:, None] * stride_ks + k_col[None, :],
                        mask=kv_ok, other=0)
        v_raw = tl.load(V + b * stride_vb + kvh * stride_vh + v_row[:, None] * stride_vs + v_col[None, :],
                        mask=kv_ok, other=0)
        k = _dequantize(k_raw, K_SCHEME, odd[None, :])
        v = _dequantize(v_raw, V_SCHEME, odd[None, :])
        if K_SCHEME != 3:
            if CHANNEL:  # one scale (and offset) per channel over each block of `channel_block` rows
                where = b * stride_ksb + kvh * stride_ksh + (k_row // channel_block)[:, None] * stride_ksr \
                    + offs_d[None, :]
                k = k * tl.load(KS + where, mask=kv_ok, other=0.0).to(tl.float32)
                if HAS_OFFSETS:
                    k = k + tl.load(KO + where, mask=kv_ok, other=0.0).to(tl.float32)
            else:
                k_scale = tl.load(KS + b * stride_ksb + kvh * stride_ksh + k_row, mask=visible, other=0.0)
                k = k * k_scale.to(tl.float32)[:, None]
        if V_SCHEME != 3:
            v_scale = tl.load(VS + b * stride_sb + kvh * stride_sh + v_row, mask=visible, other=0.0).to(tl.float32)
            v = v * v_scale[:, None]
        m_i, l_i, acc = _attend_tile(q, k, v, visible, m_i, l_i, acc, scale, softcap, HAS_SOFTCAP, PRECISION)

    _store_split(Acc, M, L, b, heads, split_base + split, acc, m_i, l_i, g_ok, d_ok, offs_d, stride_ab, stride_ah,
                 stride_as, stride_mb, stride_mh)


def quantized_decode_attention(
    q: torch.Tensor,
    codes: tuple[torch.Tensor, torch.Tensor],
    scales: tuple[torch.Tensor, torch.Tensor],
    recent: tuple[torch.Tensor, torch.Tensor],
    lengths: torch.Tensor,
    quantized: int,
    scheme: str,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    tile: int = 32,
    tiles_per_split: int | None = None,
    *,
    sinks: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_sinks: int = 0,
    channel_block: int | None = None,
    key_offsets: torch.Tensor | None = None,
    value_rotation: torch.Tensor | None = None,
    value_quantized: int | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence, `q` `[B, H, D]`, over positions `0 .. lengths[b]-1`: the first
    `num_sinks` exact from `sinks` (k, v) `[B, Hkv, S0, D]`, the next `quantized` from `codes` (k, v)
    `[B, Hkv, Sq, Dp]` with `scales` (keys `[B, Hkv, Sq]` per row, or `[B, Hkv, Sq / channel_block, D]` per channel
    over blocks of `channel_block` rows, with `key_offsets` shaped alike added when given; values `[B, Hkv, Sq]`),
    the rest from the ring `recent` (k, v) `[B, Hkv, R, D]` (stream position p = position - num_sinks in slot
    p % R). Values may age on their own count: `value_quantized` (default `quantized`) value rows are codes, the
    rest in `recent[1]` (its own ring length). Value rows stored rotated (`v @ H`, `value_rotation` H `[D, D]`
    symmetric) are rotated back once per split, before the splits combine. Returns `[B, H, D]` in q's dtype.
    `scheme`: "int8", "int4" or "fp4". `tile`: positions a program reads at once; `tiles_per_split`: tiles per
    program (default: enough splits to give a GPU ~2 programs per SM). Every sequence must have length >= 1."""
    if scheme not in ("int8", "int4", "fp4"):
        raise ValueError(f"scheme must be 'int8', 'int4' or 'fp4', got {scheme!r}")
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two >= 16, got {tile}")
    B, H, D = q.shape
    k_codes, v_codes = codes
    k_recent, v_recent = recent
    Hkv = k_codes.shape[1]
    if H % Hkv or k_codes.shape[:2] != v_codes.shape[:2] or k_codes.shape[3] != v_codes.shape[3] \
            or k_recent.shape[-1] != D or v_recent.shape[-1] != D or q.stride(-1) != 1:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, codes {tuple(k_codes.shape)}, "
                         f"ring {tuple(k_recent.shape)}")
    if num_sinks and sinks is None:
        raise ValueError(f"num_sinks={num_sinks} needs the sink tensors")
    if key_offsets is not None and channel_block is None:
        raise ValueError("key_offsets centre keys scaled per channel: give channel_block")
    longest = int(lengths.max())
    v_quantized = quantized if value_quantized is None else value_quantized
    k_ring, v_ring = k_recent.shape[2], v_recent.shape[2]
    for coded, ring in ((num_sinks + quantized, k_ring), (num_sinks + v_quantized, v_ring)):
        if longest > coded and ring == 0:
            raise ValueError(f"positions {coded}..{longest - 1} are not quantized, and the cache keeps no ring")
    k_scales, v_scales = scales
    # Key and value of each part: (scheme, tensor, ring slots). A stream position is coded below its count.
    def side(coded: bool, i: int, ring: int) -> tuple[str, torch.Tensor, int]:
        return (scheme, codes[i], 0) if coded else ("none", recent[i], ring)

    low, high = num_sinks + min(quantized, v_quantized), num_sinks + max(quantized, v_quantized)
    sink_k, sink_v = sinks or recent
    # (start, stop, key side, value side, first row's position)
    parts = [(0, min(num_sinks, longest), ("none", sink_k, 0), ("none", sink_v, 0), 0),
             (num_sinks, low, side(True, 0, k_ring), side(True, 1, v_ring), num_sinks),
             (low, high, side(quantized > v_quantized, 0, k_ring), side(v_quantized > quantized, 1, v_ring),
              num_sinks),
             (high, longest, side(False, 0, k_ring), side(False, 1, v_ring), num_sinks)]
    parts = [part for part in parts if part[1] > part[0]]
    if tiles_per_split is None:
        target = 2 * torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        tiles = max(_cdiv(part[1] - part[0], tile) for part in parts)
        tiles_per_split = _cdiv(tiles, max(1, min(tiles, _cdiv(target, B * Hkv))))
    splits = [_cdiv(_cdiv(part[1] - part[0], tile), tiles_per_split) for part in parts]
    acc = torch.empty(B, H, sum(splits), D, dtype=torch.float32, device=q.device)
    m = torch.empty(B, H, sum(splits), dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    lengths = lengths.to(torch.int32)
    offsets = k_scales if key_offsets is None else key_offsets  # a placeholder pointer when there are none
    ks_row = k_scales.stride(2) if channel_block is not None else 0
    base = 0
    for (start, stop, (k_kind, k, k_slots), (v_kind, v, v_slots), first_row), count in zip(parts, splits,
                                                                                         strict=True):
        _quantized_decode_split[(B, Hkv, count)](
            q, k, v, k_scales, v_scales, offsets, lengths, acc, m, l_sum,
            q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            k_scales.stride(0), k_scales.stride(1), ks_row,
            v_scales.stride(0), v_scales.stride(1),
            acc.stride(0), acc.stride(1), acc.stride(2),
            m.stride(0), m.stride(1),
            start, stop, k_slots, v_slots, first_row, channel_block or 1, base,
            float(scale), float(softcap or 1.0), int(window or 0),
            K_SCHEME=SCHEME_CODES[k_kind], V_SCHEME=SCHEME_CODES[v_kind], CHANNEL=channel_block is not None,
            HAS_OFFSETS=key_offsets is not None, BLOCK_N=tile,
            HEAD_DIM=D, BLOCK_D=_pow2(D), GROUP=H // Hkv, BLOCK_G=_pow2(H // Hkv), TILES_PER_SPLIT=tiles_per_split,
            HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )
        if v_kind != "none" and value_rotation is not None:
            # The splits' sums of rotated rows, rotated back (linear, so before the combine's weighting).
            acc[:, :, base : base + count] = acc[:, :, base : base + count] @ value_rotation.to(acc)
        base += count
    return combine_splits_triton(acc, m, l_sum, q.dtype)


@triton.jit
def _quantized_paged_split(
    Q, KC, VC, KS, VS, KO, KST, VST, Rot, Tables, Lengths, Starts, Acc, M, L,
    stride_qb, stride_qh,
    stride_cn, stride_ch, stride_cs,
    stride_ksn, stride_ksh,
    stride_vsn, stride_vsh,
    stride_sn, stride_sh, stride_ss,
    stride_tb,
    stride_ab, stride_ah, stride_as,
    stride_mb, stride_mh,
    num_blocks, scale, softcap, window, num_splits,
    SCHEME: tl.constexpr, PACKED: tl.constexpr, HAS_OFFSETS: tl.constexpr, ROTATED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(Lengths + b)
    start = tl.load(Starts + b)  # the position of the table's first key
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    q, heads, g_ok = _load_query_group(Q, b, kvh, stride_qb, stride_qh, offs_d, d_ok, GROUP, BLOCK_G)
    col = offs_d // 2 if PACKED else offs_d
    odd = (offs_d % 2) == 1
    if ROTATED:  # H [D, D]: a decoded value row times H is the row as written
        rot = tl.load(Rot + offs_d[:, None] * HEAD_DIM + offs_d[None, :], mask=d_ok[:, None] & d_ok[None, :],
                      other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    lo, hi = _split_blocks(length, start, window, num_splits, split, BLOCK_SIZE, HAS_WINDOW)
    for j in range(lo, hi):
        entry = tl.load(Tables + b * stride_tb + j).to(tl.int64)
        # Both sources addressed, one read: the other's loads are masked off (the flags as vectors, which the
        # interpreter's masks need).
        staged = (tl.zeros([BLOCK_N], tl.int64) + entry) >= num_blocks
        coded = (tl.zeros([BLOCK_D], tl.int64) + entry) < num_blocks
        code = tl.where(entry >= num_blocks, 0, entry)
        slot = tl.where(entry >= num_blocks, entry - num_blocks, 0)
        pos = start + j * BLOCK_SIZE + offs_n
        visible = (offs_n < BLOCK_SIZE) & (pos < length)
        if HAS_WINDOW:
            visible = visible & (pos > length - 1 - window)
        kv_ok = visible[:, None] & d_ok[None, :]
        exact_ok = kv_ok & staged[:, None]
        code_ok = kv_ok & (staged == 0)[:, None]
        chan_ok = d_ok & coded
        rows = offs_n[:, None]
        k_exact = tl.load(KST + slot * stride_sn + kvh * stride_sh + rows * stride_ss + offs_d[None, :],
                          mask=exact_ok, other=0.0).to(tl.float32)
        v_exact = tl.load(VST + slot * stride_sn + kvh * stride_sh + rows * stride_ss + offs_d[None, :],
                          mask=exact_ok, other=0.0).to(tl.float32)
        k_raw = tl.load(KC + code * stride_cn + kvh * stride_ch + rows * stride_cs + col[None, :], mask=code_ok,
                        other=0)
        v_raw = tl.load(VC + code * stride_cn + kvh * stride_ch + rows * stride_cs + col[None, :], mask=code_ok,
                        other=0)
        channel = code * stride_ksn + kvh * stride_ksh + offs_d
        k = _dequantize(k_raw, SCHEME, odd[None, :]) * tl.load(KS + channel, mask=chan_ok, other=0.0).to(
            tl.float32)[None, :]
        if HAS_OFFSETS:
            k = k + tl.load(KO + channel, mask=chan_ok, other=0.0).to(tl.float32)[None, :]
        v_scale = tl.load(VS + code * stride_vsn + kvh * stride_vsh + offs_n, mask=visible & (staged == 0),
                          other=0.0).to(tl.float32)
        v = _dequantize(v_raw, SCHEME, odd[None, :]) * v_scale[:, None]
        if ROTATED:
            v = tl.dot(v, rot, input_precision=PRECISION)
        k = tl.where(staged[:, None], k_exact, k)
        v = tl.where(staged[:, None], v_exact, v)
        m_i, l_i, acc = _attend_tile(q, k, v, visible, m_i, l_i, acc, scale, softcap, HAS_SOFTCAP, PRECISION)

    _store_split(Acc, M, L, b, heads, split, acc, m_i, l_i, g_ok, d_ok, offs_d, stride_ab, stride_ah, stride_as,
                 stride_mb, stride_mh)


def quantized_paged_decode_attention(
    q: torch.Tensor,
    codes: tuple[torch.Tensor, torch.Tensor],
    scales: tuple[torch.Tensor, torch.Tensor],
    stage: tuple[torch.Tensor, torch.Tensor],
    tables: torch.Tensor,
    lengths: torch.Tensor,
    starts: torch.Tensor,
    scheme: str,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    *,
    key_offsets: torch.Tensor | None = None,
    value_rotation: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One query per sequence, `q` `[B, H, D]`, over one layer of the engine's quantized pool through block
    `tables` `[B, nb]`: entry e < N names full block e, its `codes` (k, v) `[N, Hkv, bs, Dp]` with `scales` (keys
    `[N, Hkv, D]` per channel, plus `key_offsets` alike when given; values `[N, Hkv, bs]`), value rows stored
    rotated by `value_rotation` H `[D, D]` when given; e >= N names staged slot e - N of `stage` (k, v) `[P, Hkv,
    bs, D]`, exact. Sequence b's keys are positions `starts[b] .. lengths[b] - 1`, its table's blocks in order, the
    query at the last. `[B, H, D]` in q's dtype."""
    if scheme not in ("int8", "int4", "fp4"):
        raise ValueError(f"scheme must be 'int8', 'int4' or 'fp4', got {scheme!r}")
    B, H, D = q.shape
    k_codes, v_codes = codes
    k_stage, v_stage = stage
    num_blocks, Hkv, block_size = k_codes.shape[:3]
    if H % Hkv or k_codes.shape != v_codes.shape or k_stage.shape[1:] != (Hkv, block_size, D) \
            or k_stage.shape != v_stage.shape:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, codes {tuple(k_codes.shape)}, staging "
                         f"{tuple(k_stage.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k_codes, v_codes, k_stage, v_stage)) or k_stage.stride() != v_stage.stride():
        raise ValueError("q, the codes and the staging need a contiguous last dimension (and one staging layout)")
    k_scales, v_scales = (t.contiguous() for t in scales)
    if num_splits is None:
        target = 2 * torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        num_splits = max(1, min(tables.shape[1], _cdiv(target, B * Hkv)))
    acc = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device)
    m = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    offsets = k_scales if key_offsets is None else key_offsets.contiguous()  # a placeholder pointer without
    rotation = k_scales if value_rotation is None else value_rotation.to(torch.float32).contiguous()
    tables = tables.contiguous()
    _quantized_paged_split[(B, Hkv, num_splits)](
        q, k_codes, v_codes, k_scales, v_scales, offsets, k_stage, v_stage, rotation, tables,
        lengths.contiguous(), starts.contiguous(), acc, m, l_sum,
        q.stride(0), q.stride(1),
        k_codes.stride(0), k_codes.stride(1), k_codes.stride(2),
        k_scales.stride(0), k_scales.stride(1),
        v_scales.stride(0), v_scales.stride(1),
        k_stage.stride(0), k_stage.stride(1), k_stage.stride(2),
        tables.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2),
        m.stride(0), m.stride(1),
        num_blocks, float(scale), float(softcap or 1.0), int(window or 0), num_splits,
        SCHEME=SCHEME_CODES[scheme], PACKED=scheme in ("int4", "fp4"), HAS_OFFSETS=key_offsets is not None,
        ROTATED=value_rotation is not None, BLOCK_SIZE=block_size, BLOCK_N=_pow2(block_size), HEAD_DIM=D,
        BLOCK_D=_pow2(D), GROUP=H // Hkv, BLOCK_G=_pow2(H // Hkv),
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return combine_splits_triton(acc, m, l_sum, q.dtype)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
