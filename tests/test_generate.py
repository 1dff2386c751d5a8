"""Generation: cached == uncached == the oracle, step logits equal full-sequence logits, params checked."""

from __future__ import annotations

import pytest
import torch

import infer
from infer.families import ARCHITECTURES
from infer.generation import generate, stream_generate
from infer.sampling import SamplingParams
from infer.tokenizer import Tokenizer
from reference import Oracle, build_checkpoint
from tests.helpers import assert_close


def prompt_ids(model: infer.Transformer, length: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (length,), generator=gen).tolist()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_cached_equals_uncached_equals_oracle(arch: str) -> None:
    path = build_checkpoint(arch)
    model = infer.load_model(path)
    prompt = prompt_ids(model, 11)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    cached = generate(model, None, prompt, params)
    uncached = generate(model, None, prompt, params, use_kv_cache=False)
    assert cached.token_ids == uncached.token_ids
    assert cached.token_ids == Oracle(path).greedy(prompt, 24)
    assert len(set(cached.token_ids)) > 1, "degenerate model: the comparison would prove little"


def test_gemma_prompt_and_generation_cross_the_window() -> None:
    path = build_checkpoint("gemma3_text")
    model = infer.load_model(path)
    window = model.config.sliding_window
    assert window is not None
    prompt = prompt_ids(model, 2 * window + 1, seed=5)
    params = SamplingParams(max_new_tokens=3 * window, ignore_eos=True)
    cached = generate(model, None, prompt, params)
    assert cached.token_ids == generate(model, None, prompt, params, use_kv_cache=False).token_ids
    assert cached.token_ids == Oracle(path).greedy(prompt, 3 * window)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_seeded_sampling_same_tokens_cached_and_uncached(arch: str) -> None:
    model = infer.load_model(build_checkpoint(arch))
    prompt = prompt_ids(model, 7, seed=1)
    params = SamplingParams(max_new_tokens=20, temperature=0.9, top_k=50, top_p=0.95, seed=1234, ignore_eos=True)
    first = generate(model, None, prompt, params)
    assert first.token_ids == generate(model, None, prompt, params).token_ids
    assert first.token_ids == generate(model, None, prompt, params, use_kv_cache=False).token_ids
    other_seed = SamplingParams(**{**params.__dict__, "seed": 99})
    assert first.token_ids != generate(model, None, prompt, other_seed).token_ids


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_decode_step_logits_equal_full_sequence(arch: str) -> None:
    model = infer.load_model(build_checkpoint(arch))
    ids = torch.tensor([prompt_ids(model, 40, seed=2)])
    with torch.no_grad():
        full = model(ids)
        cache = infer.create_cache("contiguous", model.config, max_seq_len=40)
        step_logits = [model(ids[:, :9], cache)]
        step_logits += [model(ids[:, t : t + 1], cache) for t in range(9, 40)]
    for t, logits in enumerate(step_logits[1:], start=9):
        assert_close(logits[0, 0], full[0, t], 1e-5 * max(1.0, full[0, t].abs().max().item()), f"step {t}")


def test_text_prompt_stop_string_and_streaming() -> None:
    path = build_checkpoint("llama")
    model, tokenizer = infer.load_model(path), Tokenizer(path)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    free = generate(model, tokenizer, "the quick brown fox", params)
    assert free.finish_reason == "length" and len(free.token_ids) == 30
    assert free.text == tokenizer.decode(free.token_ids)
    stop = free.text[len(free.text) // 2 :][:3]
    assert stop.strip(), "need a visible stop string"
    stop_params = SamplingParams(max_new_tokens=30, ignore_eos=True, stop=(stop,))
    stopped = generate(model, tokenizer, "the quick brown fox", stop_params)
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(stop)]
    pieces = [p for p in stream_generate(model, tokenizer, "the quick brown fox", params) if isinstance(p, str)]
    assert "".join(pieces) == free.text
    assert all(pieces)


def test_eos_stops_generation() -> None:
    path = build_checkpoint("qwen3")
    model = infer.load_model(path)
    prompt = prompt_ids(model, 6)
    free = generate(model, None, prompt, SamplingParams(max_new_tokens=10, ignore_eos=True))
    target = free.token_ids[4]
    stopped = generate(model, None, prompt, SamplingParams(max_new_tokens=10, stop_token_ids=(target,)))
    assert stopped.finish_reason == "eos"
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(target) + 1]


def test_result_reports_timing_and_memory() -> None:
    model = infer.load_model(build_checkpoint("llama"))
    result = generate(model, None, prompt_ids(model, 5), SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert result.prefill_time_s > 0 and len(result.decode_times_s) == 5
    assert result.decode_tokens_per_s > 0
    c = model.config
    assert result.cache_memory_bytes == 2 * c.num_hidden_layers * c.num_key_value_heads * 11 * c.head_dim * 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ],
)
def test_bad_params_are_clear_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_prompt_longer_than_context_is_an_error() -> None:
    model = infer.load_model(build_checkpoint("llama"))
    too_long = [1] * model.config.max_position_embeddings
    with pytest.raises(ValueError, match="context"):
        generate(model, None, too_long, SamplingParams(max_new_tokens=1))


def test_out_of_vocab_prompt_is_an_error() -> None:
    model = infer.load_model(build_checkpoint("llama"))
    with pytest.raises(ValueError, match=f"prompt token id {model.config.vocab_size} is outside the model.s vocab"):
        generate(model, None, [model.config.vocab_size], SamplingParams(max_new_tokens=1))


@pytest.mark.parametrize("token", [-1, "vocab"])
def test_a_decode_steps_one_token_outside_the_vocabulary_is_refused(token: int | str) -> None:
    """A forward of one token (a decode step's, checked by one read rather than a min and a max) names an id outside
    the vocabulary, before the cache moves; the next valid step runs. On the CPU: on a GPU the check is left out by
    design (it would synchronise every step), and such an id trips a device-side assert that ends the process's
    CUDA context."""
    model = infer.load_model(build_checkpoint("llama"), device="cpu")
    cache = infer.create_cache("contiguous", model.config, max_seq_len=16, device="cpu")
    model(torch.tensor([[1, 2, 3]]), cache)
    bad = model.config.vocab_size if token == "vocab" else int(token)
    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {model.config.vocab_size}\), got min {bad}"):
        model(torch.tensor([[bad]]), cache)
    assert cache.offset == 3
    model(torch.tensor([[4]]), cache)
    assert cache.offset == 4


def test_stop_list_is_not_mutated() -> None:
    stops = ["a", "b"]
    params = SamplingParams(stop=stops)  # type: ignore[arg-type]
    assert params.stop == ("a", "b") and stops == ["a", "b"]


@pytest.mark.parametrize("kind", ["contiguous", "sliding", "paged", "int8"])
def test_prefix_snapshot_skips_prefill_and_gives_the_same_tokens(kind: str) -> None:
    model = infer.load_model(build_checkpoint("gemma3_text"))
    system = prompt_ids(model, 12, seed=8)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    snapshot = infer.snapshot_prefix(model, None, system, cache=kind, max_seq_len=64)
    assert snapshot.offset == 12 and snapshot.token_ids == system
    for question in (prompt_ids(model, 5, seed=9), prompt_ids(model, 3, seed=10)):
        full = generate(model, None, system + question, params, cache=kind)
        reused = generate(model, None, system + question, params, prefix=snapshot)
        assert reused.token_ids == full.token_ids
    with pytest.raises(ValueError, match="does not start with"):
        generate(model, None, prompt_ids(model, 14, seed=11), params, prefix=snapshot)
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, None, system, params, prefix=snapshot)


def test_generate_into_a_paged_sequence_with_a_shared_prefix() -> None:
    from infer.cache.paged import PagedKVPool

    model = infer.load_model(build_checkpoint("llama"))
    pool = PagedKVPool(model.config, num_blocks=16, block_size=4)
    shared = prompt_ids(model, 9, seed=12)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    first_prompt, second_prompt = shared + [5, 6], shared + [7]
    first = pool.new_sequence(first_prompt, max_seq_len=32)
    assert generate(model, None, first_prompt, params, cache=first).token_ids == generate(
        model, None, first_prompt, params).token_ids
    second = pool.new_sequence(second_prompt, max_seq_len=32)
    assert second.offset == 8  # two full blocks of the shared prompt come from the first sequence
    assert generate(model, None, second_prompt, params, cache=second).token_ids == generate(
        model, None, second_prompt, params).token_ids
