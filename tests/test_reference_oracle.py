"""The oracle itself: HF's cached greedy equals a cache-free argmax loop, and settings do not leak in."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from reference import Oracle, build_checkpoint
from reference.checkpoints import ARCHS


def random_prompt(oracle: Oracle, length: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, oracle.vocab_size, (length,), generator=gen).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_greedy_equals_uncached_argmax_loop(arch: str) -> None:
    oracle = Oracle(build_checkpoint(arch))
    # Gemma 3's window is 8: the prompt and the generation both cross it.
    prompt = random_prompt(oracle, 13)
    cached = oracle.greedy(prompt, 24)
    assert cached == oracle.greedy_uncached(prompt, 24)
    assert len(cached) == 24 and len(set(cached)) > 4, f"degenerate greedy run: {cached}"
    # One pass over the text gives the argmax after each prefix: the greedy path where it is given one, and where
    # a token is not the argmax, the argmax there (and, after it, the argmax of the path as given).
    assert oracle.argmax_after_each(prompt, cached) == cached
    swapped = [*cached[:9], (cached[9] + 1) % oracle.vocab_size, *cached[10:]]
    picks = oracle.argmax_after_each(prompt, swapped)
    assert picks[:10] == cached[:10] and picks[10] == oracle.greedy_uncached(prompt + swapped[:10], 1)[0]


def test_greedy_ignores_the_checkpoints_sampling_defaults() -> None:
    """generation_config.json says do_sample=True (as the real instruct models do); greedy must not care."""
    oracle = Oracle(build_checkpoint("qwen3"))
    assert oracle.model.generation_config.do_sample
    prompt = random_prompt(oracle, 5, seed=1)
    assert oracle.greedy(prompt, 10) == oracle.greedy(prompt, 10)


def test_greedy_stops_at_eos_only_when_asked() -> None:
    oracle = Oracle(build_checkpoint("llama"))
    prompt = random_prompt(oracle, 6, seed=2)
    full = oracle.greedy(prompt, 16)
    stop = full[5]
    assert oracle.greedy(prompt, 16, eos_token_ids=[stop]) == full[: full.index(stop) + 1]
    assert oracle.greedy(prompt, 0) == []


def test_logits_batch_rows_are_independent() -> None:
    oracle = Oracle(build_checkpoint("gemma3_text"))
    ids = torch.randint(0, oracle.vocab_size, (3, 20), generator=torch.Generator().manual_seed(3))
    batch = oracle.logits(ids)
    assert batch.shape == (3, 20, oracle.vocab_size) and batch.dtype == torch.float32
    for row in range(3):
        torch.testing.assert_close(batch[row], oracle.logits(ids[row : row + 1])[0], rtol=1e-5, atol=1e-5)


def test_sampling_is_seeded_and_top_k_1_is_greedy() -> None:
    oracle = Oracle(build_checkpoint("llama"))
    prompt = random_prompt(oracle, 5, seed=4)

    def sample(seed: int, **kwargs: Any) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return oracle.generate_sampled(prompt, 12, generator=gen, **kwargs)

    assert sample(0, temperature=0.8, top_p=0.9) == sample(0, temperature=0.8, top_p=0.9)
    assert sample(0, temperature=1.5) != sample(1, temperature=1.5)
    assert sample(0, temperature=0.7, top_k=1) == oracle.greedy(prompt, 12)


def test_bad_calls_give_clear_errors() -> None:
    oracle = Oracle(build_checkpoint("llama"))
    with pytest.raises(ValueError, match="at least one token"):
        oracle.greedy([], 3)
    with pytest.raises(ValueError, match=r"\[batch, seq_len\]"):
        oracle.logits(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="temperature"):
        oracle.generate_sampled([1], 3, generator=torch.Generator(), temperature=0.0)
