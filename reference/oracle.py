"""Hugging Face `transformers` as the oracle: full-sequence logits and greedy / sampled continuations.

Decoding here is a plain loop over the model's forward with HF's own DynamicCache, not `model.generate`:
`generate` fills every setting the caller leaves unset from the checkpoint's generation_config.json
(do_sample, temperature, top_k, eos_token_id, ...), which would silently turn "greedy" into sampling.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import cast

import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


class Oracle:
    """A checkpoint loaded by transformers, in eval mode, used without gradients.

    Eager attention by default (it rounds where the engine's reference attention rounds); `attention="sdpa"`
    gives HF's SDPA path, the one the engine's fast path matches on ill-conditioned shapes.
    """

    def __init__(self, path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 attention: str = "eager", gguf_file: str | None = None) -> None:
        self.path = Path(path)
        self.device = torch.device(device)
        # gguf_file: the name of a GGUF file in directory `path`, which transformers dequantizes at load.
        extra = {} if gguf_file is None else {"gguf_file": gguf_file}
        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype, attn_implementation=attention, **extra)
        self.model = model.to(self.device).eval().requires_grad_(False)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits for every position of a [B, T] batch of equal-length sequences: [B, T, V], float32."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        out = self.model(input_ids=input_ids.to(self.device), use_cache=False)
        return out.logits.float().cpu()

    def argmax_after_each(self, input_ids: list[int], continuation: list[int]) -> list[int]:
        """The argmax token after `input_ids + continuation[:i]`, for each i, from one cache-free forward pass
        over the text: equal to `continuation` exactly when it is the greedy continuation (`greedy_uncached`'s
        tokens, at the cost of one pass, not one step a token)."""
        _check_prompt(input_ids, len(continuation))
        if not continuation:
            return []
        text = torch.tensor([list(input_ids) + list(continuation[:-1])])
        return self.logits(text)[0, len(input_ids) - 1 :].argmax(-1).tolist()

    @torch.no_grad()
    def greedy(
        self, input_ids: list[int], max_new_tokens: int, eos_token_ids: Iterable[int] | None = None
    ) -> list[int]:
        """The argmax continuation (new tokens only), decoded one token at a time through HF's DynamicCache.

        Runs the full `max_new_tokens` unless `eos_token_ids` is given; the EOS token that stops it is
        included in the result.
        """
        return self._decode(input_ids, max_new_tokens, eos_token_ids, pick=lambda logits: logits.argmax())

    @torch.no_grad()
    def greedy_uncached(
        self, input_ids: list[int], max_new_tokens: int, eos_token_ids: Iterable[int] | None = None
    ) -> list[int]:
        """Like `greedy`, but recomputes the whole sequence every step: the cache-free ground truth."""
        _check_prompt(input_ids, max_new_tokens)
        stop = set(eos_token_ids or ())
        ids = list(input_ids)
        for _ in range(max_new_tokens):
            logits = self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=False).logits
            ids.append(int(logits[0, -1].argmax()))
            if ids[-1] in stop:
                break
        return ids[len(input_ids) :]

    @torch.no_grad()
    def generate_sampled(
        self,
        input_ids: list[int],
        max_new_tokens: int,
        *,
        generator: torch.Generator,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_ids: Iterable[int] | None = None,
    ) -> list[int]:
        """A sampled continuation: HF's temperature, top-k and top-p warpers (in HF's order), then one
        `torch.multinomial` draw per step from `generator` (CPU; HF's generate would use the global RNG).
        """
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature}; use greedy()")
        warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
        if top_k is not None and top_k > 0:
            warpers.append(TopKLogitsWarper(top_k))
        if top_p is not None and top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p))

        def pick(logits: torch.Tensor) -> torch.Tensor:
            no_ids = cast(torch.LongTensor, torch.empty(1, 0, dtype=torch.long))  # warpers here ignore ids
            scores = warpers(no_ids, cast(torch.FloatTensor, logits.float().cpu()[None]))
            probs = torch.softmax(scores, dim=-1)
            return torch.multinomial(probs, num_samples=1, generator=generator)[0, 0]

        return self._decode(input_ids, max_new_tokens, eos_token_ids, pick=pick)

    def _decode(
        self,
        input_ids: list[int],
        max_new_tokens: int,
        eos_token_ids: Iterable[int] | None,
        pick: Callable[[torch.Tensor], torch.Tensor],
    ) -> list[int]:
        _check_prompt(input_ids, max_new_tokens)
        stop = set(eos_token_ids or ())
        # config= gives Gemma 3's sliding layers their windowed cache layers, as generate() would.
        cache = DynamicCache(config=self.model.config)
        step_ids = torch.tensor([list(input_ids)], device=self.device)
        new_tokens: list[int] = []
        while len(new_tokens) < max_new_tokens:
            logits = self.model(input_ids=step_ids, past_key_values=cache, use_cache=True).logits
            token = int(pick(logits[0, -1]))
            new_tokens.append(token)
            if token in stop:
                break
            step_ids = torch.tensor([[token]], device=self.device)
        return new_tokens


def _check_prompt(input_ids: list[int], max_new_tokens: int) -> None:
    if not input_ids:
        raise ValueError("the prompt must hold at least one token id")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
