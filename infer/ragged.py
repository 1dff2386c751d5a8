"""One forward over a ragged batch: the metadata, and attention over each sequence's own blocks.

The tokens of many sequences are flattened into one row of N tokens. Each sequence contributes a chunk
(a whole prompt, part of one, or the one token of a decode step) with its own positions. Its K/V are
written into the paged pool through a slot mapping (physical block and slot of every new token), and its
queries attend to the keys its block table names, with its own causal and sliding-window mask.

This is the metadata a paged-attention kernel reads (flash-attention's varlen / vLLM's layout: query
start offsets, context lengths, block tables, slot mapping); `paged_attention` here is the PyTorch path.
Two forms, side by side:
- per sequence (the check, `batch_decode=False`): one attention call per sequence, with exactly the shapes
  and masks a solo run uses;
- batched decode (the default): the sequences that add one token this step are gathered into one padded
  `[B, Hkv, S_max, D]` and attend in a single call, each masked to its own length and window; the padded
  keys get zero weight (and hold zeros or the sequence's own values, so nothing stale can leak), so each
  row equals its solo run's within rounding. Multi-token chunks (prefill)
  still go one at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from infer.attention import attention, attention_mask, attention_reference, decode_attention_matmul


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
    blocks: torch.Tensor  # physical blocks holding keys first_key .. context_len-1
    masks: dict[int | None, torch.Tensor | None]  # sliding window (None: full) -> [T, S] bool, None if all visible
    first_key: int = 0  # position of the first key gathered (> 0 when a window makes earlier blocks moot)


@dataclass
class DecodeGroup:
    """The one-token chunks of a step, batched: B sequences, their keys padded to `num_blocks` blocks."""

    kernel: str  # "sdpa" (decode_attention), "matmul" (decode_attention_matmul) or "triton" (in place)
    rows: torch.Tensor  # [B] the flat-batch row of each sequence's token
    tables: torch.Tensor  # [B, nb] block tables, padded with the sequence's own first block (masked out)
    lengths: torch.Tensor  # [B] keys of each sequence, this step's included
    masks: dict[int | None, torch.Tensor]  # window -> [B, 1, 1, nb * block_size] bool: which keys each row sees


@dataclass
class RaggedBatch:
    """Per-step metadata shared by every layer. N = total new tokens."""

    positions: torch.Tensor  # [N] absolute position of each token
    slot_blocks: torch.Tensor  # [N] physical block each token's K/V go to
    slot_offsets: torch.Tensor  # [N] slot within that block
    seqs: list[SeqSlice]  # the sequences attended one at a time (all of them without a decode group)
    sample_rows: torch.Tensor  # [S] rows whose logits are wanted (the last of each sampling chunk)
    block_size: int
    fresh_blocks: torch.Tensor  # blocks this step starts (writes slot 0 of): zeroed before the writes
    decode: DecodeGroup | None = None  # the one-token sequences, attended in one call


def build_ragged_batch(
    chunks: Sequence[SeqChunk],
    sample: Sequence[bool],
    *,
    block_size: int,
    windows: Sequence[int | None],
    device: torch.device,
    decode_kernel: str = "sdpa",
) -> RaggedBatch:
    """The metadata of one forward over `chunks`, in order; `sample[i]`: chunk i wants its last logits.
    `windows`: the sliding windows the model's layers use (None for full attention). `decode_kernel`: how
    the one-token chunks attend, together in one call when there are at least two ("sdpa", "matmul", or
    "triton": the paged kernel reading the pool in place), or each on its own ("per-sequence", the check)."""
    if decode_kernel not in DECODE_KERNELS:
        raise ValueError(f"decode_kernel must be one of {DECODE_KERNELS}, got {decode_kernel!r}")
    batch_decode = decode_kernel != "per-sequence"
    positions: list[int] = []
    seqs: list[SeqSlice] = []
    sample_rows: list[int] = []
    slot_blocks: list[int] = []
    slot_offsets: list[int] = []
    starts: list[int] = []  # each chunk's first row
    fresh: list[int] = []
    decoding = [i for i, c in enumerate(chunks) if c.num_tokens == 1] if batch_decode else []
    if len(decoding) < 2:
        decoding = []
    grouped = set(decoding)
    # When every layer reading this batch has a window (the engine's ring-bounded sliding layers), blocks
    # wholly before the window are never gathered: attention costs the window, not the context.
    reach = max(w for w in windows if w is not None) if windows and None not in windows else None
    for i, (chunk, wants) in enumerate(zip(chunks, sample, strict=True)):
        end = chunk.start + chunk.num_tokens
        need = -(-end // block_size)
        if len(chunk.block_table) < need:
            raise ValueError(f"a chunk ending at position {end} needs {need} blocks, its table has "
                             f"{len(chunk.block_table)}")
        row = len(positions)
        starts.append(row)
        span = range(chunk.start, end)
        positions.extend(span)
        slot_blocks.extend(chunk.block_table[p // block_size] for p in span)
        slot_offsets.extend(p % block_size for p in span)
        fresh.extend(chunk.block_table[p // block_size] for p in span if p % block_size == 0)
        if wants:
            sample_rows.append(row + chunk.num_tokens - 1)
        if i in grouped:
            continue
        first_block = 0 if reach is None else max(0, chunk.start - reach + 1) // block_size
        q_pos = torch.arange(chunk.start, end, device=device)
        k_pos = torch.arange(first_block * block_size, end, device=device)
        masks = {
            w: None if chunk.num_tokens == 1 and w is None else attention_mask(q_pos, k_pos, w)
            for w in set(windows)
        }
        blocks = torch.tensor(list(chunk.block_table[first_block:need]), dtype=torch.long, device=device)
        seqs.append(SeqSlice(row, chunk.num_tokens, end, blocks, masks, first_block * block_size))

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    decode = None
    if decoding:
        decode = _decode_group([chunks[i] for i in decoding], [starts[i] for i in decoding], block_size,
                               windows, device, decode_kernel, None if decode_kernel == "triton" else reach)
    return RaggedBatch(as_tensor(positions), as_tensor(slot_blocks), as_tensor(slot_offsets), seqs,
                       as_tensor(sample_rows), block_size, as_tensor(fresh), decode)


def _decode_group(chunks: Sequence[SeqChunk], rows: Sequence[int], block_size: int,
                  windows: Sequence[int | None], device: torch.device, kernel: str,
                  reach: int | None = None) -> DecodeGroup:
    """Padded block tables and per-sequence masks for one-token chunks (the query sits at the last key).
    `reach`: the widest window of the layers reading the batch, when all have one: each table then starts
    at the first block that window touches."""
    lengths = [c.start + 1 for c in chunks]
    firsts = [0 if reach is None else max(0, n - reach) // block_size for n in lengths]
    nb = max(-(-n // block_size) - f for n, f in zip(lengths, firsts, strict=True))
    tables = []
    for chunk, n, first in zip(chunks, lengths, firsts, strict=True):
        own = list(chunk.block_table[first : -(-n // block_size)])
        tables.append(own + own[:1] * (nb - len(own)))  # padding reads only the sequence's own data
    lens = torch.tensor(lengths, device=device)[:, None]
    masks: dict[int | None, torch.Tensor] = {}
    if kernel != "triton":  # the kernel masks by length and window itself
        # Each row's key positions start at its first gathered block.
        k_pos = (torch.tensor(firsts, device=device)[:, None] * block_size
                 + torch.arange(nb * block_size, device=device)[None, :])
        for w in set(windows):
            visible = k_pos < lens
            if w is not None:
                visible &= k_pos > lens - 1 - w
            masks[w] = visible[:, None, None, :]
    return DecodeGroup(kernel, torch.tensor(list(rows), dtype=torch.long, device=device),
                       torch.tensor(tables, dtype=torch.long, device=device), lens[:, 0], masks)


Attend = Callable[..., torch.Tensor]
DECODE_KERNELS = ("sdpa", "matmul", "triton", "per-sequence")


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    batch: RaggedBatch,
    window: int | None,
    scale: float,
    softcap: float | None = None,
    reference: bool = False,
    wide: torch.dtype | None = None,
) -> torch.Tensor:
    """Write this step's `k`, `v` `[1, Hkv, N, D]` into one layer's blocks `[num_blocks, Hkv, bs, D]`, then
    attend each sequence's queries (rows of `q` `[1, H, N, D]`) to its own keys; returns `[1, H, N, D]`.

    `reference`: every call is `attention_reference` (the model's check); `wide`: the dtype a multi-token
    chunk computes in (the model's compute_dtype), as in a solo prefill."""
    attend: Attend = partial(attention_reference if reference else attention, scale=scale, softcap=softcap)
    # A block a sequence starts is zeroed first, so its unwritten slots never hold a previous owner's
    # values (the batched decode reads them, masked: a stale NaN would still poison its sum).
    # (index_fill_ with a scalar: no host value copied to the device, so a CUDA graph can capture it.)
    k_blocks.index_fill_(0, batch.fresh_blocks, 0)
    v_blocks.index_fill_(0, batch.fresh_blocks, 0)
    # Index tensors around the head slice put N first: the target is [N, Hkv, D].
    k_blocks[batch.slot_blocks, :, batch.slot_offsets] = k[0].transpose(0, 1).to(k_blocks.dtype)
    v_blocks[batch.slot_blocks, :, batch.slot_offsets] = v[0].transpose(0, 1).to(v_blocks.dtype)
    if batch.decode is None and len(batch.seqs) == 1:  # one sequence: no scatter
        seq = batch.seqs[0]
        return _attend_one(q[:, :, seq.row : seq.row + seq.num_tokens], k_blocks, v_blocks, seq, batch.block_size,
                           window, attend, wide)
    out = torch.empty_like(q)
    for seq in batch.seqs:
        out[:, :, seq.row : seq.row + seq.num_tokens] = _attend_one(
            q[:, :, seq.row : seq.row + seq.num_tokens], k_blocks, v_blocks, seq, batch.block_size, window, attend,
            wide)
    group = batch.decode
    if group is not None and group.kernel == "triton" and not reference:
        from infer.kernels.paged_attention import paged_decode_attention

        queries = q[0, :, group.rows].transpose(0, 1)  # [B, H, D]
        attended = paged_decode_attention(queries.contiguous(), k_blocks, v_blocks, group.tables, group.lengths,
                                          scale, softcap, window)
        out[0, :, group.rows] = attended.transpose(0, 1)
    elif group is not None:
        keys, values = _gather(k_blocks, group.tables), _gather(v_blocks, group.tables)
        queries = q[0, :, group.rows, None].transpose(0, 1)  # [B, H, 1, D]
        mask = _group_mask(group, window, keys.shape[2])
        if group.kernel == "matmul" and not reference:
            attended = decode_attention_matmul(queries, keys, values, mask, scale, softcap)
        else:
            attended = attend(queries, keys, values, mask)
        out[0, :, group.rows] = attended[:, :, 0].transpose(0, 1)
    return out


def _group_mask(group: DecodeGroup, window: int | None, num_keys: int) -> torch.Tensor:
    """The group's [B, 1, 1, S] mask (built here when the batch was planned for the kernel, which needs none)."""
    if window in group.masks:
        return group.masks[window]
    k_pos = torch.arange(num_keys, device=group.lengths.device)[None, :]
    lens = group.lengths[:, None]
    visible = k_pos < lens
    if window is not None:
        visible &= k_pos > lens - 1 - window
    return visible[:, None, None, :]


def _gather(blocks: torch.Tensor, tables: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """Keys (or values) of block tables `[B, nb]` in position order: `[B, Hkv, length, D]` (all the
    blocks' slots by default), as a contiguous cache holds them."""
    B, nb = tables.shape
    Hkv, bs, D = blocks.shape[1:]
    # index_select, not blocks[tables]: the same copy, 3x faster on CPU.
    gathered = blocks.index_select(0, tables.view(-1)).view(B, nb, Hkv, bs, D)
    return gathered.transpose(1, 2).reshape(B, Hkv, nb * bs, D)[:, :, :length]


def _attend_one(queries: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, seq: SeqSlice,
                block_size: int, window: int | None, attend: Attend, wide: torch.dtype | None) -> torch.Tensor:
    """One sequence's queries `[1, H, T, D]` over its own keys, with the shapes and mask of a solo run."""
    keys = _gather(k_blocks, seq.blocks[None], seq.context_len - seq.first_key)
    values = _gather(v_blocks, seq.blocks[None], seq.context_len - seq.first_key)
    mask = seq.masks[window]
    if wide is not None and seq.num_tokens > 1 and queries.dtype != wide:
        return attend(queries.to(wide), keys.to(wide), values.to(wide), mask).to(queries.dtype)
    return attend(queries, keys, values, mask)
