"""One forward over a ragged batch: the metadata, and attention over each sequence's own blocks.

The tokens of many sequences are flattened into one row of N tokens. Each sequence contributes a chunk
(a whole prompt, part of one, or the one token of a decode step) with its own positions. Its K/V are
written into the paged pool through a slot mapping (physical block and slot of every new token), and its
queries attend to the keys its block table names, with its own causal and sliding-window mask.

This is the metadata a paged-attention kernel reads (flash-attention's varlen / vLLM's layout: query
start offsets, context lengths, block tables, slot mapping); `paged_attention` here is the PyTorch path,
one sequence at a time, with exactly the shapes and masks a solo run uses, so every sequence's attention
equals its solo run's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from infer.attention import attention_mask


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's part of the batch: `num_tokens` new tokens at positions `start ..`, written into
    `block_table`'s blocks; afterwards `start + num_tokens` keys are cached."""

    start: int
    num_tokens: int
    block_table: Sequence[int]


@dataclass
class SeqSlice:
    """Where a sequence's queries sit in the flat batch, and what they attend to."""

    row: int  # first of its rows in the flat batch
    num_tokens: int
    context_len: int  # keys 0 .. context_len-1, this step's included
    blocks: torch.Tensor  # [ceil(context_len / block_size)] physical blocks holding them
    masks: dict[int | None, torch.Tensor | None]  # sliding window (None: full) -> [T, S] bool, None if all visible


@dataclass
class RaggedBatch:
    """Per-step metadata shared by every layer. N = total new tokens."""

    positions: torch.Tensor  # [N] absolute position of each token
    slot_blocks: torch.Tensor  # [N] physical block each token's K/V go to
    slot_offsets: torch.Tensor  # [N] slot within that block
    seqs: list[SeqSlice]
    sample_rows: torch.Tensor  # [S] rows whose logits are wanted (the last of each sampling chunk)
    block_size: int


def build_ragged_batch(
    chunks: Sequence[SeqChunk],
    sample: Sequence[bool],
    *,
    block_size: int,
    windows: Sequence[int | None],
    device: torch.device,
) -> RaggedBatch:
    """The metadata of one forward over `chunks`, in order; `sample[i]`: chunk i wants its last logits.
    `windows`: the sliding windows the model's layers use (None for full attention)."""
    positions: list[int] = []
    seqs: list[SeqSlice] = []
    sample_rows: list[int] = []
    slot_blocks: list[int] = []
    slot_offsets: list[int] = []
    for chunk, wants in zip(chunks, sample, strict=True):
        end = chunk.start + chunk.num_tokens
        need = -(-end // block_size)
        if len(chunk.block_table) < need:
            raise ValueError(f"a chunk ending at position {end} needs {need} blocks, its table has "
                             f"{len(chunk.block_table)}")
        row = len(positions)
        span = range(chunk.start, end)
        positions.extend(span)
        slot_blocks.extend(chunk.block_table[p // block_size] for p in span)
        slot_offsets.extend(p % block_size for p in span)
        q_pos = torch.arange(chunk.start, end, device=device)
        k_pos = torch.arange(end, device=device)
        masks = {
            w: None if chunk.num_tokens == 1 and w is None else attention_mask(q_pos, k_pos, w)
            for w in set(windows)
        }
        blocks = torch.tensor(list(chunk.block_table[:need]), dtype=torch.long, device=device)
        seqs.append(SeqSlice(row, chunk.num_tokens, end, blocks, masks))
        if wants:
            sample_rows.append(row + chunk.num_tokens - 1)

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return RaggedBatch(as_tensor(positions), as_tensor(slot_blocks), as_tensor(slot_offsets), seqs,
                       as_tensor(sample_rows), block_size)


Attend = Callable[..., torch.Tensor]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    batch: RaggedBatch,
    window: int | None,
    attend: Attend,
    wide: torch.dtype | None = None,
) -> torch.Tensor:
    """Write this step's `k`, `v` `[1, Hkv, N, D]` into one layer's blocks `[num_blocks, Hkv, bs, D]`, then
    attend each sequence's queries (rows of `q` `[1, H, N, D]`) to its own keys; returns `[1, H, N, D]`.

    `attend(q, k, v, mask)` is the model's attention (fused or reference) with scale and softcap bound;
    `wide`: the dtype a multi-token chunk computes in (the model's compute_dtype), as in a solo prefill."""
    # Index tensors around the head slice put N first: the target is [N, Hkv, D].
    k_blocks[batch.slot_blocks, :, batch.slot_offsets] = k[0].transpose(0, 1).to(k_blocks.dtype)
    v_blocks[batch.slot_blocks, :, batch.slot_offsets] = v[0].transpose(0, 1).to(v_blocks.dtype)
    Hkv, D = k_blocks.shape[1], k_blocks.shape[3]
    outs = []
    for seq in batch.seqs:
        nb = seq.blocks.shape[0]
        # [nb, Hkv, bs, D] -> [1, Hkv, context_len, D]: the keys in position order, as a contiguous cache holds them
        keys = k_blocks[seq.blocks].transpose(0, 1).reshape(1, Hkv, nb * batch.block_size, D)[:, :, : seq.context_len]
        values = v_blocks[seq.blocks].transpose(0, 1).reshape(1, Hkv, nb * batch.block_size, D)[:, :, : seq.context_len]
        queries = q[:, :, seq.row : seq.row + seq.num_tokens]
        mask = seq.masks[window]
        if wide is not None and seq.num_tokens > 1 and q.dtype != wide:
            out = attend(queries.to(wide), keys.to(wide), values.to(wide), mask).to(q.dtype)
        else:
            out = attend(queries, keys, values, mask)
        outs.append(out)
    return torch.cat(outs, dim=2)
