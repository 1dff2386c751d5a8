"""Text generation: prefill the prompt once, then decode one token at a time from the KV cache.

`use_kv_cache=False` is the unoptimised path kept as the check: every step re-runs the whole
sequence. Both paths share everything else (sampling, stopping, timing), so a difference in
tokens can only come from the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from infer.cache import CacheSnapshot, KVCache, create_cache
from infer.graphs import graphed_decoder
from infer.memory import frozen_heap, synchronize
from infer.models import Transformer
from infer.sampling import SamplingParams, sample_next
from infer.tensor_parallel import broadcast_token
from infer.tokenizer import StreamDecoder, Tokenizer

FinishReason = Literal["eos", "length", "stop", "abort", "error"]
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
    # Set by the batched engine (infer.Engine):
    queue_time_s: float = 0.0  # from add_request to the first forward that included the request
    error: str | None = None  # why the request failed (finish_reason "error")
    logits: torch.Tensor | None = None  # [tokens, vocab] fp32, when the engine keeps them (keep_logits=True)
    num_prefix_hit_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    num_preemptions: int = 0  # times the request was preempted and recomputed

    @property
    def time_to_first_token_s(self) -> float:
        """Time in the queue, then prefill plus the first sampling step."""
        return self.queue_time_s + self.prefill_time_s

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second over the decode steps (the first token comes from prefill)."""
        total = sum(self.decode_times_s)
        return len(self.decode_times_s) / total if total > 0 else float("nan")


def encode_prompt(tokenizer: Tokenizer | None, prompt: Prompt, *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a prompt given as text, chat messages (rendered with the generation header unless
    `add_generation_prompt` is False) or ids."""
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
        raise TypeError(
            f"prompt must be a str, a list of token ids or a list of chat messages, got {type(prompt).__name__}"
            + (" (decode bytes to str first)" if isinstance(prompt, (bytes, bytearray)) else "")
        )
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
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt))
    ids = [t for t in items if isinstance(t, int) and not isinstance(t, bool)]
    if len(ids) == len(items):
        return ids
    raise TypeError("prompt must be a string, a list of token ids, or a list of chat messages (dicts)")


def _check_model(model: Transformer, tokenizer: Tokenizer | None) -> None:
    if not isinstance(model, Transformer):
        raise TypeError(f"model must be an infer model (infer.load_model), got {type(model).__name__}")
    if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must be an infer.Tokenizer or None, got {type(tokenizer).__name__}")


def _check_generate_args(model: Transformer, tokenizer: Tokenizer | None, params: SamplingParams | None,
                         cache: object, use_kv_cache: object, cache_options: object, prefix: object) -> None:
    _check_model(model, tokenizer)
    if params is not None and not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if cache is not None and not isinstance(cache, (str, KVCache)):
        raise TypeError(f"cache must be a cache kind name or a KVCache, got {type(cache).__name__}")
    if not isinstance(use_kv_cache, bool):
        raise TypeError(f"use_kv_cache must be True or False, got {use_kv_cache!r}")
    if cache_options is not None and not isinstance(cache_options, dict):
        raise TypeError(f"cache_options must be a dict of keyword arguments, got {type(cache_options).__name__}")
    if prefix is not None and not isinstance(prefix, CacheSnapshot):
        raise TypeError(f"prefix must be a CacheSnapshot from snapshot_prefix, got {type(prefix).__name__}")
    if not use_kv_cache and (prefix is not None or not (cache is None or isinstance(cache, str))):
        raise ValueError("use_kv_cache=False recomputes everything: it takes no prefix and no cache")


def _check_prompt_ids(model: Transformer, prompt_ids: list[int]) -> None:
    context = model.config.max_position_embeddings
    if len(prompt_ids) >= context:
        raise ValueError(
            f"the prompt has {len(prompt_ids)} tokens but the model's context is {context}; shorten the prompt"
        )
    vocab = model.config.vocab_size
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        bad = next(t for t in prompt_ids if not 0 <= t < vocab)
        raise ValueError(f"prompt token id {bad} is outside the model's vocabulary [0, {vocab})")


@dataclass
class _Step:
    token_id: int
    elapsed_s: float


def _token_steps(
    model: Transformer,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    cache: str | KVCache | None,
    use_kv_cache: bool,
    cache_options: dict[str, Any],
    prefix: CacheSnapshot | None,
    stats: dict[str, int],
) -> Generator[_Step, None, None]:
    """Yield each new token with the time its forward took (prefill for the first)."""
    device = model.device
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
    graphed = graphed_decoder(model, kv_cache)  # one-token steps replayed from a CUDA graph, where it applies
    with torch.inference_mode():
        for _ in range(params.max_new_tokens):
            seen = all_ids[:, :length]
            synchronize(device)
            start = time.perf_counter()
            # The unoptimised path re-runs the whole sequence; the cached one only the new tokens.
            if kv_cache is None:
                logits = model(seen)[:, -1]
            elif graphed is not None and next_input.shape[1] == 1:
                logits = graphed.step(next_input)[:, -1]
            else:
                logits = model(next_input, kv_cache)[:, -1]
            if kv_cache is not None:
                _note_fed(kv_cache, all_ids)
            token = sample_next(logits, params, seen, generator)
            if model.tensor_parallel is not None:  # every rank goes on with rank 0's token
                token = broadcast_token(token, model.tensor_parallel)
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
    cache: str | KVCache | None,
    cache_options: dict[str, Any],
    prefix: CacheSnapshot | None,
) -> KVCache:
    """The cache to generate into: a new one of the named kind, or the caller's, or a restored prefix."""
    if prefix is not None:
        check_prefix_snapshot(model, prefix, prompt_ids, cache)
    if cache is None or isinstance(cache, str):
        kind = cache if cache is not None else prefix.kind if prefix is not None else "contiguous"
        kv_cache = create_cache(
            kind, model.config, max_seq_len=max_len, batch_size=1, dtype=model.dtype, device=model.device,
            **cache_options,
        )
    else:
        kv_cache = cache
        if kv_cache.max_seq_len < max_len or kv_cache.batch_size != 1:
            raise ValueError(
                f"the given cache (batch {kv_cache.batch_size}, max_seq_len {kv_cache.max_seq_len}) cannot hold "
                f"{max_len} tokens of one sequence; make it larger or lower max_new_tokens"
            )
        # Checked as far as the ids are known: a cache the caller filled through the model itself is taken on
        # the documented promise that its first `offset` tokens are the prompt's.
        n = kv_cache.offset
        known = (_known_tokens(kv_cache) or [])[:n]
        if known != prompt_ids[: len(known)]:
            raise ValueError(
                "the given cache holds other tokens than the prompt's first ones; its K/V cannot be reused for "
                "this prompt (release it and pass a fresh cache, or a cache kind name)"
            )
    if prefix is not None:
        kv_cache.restore(prefix)
    if kv_cache.offset >= len(prompt_ids):
        raise ValueError(
            f"the cache already holds {kv_cache.offset} tokens but the prompt has {len(prompt_ids)}: the prompt "
            "must extend what is cached by at least one token"
        )
    return kv_cache


# The ids whose K/V `generate` put in a cache: its all_ids row, and the cache's offset when it last fed it. A cache
# given again is reused only for tokens known to be the prompt's (a paged cache also tracks its own).
_FED: weakref.WeakKeyDictionary[KVCache, tuple[torch.Tensor, int]] = weakref.WeakKeyDictionary()


def _note_fed(cache: KVCache, all_ids: torch.Tensor) -> None:
    with contextlib.suppress(TypeError):  # a cache class that cannot be weakly referenced: its tokens stay unknown
        _FED[cache] = (all_ids, cache.offset)


def _known_tokens(cache: KVCache) -> list[int] | None:
    """The ids of the tokens `cache` holds, as far as known: the paged cache's own record, else what generate
    fed it (while its offset has not moved since)."""
    held = getattr(cache, "token_ids", None)
    if held is not None and len(held) >= cache.offset:
        return list(held)
    fed = _FED.get(cache)
    if fed is not None and fed[1] == cache.offset:
        return [int(t) for t in fed[0][0, : cache.offset].tolist()]
    return None if held is None else list(held)  # a paged cache told only its first tokens


_FINGERPRINTS: weakref.WeakKeyDictionary[Transformer, str] = weakref.WeakKeyDictionary()


def model_fingerprint(model: Transformer) -> str:
    """A short hash of the model's config and a strided sample of every weight: tells two models apart even
    when their configs are equal (computed once per model; weights changed in place afterwards go unseen)."""
    cached = _FINGERPRINTS.get(model)
    if cached is not None:
        return cached
    digest = hashlib.sha256(repr(model.config).encode())
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 1024)][:1024].float().cpu()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(sample.numpy().tobytes())
    _FINGERPRINTS[model] = digest.hexdigest()[:16]
    return _FINGERPRINTS[model]


def check_prefix_snapshot(model: Transformer, prefix: CacheSnapshot, prompt_ids: list[int],
                          cache: str | KVCache | None) -> None:
    """Refuse a prefix snapshot that does not belong to this model, this prompt or the asked cache kind."""
    if not isinstance(prefix, CacheSnapshot):
        raise TypeError(f"prefix must be a CacheSnapshot from snapshot_prefix, got {type(prefix).__name__}")
    taken_on = prefix.meta.get("model")
    if taken_on is None:
        raise ValueError("the prefix snapshot does not say which model it came from; make it with snapshot_prefix")
    if taken_on != model_fingerprint(model):
        raise ValueError(
            f"the prefix snapshot was taken on another model (fingerprint {taken_on}, this model's is "
            f"{model_fingerprint(model)}); its K/V would give wrong logits here: snapshot the prefix on this model"
        )
    if prefix.token_ids is None or prompt_ids[: len(prefix.token_ids)] != prefix.token_ids:
        raise ValueError("the prompt does not start with the snapshot's tokens; it cannot reuse that prefix")
    if isinstance(cache, str) and cache != prefix.kind:
        raise ValueError(
            f"cache={cache!r} was asked for, but the prefix snapshot is of a {prefix.kind!r} cache; snapshot the "
            f"prefix with cache={cache!r}, or leave cache unset to use the snapshot's kind"
        )


def snapshot_prefix(
    model: Transformer,
    tokenizer: Tokenizer | None,
    prefix: Prompt,
    *,
    cache: str = "contiguous",
    max_seq_len: int | None = None,
) -> CacheSnapshot:
    """Prefill `prefix` once and return a snapshot of the cache; pass it as `generate(prefix=...)` to
    every later prompt that starts with those tokens, which then skips their prefill. Chat messages are
    rendered without the generation header (a prefix is the start of longer conversations). The snapshot
    records the model's fingerprint and is refused on any other model."""
    _check_model(model, tokenizer)
    if not isinstance(cache, str):
        raise TypeError(f"cache must be a cache kind name, got {type(cache).__name__}")
    if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)):
        raise TypeError(f"max_seq_len must be an int or None, got {max_seq_len!r}")
    ids = encode_prompt(tokenizer, prefix, add_generation_prompt=False)
    _check_prompt_ids(model, ids)
    kv_cache = create_cache(
        cache, model.config, max_seq_len=max_seq_len or len(ids), dtype=model.dtype, device=model.device
    )
    with torch.inference_mode():
        model(torch.tensor([ids], device=model.device), kv_cache)
    snapshot = kv_cache.snapshot()
    snapshot.token_ids = ids
    snapshot.meta["model"] = model_fingerprint(model)
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


class OutputStream:
    """A request's sampled tokens as text, and when it is done: an EOS id (kept in `token_ids`, not in the
    text), a stop string (the text is cut before it) or the token budget. Shared by `stream_generate` and
    the batched engine, so both stop on exactly the same token."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer | None, params: SamplingParams) -> None:
        self.budget = params.max_new_tokens
        self.stop_ids: set[int] = set()
        if not params.ignore_eos:
            if params.stop_token_ids is not None:
                self.stop_ids = set(params.stop_token_ids)
            else:  # the checkpoint's (config.json and generation_config.json) and the tokenizer's EOS ids
                self.stop_ids = set(model.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else ())
        self.decoder = StreamDecoder(tokenizer) if tokenizer is not None else None
        self.matcher = _StopMatcher(params.stop)
        self.token_ids: list[int] = []
        self.finish: FinishReason | None = None if self.budget > 0 else "length"

    @property
    def text(self) -> str:
        """The text so far (final once `finish` is set)."""
        return self.matcher.text

    def push(self, token_id: int) -> str:
        """Take the next token; return the text that became final (at the end, everything held back)."""
        self.token_ids.append(token_id)
        if token_id in self.stop_ids:
            return self._close("eos")
        piece = ""
        if self.decoder is not None:
            piece, hit = self.matcher.push(self.decoder.push(token_id))
            if hit:
                self.finish = "stop"
                return piece
        if len(self.token_ids) >= self.budget:
            return piece + self._close("length")
        return piece

    def _close(self, reason: FinishReason) -> str:
        self.finish = reason
        if self.decoder is None:
            return ""
        rest, hit = self.matcher.push(self.decoder.flush())
        if hit:
            self.finish = "stop"
            return rest
        return rest + self.matcher.flush()


def budgeted(model: Transformer, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
    """`params` with max_new_tokens cut to what the model's context leaves after the prompt."""
    budget = min(params.max_new_tokens, model.config.max_position_embeddings - len(prompt_ids))
    return params if budget == params.max_new_tokens else replace(params, max_new_tokens=budget)


def stream_generate(
    model: Transformer,
    tokenizer: Tokenizer | None,
    prompt: Prompt,
    params: SamplingParams | None = None,
    *,
    cache: str | KVCache | None = None,
    use_kv_cache: bool = True,
    cache_options: dict[str, Any] | None = None,
    prefix: CacheSnapshot | None = None,
) -> Iterator[str | GenerationResult]:
    """Yield text pieces as they are generated, then the `GenerationResult` as the last item."""
    _check_generate_args(model, tokenizer, params, cache, use_kv_cache, cache_options, prefix)
    params = params or SamplingParams()
    prompt_ids = encode_prompt(tokenizer, prompt)
    _check_prompt_ids(model, prompt_ids)
    params = budgeted(model, prompt_ids, params)
    out = OutputStream(model, tokenizer, params)
    stats: dict[str, int] = {}
    times: list[float] = []
    steps = _token_steps(
        model, prompt_ids, params, cache=cache, use_kv_cache=use_kv_cache,
        cache_options=cache_options or {}, prefix=prefix, stats=stats,
    )
    with frozen_heap():  # (the collector off the objects that existed before: a full collection is ~10 steps)
        for step in steps:
            times.append(step.elapsed_s)
            piece = out.push(step.token_id)
            if piece:
                yield piece
            if out.finish is not None:
                break
        steps.close()
    yield GenerationResult(
        prompt_ids=prompt_ids,
        token_ids=out.token_ids,
        text=out.text,
        finish_reason=out.finish or "length",
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
    cache: str | KVCache | None = None,
    use_kv_cache: bool = True,
    cache_options: dict[str, Any] | None = None,
    prefix: CacheSnapshot | None = None,
    on_text: Callable[[str], None] | None = None,
) -> GenerationResult:
    """Generate a continuation of `prompt` (text, chat messages or token ids).

    `cache` names the KV-cache kind (see `infer.CACHE_KINDS`; default "contiguous", or the prefix's kind)
    or is a cache to fill (its first `offset` tokens must be the prompt's; a paged cache's are checked);
    `prefix` is a snapshot from `snapshot_prefix` of this model whose tokens the prompt starts with.
    `use_kv_cache=False` recomputes the whole sequence every step.
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
