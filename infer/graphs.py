"""One-token decode steps without launch overhead: captured once as a CUDA graph, then replayed.

A 1B model's decode step is a few hundred small kernel launches; on a GPU their launch cost, not the
memory traffic, sets the step time unless they are replayed from a graph. A graph replays fixed shapes
and addresses, so the step it captures is the model's one forward over a `StaticBackend` (infer/backends.py):
the token and its position live in tensors the graph reads, K/V go into a contiguous cache's slot at that
position, and attention reads every slot of the cache with the ones past the position masked (gpt-fast's
approach). Prefill stays eager.

`GraphedDecoder(capture=False)` runs the same static step eagerly: that is how the CPU tests check it against
the ordinary step, and it is what the graph holds.

The batched engine's pure-decode steps (one new token for each running sequence, the steady state of serving)
get the same treatment in `BatchedDecodeGraphs`: the ragged batch is padded to a few batch-size buckets and
block-table widths, its metadata lives in static buffers the graph reads, and the paged kernel reads the pool
in place. A quantized pool's step plan (where each token is staged, which blocks the step fills and quantizes) is
planned on the host as in an eager step and padded into the same buffers (`QuantizedPagedPool.padded_plan`).
Steps with prompt chunks run eagerly, as prefill does, unless `max_rows` lets them in: where every token of a step is
a row of the in-place kernel (the engine's `chunk_attention` "triton" or "native"), a prompt chunk's tokens are
just more rows, each with its own position, slot, length and its chunk's table, so a mixed step (the running
requests' decode rows and an arriving prompt) pads to a row bucket like a decode step does.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from infer.backends import PagedBackend
from infer.cache.contiguous import ContiguousCache
from infer.cache.paged_quantized import QuantizedPagedPool, QuantizedPoolLayer
from infer.errors import CacheFullError
from infer.models import Transformer
from infer.ragged import IN_PLACE_KERNELS, DecodeGroup, RaggedBatch, SeqChunk, long_tensors, padded_table


class GraphedDecoder:
    """One-token steps of `model` into the contiguous `cache`, replayed from a CUDA graph captured on the first
    step (`capture`, default: on CUDA), else run eagerly with the same static shapes."""

    def __init__(self, model: Transformer, cache: ContiguousCache, capture: bool | None = None) -> None:
        if not isinstance(cache, ContiguousCache):
            raise TypeError(f"cache must be a ContiguousCache, got {type(cache).__name__}")
        device = cache.k_cache.device
        if capture and device.type != "cuda":
            raise ValueError(f"capturing a CUDA graph needs the model on CUDA, this cache is on {device.type}")
        self.model, self.cache = model, cache
        # The step reads every slot (masked past the position), and a masked NaN still poisons the weighted sum
        # (0 x NaN): slots nothing has written since the cache was last reset may hold any stale value.
        cache.k_cache[:, :, :, cache.offset :].zero_()
        cache.v_cache[:, :, :, cache.offset :].zero_()
        self.capture = device.type == "cuda" if capture is None else capture
        # The graph's inputs and output: written before each replay, read after it.
        self.input_ids = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits `[B, 1, vocab]` of the next position for `input_ids` `[B, 1]`; the cache advances by one.
        With a graph, the returned tensor is overwritten by the next step: copy it to keep it."""
        offset = self.cache.offset
        if offset >= self.cache.max_seq_len:
            raise CacheFullError(f"the cache holds max_seq_len={self.cache.max_seq_len} tokens; no room for one more")
        if input_ids.shape != self.input_ids.shape:
            raise ValueError(f"input_ids must be {tuple(self.input_ids.shape)}, got {tuple(input_ids.shape)}")
        self.input_ids.copy_(input_ids)
        self.position.fill_(offset)
        if self.capture and self.graph is None:
            self.graph, self.logits = capture_graph(self._forward)
        if self.graph is not None:
            self.graph.replay()
            logits = cast(torch.Tensor, self.logits)
        else:
            logits = self._forward()
        self.cache.advance(1)
        return logits

    def _forward(self) -> torch.Tensor:
        backend = self.model.static_backend(self.position, self.cache.k_cache, self.cache.v_cache)
        return self.model(self.input_ids, backend)



def capture_graph(forward: Callable[[], torch.Tensor], pool: object = None
                  ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`forward` captured as a CUDA graph (in memory pool `pool`, if given), and the output tensor each replay
    overwrites. Warm-ups on a side stream first keep first-call allocations, compilation and autotuning out
    of the graph; they run the step for real, so a decode step's warm-ups write the K/V its replay writes."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):  # type: ignore[arg-type]
        output = forward()
    return graph, output


def graphed_decoder(model: Transformer, cache: object) -> GraphedDecoder | None:
    """The decoder `generate` replays one-token steps from: on CUDA, for a contiguous cache, when
    `model.decode_graphs` is on; None elsewhere (the eager step)."""
    if not model.decode_graphs or type(cache) is not ContiguousCache:
        return None
    if cache.k_cache.device.type != "cuda":
        return None
    return GraphedDecoder(model, cache)


# Batch sizes a pure-decode step of the batched engine is padded to (vLLM pads to 1, 2, 4 and multiples of 8):
# few shapes to capture, at most 1.5x the rows past 8. `max_num_seqs` is a bucket too.
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# The most tokens a step carrying prompt chunks may hold to replay from a graph (`max_rows`): beyond, its products
# are large enough that launches no longer set its time (and the largest bucket sets the memory graphs share).
MIXED_GRAPH_ROWS = 512
# Block-table widths are padded to powers of two from this, not to the model's context: every column is copied
# to the device each step (and read by the PyTorch gather path), so widths follow the sequences.
MIN_TABLE_WIDTH = 4


def batch_bucket(n: int, max_batch: int) -> int | None:
    """The padded batch size of a step of `n` sequences: the smallest bucket >= n, capped at `max_batch`;
    None when n exceeds both (the step runs as it is)."""
    if n > max_batch:
        return None
    return next((min(size, max_batch) for size in BATCH_BUCKETS if size >= n), None)


def table_width(num_blocks: int, max_blocks: int) -> int | None:
    """The padded block-table width for sequences holding up to `num_blocks` blocks: the next power of two,
    at least MIN_TABLE_WIDTH, capped at `max_blocks`; None when num_blocks exceeds that."""
    if num_blocks > max_blocks:
        return None
    return min(max_blocks, max(MIN_TABLE_WIDTH, 1 << (num_blocks - 1).bit_length()))


@dataclass
class _SetInputs:
    """One table set's step inputs (views into a shape's flat input buffer)."""

    slot_blocks: torch.Tensor  # [B] block each row writes
    slot_offsets: torch.Tensor  # [B] slot in it
    fresh: torch.Tensor  # [B] block zeroed before the writes: the row's block when it starts one, else the spare
    lengths: torch.Tensor  # [B] keys of each row
    tables: torch.Tensor  # [T, W] block tables: a row's own (T = B), or past max_batch rows a chunk's
    # [B] past max_batch rows, which table each row reads (its chunk's; padding rows the spare's, the last): a
    # table per chunk, not per row, so a step's host-to-device copy stays max_batch tables however many rows
    row_tables: torch.Tensor | None = None


@dataclass
class _Shape:
    """The static inputs, metadata and output of one (batch, table width) shape, and its graph once captured."""

    inputs: torch.Tensor  # every input, flat: ids, positions, then each set's fields (see _layout)
    ids: torch.Tensor
    batches: list[RaggedBatch]  # per table set, reading views of `inputs`
    sets: list[_SetInputs]
    plan: torch.Tensor | None  # [4, B] a quantized pool's padded plan (`QuantizedPagedPool.padded_plan`), last
    logits: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


class BatchedDecodeGraphs:
    """Pure-decode steps of the batched engine (one new token per sequence) at static shapes: the batch padded
    to a bucket (BATCH_BUCKETS) and the block tables to a width bucket, each shape captured as a CUDA graph on
    first use and replayed after (`capture`, default: on CUDA), else run eagerly with the same shapes, which
    is how the CPU tests check it against the ordinary step.

    `layers[i]`: (table set, k_blocks, v_blocks) of model layer i. Table sets are the block spaces sequences
    have tables in (the engine's pool, and its sliding layers' rings); `spare[s]` is a block of set s that no
    sequence owns: padding rows write and read only there, so they touch no sequence's K/V. A quantized pool's
    layers (its plan padded into the buffer too) take its spare code block and staging slot. Each step's metadata is
    copied into the shape's input buffer in one host-to-device copy.

    `max_rows` (0: off): steps carrying prompt chunks take the padded path too, up to this many tokens, every
    token a row (only where the engine's ordinary step makes every token a row of `kernel`, an in-place one; not
    for a quantized pool, whose staging plan pads one write a row of a pure-decode step)."""

    def __init__(self, model: Transformer,
                 layers: Sequence[tuple[int, torch.Tensor | QuantizedPoolLayer, torch.Tensor | QuantizedPoolLayer]],
                 spare: Sequence[int], *, block_size: int, kernel: str, max_batch: int, max_blocks: int,
                 capture: bool | None = None, max_rows: int = 0) -> None:
        first = layers[0][1]
        device = first.pool.device if isinstance(first, QuantizedPoolLayer) else first.device
        if capture and device.type != "cuda":
            raise ValueError(f"capturing CUDA graphs needs the model on CUDA, the pool is on {device.type}")
        self.model, self.layers, self.spare = model, list(layers), list(spare)
        # A quantized pool's layers: the pool whose step plan is padded into each shape's buffer.
        self.staging: QuantizedPagedPool | None = next(
            (k.pool for _, k, _ in layers if isinstance(k, QuantizedPoolLayer)), None)
        self.block_size, self.kernel, self.device = block_size, kernel, device
        self.max_batch, self.max_blocks = max_batch, max_blocks
        if max_rows and (kernel not in IN_PLACE_KERNELS or self.staging is not None):
            raise ValueError(f"max_rows={max_rows}: prompt tokens as graph rows need an in-place kernel "
                             f"{IN_PLACE_KERNELS} and an unquantized pool, got kernel {kernel!r}"
                             + (" and a quantized pool" if self.staging is not None else ""))
        self.max_rows = max_rows
        self.capture = device.type == "cuda" if capture is None else capture
        self.shapes: dict[tuple[int, int], _Shape] = {}
        self._mempool: object = None  # one memory pool for every captured graph

    def shape_for(self, chunk_sets: Sequence[Sequence[SeqChunk]]) -> tuple[int, int] | None:
        """The padded (rows, table width) of a step over `chunk_sets` (per table set, one chunk per sequence),
        or None when it is not pure decode (nor within `max_rows` tokens) or exceeds the largest shape."""
        chunks = chunk_sets[0]
        if not chunks:
            return None
        rows = sum(c.num_tokens for c in chunks)
        if rows == len(chunks):  # pure decode
            batch = batch_bucket(rows, self.max_batch)
        elif len(chunks) > self.max_batch:  # (the scheduler runs at most max_batch sequences: never taken)
            batch = None
        else:
            # (a decode step's bucket up to max_batch, so that the shapes captured up front hold it)
            batch = batch_bucket(rows, max(self.max_batch, self.max_rows)) if rows <= self.max_rows else None
        width = table_width(max(-(-(c.start + c.num_tokens) // self.block_size) for c in chunks), self.max_blocks)
        return None if batch is None or width is None else (batch, width)

    def capture_up_to(self, num_blocks: int) -> int:
        """Capture now every shape a pure-decode step over sequences of up to `num_blocks` blocks can take (at
        start-up, as vLLM does, instead of on first use in the middle of serving); returns how many shapes
        there are. The captures run on padding rows only, which touch nothing but the spare blocks."""
        widths = sorted({w for n in range(1, num_blocks + 1) if (w := table_width(n, self.max_blocks)) is not None})
        batches = sorted({b for n in range(1, self.max_batch + 1) if (b := batch_bucket(n, self.max_batch))}
                         | {b for n in range(self.max_batch + 1, self.max_rows + 1)
                            if (b := batch_bucket(n, self.max_rows))})  # (max_rows > max_batch there)
        for key in ((b, w) for b in batches for w in widths):
            shape = self._shape(key)
            if self.capture and shape.graph is None:
                empty: list[list[SeqChunk]] = [[] for _ in self.spare]
                shape.inputs.copy_(long_tensors(self._input_values(key, [], empty))[0])
                self._capture(shape)
        return len(batches) * len(widths)

    def step(self, token_ids: Sequence[int], chunk_sets: Sequence[Sequence[SeqChunk]], sample: Sequence[bool]
             ) -> torch.Tensor | None:
        """Logits `[S, vocab]` of the chunks that sample (each at its last token), writing each token's K/V
        into its slot as the ordinary step does; None (nothing done) when `shape_for` gives no shape: the
        caller runs the ordinary step."""
        key = self.shape_for(chunk_sets)
        if key is None:
            return None
        shape = self._shape(key)
        values = self._input_values(key, token_ids, chunk_sets)
        shape.inputs.copy_(long_tensors(values)[0])
        if self.capture and shape.graph is None:
            self._capture(shape)
        if shape.graph is not None:
            shape.graph.replay()
            logits = cast(torch.Tensor, shape.logits)
        else:
            logits = self._forward(shape)
        ends = itertools.accumulate(c.num_tokens for c in chunk_sets[0])
        rows = [end - 1 for end, wants in zip(ends, sample, strict=True) if wants]
        return logits[rows]  # a copy: the static output is overwritten by the next replay

    def _input_values(self, key: tuple[int, int], token_ids: Sequence[int],
                      chunk_sets: Sequence[Sequence[SeqChunk]]) -> list[int]:
        """The flat input buffer's values, in _layout's order: a row per token (a prompt chunk's tokens each
        its own, at its position, with its chunk's table). Padding rows: token 0 at position 0, writing and
        reading slot 0 of the spare block."""
        batch, width = key
        bs, pad, table_rows = self.block_size, batch - len(token_ids), self._table_rows(batch)
        positions = [p for c in chunk_sets[0] for p in range(c.start, c.start + c.num_tokens)]
        values = [*token_ids, *[0] * pad, *positions, *[0] * pad]
        for chunks, spare in zip(chunk_sets, self.spare, strict=True):
            blocks = [c.block_table[p // bs] for c in chunks for p in range(c.start, c.start + c.num_tokens)]
            offsets = [p % bs for p in positions]
            values += [*blocks, *[spare] * pad]
            values += [*offsets, *[0] * pad]
            values += [*[b if o == 0 else spare for b, o in zip(blocks, offsets, strict=True)], *[spare] * pad]
            values += [*[p + 1 for p in positions], *[1] * pad]
            tables = [padded_table(c.block_table[: -(-(c.start + c.num_tokens) // bs)], width) for c in chunks]
            if table_rows < batch:  # a table per chunk; each row names its chunk's, padding rows the last (spare)
                values += [i for i, c in enumerate(chunks) for _ in range(c.num_tokens)] + [table_rows - 1] * pad
                values += [b for table in tables for b in table] + [spare] * ((table_rows - len(chunks)) * width)
            else:
                for c, table in zip(chunks, tables, strict=True):
                    values += table * c.num_tokens
                values += [spare] * (pad * width)
        if self.staging is not None:
            values += self.staging.padded_plan(batch)
        return values

    def _shape(self, key: tuple[int, int]) -> _Shape:
        """The shape's buffers and metadata, laid out on first use."""
        shape = self.shapes.get(key)
        if shape is None:
            shape = self.shapes[key] = self._new_shape(*key)
        return shape

    def _table_rows(self, batch: int) -> int:
        """Tables a shape's buffer holds: one a row up to max_batch rows, else one a chunk and a spare one."""
        return batch if batch <= self.max_batch else self.max_batch + 1

    def _new_shape(self, batch: int, width: int) -> _Shape:
        num_sets, planned = len(self.spare), 4 * batch if self.staging is not None else 0
        table_rows = self._table_rows(batch)
        per_set = (4 + (table_rows < batch)) * batch + table_rows * width
        inputs = torch.zeros(2 * batch + num_sets * per_set + planned, dtype=torch.long, device=self.device)
        ids, positions, sets = _layout(inputs, batch, width, num_sets, table_rows)
        rows = torch.arange(batch, device=self.device)
        batches = [RaggedBatch(positions, s.slot_blocks, s.slot_offsets, [], rows, self.block_size, s.fresh,
                               DecodeGroup(self.kernel, rows, s.tables, s.lengths, {}, torch.zeros_like(rows)))
                   for s in sets]
        plan = inputs[inputs.numel() - planned :].view(4, batch) if planned else None
        return _Shape(inputs, ids, batches, sets, plan)

    def _forward(self, shape: _Shape) -> torch.Tensor:
        if self.staging is not None:
            self.staging.use_padded_plan(cast(torch.Tensor, shape.plan))
        for batch, s in zip(shape.batches, shape.sets, strict=True):
            if s.row_tables is not None:  # each row's table from its chunk's, on the device (inside the graph)
                cast(DecodeGroup, batch.decode).tables = s.tables.index_select(0, s.row_tables)
        layers = [(shape.batches[s], k, v) for s, k, v in self.layers]
        return self.model(shape.ids[None], PagedBackend(layers))

    def _capture(self, shape: _Shape) -> None:
        # One memory pool for every shape: replays never overlap, so their intermediates can share memory.
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        shape.graph, shape.logits = capture_graph(lambda: self._forward(shape), self._mempool)


def _layout(inputs: torch.Tensor, batch: int, width: int, num_sets: int, table_rows: int
            ) -> tuple[torch.Tensor, torch.Tensor, list[_SetInputs]]:
    """Views of a flat input buffer: ids [B], positions [B], then per table set slot blocks, slot offsets,
    fresh blocks and lengths [B] each, each row's table [B] where `table_rows` < B, and tables [table_rows, W]."""
    ids, positions = inputs[:batch], inputs[batch : 2 * batch]
    sets, start = [], 2 * batch
    fields = 4 + (table_rows < batch)
    for _ in range(num_sets):
        per_row = inputs[start : start + fields * batch].view(fields, batch)
        start += fields * batch
        tables = inputs[start : start + table_rows * width].view(table_rows, width)
        start += table_rows * width
        sets.append(_SetInputs(per_row[0], per_row[1], per_row[2], per_row[3], tables,
                               per_row[4] if fields == 5 else None))
    return ids, positions, sets
