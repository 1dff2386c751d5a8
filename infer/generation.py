"""Text generation: prefill the prompt once, then decode one token at a time from the KV cache.

`use_kv_cache=False` is the unoptimised path kept as the check: every step re-runs the whole
sequence. Both paths share everything else (sampling, stopping, timing), so a difference in
tokens can only come from the cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from infer.cache import CacheSnapshot, KVCache, create_cache
from infer.models import Transformer
from infer.sampling import SamplingParams, sample_next
from infer.tokenizer import StreamDecoder, Tokenizer

FinishReason = Literal["eos", "length", "stop"]
Prompt = str | Sequence[int] | Sequence[dict[str, Any]]


@dataclass
class GenerationResult:
    """What one generation produced, and how long it took."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prefill_time_s: float
    decode_times_s: list[float] = field(default_factory=list)
    cache_memory_bytes: int = 0

    @property
    def time_to_first_token_s(self) -> float:
        """Prefill plus the first sampling step."""
        return self.prefill_time_s

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second over the decode steps (the first token comes from prefill)."""
        total = sum(self.decode_times_s)
        return len(self.decode_times_s) / total if total > 0 else float("nan")


def encode_prompt(tokenizer: Tokenizer | None, prompt: Prompt) -> list[int]:
    """Token ids of a prompt given as text, chat messages or ids."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids or a Tokenizer")
        return tokenizer.encode(prompt)
    items = list(prompt)
    if not items:
        raise ValueError("the prompt is empty: give at least one token")
    if all(isinstance(m, dict) for m in items):
        if tokenizer is None:
            raise ValueError("chat messages need a tokenizer with a chat template")
        messages = [m for m in items if isinstance(m, dict)]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    ids = [t for t in items if isinstance(t, int) and not isinstance(t, bool)]
    if len(ids) == len(items):
        return ids
    raise TypeError("prompt must be a string, a list of token ids, or a list of chat messages (dicts)")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Step:
    token_id: int
    elapsed_s: float


def _token_steps(
    model: Transformer,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    cache: str | KVCache,
    use_kv_cache: bool,
    cache_options: dict[str, Any],
    prefix: CacheSnapshot | None,
    stats: dict[str, int],
) -> Generator[_Step, None, None]:
    """Yield each new token with the time its forward took (prefill for the first)."""
    device = model.embed_tokens.weight.device
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device).manual_seed(params.seed)
    max_len = len(prompt_ids) + params.max_new_tokens
    # all_ids: [1, max_len], filled as tokens come; `seen` is a view of its filled part.
    all_ids = torch.zeros(1, max_len, dtype=torch.long, device=device)
    all_ids[0, : len(prompt_ids)] = torch.tensor(prompt_ids, dtype=torch.long)
    length = len(prompt_ids)
    kv_cache = None
    if use_kv_cache:
        kv_cache = _prepare_cache(model, prompt_ids, max_len, cache, cache_options, prefix)
        stats["cache_memory_bytes"] = kv_cache.memory_bytes
    # With a cached prefix (a snapshot, or a paged cache sharing blocks) only the rest is prefilled.
    next_input = all_ids[:, kv_cache.offset if kv_cache is not None else 0 : length]
    with torch.inference_mode():
        for _ in range(params.max_new_tokens):
            seen = all_ids[:, :length]
            _sync(device)
            start = time.perf_counter()
            # The unoptimised path re-runs the whole sequence; the cached one only the new tokens.
            logits = model(next_input, kv_cache)[:, -1] if kv_cache is not None else model(seen)[:, -1]
            token = sample_next(logits, params, seen, generator)
            token_id = int(token.item())  # the sync point: the host needs the id to decide to stop
            elapsed = time.perf_counter() - start
            all_ids[0, length] = token[0]
            next_input = all_ids[:, length : length + 1]
            length += 1
            yield _Step(token_id, elapsed)


def _prepare_cache(
    model: Transformer,
    prompt_ids: list[int],
    max_len: int,
    cache: str | KVCache,
    cache_options: dict[str, Any],
    prefix: CacheSnapshot | None,
) -> KVCache:
    """The cache to generate into: a new one of the named kind, or the caller's, or a restored prefix."""
    if isinstance(cache, str):
        kind = prefix.kind if prefix is not None else cache
        weight = model.embed_tokens.weight
        kv_cache = create_cache(
            kind, model.config, max_seq_len=max_len, batch_size=1, dtype=weight.dtype, device=weight.device,
            **cache_options,
        )
    else:
        kv_cache = cache
        if kv_cache.max_seq_len < max_len or kv_cache.batch_size != 1:
            raise ValueError(
                f"the given cache (batch {kv_cache.batch_size}, max_seq_len {kv_cache.max_seq_len}) cannot hold "
                f"{max_len} tokens of one sequence; make it larger or lower max_new_tokens"
            )
    if prefix is not None:
        if prefix.token_ids is None or prompt_ids[: len(prefix.token_ids)] != prefix.token_ids:
            raise ValueError("the prompt does not start with the snapshot's tokens; it cannot reuse that prefix")
        kv_cache.restore(prefix)
    if kv_cache.offset >= len(prompt_ids):
        raise ValueError(
            f"the cache already holds {kv_cache.offset} tokens but the prompt has {len(prompt_ids)}: the prompt "
            "must extend what is cached by at least one token"
        )
    return kv_cache


def snapshot_prefix(
    model: Transformer,
    tokenizer: Tokenizer | None,
    prefix: Prompt,
    *,
    cache: str = "contiguous",
    max_seq_len: int | None = None,
) -> CacheSnapshot:
    """Prefill `prefix` once and return a snapshot of the cache; pass it as `generate(prefix=...)` to
    every later prompt that starts with those tokens, which then skips their prefill."""
    ids = encode_prompt(tokenizer, prefix)
    weight = model.embed_tokens.weight
    kv_cache = create_cache(
        cache, model.config, max_seq_len=max_seq_len or len(ids), dtype=weight.dtype, device=weight.device
    )
    with torch.inference_mode():
        model(torch.tensor([ids], device=weight.device), kv_cache)
    snapshot = kv_cache.snapshot()
    snapshot.token_ids = ids
    return snapshot


class _StopMatcher:
    """Finds stop strings in the streamed text, holding back what could still become one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.emitted = 0

    def push(self, piece: str) -> tuple[str, bool]:
        """Add decoded text; return (text safe to emit, whether a stop string was found)."""
        self.text += piece
        search_from = max(0, self.emitted - self.holdback)
        hits = [i for s in self.stops if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return self._emit(len(self.text)), True
        return self._emit(max(self.emitted, len(self.text) - self.holdback)), False

    def flush(self) -> str:
        """Emit whatever is held back."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        out = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        return out


def stream_generate(
    model: Transformer,
    tokenizer: Tokenizer | None,
    prompt: Prompt,
    params: SamplingParams | None = None,
    *,
    cache: str | KVCache = "contiguous",
    use_kv_cache: bool = True,
    cache_options: dict[str, Any] | None = None,
    prefix: CacheSnapshot | None = None,
) -> Iterator[str | GenerationResult]:
    """Yield text pieces as they are generated, then the `GenerationResult` as the last item."""
    params = params or SamplingParams()
    prompt_ids = encode_prompt(tokenizer, prompt)
    context = model.config.max_position_embeddings
    if len(prompt_ids) >= context:
        raise ValueError(
            f"the prompt has {len(prompt_ids)} tokens but the model's context is {context}; shorten the prompt"
        )
    vocab = model.config.vocab_size
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise ValueError(f"prompt token ids must lie in [0, {vocab})")
    budget = min(params.max_new_tokens, context - len(prompt_ids))
    if budget != params.max_new_tokens:
        params = replace(params, max_new_tokens=budget)
    stop_ids: set[int] = set()
    if not params.ignore_eos:
        if params.stop_token_ids is not None:
            stop_ids = set(params.stop_token_ids)
        else:  # the checkpoint's (config.json and generation_config.json) and the tokenizer's EOS ids
            stop_ids = set(model.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer is not None else ())
    decoder = StreamDecoder(tokenizer) if tokenizer is not None else None
    matcher = _StopMatcher(params.stop)
    stats: dict[str, int] = {}
    token_ids: list[int] = []
    times: list[float] = []
    finish: FinishReason = "length"
    steps = _token_steps(
        model, prompt_ids, params, cache=cache, use_kv_cache=use_kv_cache,
        cache_options=cache_options or {}, prefix=prefix, stats=stats,
    )
    for step in steps:
        token_ids.append(step.token_id)
        times.append(step.elapsed_s)
        if step.token_id in stop_ids:
            finish = "eos"
            break
        if decoder is not None:
            piece, hit = matcher.push(decoder.push(step.token_id))
            if piece:
                yield piece
            if hit:
                finish = "stop"
                break
    steps.close()
    if decoder is not None and finish != "stop":
        rest, hit = matcher.push(decoder.flush())
        rest += "" if hit else matcher.flush()
        finish = "stop" if hit else finish
        if rest:
            yield rest
    yield GenerationResult(
        prompt_ids=prompt_ids,
        token_ids=token_ids,
        text=matcher.text,
        finish_reason=finish,
        prefill_time_s=times[0] if times else 0.0,
        decode_times_s=times[1:],
        cache_memory_bytes=stats.get("cache_memory_bytes", 0),
    )


def generate(
    model: Transformer,
    tokenizer: Tokenizer | None,
    prompt: Prompt,
    params: SamplingParams | None = None,
    *,
    cache: str | KVCache = "contiguous",
    use_kv_cache: bool = True,
    cache_options: dict[str, Any] | None = None,
    prefix: CacheSnapshot | None = None,
    on_text: Callable[[str], None] | None = None,
) -> GenerationResult:
    """Generate a continuation of `prompt` (text, chat messages or token ids).

    `cache` names the KV-cache kind (see `infer.CACHE_KINDS`) or is a cache to fill (its first
    `offset` tokens must be the prompt's); `prefix` is a snapshot from `snapshot_prefix` whose tokens
    the prompt starts with. `use_kv_cache=False` recomputes the whole sequence every step.
    `on_text` receives text pieces as they are generated.
    """
    for item in stream_generate(
        model, tokenizer, prompt, params, cache=cache, use_kv_cache=use_kv_cache,
        cache_options=cache_options, prefix=prefix,
    ):
        if isinstance(item, GenerationResult):
            return item
        if on_text is not None:
            on_text(item)
    raise RuntimeError("stream_generate ended without a result")  # unreachable
