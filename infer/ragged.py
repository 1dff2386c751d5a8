"""One forward over a ragged batch: the metadata, and attention over each sequence's own blocks.

The tokens of many sequences are flattened into one row of N tokens. Each sequence contributes a chunk
(a whole prompt, part of one, or the one token of a decode step) with its own positions. Its K/V are
written into the paged pool through a slot mapping (physical block and slot of every new token), and its
queries attend to the keys its block table names, with its own causal and sliding-window mask.

This is the metadata a paged-attention kernel reads (flash-attention's varlen / vLLM's layout: query
start offsets, context lengths, block tables, slot mapping), and the only place that turns the scheduler's
chunks into tensors; the attention over it is `infer.backends.PagedBackend` (`paged_attention`, the PyTorch
path, and the Triton kernel for decode groups). Two forms, side by side:
- per sequence (the check, `batch_decode=False`): one attention call per sequence, with exactly the shapes
  and masks a solo run uses;
- batched decode (the default): the sequences that add one token this step are gathered into one padded
  `[B, Hkv, S_max, D]` and attend in a single call, each masked to its own length and window; the padded
  keys get zero weight (and hold zeros or the sequence's own values, so nothing stale can leak), so each
  row equals its solo run's within rounding. Multi-token chunks (prefill)
  still go one at a time.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from infer.attention import CAUSAL, Mask, attention_mask


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
    masks: dict[int | None, Mask]  # sliding window (None: full) -> [T, S] bool, CAUSAL, or None if all visible
    first_key: int = 0  # position of the first key gathered (> 0 when a window makes earlier blocks moot)


@dataclass
class DecodeGroup:
    """The one-token chunks of a step, batched: B sequences, their keys padded to `num_blocks` blocks."""

    kernel: str  # "sdpa" (decode_attention), "matmul" (decode_attention_matmul), "native" or "triton" (in place)
    rows: torch.Tensor  # [B] the flat-batch row of each sequence's token
    tables: torch.Tensor  # [B, nb] block tables, padded with the sequence's own first block (masked out)
    lengths: torch.Tensor  # [B] keys of each sequence, this step's included
    masks: dict[int | None, torch.Tensor]  # window -> [B, 1, 1, nb * block_size] bool: which keys each row sees
    starts: torch.Tensor | None = None  # [B] position of each table's first key (0 unless a window cut it)
    # The step is these B tokens alone, in order (rows 0 .. B-1): a kernel reading the pool in place takes the
    # queries and returns the output as views of the step's rows, with no gather and no scatter.
    all_rows: bool = False


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
    end: int | None = None  # 1 + the furthest position (None: not known without reading `positions`)


def build_ragged_batch(
    chunks: Sequence[SeqChunk],
    sample: Sequence[bool],
    *,
    block_size: int,
    windows: Sequence[int | None],
    device: torch.device,
    decode_kernel: str = "sdpa",
    every_token: bool = False,
) -> RaggedBatch:
    """The metadata of one forward over `chunks`, in order; `sample[i]`: chunk i wants its last logits.
    `windows`: the sliding windows the model's layers use (None for full attention). `decode_kernel`: how
    the one-token chunks attend, together in one call when there are at least two ("sdpa", "matmul", or a
    paged kernel reading the pool in place: "native" on the CPU, "triton"), or each on its own ("per-sequence",
    the check). `every_token` (with "native" or "triton"): the prompt chunks' tokens too, each a row of that one
    call masked by its own position (`_every_token_group`), instead of each chunk attending on its own."""
    if decode_kernel not in DECODE_KERNELS:
        raise ValueError(f"decode_kernel must be one of {DECODE_KERNELS}, got {decode_kernel!r}")
    if every_token and decode_kernel not in IN_PLACE_KERNELS:
        raise ValueError(f"every_token=True needs decode_kernel 'native' or 'triton' (the kernels that mask each row "
                         f"by its position), got {decode_kernel!r}")
    batch_decode = decode_kernel != "per-sequence"
    positions: list[int] = []
    seqs: list[SeqSlice] = []
    sample_rows: list[int] = []
    slot_blocks: list[int] = []
    slot_offsets: list[int] = []
    starts: list[int] = []  # each chunk's first row
    fresh: list[int] = []
    decoding = [i for i, c in enumerate(chunks) if c.num_tokens == 1] if batch_decode else []
    if len(decoding) < (1 if decode_kernel == "native" else 2):  # (one token padded into a batch gains nothing; the
        decoding = []  # native kernel reads it in place all the same, and the engine's whole step then takes it)
    if every_token:
        decoding = list(range(len(chunks)))
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
        if chunk.num_tokens == 1:  # (a decode step's every chunk: no generators, ~1 us a chunk less)
            block, offset = divmod(chunk.start, block_size)
            positions.append(chunk.start)
            slot_blocks.append(chunk.block_table[block])
            slot_offsets.append(offset)
            if offset == 0:
                fresh.append(chunk.block_table[block])
        else:
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
        # A prompt's first chunk sees exactly its own tokens: SDPA's causal flag, as a solo prefill runs (the
        # fused kernel then skips the blocks above the diagonal instead of reading a mask).
        masks: dict[int | None, Mask] = {
            w: None if chunk.num_tokens == 1 and w is None
            else CAUSAL if chunk.start == 0 and (w is None or w >= chunk.num_tokens)
            else attention_mask(q_pos, k_pos, w)
            for w in set(windows)
        }
        blocks = torch.tensor(list(chunk.block_table[first_block:need]), dtype=torch.long, device=device)
        seqs.append(SeqSlice(row, chunk.num_tokens, end, blocks, masks, first_block * block_size))

    decode = None
    # The Triton kernel over exact blocks reads each table from position 0 (it masks the window by position).
    table_reach = None if decode_kernel == "triton" else reach
    if every_token and chunks:
        decode = _every_token_group(chunks, positions, block_size, table_reach, device, decode_kernel)
    elif decoding:
        decode = _decode_group([chunks[i] for i in decoding], [starts[i] for i in decoding], block_size,
                               windows, device, decode_kernel, table_reach)
        decode.all_rows = len(decoding) == len(chunks)  # every chunk one token: rows 0 .. B-1
    positions_t, blocks_t, offsets_t, sample_t, fresh_t = long_tensors(positions, slot_blocks, slot_offsets,
                                                                       sample_rows, fresh, device=device)
    return RaggedBatch(positions_t, blocks_t, offsets_t, seqs, sample_t, block_size, fresh_t, decode,
                       max((c.start + c.num_tokens for c in chunks), default=0))


def _decode_group(chunks: Sequence[SeqChunk], rows: Sequence[int], block_size: int,
                  windows: Sequence[int | None], device: torch.device, kernel: str,
                  reach: int | None = None) -> DecodeGroup:
    """Padded block tables and per-sequence masks for one-token chunks (the query sits at the last key).
    `reach`: the widest window of the layers reading the batch, when all have one: each table then starts
    at the first block that window touches."""
    lengths = [c.start + 1 for c in chunks]
    firsts = [0 if reach is None else max(0, n - reach) // block_size for n in lengths]
    nb = max(-(-n // block_size) - f for n, f in zip(lengths, firsts, strict=True))
    tables = [padded_table(chunk.block_table[first : -(-n // block_size)], nb)
              for chunk, n, first in zip(chunks, lengths, firsts, strict=True)]
    rows_t, flat, lens, key_starts = long_tensors(rows, [b for table in tables for b in table], lengths,
                                                  [f * block_size for f in firsts], device=device)
    masks: dict[int | None, torch.Tensor] = {}
    if kernel not in ("triton", "native"):  # the kernels mask by length and window themselves
        # Each row's key positions start at its first gathered block.
        k_pos = key_starts[:, None] + torch.arange(nb * block_size, device=device)[None, :]
        for w in set(windows):
            visible = k_pos < lens[:, None]
            if w is not None:
                visible &= k_pos > lens[:, None] - 1 - w
            masks[w] = visible[:, None, None, :]
    return DecodeGroup(kernel, rows_t, flat.view(len(tables), nb), lens, masks, key_starts)


def _every_token_group(chunks: Sequence[SeqChunk], positions: Sequence[int], block_size: int, reach: int | None,
                       device: torch.device, kernel: str = "native") -> DecodeGroup:
    """Every token of `chunks` a row of one in-place kernel call, rows 0 .. N-1 in order: a token at position p
    sees its sequence's keys up to p (its length p + 1; the step's later keys are written but masked), its table
    that of its chunk, from the first block the widest window (`reach`) touches from the chunk's first token (the
    span a chunk attending on its own gathers)."""
    firsts = [0 if reach is None else max(0, c.start + 1 - reach) // block_size for c in chunks]
    spans = [c.block_table[first : -(-(c.start + c.num_tokens) // block_size)]
             for c, first in zip(chunks, firsts, strict=True)]
    width = max(len(span) for span in spans)
    # (lists made into tensors, not tensors of them multiplied or added to: each torch op after a native step runs
    # with its code evicted)
    flat, starts, lengths = long_tensors([b for span in spans for b in padded_table(span, width)],
                                         [f * block_size for f in firsts], [p + 1 for p in positions], device=device)
    tables = flat.view(len(chunks), width)
    if len(positions) > len(chunks):  # each chunk's row for each of its tokens (a CPU repeat_interleave costs
        # ~0.3 ms a call even where every chunk is one token: a pure decode step's every table)
        rows = long_tensors([i for i, c in enumerate(chunks) for _ in range(c.num_tokens)], device=device)[0]
        tables, starts = tables[rows], starts[rows]
    return DecodeGroup(kernel, torch.arange(len(positions), device=device), tables, lengths, {}, starts, all_rows=True)


def long_tensors(*values: Sequence[int], device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Each list of `values` as an int64 tensor on `device`: views of one tensor made from one array's buffer and
    moved in one copy: `torch.tensor` on a short list costs ~4 us (a step's ten lists ~60 us), and per value an
    array's buffer is 3x faster (1.5 against 4.6 ms for a padded step's 35k values, 64 sequences at 512-block tables,
    on a Zen 3)."""
    flat = array.array("q", itertools.chain.from_iterable(values))
    whole = (torch.frombuffer(flat, dtype=torch.long) if flat else torch.zeros(0, dtype=torch.long)).to(device)
    return list(whole.split_with_sizes([len(v) for v in values]))


def padded_table(blocks: Sequence[int], width: int) -> list[int]:
    """A sequence's blocks padded to `width` columns with its own first block: padding reads only the
    sequence's own data (masked by length), never another's, and never an unstarted block's stale values."""
    own = list(blocks)
    return own + own[:1] * (width - len(own))


# How the one-token chunks of a batch attend: the one list (the engine, tuning, the bench and the tests read it).
DECODE_KERNELS = ("sdpa", "matmul", "native", "triton", "per-sequence")
# The kernels that read the pool in place and mask each row by its own length: a step's prompt tokens can be rows too.
IN_PLACE_KERNELS = ("native", "triton")
