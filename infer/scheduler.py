"""Which tokens of which requests go into the next forward, in pure Python (no tensors, no torch).

Continuous batching over a `BlockManager` pool, as vLLM's and nano-vllm's schedulers do it:
- every step has a token budget (`max_num_batched_tokens`) and a cap on running requests
  (`max_num_seqs`); running requests go first, oldest first, one token each when decoding or a chunk of
  their prompt when prefilling; waiting requests are then admitted first come, first served;
- a prompt longer than what is left of the budget is prefilled in chunks over several steps, in the same
  forward as other requests' decode steps;
- when the pool has no block for a running request, the youngest running request is preempted: its
  blocks are freed and it waits at the head of the queue, to be recomputed (prompt and the tokens it
  already produced) when blocks free up. The oldest request is preempted only by itself, when the pool
  cannot hold it even alone; it then fails with `PoolTooSmall` instead of waiting forever;
- a new request starts from the longest cached prefix of full blocks (`BlockManager.new_sequence`), so a
  shared system prompt is computed once.

The engine (`infer/engine.py`) turns a `SchedulerOutput` into tensors, runs the forward, samples, and
reports back with `append_token` / `finish`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from infer.cache.block_manager import BlockManager, CopyOnWrite
from infer.errors import CacheFullError


class PoolTooSmall(CacheFullError):
    """A request needs more KV blocks than the whole pool has; it fails, the others go on."""


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """The scheduler's view of a request: its tokens and how many of them have K/V in the pool."""

    request_id: int
    prompt_ids: list[int]
    max_tokens: int  # prompt + output may not exceed this (the model's context, or less)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose K/V are in the pool
    status: Status = Status.WAITING
    num_prefix_hit_tokens: int = 0  # prompt tokens found in the prefix cache at (last) admission
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens known so far."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt then output tokens."""
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, stop: int) -> list[int]:
        """`token_ids[start:stop]` (0 <= start <= stop), without building the whole list first."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : stop - n]
        if stop <= n:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[: stop - n]


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens `start .. start+num_tokens-1` of a request go into this step's forward. `sample`: the chunk
    ends at the request's last known token, so its logits give the next token."""

    request_id: int
    start: int
    num_tokens: int
    sample: bool


@dataclass
class SchedulerOutput:
    """One step's plan: chunks in forward order, block copies to do before writing, and what changed."""

    chunks: list[ScheduledChunk]
    copies: list[CopyOnWrite]
    preempted: list[int]  # requests sent back to the queue this step
    failed: list[tuple[int, str]]  # requests that can never fit, with the reason

    @property
    def num_batched_tokens(self) -> int:
        """Tokens in this step's forward."""
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """First-come admission, chunked prefill and preemption over one block pool."""

    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_prefix_caching: bool = True) -> None:
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first
        self.requests: dict[int, Request] = {}
        self._arrival: dict[int, int] = {}
        self._arrivals = 0
        # Prefix-cache figures over every admission: prompt tokens asked for, and found cached.
        self.prompt_tokens_admitted = 0
        self.prefix_hit_tokens = 0

    # ---- queries ----------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        """Whether any request waits or runs."""
        return bool(self.waiting or self.running)

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of admitted prompt tokens whose K/V came from the prefix cache."""
        return self.prefix_hit_tokens / self.prompt_tokens_admitted if self.prompt_tokens_admitted else 0.0

    # ---- requests in and out ----------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request. Raises `PoolTooSmall` (queueing nothing) when its prompt can never fit."""
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id} is already scheduled")
        if not request.prompt_ids:
            raise ValueError("a request needs at least one prompt token")
        self._check_fits_pool(request)
        self.requests[request.request_id] = request
        self._arrival[request.request_id] = self._arrivals
        self._arrivals += 1
        self.waiting.append(request)

    def finish(self, request_id: int) -> None:
        """End a request (finished or aborted): free its blocks and forget it. Unknown ids are ignored,
        so an abort racing with the request's own end is harmless."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if request.status is Status.RUNNING:
            self.running.remove(request)
            self.blocks.free(request_id)
        else:
            self.waiting.remove(request)
        request.status = Status.FINISHED
        del self._arrival[request_id]

    def append_token(self, request_id: int, token_id: int) -> None:
        """Record the token sampled for a request whose chunk had `sample` set."""
        self.requests[request_id].output_ids.append(token_id)

    # ---- the step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan the next forward. Takes the blocks the chunks write (doing the allocator's side of
        copy-on-write); the caller must run `copies` on the tensors, then call `computed` after the forward."""
        out = SchedulerOutput([], [], [], [])
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(request.num_tokens - request.num_computed, budget)
            if not self._make_room(request, n, scheduled, out):
                continue
            out.copies += self.blocks.append(request.request_id, n)
            out.chunks.append(self._chunk(request, n))
            scheduled.add(request.request_id)
            budget -= n
        # No admission in a step that had to preempt: the pool is short, and the preempted go first.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            request = self.waiting[0]
            n = self._admit(request, budget)
            if n == 0:
                break
            self.waiting.popleft()
            self.running.append(request)
            self.running.sort(key=lambda r: self._arrival[r.request_id])
            request.status = Status.RUNNING
            out.copies += self.blocks.append(request.request_id, n)
            out.chunks.append(self._chunk(request, n))
            scheduled.add(request.request_id)
            budget -= n
        return out

    def computed(self, chunks: Sequence[ScheduledChunk]) -> None:
        """The forward of these chunks ran: their K/V are in the pool. Full blocks are registered for
        prefix sharing."""
        size = self.blocks.block_size
        for chunk in chunks:
            request = self.requests.get(chunk.request_id)
            if request is None:
                continue
            request.num_computed = chunk.start + chunk.num_tokens
            # Only a chunk that fills a block has one to register: the blocks before its first token's are
            # registered already (by the chunks before it, or found so at admission).
            if self.enable_prefix_caching and request.num_computed // size > chunk.start // size:
                self.blocks.register_full_blocks(request.request_id, request.tokens(0, request.num_computed))

    def discard(self, chunks: Sequence[ScheduledChunk]) -> None:
        """The forward of these chunks did not run (an exception): give back the slots they took."""
        for chunk in chunks:
            request = self.requests.get(chunk.request_id)
            if request is not None and request.status is Status.RUNNING:
                self.blocks.truncate(request.request_id, request.num_computed)

    # ---- internals --------------------------------------------------------------------------

    def _chunk(self, request: Request, n: int) -> ScheduledChunk:
        start = request.num_computed
        return ScheduledChunk(request.request_id, start, n, sample=start + n == request.num_tokens)

    def _check_fits_pool(self, request: Request) -> None:
        need = self.blocks.blocks_for(request.num_tokens)
        if need > self.blocks.num_blocks:
            raise PoolTooSmall(
                f"request {request.request_id} has {request.num_tokens} tokens, which need {need} KV blocks of "
                f"{self.blocks.block_size}, but the pool has {self.blocks.num_blocks}; shorten the prompt or "
                "give the engine more blocks (num_blocks or cache_memory)"
            )

    def _make_room(self, request: Request, n: int, scheduled: set[int], out: SchedulerOutput) -> bool:
        """Preempt the youngest unscheduled running requests until `request` can take `n` more slots;
        False if `request` itself had to go (preempted, or failed when it cannot fit even alone)."""
        rid = request.request_id
        while not self.blocks.can_append(rid, n):
            victims = [r for r in self.running if r.request_id not in scheduled]
            victim = victims[-1]  # the youngest not yet in this step; `request` itself is among them
            if victim is request and len(self.running) == 1 and not scheduled:
                # Alone and still no room: the pool cannot hold this request's tokens.
                reason = (f"request {rid} needs more than the pool's {self.blocks.num_blocks} KV blocks of "
                          f"{self.blocks.block_size} tokens; give the engine more blocks or lower max_new_tokens")
                out.failed.append((rid, reason))
                self.finish(rid)
                return False
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.blocks.free(request.request_id)
        self.running.remove(request)
        request.status = Status.WAITING
        request.num_computed = 0
        request.num_preemptions += 1
        # Back to the queue in arrival order, so it goes before anything that came after it.
        position = sum(1 for r in self.waiting if self._arrival[r.request_id] < self._arrival[request.request_id])
        self.waiting.insert(position, request)
        out.preempted.append(request.request_id)

    def _admit(self, request: Request, budget: int) -> int:
        """Start `request`'s sequence in the pool (sharing its cached prefix) and return how many tokens it
        computes this step; 0 (changing nothing) when the free blocks cannot take its first chunk."""
        rid = request.request_id
        tokens = request.token_ids if self.enable_prefix_caching else []
        num_cached = self.blocks.new_sequence(rid, tokens)
        n = min(request.num_tokens - num_cached, budget)
        if not self.blocks.can_append(rid, n):
            self.blocks.free(rid)
            return 0
        request.num_computed = num_cached
        request.num_prefix_hit_tokens = num_cached
        self.prompt_tokens_admitted += request.num_tokens
        self.prefix_hit_tokens += num_cached
        return n
