"""One-row products on a GPU in Triton: y = W x for a decode step's weights, W `[N, K]` row-major.

A decode step is bound by reading the weights once, and cuBLAS's bf16 GEMV, reached through F.linear or torch.mv,
streams them at a fraction of the card's read bandwidth. Here each program owns BLOCK_N output rows and walks K
in BLOCK_K chunks: every row's chunk is one contiguous, coalesced load, products are summed in fp32 in registers,
and the row sums are rounded to the weight dtype once at the end (as torch.mv does). The grid is sized so the
smallest projections of a 1B model still give every multiprocessor several programs.

`torch.mv` is the formula this is held to (tests/test_triton_kernels.py, under TRITON_INTERPRET=1 on a CPU);
`infer.tuning.choose_decode_gemv` times it against F.linear and torch.mv on the model's weights and keeps the
fastest (`decode_gemv="triton"` forces it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(W, X, Y, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        x = tl.load(X + cols, mask=col_ok, other=0.0).to(tl.float32)
        w = tl.load(W + rows[:, None] * stride_w + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += w * x[None, :]
    tl.store(Y + rows, tl.sum(acc, 1).to(Y.dtype.element_ty), mask=row_ok)


def gemv_blocks(n: int, k: int, multiprocessors: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): 512-wide chunks of K (1 KiB of bf16 per row), and the widest BLOCK_N (up to 16) that
    still gives each multiprocessor four programs."""
    block_k = min(512, triton.next_power_of_2(k))
    block_n = 16
    while block_n > 1 and triton.cdiv(n, block_n) < 4 * multiprocessors:
        block_n //= 2
    return block_n, block_k


_MULTIPROCESSORS: dict[int, int] = {}


def triton_gemv(weight: torch.Tensor, x: torch.Tensor, blocks: tuple[int, int] | None = None) -> torch.Tensor:
    """`torch.mv(weight, x)` for a row-major `weight` `[N, K]` and a contiguous `x` `[K]` of its dtype, on CUDA
    (or under TRITON_INTERPRET=1). `blocks` overrides (BLOCK_N, BLOCK_K)."""
    n, k = weight.shape
    if weight.stride(1) != 1 or x.dim() != 1 or x.shape[0] != k or x.dtype != weight.dtype:
        raise ValueError(f"triton_gemv needs a row-major [N, K] weight and a [K] vector of its dtype, got "
                         f"{tuple(weight.shape)} stride {weight.stride()} and {tuple(x.shape)} {x.dtype}")
    if blocks is None:
        index = weight.device.index or 0
        if index not in _MULTIPROCESSORS:
            # Under the CPU interpreter one "multiprocessor": 16 rows a program, as a 1B model's projections get
            # on a GPU, since the interpreter's cost is per program (a row's sum is the same at any BLOCK_N).
            _MULTIPROCESSORS[index] = (torch.cuda.get_device_properties(index).multi_processor_count
                                       if weight.is_cuda else 1)
        blocks = gemv_blocks(n, k, _MULTIPROCESSORS[index])
    y = torch.empty(n, dtype=weight.dtype, device=weight.device)
    _gemv_kernel[(triton.cdiv(n, blocks[0]),)](weight, x.contiguous(), y, n, k, weight.stride(0),
                                               BLOCK_N=blocks[0], BLOCK_K=blocks[1])
    return y
