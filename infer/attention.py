"""Scaled dot-product attention over (possibly cached) keys, and the masks it needs.

`attention_reference` is the plain formula, kept as the check for `attention`, the fast path
(PyTorch's fused SDPA). Masks are boolean, True where a query may attend a key, built from
absolute positions so the same code serves full sequences, chunks after a cache, and ring buffers.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Literal, TypeAlias

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# A mask: boolean `[T, S]` (True where a query may attend a key), None (every key visible), or CAUSAL: query t
# sees keys 0..t of T = S keys (a prefill from position 0), which fused kernels run without a mask tensor.
CAUSAL: Literal["causal"] = "causal"
Mask: TypeAlias = "torch.Tensor | Literal['causal'] | None"


def materialize(mask: Mask, q_len: int, k_len: int, device: torch.device) -> torch.Tensor | None:
    """`mask` as a boolean tensor (or None), CAUSAL built out."""
    if isinstance(mask, str):
        return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()
    return mask


def attention_mask(
    q_positions: torch.Tensor, k_positions: torch.Tensor, sliding_window: int | None = None
) -> torch.Tensor:
    """Boolean mask `[T, S]`: key at `k_positions[s]` is visible to the query at `q_positions[t]`.

    Causal; with `sliding_window` W a query at p sees keys p-W+1 .. p (W keys, itself included),
    as Hugging Face defines it. Negative key positions mark empty cache slots and are never visible.
    """
    q = q_positions[:, None]
    k = k_positions[None, :]
    visible = (k <= q) & (k >= 0)
    if sliding_window is not None:
        visible &= k > q - sliding_window
    return visible


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention by the formula. q: [B, H, T, D]; k, v: [B, Hkv, S, D]; returns [B, H, T, D]."""
    mask = materialize(mask, q.shape[2], k.shape[2], q.device)
    groups = q.shape[1] // k.shape[1]
    # KV head j serves query heads j*groups .. j*groups+groups-1 (HF's repeat_kv).
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    return _probabilities((q @ k.transpose(-1, -2)) * scale, mask, softcap, q.dtype) @ v


def _probabilities(scores: torch.Tensor, mask: torch.Tensor | None, softcap: float | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """Scaled scores -> attention weights in `dtype`: softcap, mask, then softmax in fp32 (HF's eager order)."""
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One query per head: the g query heads of a KV group become g query rows of that KV head
    (Hugging Face's `pack_gqa`), so the fused kernel works on Hkv heads without repeating K/V.

    On a 2-core CPU in bf16 this is 7x faster than `enable_gqa` at 4k keys.
    q: [B, H, 1, D]; k, v: [B, Hkv, S, D]; mask: [1, S] or None.
    """
    B, H, _, D = q.shape
    # reshape, not view: CUDA's fused kernels return non-contiguous outputs (a no-op copy-free view on CPU).
    packed = q.reshape(B, k.shape[1], H // k.shape[1], D)  # head h reads KV head h // g, as in repeat_kv
    return F.scaled_dot_product_attention(packed, k, v, attn_mask=mask, scale=scale).reshape(B, H, 1, D)


def decode_attention_matmul(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """`decode_attention` by two batched matmuls and a softmax in fp32 (scores rounded to q's dtype first, as
    Hugging Face's eager attention does): for many sequences of one query each, on CPUs where the fused
    kernel's per-call cost dominates (chosen by measurement, infer.tuning). Same contract; mask
    `[B, 1, 1, S]` or None."""
    B, H, _, D = q.shape
    packed = q.reshape(B, k.shape[1], H // k.shape[1], D)  # [B, Hkv, g, D]
    probs = _probabilities((packed @ k.transpose(-1, -2)) * scale, mask, softcap, q.dtype)
    return (probs @ v).reshape(B, H, 1, D)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """The fast path. Same contract as `attention_reference`: fused SDPA with grouped KV heads (a CAUSAL mask
    as SDPA's own causal flag, as Hugging Face's SDPA path runs a prefill), or `decode_attention` for a
    one-token step."""
    if softcap is not None:  # SDPA has no soft-capping
        return attention_reference(q, k, v, mask, scale, softcap)
    if q.shape[2] == 1:
        return decode_attention(q, k, v, materialize(mask, 1, k.shape[2], q.device), scale)
    if isinstance(mask, str):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


# On an H100 PyTorch sends SDPA to cuDNN, which builds an execution plan for each new shape, so every eager
# decode step (one more key) and every prefill chunk of a new length waits for one: eager decode steps of a 1B
# model measured 84 ms at 8k context where the step's kernels take about 2 ms (H100, torch 2.11, 2026-11-25).
# The flash and memory-efficient kernels need no plan; math is the fallback they lack (fp32 with GQA).
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_backends(device: torch.device, cudnn: bool = False) -> AbstractContextManager[None]:
    """The SDPA kernels a forward on `device` may use: on CUDA all but cuDNN's unless `cudnn` (PyTorch's own
    choice, the unoptimised path); elsewhere PyTorch's choice."""
    return sdpa_kernel(CUDA_SDPA_BACKENDS) if device.type == "cuda" and not cudnn else nullcontext()
