"""Paged decode attention in Triton: one query token per sequence, K/V read in place through each sequence's
block table (no gather), the query heads of a KV group packed into one tile (GQA), causal and sliding-window
masks, attention softcap, any head dim and block size, and split-K over the blocks (flash-decoding) so a few
long sequences still fill the GPU.

Layout: the engine's pool, one layer: `k_blocks`, `v_blocks` `[num_blocks, Hkv, block_size, D]`; `tables`
`[B, max_blocks]` int32; `lengths` `[B]` int32 (keys of each sequence, its query at position length-1).
Grid: (sequence, KV head, split). Each program keeps an online softmax (running max, sum, weighted values)
over its split's blocks and writes it out; `paged_decode_attention` combines the splits. A sequence's splits
divide its own blocks, so a table padded wider than the sequence (the batched engine's graph-captured
shapes) or a longer neighbour in the batch leaves no split idle.

`infer.ragged` is the PyTorch path this is checked against (tests/test_triton_kernels.py, under
`TRITON_INTERPRET=1` on a CPU); the engine uses this on CUDA (`decode_attention="triton"`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # tanh from exp, finite for large |x| (libdevice's name differs by backend and version).
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _load_query_group(Q, b, kvh, stride_qb, stride_qh, offs_d, d_ok, GROUP: tl.constexpr, BLOCK_G: tl.constexpr):
    """The query heads of sequence b that read KV head kvh (head h reads KV head h // GROUP, as repeat_kv), packed
    into one [BLOCK_G, BLOCK_D] fp32 tile, with their head indices and which rows are real. Products are fp32
    whatever the storage dtype (decode is bandwidth-bound, so widening in registers costs no time, and it
    sidesteps the interpreter's broken bf16 dot)."""
    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    return q, heads, g_ok


@triton.jit
def _attend_tile(q, k, v, visible, m_i, l_i, acc, scale, softcap, HAS_SOFTCAP: tl.constexpr,
                 PRECISION: tl.constexpr):
    """One tile of keys into the online softmax: scores of the packed query heads `q` against `k`, softcapped,
    masked to `visible`, folded into the running max `m_i`, sum `l_i` and weighted values `acc`."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if HAS_SOFTCAP:
        s = softcap * _tanh(s / softcap)
    s = tl.where(visible[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_decode_split(
    Q, K, V, Tables, Lengths, Acc, M, L, Out,
    stride_qb, stride_qh,
    stride_kn, stride_kh, stride_ks,
    stride_vn, stride_vh, stride_vs,
    stride_tb,
    stride_ab, stride_ah, stride_as,
    stride_mb, stride_mh,
    stride_ob, stride_oh,
    scale, softcap, window, num_splits,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, ONE_SPLIT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(Lengths + b)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    q, heads, g_ok = _load_query_group(Q, b, kvh, stride_qb, stride_qh, offs_d, d_ok, GROUP, BLOCK_G)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    lo, hi = _split_blocks(length, 0, window, num_splits, split, BLOCK_SIZE, HAS_WINDOW)
    for j in range(lo, hi):
        block = tl.load(Tables + b * stride_tb + j).to(tl.int64)
        pos = j * BLOCK_SIZE + offs_n
        visible = (offs_n < BLOCK_SIZE) & (pos < length)
        if HAS_WINDOW:
            visible = visible & (pos > length - 1 - window)
        kv_ok = visible[:, None] & d_ok[None, :]
        k = tl.load(K + block * stride_kn + kvh * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
                    mask=kv_ok, other=0.0).to(tl.float32)
        v = tl.load(V + block * stride_vn + kvh * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :],
                    mask=kv_ok, other=0.0).to(tl.float32)
        m_i, l_i, acc = _attend_tile(q, k, v, visible, m_i, l_i, acc, scale, softcap, HAS_SOFTCAP, PRECISION)

    if ONE_SPLIT:  # the combine of one split is this division (its weight exp(m - m) is 1): no second launch
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        _store_split(Acc, M, L, b, heads, split, acc, m_i, l_i, g_ok, d_ok, offs_d, stride_ab, stride_ah,
                     stride_as, stride_mb, stride_mh)


@triton.jit
def _split_blocks(length, start, window, num_splits, split, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The table columns [lo, hi) split `split` of `num_splits` reads: the sequence's own blocks (keys at positions
    start .. length - 1, from the first block its window touches) in equal runs, so each split's work follows the
    sequence's length, not the table's width (a padded table, or a longer neighbour)."""
    last = tl.cdiv(length - start, BLOCK_SIZE)
    first = 0
    if HAS_WINDOW:  # blocks wholly before the window hold nothing this query sees
        first = tl.maximum(length - window - start, 0) // BLOCK_SIZE
    per_split = tl.cdiv(last - first, num_splits)
    lo = first + split * per_split
    return lo, tl.minimum(lo + per_split, last)


@triton.jit
def _store_split(Acc, M, L, b, heads, slot, acc, m_i, l_i, g_ok, d_ok, offs_d, stride_ab, stride_ah, stride_as,
                 stride_mb, stride_mh):
    """One program's online-softmax state (weighted values, running max, sum) into split `slot` of the combine's
    inputs, for the query heads `heads` of sequence b."""
    tl.store(Acc + b * stride_ab + heads[:, None] * stride_ah + slot * stride_as + offs_d[None, :], acc,
             mask=g_ok[:, None] & d_ok[None, :])
    tl.store(M + b * stride_mb + heads * stride_mh + slot, m_i, mask=g_ok)
    tl.store(L + b * stride_mb + heads * stride_mh + slot, l_i, mask=g_ok)


# Positions per program iteration when the kernel reads a contiguous cache (contiguous_decode_attention).
CONTIGUOUS_BLOCK = 64


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def paged_decode_attention(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    num_splits: int | None = None,
    *,
    one_split_direct: bool = True,
) -> torch.Tensor:
    """Attention of one query per sequence, `q` `[B, H, D]`, over its own blocks; returns `[B, H, D]` in q's
    dtype. `num_splits`: programs per sequence and KV head, each reading an equal run of the sequence's blocks
    (default: enough to give the GPU ~2 programs per SM, at most one per table column). `one_split_direct=False`
    combines even one split in its own launch (the unoptimised path the direct write is checked against). Every
    sequence must have length >= 1."""
    _, Hkv, block_size, _ = k_blocks.shape
    if q.shape[1] % Hkv or k_blocks.shape != v_blocks.shape or k_blocks.shape[-1] != q.shape[2]:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k/v blocks {tuple(k_blocks.shape)}")
    return _decode(q, k_blocks, v_blocks, tables, lengths, k_blocks.stride()[:3], v_blocks.stride()[:3], Hkv,
                   block_size, scale, softcap, window, num_splits, one_split_direct)


def contiguous_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    block_size: int = CONTIGUOUS_BLOCK,
) -> torch.Tensor:
    """The same kernel over one layer of a contiguous cache, `k_cache`, `v_cache` `[B, Hkv, S, D]`, reading only
    each row's first `lengths[b]` positions (a one-token step replayed from a CUDA graph, where the dense form would
    read every slot under a mask). The rows are cut into runs of `block_size` positions addressed in units of one
    position: `tables` is `contiguous_tables(...)`, so any S works. Returns `[B, H, D]`."""
    B, Hkv, S, D = k_cache.shape
    if k_cache.shape != v_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"k_cache and v_cache must be contiguous [B, Hkv, S, D] of one shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if q.shape[0] != B or q.shape[1] % Hkv or q.shape[2] != D:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k/v cache {tuple(k_cache.shape)}")
    # A table entry is a position's index in the layer's storage (b * Hkv * S + first position of the run):
    # the "block" stride is one position's, and the head stride moves along the same row.
    return _decode(q, k_cache, v_cache, tables, lengths, (D, S * D, D), (D, S * D, D), Hkv, block_size, scale,
                   softcap, window, None)


def contiguous_tables(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                      block_size: int = CONTIGUOUS_BLOCK) -> torch.Tensor:
    """`[batch, ceil(max_seq_len / block_size)]` int32: where each run of `block_size` positions of each row
    starts, counted in positions from the layer's first (see `contiguous_decode_attention`)."""
    runs = torch.arange(0, max_seq_len, block_size, device=device, dtype=torch.int32)
    rows = torch.arange(batch, device=device, dtype=torch.int32) * (num_kv_heads * max_seq_len)
    return rows[:, None] + runs[None, :]


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
            k_strides: tuple[int, ...], v_strides: tuple[int, ...], Hkv: int, block_size: int, scale: float,
            softcap: float | None, window: int | None, num_splits: int | None,
            one_split_direct: bool = True) -> torch.Tensor:
    """Launch the split kernel over K and V each addressed as `block * s0 + head * s1 + slot * s2` (their
    strides) and combine the splits."""
    B, H, D = q.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q, k and v need a contiguous last dimension")
    if num_splits is None:
        target = 2 * torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        num_splits = max(1, min(tables.shape[1], -(-target // (B * Hkv))))
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1 or None, got {num_splits!r}")
    splits = num_splits
    # One split (the CPU's default, and a GPU's once sequences x KV heads fill it) writes the output itself; its
    # split buffers are left unread (one row each, so no launcher ever sees a null pointer).
    one_split = splits == 1 and one_split_direct
    acc = torch.empty(1 if one_split else B, H, splits, D, dtype=torch.float32, device=q.device)
    m = torch.empty(1 if one_split else B, H, splits, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    tables = tables.to(torch.int32).contiguous()  # the kernel steps rows by stride and lengths by one
    lengths = lengths.to(torch.int32).contiguous()
    group = H // Hkv
    _paged_decode_split[(B, Hkv, splits)](
        q, k, v, tables, lengths, acc, m, l_sum, out,
        q.stride(0), q.stride(1),
        *k_strides,
        *v_strides,
        tables.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2),
        m.stride(0), m.stride(1),
        out.stride(0), out.stride(1),
        float(scale), float(softcap or 1.0), int(window or 0), splits,
        BLOCK_SIZE=block_size, BLOCK_N=_pow2(block_size), HEAD_DIM=D, BLOCK_D=_pow2(D),
        GROUP=group, BLOCK_G=_pow2(group),
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        # fp32 models get exact fp32 products (the engine's fp32 logits must equal the PyTorch path's); half
        # ones TF32, still finer than their own rounding.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", ONE_SPLIT=one_split,
    )
    return out if one_split else combine_splits_triton(acc, m, l_sum, q.dtype)


@triton.jit
def _combine_kernel(Acc, M, L, Out, stride_ab, stride_ah, stride_as, stride_mb, stride_mh, stride_ob, stride_oh,
                    num_splits, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    # Splits in chunks of BLOCK_S: a long context on few KV heads has hundreds of splits, too many for one tile.
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_row = M + b * stride_mb + h * stride_mh
    l_row = L + b * stride_mb + h * stride_mh
    top = tl.full((1,), float("-inf"), tl.float32)
    for start in range(0, num_splits, BLOCK_S):
        m = tl.load(m_row + start + offs_s, mask=start + offs_s < num_splits, other=float("-inf"))
        top = tl.maximum(top, tl.max(m, 0))
    num = tl.zeros((BLOCK_D,), tl.float32)
    den = tl.zeros((1,), tl.float32)
    for start in range(0, num_splits, BLOCK_S):
        s_ok = start + offs_s < num_splits
        m = tl.load(m_row + start + offs_s, mask=s_ok, other=float("-inf"))
        l_sum = tl.load(l_row + start + offs_s, mask=s_ok, other=0.0)
        weight = tl.where(s_ok, tl.exp(m - top), 0.0)  # a split that saw no key: max -inf, weight 0
        acc = tl.load(Acc + b * stride_ab + h * stride_ah + (start + offs_s)[:, None] * stride_as + offs_d[None, :],
                      mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        num += tl.sum(acc * weight[:, None], 0)
        den += tl.sum(l_sum * weight, 0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, (num / den).to(Out.dtype.element_ty), mask=d_ok)


def combine_splits_triton(acc: torch.Tensor, m: torch.Tensor, l_sum: torch.Tensor, dtype: torch.dtype
                          ) -> torch.Tensor:
    """`combine_splits` in one launch (the PyTorch form is ~7 kernels, each a graph node a step replays once per
    layer), written in `dtype`: `[B, H, D]`."""
    B, H, splits, D = acc.shape
    out = torch.empty(B, H, D, dtype=dtype, device=acc.device)
    _combine_kernel[(B, H)](acc, m, l_sum, out, acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0),
                            m.stride(1), out.stride(0), out.stride(1), splits, HEAD_DIM=D, BLOCK_D=_pow2(D),
                            BLOCK_S=min(_pow2(splits, 2), 16))
    return out


def combine_splits(acc: torch.Tensor, m: torch.Tensor, l_sum: torch.Tensor) -> torch.Tensor:
    """Flash-decoding's combine, in fp32: each split holds (max `m`, sum of exp `l_sum`, exp-weighted values
    `acc`) over its keys, `[B, H, S(, D)]`; a split with no visible key has max -inf and contributes nothing.
    The formula `combine_splits_triton` (what the kernels call) is held to."""
    top = m.max(dim=2, keepdim=True).values
    weight = torch.exp(m - top)  # [B, H, S]
    return (acc * weight[..., None]).sum(2) / (l_sum * weight).sum(2)[..., None]
