"""Many requests at once: continuous batching over the paged pool.

`Engine` owns a `PagedKVPool` and a `Scheduler` (infer/scheduler.py, pure bookkeeping). Each `step()`
asks the scheduler for a plan, runs one forward over the ragged batch it names (infer/ragged.py), samples
one token for every request whose chunk reached its last known token, and reports what each request
produced. Every request keeps its own sampling state (seeded generator, seen tokens, stop logic), so its
tokens are those of its solo `infer.generate` run, whatever else is batched with it.

    engine = Engine(model, tokenizer)
    results = engine.generate(["Once upon", "The sea"], SamplingParams(max_new_tokens=32))

or incrementally, for serving: `add_request`, `step`, `abort`, `has_unfinished`, `stream`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from infer.backends import PagedBackend
from infer.cache.batch_storage import BatchStorage
from infer.cache.block_manager import BlockStats
from infer.cache.paged import DEFAULT_BLOCK_SIZE
from infer.cache.paged_quantized import check_pool_scheme
from infer.generation import (
    GenerationResult,
    OutputStream,
    Prompt,
    _check_model,
    _check_prompt_ids,
    budgeted,
    encode_prompt,
)
from infer.graphs import MIXED_GRAPH_ROWS, BatchedDecodeGraphs
from infer.kernels.native import native_kernels
from infer.memory import frozen_heap
from infer.models import Transformer
from infer.models.transformer import PACKED_LAYOUTS, few_row_products
from infer.ragged import IN_PLACE_KERNELS, SeqChunk, build_ragged_batch
from infer.roofline import ChunkShape, StepRecord, host_counters
from infer.sampling import SamplingParams, draw, process_logits, uniforms
from infer.scheduler import Request, Scheduler, SchedulerOutput
from infer.tensor_parallel import Shards, StepOrder, broadcast_step, min_over_ranks
from infer.tokenizer import Tokenizer
from infer.tuning import (
    choose_chunk_attention,
    choose_decode_attention,
    choose_packed_ahead,
    choose_packed_products,
    choose_token_budget,
)


@dataclass
class RequestOutput:
    """What one request produced in one step."""

    request_id: int
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None  # eos | length | stop | abort | error, once finished
    error: str | None = None  # why the request failed (finish_reason "error")


@dataclass
class _Live:
    """The engine's side of a request: sampling state, output stream and timings."""

    request: Request
    params: SamplingParams
    stream: OutputStream
    generator: torch.Generator
    arrival_s: float
    first_scheduled_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    error: str | None = None


@dataclass
class EngineStats:
    """Counters over the engine's life."""

    steps: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0  # prompt tokens admitted (a recomputed request counts again)
    prefix_hit_tokens: int = 0  # of those, found in the prefix cache
    peak_blocks_used: int = 0
    peak_blocks_shared: int = 0
    max_waste_per_running_seq: float = 0.0  # unfilled slots in used blocks / running requests, at worst
    graph_steps: int = 0  # steps run at a padded static shape (BatchedDecodeGraphs), replayed on CUDA
    graph_prompt_steps: int = 0  # those of them carrying prompt tokens (`mixed_graphs`)

    @property
    def prefix_hit_rate(self) -> float:
        """Share of admitted prompt tokens whose K/V came from the prefix cache."""
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Engine:
    """Continuously batched generation over one paged KV pool (see the module docstring)."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer | None = None,
        *,
        num_blocks: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        cache_memory: int | None = None,
        enable_prefix_caching: bool = True,
        keep_logits: bool = False,
        decode_attention: str = "auto",
        bound_sliding_layers: bool = True,
        decode_graphs: bool | None = None,
        kv_cache_dtype: str | None = None,
        packed_products: bool | str | None = None,
        chunk_attention: str = "auto",
        mixed_graphs: bool | None = None,
    ) -> None:
        _check_model(model, tokenizer)
        if any(getattr(m, "int8_activations", False) for m in model.modules()):
            raise ValueError("the batched engine's steps are exact, and this model's one-row products quantize their "
                             "input to int8: call model.quantize_activations(False) first")
        if packed_products is not None and not isinstance(packed_products, bool) and packed_products not in \
                PACKED_LAYOUTS:
            raise TypeError(f"packed_products must be True, False, None (auto) or a layout "
                            f"({', '.join(PACKED_LAYOUTS)}), got {packed_products!r}")
        if num_blocks is not None and cache_memory is not None:
            raise ValueError("give num_blocks or cache_memory (bytes), not both")
        for name, value in (("cache_memory", cache_memory), ("num_blocks", num_blocks)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if decode_graphs is not None and not isinstance(decode_graphs, bool):
            raise TypeError(f"decode_graphs must be True, False or None (auto), got {decode_graphs!r}")
        if mixed_graphs is not None and not isinstance(mixed_graphs, bool):
            raise TypeError(f"mixed_graphs must be True, False or None (auto), got {mixed_graphs!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.device = model.device
        config = model.config
        # Under tensor parallelism (infer/tensor_parallel.py) rank 0's engine schedules and samples; the other
        # ranks' engines `follow`, running the forward of each step it broadcasts (exact pools only: a quantized
        # pool's staging is planned per step on the host, beside the scheduler).
        self.shards = model.tensor_parallel
        if self.shards is not None and (kv_cache_dtype is not None or decode_graphs):
            raise ValueError("under tensor parallelism the engine runs exact pools without graphs: drop "
                             f"kv_cache_dtype={kv_cache_dtype!r} / decode_graphs={decode_graphs!r}")
        # The decode steps of a forward attend in one padded call, by the kernel measured fastest here
        # ("per-sequence": one call each, the check).
        self.decode_attention = choose_decode_attention(config, model.dtype, self.device, decode_attention).value
        # A quantized pool (kv_cache_dtype "int8" | "int4" | "fp4") is read in place by the native kernel on the
        # CPU and the Triton one on CUDA ("sdpa" / "matmul" dequantize gathers); its staging is planned per step on
        # the host, and padded into a graph's static buffers for replayed decode steps.
        if (kv_cache_dtype is not None and decode_attention == "auto" and self.device.type == "cpu"
                and native_kernels() is not None):
            # Over codes the native kernel reads them in place; sdpa / matmul would dequantize gathers.
            self.decode_attention = "native"
        # The prompt chunks' tokens join the decode rows in the native kernel where it is measured faster than SDPA
        # over each chunk's gathered keys ("sdpa": each chunk on its own, the unoptimised path).
        self.chunk_attention = choose_chunk_attention(config, model.dtype, self.device, self.decode_attention,
                                                      chunk_attention).value
        # The token budget: the caller's, else the fewest rows at which a prompt token costs near the least (the
        # products at their rate there plus a share of a step's fixed cost), measured here; under tensor
        # parallelism the smallest of the ranks'.
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an int >= 1, got {max_num_seqs!r}")
        if kv_cache_dtype is not None:  # (refused before the budget's measurement, which runs the model)
            check_pool_scheme(kv_cache_dtype, config)
        max_num_batched_tokens = int(choose_token_budget(model, max_num_seqs, max_num_batched_tokens).value)
        if self.shards is not None:
            max_num_batched_tokens = min_over_ranks(max_num_batched_tokens, self.shards)
        graphs = _use_decode_graphs(decode_graphs, model, self.device, self.decode_attention)
        # Steps carrying prompt chunks at padded shapes too: what they need, refused before the pool is allocated
        # and the model's products packed when asked for; by default (None) on wherever they can run on CUDA (an
        # H200, 2026-12-04: 256 requests of the mixed workload 1.65x the eager mixed steps' tok/s, those steps' p50
        # 15.1 -> 6.2 ms); off the GPU their padded eager path is the check, not a speed-up.
        missing = [what for what, ok in (
            (f"decode graphs (decode_graphs={decode_graphs!r}: pass True off CUDA)", graphs),
            (f"chunk_attention 'native' or 'triton' (chosen: {self.chunk_attention!r})",
             self.chunk_attention in IN_PLACE_KERNELS),
            (f"an unquantized pool (kv_cache_dtype={kv_cache_dtype!r})", kv_cache_dtype is None)) if not ok]
        if mixed_graphs and missing:
            raise ValueError("mixed_graphs=True replays steps whose every token is a row of the in-place kernel: "
                             f"it needs {' and '.join(missing)}")
        if mixed_graphs is None:
            mixed_graphs = not missing and self.device.type == "cuda"
        self.mixed_graphs = mixed_graphs
        spare = 1 if graphs else 0  # the block the padded rows of a graph's steps write (BatchedDecodeGraphs)
        windows = [layer.self_attn.window for layer in model._decoder_layers()]
        # Sliding-window layers (Gemma 3's local ones) need only their window's keys: with
        # `bound_sliding_layers` they live in per-request rings of blocks instead of the pool, so their memory
        # is bounded by window + chunk, not by the context. Their rings hold no shareable prefix, so prefix
        # caching is off for such models (a prefix hit would skip computing K/V the rings need).
        self.storage = BatchStorage.allocate(
            config, windows, dtype=model.dtype, device=self.device, block_size=block_size, num_blocks=num_blocks,
            cache_memory=cache_memory, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            bound_sliding_layers=bound_sliding_layers,
            spare_blocks=spare, kv_cache_dtype=kv_cache_dtype, huge_pages=model.huge_pages,
            agree_blocks=None if self.shards is None else (lambda n: min_over_ranks(n, cast(Shards, self.shards))))
        self.kv_cache_dtype = kv_cache_dtype
        self.pool, self.ring = self.storage.pool, self.storage.ring

        if self.ring is not None:
            enable_prefix_caching = False
        self.prefix_caching = enable_prefix_caching
        self.scheduler = Scheduler(self.pool.manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   enable_prefix_caching=enable_prefix_caching)
        self.keep_logits = keep_logits
        # The step's products on weights packed once (a second copy of the projections), where measured faster than
        # F.linear here: in oneDNN's layout past the few-row kernel's rows, or in the native packed product's.
        packing = choose_packed_products(model, max_num_batched_tokens, packed_products)
        if packing.on or model.packed_products:
            model.pack_products(packing.on, packing.native_rows, packing.layout, packing.upto, packing.one_row)
        if packing.on and packing.layout == "native":
            choose_packed_ahead(model)
        # Pure-decode steps at padded static shapes, replayed from CUDA graphs on CUDA (infer/graphs.py); with
        # `mixed_graphs`, steps carrying prompt chunks too, up to MIXED_GRAPH_ROWS tokens, every token a kernel row.
        self.graphs: BatchedDecodeGraphs | None = None
        if graphs:
            self.graphs = BatchedDecodeGraphs(
                model, self.storage.layer_blocks(),
                [cast(int, ts.spare) for ts in self.storage.table_sets],
                block_size=block_size, kernel=self.decode_attention, max_batch=max_num_seqs,
                max_blocks=-(-config.max_position_embeddings // block_size),
                max_rows=min(MIXED_GRAPH_ROWS, max_num_batched_tokens) if mixed_graphs else 0)
        self.stats = EngineStats()
        # A list to record each step into (infer/roofline.py: its chunks and where its time went); None: off.
        self.trace: list[StepRecord] | None = None
        self._build_s = 0.0  # this step's block tables and batch tensors (for the trace)
        self._live: dict[int, _Live] = {}
        self._done: dict[int, GenerationResult] = {}
        self._pending: list[RequestOutput] = []  # outputs decided outside a step (instant ends)
        self._next_id = 0

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> int:
        """Queue a prompt (text, token ids or chat messages); return its request id. Raises a
        ValueError/TypeError (queueing nothing) for a bad prompt or parameters, or a prompt the pool or the
        model's context can never hold."""
        self._check_leader("add_request")
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        params = params or SamplingParams()
        prompt_ids = encode_prompt(self.tokenizer, prompt)
        _check_prompt_ids(self.model, prompt_ids)
        params = budgeted(self.model, prompt_ids, params)
        rid = self._next_id
        request = Request(rid, list(prompt_ids), max_tokens=len(prompt_ids) + params.max_new_tokens)
        stream = OutputStream(self.model, self.tokenizer, params)
        # A seed per request, so its draws never depend on what else runs; unseeded ones draw a seed from
        # the global generator (as a solo run would draw from it).
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        generator = torch.Generator(device=self.device).manual_seed(seed)
        live = _Live(request, params, stream, generator, time.perf_counter())
        if stream.finish is None:
            self.scheduler.add(request)  # raises PoolTooSmall before anything is recorded
        self._next_id += 1
        self._live[rid] = live
        if stream.finish is not None:  # max_new_tokens 0: done before it starts
            self._pending.append(self._end(live))
        return rid

    def abort(self, request_id: int) -> None:
        """Stop a request now; its result keeps what it produced, with finish reason "abort"."""
        live = self._live.get(request_id)
        if live is None:
            return
        live.stream.finish = "abort"
        self._pending.append(self._end(live))

    def has_unfinished(self) -> bool:
        """Whether a request waits or runs (or has output not yet returned by `step`)."""
        return self.scheduler.has_unfinished() or bool(self._pending)

    def result(self, request_id: int) -> GenerationResult:
        """The finished request's result (tokens, text, finish reason, timings)."""
        if request_id not in self._done:
            raise ValueError(f"request {request_id} has not finished (or is unknown)")
        return self._done[request_id]

    def capture_decode_graphs(self, max_seq_len: int | None = None) -> int:
        """Capture the CUDA graphs of every padded pure-decode shape for sequences of up to `max_seq_len` tokens
        (default: the model's context) now, rather than each on its first use; returns how many shapes there
        are (0 without graphs). Off CUDA (decode_graphs forced on) nothing is captured."""
        if self.graphs is None:
            return 0
        context = self.model.config.max_position_embeddings if max_seq_len is None else max_seq_len
        if isinstance(context, bool) or not isinstance(context, int) or context < 1:
            raise ValueError(f"max_seq_len must be an int >= 1 or None, got {max_seq_len!r}")
        with torch.inference_mode():
            return self.graphs.capture_up_to(-(-min(context, self.model.config.max_position_embeddings)
                                               // self.pool.block_size))

    @property
    def memory_bytes(self) -> int:
        """Bytes of the KV storage: the pool, and the sliding layers' rings."""
        return self.storage.memory_bytes

    def block_stats(self) -> BlockStats:
        """The pool's occupancy now."""
        return self.pool.stats()

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one forward for the scheduled requests; return each one's new tokens and text."""
        self._check_leader("step")
        outputs, self._pending = self._pending, []
        host = host_counters() if self.trace is not None else None  # (page faults and steal: a traced step's)
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        self.stats.preemptions += len(plan.preempted)
        for rid, reason in plan.failed:
            live = self._live[rid]
            live.error, live.stream.finish = reason, "error"
            outputs.append(self._end(live))
        self.storage.schedule(plan.preempted, plan.chunks)
        if not plan.chunks:
            return outputs
        self.stats.steps += 1
        now = time.perf_counter()
        for chunk in plan.chunks:
            live = self._live[chunk.request_id]
            if live.first_scheduled_s is None:
                live.first_scheduled_s = now
        self._note_pool(plan)
        shapes = None if self.trace is None else [
            ChunkShape(c.start, c.num_tokens, c.start >= len(self._live[c.request_id].request.prompt_ids), c.sample)
            for c in plan.chunks]
        self._build_s = 0.0
        scheduled = time.perf_counter()
        logits = self._forward(plan)
        done = time.perf_counter()
        sampling = [self._live[c.request_id] for c in plan.chunks if c.sample]
        picked = self._batched_picks(sampling, logits)
        rows = logits.unbind(0) if self.keep_logits else (None,) * len(sampling)  # (16 row views: ~30 us a step)
        for i, (live, row) in enumerate(zip(sampling, rows, strict=True)):
            outputs.append(self._record(live, row, done, picked[i]))
        if self.trace is not None and shapes is not None and host is not None:
            ended = time.perf_counter()
            faults, steal = host_counters().since(host)
            self.trace.append(StepRecord(shapes, schedule_s=scheduled - started, build_s=self._build_s,
                                         forward_s=done - scheduled - self._build_s, sample_s=ended - done,
                                         faults=faults, steal_s=steal))
        return outputs

    def follow(self) -> None:
        """On a tensor-parallel rank other than 0: run the forward of every step rank 0's engine broadcasts (its
        copy-on-write copies, block tables and token ids: this rank's pool mirrors rank 0's), until rank 0 calls
        `close`. This rank's scheduler stays idle; the logits are rank 0's to sample. On a frozen heap, as
        `stream`."""
        if self.shards is None or self.shards.rank == 0:
            raise ValueError("Engine.follow runs on tensor-parallel ranks other than 0 (rank 0 schedules)")
        with frozen_heap():  # (a collection here would hold up every rank at the next step's all-reduce)
            while (order := broadcast_step(None, self.shards)) is not None:
                self.pool.copy_blocks(order.copies)
                with torch.inference_mode():
                    self._forward_ragged(order.token_ids, order.chunk_sets, order.sample)

    def _check_leader(self, what: str) -> None:
        if self.shards is not None and self.shards.rank != 0:
            raise ValueError(f"Engine.{what} runs on tensor-parallel rank 0, which schedules; rank {self.shards.rank} "
                             "calls Engine.follow() instead")

    def close(self) -> None:
        """On tensor-parallel rank 0: release the other ranks from `follow` (no more steps). A no-op in one
        process."""
        if self.shards is not None and self.shards.rank == 0:
            broadcast_step(None, self.shards)

    def stream(self) -> Iterator[RequestOutput]:
        """Step until every request has finished, yielding each step's outputs as they come (the collector kept off
        the objects that existed before: `frozen_heap`)."""
        with frozen_heap():
            while self.has_unfinished():
                yield from self.step()

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[GenerationResult]:
        """Generate for every prompt, batched; results in prompt order. A prompt that fails (bad input, longer
        than the context or the pool) gets a result with finish reason "error" and the reason in `error`;
        the others are unaffected."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError("prompts must be a list of prompts (each text, token ids or chat messages)")
        if params is None or isinstance(params, SamplingParams):
            per_prompt: list[SamplingParams | None] = [params] * len(prompts)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(prompts):
                raise ValueError(f"params has {len(per_prompt)} entries for {len(prompts)} prompts; "
                                 "give one SamplingParams, or one per prompt")
        ids: list[int | GenerationResult] = []
        for prompt, p in zip(prompts, per_prompt, strict=True):
            try:
                ids.append(self.add_request(prompt, p))
            except (ValueError, TypeError) as e:
                ids.append(_failed_result(e))
        for _ in self.stream():
            pass
        return [self._done.pop(i) if isinstance(i, int) else i for i in ids]

    # ---- internals --------------------------------------------------------------------------

    def _forward(self, plan: SchedulerOutput) -> torch.Tensor:
        """Logits `[S, vocab]` of the chunks that sample, in plan order."""
        self.pool.copy_blocks(plan.copies)
        sample = [c.sample for c in plan.chunks]
        began = time.perf_counter()
        chunk_sets = self.storage.block_tables(plan.chunks)
        self._build_s += time.perf_counter() - began
        live = self._live
        token_ids = [t for c in plan.chunks for t in live[c.request_id].request.tokens(c.start, c.start + c.num_tokens)]
        if self.shards is not None:  # the other ranks run this very forward (`follow`)
            broadcast_step(StepOrder(plan.copies, chunk_sets, token_ids, sample), self.shards)
        try:
            with torch.inference_mode():
                logits = None if self.graphs is None else self.graphs.step(token_ids, chunk_sets, sample)
                self.stats.graph_steps += logits is not None
                self.stats.graph_prompt_steps += logits is not None and len(token_ids) > len(plan.chunks)
                if logits is None:  # not a pure-decode step (or beyond the largest shape)
                    logits = self._forward_ragged(token_ids, chunk_sets, sample)
        except BaseException:
            self.storage.abort_step()
            self.scheduler.discard(plan.chunks)
            raise
        self.storage.commit_step()
        self.scheduler.computed(plan.chunks)
        return logits

    def _forward_ragged(self, token_ids: list[int], chunk_sets: list[list[SeqChunk]], sample: list[bool]
                        ) -> torch.Tensor:
        """The ordinary step: the ragged batch of each table set (the pool's, the rings'), one forward."""
        began = time.perf_counter()
        batches = [build_ragged_batch(chunks, sample, block_size=self.pool.block_size, windows=ts.windows,
                                      device=self.device, decode_kernel=self.decode_attention,
                                      every_token=self.chunk_attention in IN_PLACE_KERNELS)
                   for chunks, ts in zip(chunk_sets, self.storage.table_sets, strict=True)]
        layers = [(batches[s], k, v) for s, k, v in self.storage.layer_blocks()]
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        self._build_s += time.perf_counter() - began
        with few_row_products():  # the engine answers to solo runs within rounding, not to F.linear's bits
            return self.model(input_ids, PagedBackend(layers))

    @staticmethod
    def _batched_picks(sampling: list[_Live], logits: torch.Tensor) -> dict[int, int]:
        """The step's tokens, by row, each as its solo run's `sample_next` takes it: the plain greedy rows (the argmax
        of their fp32 logits) in one call over their rows (one per row cost ~20 us each); the others in one
        `process_logits` per set of equal settings (a repetition penalty reading each row's own tokens, padded with
        its first: a token penalised twice is penalised once), then their argmax or one `draw`, each row's uniform
        from its own generator as its solo run draws it (one call a row cost ~0.5 ms at 32k with torch.multinomial,
        more than a 16-request decode step's forward)."""
        picks: dict[int, int] = {}
        greedy: list[int] = []
        groups: dict[tuple[float, int, float, float, float], list[int]] = {}
        for i, live in enumerate(sampling):
            p = live.params
            if p.is_greedy and p.repetition_penalty == 1.0:
                greedy.append(i)
            else:
                groups.setdefault((p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty), []).append(i)
        with torch.inference_mode():
            if greedy:
                picked = logits if len(greedy) == logits.shape[0] else logits[greedy]
                kernels = native_kernels() if logits.device.type == "cpu" and logits.dtype in (
                    torch.float32, torch.bfloat16) else None  # the native scan takes the same index, ~15x faster
                tokens = (kernels.argmax_rows(picked) if kernels is not None else picked.float().argmax(dim=-1))
                picks.update(zip(greedy, tokens.tolist(), strict=True))
            for rows in groups.values():
                params = sampling[rows[0]].params
                seen = None
                if params.repetition_penalty != 1.0:
                    ids = [sampling[i].request.token_ids for i in rows]
                    width = max(len(t) for t in ids)
                    seen = torch.tensor([t + t[:1] * (width - len(t)) for t in ids], device=logits.device)
                processed = process_logits(logits if len(rows) == logits.shape[0] else logits[rows], params, seen)
                if params.is_greedy:
                    tokens = processed.argmax(dim=-1)
                else:
                    tokens = draw(processed, torch.cat([uniforms(1, sampling[i].generator, logits.device)
                                                        for i in rows]))
                picks.update(zip(rows, tokens.tolist(), strict=True))
        return picks

    def _record(self, live: _Live, logits: torch.Tensor | None, now: float, token_id: int) -> RequestOutput:
        """The request's next token (`_batched_picks`'): recorded, streamed, and the request ended if it stops;
        its logits row kept where `keep_logits` (given then)."""
        request = live.request
        if logits is not None:
            live.logits.append(logits.float().cpu())
        live.token_times_s.append(now)
        self.scheduler.append_token(request.request_id, token_id)
        text = live.stream.push(token_id)
        if live.stream.finish is not None:
            end = self._end(live)
            return RequestOutput(request.request_id, [token_id], text + end.new_text, True, end.finish_reason)
        return RequestOutput(request.request_id, [token_id], text, False)

    def _end(self, live: _Live) -> RequestOutput:
        """Retire a request: free its blocks and keep its result."""
        rid = live.request.request_id
        self.scheduler.finish(rid)
        self.storage.release(rid)
        del self._live[rid]
        reason = live.stream.finish or "length"
        times = live.token_times_s
        first_scheduled = live.first_scheduled_s if live.first_scheduled_s is not None else live.arrival_s
        self._done[rid] = GenerationResult(
            prompt_ids=list(live.request.prompt_ids),
            token_ids=list(live.stream.token_ids),
            text=live.stream.text,
            finish_reason=reason,
            prefill_time_s=(times[0] - first_scheduled) if times else 0.0,
            decode_times_s=[b - a for a, b in zip(times, times[1:], strict=False)],
            cache_memory_bytes=self.memory_bytes,
            queue_time_s=first_scheduled - live.arrival_s,
            error=live.error,
            logits=torch.stack(live.logits) if live.logits else None,
            num_prefix_hit_tokens=live.request.num_prefix_hit_tokens,
            num_preemptions=live.request.num_preemptions,
        )
        return RequestOutput(rid, [], "", True, reason, live.error)

    def _note_pool(self, plan: SchedulerOutput) -> None:
        # The manager's O(used blocks) counters, not stats(), which walks the whole free list.
        stats, manager = self.stats, self.pool.manager
        stats.prompt_tokens = self.scheduler.prompt_tokens_admitted
        stats.prefix_hit_tokens = self.scheduler.prefix_hit_tokens
        stats.peak_blocks_used = max(stats.peak_blocks_used, manager.num_used)
        stats.peak_blocks_shared = max(stats.peak_blocks_shared, manager.num_shared)
        if self.scheduler.running:
            waste = manager.waste_slots / len(self.scheduler.running)
            stats.max_waste_per_running_seq = max(stats.max_waste_per_running_seq, waste)


def _use_decode_graphs(forced: bool | None, model: Transformer, device: torch.device, kernel: str) -> bool:
    """Whether pure-decode steps run at padded static shapes (BatchedDecodeGraphs): by default on CUDA when
    `model.decode_graphs` is on; forced on elsewhere, the same padded steps run eagerly (how they are
    tested on a CPU). They batch every sequence's attention, so the per-sequence check kernel excludes them."""
    if forced is None:
        return model.decode_graphs and device.type == "cuda" and kernel != "per-sequence"
    if forced and kernel == "per-sequence":
        raise ValueError("decode_graphs=True pads each decode step into one batch, but "
                         "decode_attention='per-sequence' attends one sequence at a time: drop one of them")
    return forced


def _failed_result(error: Exception) -> GenerationResult:
    return GenerationResult(prompt_ids=[], token_ids=[], text="", finish_reason="error", prefill_time_s=0.0,
                            error=f"{type(error).__name__}: {error}")
