"""Products with quantized weights on a GPU in Triton: Y = X W^T for a few rows of X (decode steps, the engine's
decode batches) and W stored as codes and scales (infer/quant_weights.py), dequantized in registers.

Each program owns BLOCK_N output rows and BLOCK_M rows of X and walks K in BLOCK_K chunks: it loads the chunk's
codes (q8: int8; q4: the byte holding each code, then its nibble: per run of 32, byte j's low nibble is element
j, its high nibble element j + 16), each code's group scale (and min), forms `scale * q (+ min)` in fp32 and sums
the products in fp32; outputs are rounded to X's dtype once. Longer inputs (prefill) dequantize into cuBLAS.

`QuantizedWeight.dequantize` followed by a matmul is the formula this is held to (tests/test_triton_kernels.py,
under TRITON_INTERPRET=1 on a CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.quant_weights import QuantizedWeight


@triton.jit
def _qgemm_kernel(C, S, MN, X, Y, M, N, K, GROUP, Q4: tl.constexpr, HAS_MIN: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    xrows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok, xrow_ok = rows < N, xrows < M
    groups = K // GROUP
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        ok = row_ok[:, None] & col_ok[None, :]
        if Q4:
            byte = (cols // 32) * 16 + cols % 16
            packed = tl.load(C + rows[:, None] * (K // 2) + byte[None, :], mask=ok, other=0).to(tl.int32)
            q = (packed >> (((cols % 32) // 16) * 4)[None, :]) & 15
        else:
            q = tl.load(C + rows[:, None] * K + cols[None, :], mask=ok, other=0).to(tl.int32)
        where = rows[:, None] * groups + (cols // GROUP)[None, :]
        w = q.to(tl.float32) * tl.load(S + where, mask=ok, other=0.0).to(tl.float32)
        if HAS_MIN:
            w = w + tl.load(MN + where, mask=ok, other=0.0).to(tl.float32)
        x = tl.load(X + xrows[:, None] * K + cols[None, :], mask=xrow_ok[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(Y + xrows[:, None] * N + rows[None, :], acc.to(Y.dtype.element_ty),
             mask=xrow_ok[:, None] & row_ok[None, :])


def triton_qgemm(weight: QuantizedWeight, x: torch.Tensor, blocks: tuple[int, int, int] | None = None
                 ) -> torch.Tensor:
    """`x @ weight.dequantize().T` for `x` `[..., K]` (a few rows) and a quantized `weight` `[N, K]` on x's
    device (CUDA, or the CPU under TRITON_INTERPRET=1); `[..., N]` in x's dtype. `blocks` overrides (BLOCK_M,
    BLOCK_N, BLOCK_K)."""
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"triton_qgemm: x has {x.shape[-1]} inputs, the weight {k}")
    weight = weight.unfactored()  # factored k-quant scales only stay so on the CPU (QuantizedWeight.to)
    xs = x.reshape(-1, k).contiguous()
    m = xs.shape[0]
    block_m, block_n, block_k = blocks or (min(triton.next_power_of_2(m), 4), 16, 64)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    mins = weight.mins if weight.mins is not None else weight.scales  # unread without HAS_MIN
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _qgemm_kernel[grid](weight.codes, weight.scales, mins, xs, y, m, n, k, weight.group, Q4=weight.fmt == "q4",
                        HAS_MIN=weight.mins is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y.reshape(*x.shape[:-1], n)
