"""Hugging Face's logits-processor chain for an engine `SamplingParams`: the oracle for sampling.

Built the way `GenerationMixin._get_logits_processor` builds it: the repetition penalty is a processor
(applied in greedy and sampled decoding alike); temperature, top-k, top-p and min-p are warpers, applied
only when sampling (`do_sample=True`), in that order. The engine's temperature 0 is HF's `do_sample=False`.
"""

from __future__ import annotations

from typing import cast

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from infer.sampling import SamplingParams


def hf_logits_processors(params: SamplingParams) -> LogitsProcessorList:
    """HF's processor list for `params`, holding only the processors HF's `generate` would add."""
    processors = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.is_greedy:
        return processors
    if params.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k != 0:
        processors.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
    if params.top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=1))
    if params.min_p > 0.0:
        processors.append(MinPLogitsWarper(min_p=params.min_p, min_tokens_to_keep=1))
    return processors


def hf_process_logits(logits: torch.Tensor, params: SamplingParams, seen_ids: torch.Tensor | None) -> torch.Tensor:
    """Logits `[B, V]` after HF's chain for `params`, in fp32; `seen_ids` `[B, n]` are the tokens so far."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    ids = seen_ids if seen_ids is not None else torch.empty(logits.shape[0], 0, dtype=torch.long)
    scores = logits.float().clone()  # processors may write in place; never touch the caller's tensor
    if ids.shape[-1] == 0:
        # HF's repetition penalty gathers from ids; with no history there is nothing to penalise.
        processors = LogitsProcessorList(p for p in hf_logits_processors(params)
                                         if not isinstance(p, RepetitionPenaltyLogitsProcessor))
    else:
        processors = hf_logits_processors(params)
    return cast(torch.Tensor, processors(cast(torch.LongTensor, ids), cast(torch.FloatTensor, scores)))


def hf_next_token_distribution(
    logits: torch.Tensor, params: SamplingParams, seen_ids: torch.Tensor | None
) -> torch.Tensor:
    """The distribution HF's `generate` draws the next token from, `[B, V]`: one-hot on the argmax if greedy."""
    processed = hf_process_logits(logits, params, seen_ids)
    if params.is_greedy:
        return torch.nn.functional.one_hot(processed.argmax(-1), processed.shape[-1]).float()
    return processed.softmax(-1)
