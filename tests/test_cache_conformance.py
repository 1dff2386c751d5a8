"""One conformance suite for every registered cache kind, on every architecture.

A new kind registered with `infer.register_cache_kind` is picked up here automatically: exact kinds
must reproduce full-sequence logits and the oracle's greedy tokens; lossy kinds must stay within the
`ErrorBounds` they registered; every kind must snapshot and restore.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import infer
from infer.cache import CACHE_KINDS, ErrorBounds
from infer.cache.snapshot import load_snapshot, save_snapshot
from infer.families import ARCHITECTURES
from infer.generation import generate
from infer.model_store import default_model_path
from infer.quality import compare, load_text, one_pass_logits, teacher_forced_logits, text_ids
from infer.sampling import SamplingParams
from reference import Oracle, build_checkpoint
from tests.helpers import assert_close
from tests.property.strategies import splits

ALL_KINDS = sorted(CACHE_KINDS)
EXACT_KINDS = [k for k in ALL_KINDS if CACHE_KINDS[k].is_exact]
LOSSY_KINDS = [k for k in ALL_KINDS if not CACHE_KINDS[k].is_exact]
# Tokens of each real text the real-model bounds are checked over (fp32, so the suite stays within CI's time): enough
# that int8's key blocks of 64 fill three times after the sinks.
REAL_TEXT_TOKENS = 256


@functools.cache
def model_of(arch: str) -> infer.Transformer:
    return infer.load_model(build_checkpoint(arch))


def ids_for(model: infer.Transformer, batch: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=gen)


def run_split(model: infer.Transformer, cache: infer.KVCache, ids: torch.Tensor, split: list[int]) -> torch.Tensor:
    pieces, start = [], cache.offset
    for n in split:
        pieces.append(model(ids[:, start : start + n], cache, all_logits=True))
        start += n
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("kind", EXACT_KINDS)
@settings(max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(split=splits(min_total=2, max_total=40), batch=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_exact_kind_equals_full_sequence(arch: str, kind: str, split: list[int], batch: int, seed: int) -> None:
    model = model_of(arch)
    ids = ids_for(model, batch, sum(split), seed)
    cache = infer.create_cache(kind, model.config, max_seq_len=ids.shape[1], batch_size=batch)
    with torch.no_grad():
        full = model(ids)
        cached = run_split(model, cache, ids, split)
    assert_close(cached, full, 1e-5 * max(1.0, full.abs().max().item()), f"{kind}/{arch} split {split}")


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("kind", EXACT_KINDS)
def test_exact_kind_greedy_equals_oracle(arch: str, kind: str) -> None:
    model = model_of(arch)
    window = model.config.sliding_window or 8
    prompt = ids_for(model, 1, 2 * window + 1, seed=7)[0].tolist()
    n = 3 * window  # prompt and generation both cross a Gemma sliding window
    result = generate(model, None, prompt, SamplingParams(max_new_tokens=n, ignore_eos=True), cache=kind)
    assert result.token_ids == Oracle(build_checkpoint(arch)).greedy(prompt, n)


def quality(model: infer.Transformer, kind: str, seeds: tuple[int, ...] = (11, 12), steps: int = 64) -> ErrorBounds:
    """Max logit error, top-1 agreement and mean KL(exact || lossy) of `kind` against the exact cache,
    both forced along the same sampled continuations of random prompts (so every step compares alike)."""
    exact_all, lossy_all, targets = [], [], []
    for seed in seeds:
        prompt = ids_for(model, 1, 16, seed=seed)[0].tolist()
        run = generate(model, None, prompt, SamplingParams(max_new_tokens=steps, temperature=1.0, seed=seed,
                                                           ignore_eos=True))
        ids = prompt + run.token_ids
        exact_all.append(teacher_forced_logits(model, "contiguous", ids, len(prompt))[0])
        lossy_all.append(teacher_forced_logits(model, kind, ids, len(prompt))[0])
        targets.append(torch.tensor(ids[len(prompt):]))
    row = compare(kind, torch.cat(exact_all), torch.cat(lossy_all), torch.cat(targets), 1, 1)
    return ErrorBounds(row.max_logit_error, row.top1_agreement, row.mean_kl)


def assert_within(measured: ErrorBounds, bounds: ErrorBounds, what: str) -> None:
    report = (f"{what}: max logit error {measured.max_logit_error:.4f}, top-1 agreement "
              f"{measured.min_top1_agreement:.3f}, mean KL {measured.max_mean_kl:.2e}; promised {bounds}")
    assert measured.max_logit_error <= bounds.max_logit_error, report
    assert measured.min_top1_agreement >= bounds.min_top1_agreement, report
    assert measured.max_mean_kl <= bounds.max_mean_kl, report
    if bounds.max_perplexity_ratio is not None:
        assert measured.max_perplexity_ratio is not None, report
        assert measured.max_perplexity_ratio <= bounds.max_perplexity_ratio, report


@functools.cache
def real_model() -> infer.Transformer:
    return infer.load_model(None, dtype="float32")  # the default model: the real SmolLM2-135M-Instruct


@pytest.mark.real_model
@pytest.mark.parametrize("text", ["prose", "code"])
def test_lossy_kinds_within_their_error_bounds_on_the_real_model(text: str) -> None:
    """Teacher-forced over real text (infer.quality), each lossy kind against the exact cache on the real model, read in
    one pass (`one_pass_logits`: in fp32 the stepped exact cache's logits to rounding), not 240 steps. The lossy kinds
    step as a model runs by default: every layer of a step in one native call where the step fills no block
    (`infer.quality` steps layer by layer)."""
    model = real_model()
    ids = text_ids(infer.Tokenizer(default_model_path()), load_text(text), REAL_TEXT_TOKENS)
    prefill, targets = 16, torch.tensor(ids[16:])
    exact, exact_bytes = one_pass_logits(model, ids, prefill)
    for kind in LOSSY_KINDS:
        lossy, nbytes = teacher_forced_logits(model, kind, ids, prefill)
        row = compare(kind, exact, lossy, targets, nbytes, exact_bytes)
        bounds = CACHE_KINDS[row.kind].error_bounds
        assert bounds is not None
        measured = ErrorBounds(row.max_logit_error, row.top1_agreement, row.mean_kl, row.perplexity_ratio)
        assert_within(measured, bounds, f"{row.kind}/real model/{text}")


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("kind", LOSSY_KINDS)
def test_lossy_kind_within_its_stress_bounds(arch: str, kind: str) -> None:
    bounds = CACHE_KINDS[kind].stress_bounds
    assert bounds is not None
    assert_within(quality(model_of(arch), kind), bounds, f"{kind}/{arch}")


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_snapshot_restore_equals_uninterrupted(arch: str, kind: str, tmp_path: Path) -> None:
    model = model_of(arch)
    ids = ids_for(model, 1, 30, seed=3)
    with torch.no_grad():
        first = infer.create_cache(kind, model.config, max_seq_len=30)
        run_split(model, first, ids, [13])
        snapshot = first.snapshot()
        uninterrupted = run_split(model, first, ids, [5, 1, 1, 10])
        save_snapshot(snapshot, tmp_path / "prefix.safetensors")
        for restored_snapshot in (snapshot, load_snapshot(tmp_path / "prefix.safetensors")):
            second = infer.create_cache(kind, model.config, max_seq_len=30)
            second.restore(restored_snapshot)
            assert second.offset == 13
            resumed = run_split(model, second, ids, [5, 1, 1, 10])
            assert_close(resumed, uninterrupted, 1e-6, f"{kind}/{arch} restored")


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_snapshot_is_a_copy(arch: str, kind: str) -> None:
    """Whatever happens to the source cache after a snapshot (more tokens, reset and refill with other
    tokens) or to a cache restored from it, the snapshot's tensors and what a restore gives stay the same."""
    model = model_of(arch)
    ids, other = ids_for(model, 1, 30, seed=4), ids_for(model, 1, 30, seed=5)
    with torch.no_grad():
        source = infer.create_cache(kind, model.config, max_seq_len=30)
        run_split(model, source, ids, [11])
        snapshot = source.snapshot()
        kept = {name: t.clone() for name, t in snapshot.tensors.items()}
        fresh = infer.create_cache(kind, model.config, max_seq_len=30)
        fresh.restore(snapshot)
        expected = run_split(model, fresh, ids, [3, 1, 7])  # also writes into the restored cache
        run_split(model, source, ids, [10])  # more tokens: a ring wraps, a quantized residue flushes
        source.reset()
        run_split(model, source, other, [12, 1])  # refilled with other tokens over the same slots
        for name, t in snapshot.tensors.items():
            assert torch.equal(t, kept[name]), f"{kind}/{arch}: snapshot tensor {name!r} changed with its source"
        again = infer.create_cache(kind, model.config, max_seq_len=30)
        again.restore(snapshot)
        assert again.offset == 11
        assert torch.equal(run_split(model, again, ids, [3, 1, 7]), expected), f"{kind}/{arch}: restore changed"


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize(("max_seq_len", "batch_size"), [(0, 1), (8, 0)])
def test_empty_cache_size_is_a_clear_error(kind: str, max_seq_len: int, batch_size: int) -> None:
    config = model_of("llama").config
    culprit = "max_seq_len" if max_seq_len < 1 else "batch_size"
    with pytest.raises(ValueError, match=f"{culprit} must be >= 1, got 0"):
        infer.create_cache(kind, config, max_seq_len=max_seq_len, batch_size=batch_size)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_write_past_capacity_is_clear_and_keeps_state(kind: str) -> None:
    model = model_of("gemma3_text")
    ids = ids_for(model, 1, 12, seed=5)
    cache = infer.create_cache(kind, model.config, max_seq_len=10)
    with torch.no_grad():
        model(ids[:, :8], cache)
        before = model(ids[:, 8:9], cache, all_logits=True)
        with pytest.raises(infer.CacheFullError):
            model(ids[:, 9:12], cache)
        assert cache.offset == 9
        # The failed write changed nothing: the next token's logits match a run that never failed.
        fresh = infer.create_cache(kind, model.config, max_seq_len=10)
        model(ids[:, :8], fresh)
        assert torch.equal(model(ids[:, 8:9], fresh, all_logits=True), before)
        assert torch.equal(model(ids[:, 9:10], cache), model(ids[:, 9:10], fresh)), f"{kind} after failed write"
