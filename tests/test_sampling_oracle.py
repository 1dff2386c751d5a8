"""Sampling against the oracle: the engine's processed distribution equals HF's logits-processor chain.

The oracle is `reference.sampling`, which builds HF's own processors (repetition penalty, temperature,
top-k, top-p, min-p) in the order `generate` applies them. Random logits carry ties, `-inf` entries and
large and tiny magnitudes; every parameter combination is drawn, greedy included.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import infer
from infer.generation import generate
from infer.kernels.native import native_kernels, unavailable_reason
from infer.sampling import SamplingParams, draw, process_logits, sample_next, top_p_filtered, top_p_removed_by_sort
from reference import build_checkpoint
from reference.sampling import hf_next_token_distribution, hf_process_logits


def engine_distribution(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None) -> torch.Tensor:
    processed = process_logits(logits, params, seen)
    if params.is_greedy:
        return torch.nn.functional.one_hot(processed.argmax(-1), processed.shape[-1]).float()
    return processed.softmax(-1)


@contextlib.contextmanager
def stable_sorts() -> Iterator[None]:
    """torch.sort with equal elements in index order while HF's processors run. HF's top-p sorts without
    `stable=True`, and torch leaves the order of equal elements unspecified then (it differs between devices), so
    which of the tokens tied at top-p's boundary HF removes is not its answer; the engine takes the stable order."""
    real = torch.sort

    def stable(*args: Any, **kwargs: Any) -> Any:
        return real(*args, **{**kwargs, "stable": True})

    with mock.patch.object(torch, "sort", stable):
        yield


def assert_same_distribution(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None) -> None:
    with stable_sorts():
        theirs = hf_process_logits(logits, params, seen)
    hf_kept = torch.isfinite(theirs)
    for sort_free in (True, False):  # top-p from the sorted values (the default) and by a stable sort
        ours = process_logits(logits, params, seen, sort_free_top_p=sort_free)
        kept = torch.isfinite(ours)
        assert torch.equal(kept, hf_kept), (
            f"kept sets differ for {params} (sort_free_top_p={sort_free}): engine keeps {kept.sum(-1).tolist()}, "
            f"HF keeps {hf_kept.sum(-1).tolist()}, first difference at {torch.nonzero(kept != hf_kept)[0].tolist()}"
        )
    # HF as it runs (its own sort): the same sets, but which tokens of the boundary's value go
    as_is = hf_process_logits(logits, params, seen)
    as_is_kept = torch.isfinite(as_is)
    assert torch.equal(kept.sum(-1), as_is_kept.sum(-1)), f"kept counts differ from HF's for {params}"
    for row in range(logits.shape[0]):
        differ = kept[row] != as_is_kept[row]
        values = torch.cat([ours[row][differ & kept[row]], as_is[row][differ & as_is_kept[row]]])
        assert bool((values == values[:1]).all()), f"row {row}: tokens of other values kept than HF keeps, {params}"
    p = engine_distribution(logits, params, seen)
    with stable_sorts():
        q = hf_next_token_distribution(logits, params, seen)
    worst = (p - q).abs().max().item()
    assert worst <= 1e-6, f"probabilities differ by {worst:.2e} for {params}"


@st.composite
def logits_rows(draw: st.DrawFn) -> torch.Tensor:
    """`[B, V]` fp32 logits: V in 2..5000, a magnitude from 1e-6 to 1e4, maybe ties, maybe `-inf` entries."""
    vocab = draw(st.one_of(st.integers(2, 12), st.integers(2, 5000)))
    batch = draw(st.integers(1, 3))
    scale = draw(st.sampled_from([1e-6, 1e-2, 1.0, 5.0, 30.0, 1e4]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logits = torch.randn(batch, vocab, generator=gen) * scale
    if draw(st.booleans()):  # ties: only a few distinct values
        levels = draw(st.integers(1, 4))
        logits = (torch.randint(0, levels, (batch, vocab), generator=gen).float() - 1) * scale
    if draw(st.booleans()):  # some tokens already masked (e.g. by a grammar), never all of them
        masked = torch.rand(batch, vocab, generator=gen) < draw(st.sampled_from([0.1, 0.5, 0.9]))
        masked[:, 0] = False
        logits = logits.masked_fill(masked, float("-inf"))
    return logits


@st.composite
def sampling_params(draw: st.DrawFn, vocab: int) -> SamplingParams:
    return SamplingParams(
        temperature=draw(st.one_of(st.just(0.0), st.just(1.0), st.floats(0.05, 5.0))),
        top_k=draw(st.one_of(st.just(0), st.just(1), st.integers(1, vocab + 3))),
        top_p=draw(st.one_of(st.just(1.0), st.floats(0.01, 1.0))),
        min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0))),
        repetition_penalty=draw(st.one_of(st.just(1.0), st.floats(0.5, 3.0))),
    )


@given(data=st.data(), logits=logits_rows())
def test_processed_distribution_equals_hf(data: st.DataObject, logits: torch.Tensor) -> None:
    batch, vocab = logits.shape
    params = data.draw(sampling_params(vocab), label="params")
    history = data.draw(st.integers(0, 20), label="history length")
    seen = torch.randint(0, vocab, (batch, history), generator=torch.Generator().manual_seed(history))
    before = logits.clone()
    assert_same_distribution(logits, params, seen)
    assert torch.equal(logits, before), "the caller's logits were changed"


# The edges, pinned: each is compared with HF and with what the rule means.

LOGITS = torch.tensor([[3.0, -2.0, 1.0, 0.5, 2.9, -7.0, 0.0, 1.5]])


def test_top_k_1_is_greedy() -> None:
    params = SamplingParams(temperature=0.7, top_k=1)
    assert_same_distribution(LOGITS, params, None)
    probs = engine_distribution(LOGITS, params, None)
    assert probs[0, 0] == 1.0 and probs.sum() == 1.0
    gen = torch.Generator().manual_seed(0)
    draws = sample_next(LOGITS.expand(200, -1), params, None, gen)
    assert (draws == 0).all()


def test_top_k_1_generation_equals_greedy() -> None:
    model = infer.load_model(build_checkpoint("llama"))
    prompt = [3, 14, 15, 9, 26, 5]
    greedy = generate(model, None, prompt, SamplingParams(max_new_tokens=16, ignore_eos=True))
    top1 = generate(model, None, prompt, SamplingParams(max_new_tokens=16, temperature=1.3, top_k=1, seed=7,
                                                        ignore_eos=True))
    assert top1.token_ids == greedy.token_ids


@pytest.mark.parametrize("top_k", [8, 9, 1000])
def test_top_k_at_or_above_vocab_keeps_everything(top_k: int) -> None:
    params = SamplingParams(temperature=1.0, top_k=top_k)
    assert_same_distribution(LOGITS, params, None)
    assert torch.allclose(engine_distribution(LOGITS, params, None), LOGITS.softmax(-1), atol=1e-7)


def test_top_p_1_keeps_everything() -> None:
    params = SamplingParams(temperature=0.5, top_p=1.0)
    assert_same_distribution(LOGITS, params, None)
    assert torch.allclose(engine_distribution(LOGITS, params, None), (LOGITS / 0.5).softmax(-1), atol=1e-7)


def test_min_p_with_one_dominant_token_keeps_only_it() -> None:
    logits = torch.tensor([[12.0, 0.0, 0.1, -0.3, 0.2]])
    params = SamplingParams(temperature=1.0, min_p=0.05)
    assert_same_distribution(logits, params, None)
    assert torch.equal(torch.isfinite(process_logits(logits, params, None)), torch.tensor([[True] + [False] * 4]))


def test_repetition_penalty_lowers_seen_tokens_of_either_sign() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    seen = torch.tensor([[0, 1, 1]])  # repeated ids are penalised once, not twice
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, repetition_penalty=2.0)
        assert_same_distribution(logits, params, seen)
    processed = process_logits(logits, SamplingParams(repetition_penalty=2.0), seen)
    assert processed.tolist() == [[1.0, -4.0, 1.0, -1.0]]


def test_temperature_applies_before_top_p() -> None:
    """At T=0.25 the top token holds 87% of the mass (top-p 0.8 keeps one token); at T=1 only 42% (keeps more).
    Applying top-p before the temperature would keep the wrong set."""
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0]])
    params = SamplingParams(temperature=0.25, top_p=0.8)
    assert_same_distribution(logits, params, None)
    assert torch.isfinite(process_logits(logits, params, None)).sum().item() == 1
    assert torch.isfinite(process_logits(logits, SamplingParams(temperature=1.0, top_p=0.8), None)).sum() > 1


def test_temperature_applies_before_min_p() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0.3, min_p=0.1)  # at T=0.3 token 1 holds 3.6% of token 0's mass
    assert_same_distribution(logits, params, None)
    assert torch.isfinite(process_logits(logits, params, None)).tolist() == [[True, False, False]]


def chi_square_critical(df: int, z: float = 3.719) -> float:
    """Upper critical value of chi-square at p = 1e-4 (z = 3.719), by the Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
        SamplingParams(temperature=1.4, min_p=0.05, repetition_penalty=1.3),
    ],
    ids=["plain", "top-k-top-p", "min-p-penalty"],
)
def test_sampler_draws_from_the_oracle_distribution(params: SamplingParams) -> None:
    """10^4 seeded draws; chi-square against HF's distribution below the p = 1e-4 critical value (a correct
    sampler fails one seed in 10^4; a wrong distribution at these sizes gives statistics in the hundreds)."""
    logits = torch.tensor([[2.0, 1.6, 1.5, 1.0, 0.6, 0.3, 0.0, -0.4, -1.0, -2.0, -3.0, -8.0]])
    seen = torch.tensor([[1, 4, 7]])
    expected = hf_next_token_distribution(logits, params, seen)[0]
    n = 10_000
    draws = sample_next(logits.expand(n, -1), params, seen.expand(n, -1), torch.Generator().manual_seed(1234))
    counts = torch.bincount(draws, minlength=logits.shape[-1]).double()
    kept = expected > 0
    assert counts[~kept].sum() == 0, f"drew tokens HF never would: {torch.nonzero(counts * ~kept).flatten()}"
    want = expected[kept].double() * n
    stat = float(((counts[kept] - want) ** 2 / want).sum())
    df = int(kept.sum()) - 1
    assert df >= 1
    assert stat < chi_square_critical(df), f"chi-square {stat:.1f} >= {chi_square_critical(df):.1f} (df {df})"


def test_top_p_boundary_token_is_removed_as_hf_does() -> None:
    """A token whose ascending cumulative mass equals 1 - top_p exactly is removed (HF's `<=`): top_p is
    chosen from the fp32 cumulative sums themselves so the tie is exact, which random draws almost never hit."""
    logits = torch.tensor([[0.3, -1.2, 2.0, 0.9, -0.4, 1.1]])
    ascending = torch.sort(logits, descending=False).values.softmax(-1).cumsum(-1)
    for j in range(logits.shape[-1] - 1):
        c = ascending[0, j]
        top_p = 1.0 - float(c)
        if torch.tensor(1 - top_p, dtype=torch.float32) != c:
            continue  # this cumulative sum cannot be hit exactly through a Python float
        params = SamplingParams(temperature=1.0, top_p=top_p)
        assert_same_distribution(logits, params, None)
        assert torch.isfinite(process_logits(logits, params, None)).sum().item() == logits.shape[-1] - (j + 1)
        break
    else:
        pytest.fail("no exact boundary found for these logits")


def test_sampling_params_cannot_be_changed_after_validation() -> None:
    """SamplingParams is checked once, when made; one shared by many requests (the engine's per-prompt list, a
    caller's constant) must not be changed under them: assignment raises, and `dataclasses.replace` makes a new,
    re-checked one."""
    import dataclasses

    params = SamplingParams(max_new_tokens=4, temperature=0.7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = -1.0  # type: ignore[misc]
    assert params.temperature == 0.7
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(params, temperature=-1.0)


needs_build = pytest.mark.skipif(native_kernels() is None, reason=f"no native build here: {unavailable_reason()}")


@needs_build
@given(data=st.data(), logits=logits_rows())
def test_top_p_from_sorted_values_equals_the_sorting_form(data: st.DataObject, logits: torch.Tensor) -> None:
    """The sort-free form (numpy's sorted values, the native pass) leaves HF's sorted form's tokens, bf16-rounded
    logits too (a real bf16 model's: ties at the boundary in most rows), -0.0 beside 0.0 and NaN included; rows
    read in place from wider ones; the caller's logits untouched."""
    if data.draw(st.booleans(), label="bf16 logits"):
        logits = logits.to(torch.bfloat16).float()
    if data.draw(st.booleans(), label="signed zeros"):
        logits = torch.where(torch.arange(logits.shape[-1]) % 2 == 0, logits * 0.0, logits)  # 0.0 and -0.0 mixed
    if data.draw(st.booleans(), label="NaN"):
        logits[-1, data.draw(st.integers(0, logits.shape[-1] - 1), label="NaN at")] = float("nan")
    if data.draw(st.booleans(), label="a view of wider rows"):
        logits = torch.cat([logits, torch.zeros(logits.shape[0], 3)], -1)[:, :-3]
    top_p = data.draw(st.floats(0.001, 0.999), label="top_p")
    before = logits.clone()
    got = top_p_filtered(logits, top_p)
    want = logits.masked_fill(top_p_removed_by_sort(logits, top_p), float("-inf"))
    assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(logits.nan_to_num(), before.nan_to_num()), "the caller's logits were changed"


@needs_build
def test_top_p_ties_at_the_boundary_go_in_index_order_without_a_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sort-free form never sorts indices: where the removed run ends among equal logits, the lowest-indexed of
    them go (a stable sort's order); below them everything goes, above nothing. Rows past sixteen tokens too (the
    native pass takes sixteen at a time), the tied run crossing a block's edge."""
    import infer.sampling as sampling

    def no_sort(*args: object, **kwargs: object) -> None:
        raise AssertionError("the sort-free top-p sorted")

    monkeypatch.setattr(sampling, "top_p_removed_by_sort", no_sort)
    monkeypatch.setattr(torch, "sort", no_sort)

    def removed(logits: torch.Tensor, top_p: float) -> list[list[bool]]:
        return torch.isneginf(sampling.top_p_filtered(logits, top_p)).tolist()

    equal = torch.zeros(1, 8)  # eighths: cumulative sums 1/8 .. 1 exactly, 1/2 at the fourth
    assert removed(equal, 0.5) == [[True] * 4 + [False] * 4]
    # 2.0 at 1 and 6, 1.0 at 0, 4, 7, -1.0 at 2, 3, 5: the -1s go, then the 1s by index until the mass is reached
    mixed = torch.tensor([[1.0, 2.0, -1.0, -1.0, 1.0, -1.0, 2.0, 1.0]])
    probs = mixed.softmax(-1)[0]
    top_p = 1 - float(probs[2] * 3 + probs[0] * 1.5)  # the boundary inside the 1s: one of them goes
    assert removed(mixed, top_p) == [[True, False, True, True, False, True, False, False]]
    # 64 equal tokens: sums k/64 exactly; 1 - 21/64 = 43/64 removes the first 43, across two blocks of sixteen
    assert removed(torch.zeros(1, 64), 21 / 64) == [[True] * 43 + [False] * 21]
    # ten 1s among 0s in a row of 40 (1.0 at 3, 7, ..., 39): the 0s go, then the 1s from the lowest index
    spread = torch.zeros(1, 40)
    spread[0, 3::4] = 1.0
    p = spread.softmax(-1)[0]
    top_p = 1 - float(p[0] * 30 + p[3] * 6.5)  # six of the ten 1s go (the last crossing into the second block)
    assert removed(spread, top_p) == [[i % 4 != 3 or i <= 23 for i in range(40)]]  # the 1s at 3 .. 23 go
    with pytest.raises(ValueError, match="top_p_rows takes fp32 rows"):
        native_kernels().top_p_rows(torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(2, 4), torch.zeros(2, 4), 0.5)


@pytest.mark.parametrize("vocab", [80, 151936])
def test_top_p_after_top_k_equals_hf(vocab: int) -> None:
    """Top-k leaves most tokens at -inf, whose probabilities (exactly 0) lead the sorted order; the native pass skips
    their run sixteen at a time, never past a token with probability: 24 kept by top-k of 80 (the run ends mid
    block) and Qwen3's top-k 20 of 152k, under top-p from 0.5 to 0.999, as HF's processors keep them."""
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(vocab)) * 2
    for top_p in (0.5, 0.9, 0.99, 0.999):
        assert_same_distribution(logits, SamplingParams(temperature=1.0, top_k=24 if vocab == 80 else 20,
                                                        top_p=top_p), None)


def test_top_p_by_sort_removes_tied_tokens_in_index_order() -> None:
    """The sorting form (the check, and the path off the CPU) sorts stably: of 4096 equal logits at top-p 0.5, the
    first 2048 go (torch's unstable sort leaves equal elements in another order, even at 40)."""
    removed = top_p_removed_by_sort(torch.zeros(2, 4096), 0.5)
    assert bool(removed[:, :2048].all()) and not bool(removed[:, 2048:].any())


@needs_build
def test_top_p_sums_round_as_torchs_cumsum() -> None:
    """HF's cumulative sums are torch's CPU cumsum of fp32: a double accumulator, each sum rounded to float. A
    boundary placed exactly on such a sum, where a float accumulator's sum already lies past it: the sort-free
    form removes what HF removes."""
    logits = torch.randn(1, 30000, generator=torch.Generator().manual_seed(0)) * 0.1
    probs = logits.sort(-1).values.softmax(-1)[0].numpy()
    exact = np.cumsum(probs.astype(np.float64)).astype(np.float32)
    single = np.cumsum(probs)  # sequential float32 sums
    past = np.nonzero((single > exact) & (exact > 0.05) & (exact < 0.95))[0]
    assert len(past), "no float sum above the double one here"
    i = int(past[len(past) // 2])
    top_p = 1 - float(exact[i])  # 1 - top_p is exact[i] exactly: positions 0 .. i go, the float sums stop earlier
    want = logits.masked_fill(top_p_removed_by_sort(logits, top_p), float("-inf"))
    assert int(torch.isneginf(want).sum()) == i + 1
    assert torch.equal(top_p_filtered(logits, top_p), want)


@pytest.mark.parametrize("native", [True, False], ids=["native", "cumulative sum"])
def test_draw_takes_the_inverse_cdf_and_never_a_removed_token(native: bool) -> None:
    """u = 0 draws the first token with probability, u just below 1 the last; every u between lands on a kept token,
    token i for the u in its share of the cumulative sum. Both forms (the native one's blocks of 64 too)."""
    processed = torch.tensor([[float("-inf"), 0.0, float("-inf"), 0.0, 0.0, float("-inf")]])  # thirds at 1, 3, 4
    ends = [0.0, 1 / 3, 2 / 3, 1.0]
    for u, want in [(0.0, 1), (1 / 3 - 1e-9, 1), (1 / 3 + 1e-9, 3), (0.5, 3), (2 / 3 + 1e-9, 4),
                    (1 - 2**-53, 4)]:
        assert int(draw(processed, torch.tensor([u], dtype=torch.float64), native=native)[0]) == want, (u, want, ends)
    grid = torch.linspace(0, 1 - 2**-53, 1001, dtype=torch.float64)
    tokens = draw(processed.expand(grid.shape[0], -1), grid, native=native)
    assert set(tokens.tolist()) == {1, 3, 4}
    counts = torch.bincount(tokens, minlength=6)
    assert all(abs(int(counts[t]) - 1001 / 3) <= 1 for t in (1, 3, 4))
    wide = torch.full((2, 200), float("-inf"))
    wide[:, [5, 70, 199]] = 0.0  # thirds in the first, second and last (partial) blocks of 64
    for u, want in [(0.0, 5), (1 / 3 + 1e-9, 70), (2 / 3 + 1e-9, 199), (1 - 2**-53, 199)]:
        assert draw(wide, torch.tensor([u, u], dtype=torch.float64), native=native).tolist() == [want, want]


@pytest.mark.parametrize("native", [True, False], ids=["native", "cumulative sum"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_draw_refuses_logits_it_cannot_sample(bad: float, native: bool) -> None:
    processed = torch.tensor([[0.0, bad, 1.0]])
    with pytest.raises(ValueError, match="NaN or inf"):
        draw(processed, torch.tensor([0.5], dtype=torch.float64), native=native)


@pytest.mark.parametrize("native", [True, False], ids=["native", "cumulative sum"])
@pytest.mark.parametrize("at", [(0, 1), (10, 20)], ids=["alone", "in a block of 64"])
def test_draw_reaches_a_token_below_fp32_resolution(at: tuple[int, int], native: bool) -> None:
    """A token of probability ~1e-12 after one of ~1 keeps its share of [0, 1) (fp32 sums would round it away:
    1 - 1e-12 is 1.0 in fp32, so no u could reach it), alone or in one of the native form's blocks."""
    processed = torch.full((1, 2 if at == (0, 1) else 200), float("-inf"))
    processed[0, at[0]], processed[0, at[1]] = 0.0, -27.6
    p = processed.double().softmax(-1)[0, list(at)]
    assert 1e-13 < p[1] < 1e-11
    u = torch.tensor([float(p[0]) + float(p[1]) / 2, float(p[0]) / 2], dtype=torch.float64)
    assert draw(processed.expand(2, -1), u, native=native).tolist() == [at[1], at[0]]


def test_top_p_takes_logits_that_require_grad() -> None:
    """A caller's logits straight from a model under autograd: processed as HF processes them, no numpy error."""
    logits = (torch.randn(2, 50, generator=torch.Generator().manual_seed(3)) * 2).requires_grad_()
    assert_same_distribution(logits.detach(), SamplingParams(temperature=1.0, top_p=0.5), None)
    assert torch.equal(torch.isfinite(process_logits(logits, SamplingParams(temperature=1.0, top_p=0.5), None)),
                       torch.isfinite(process_logits(logits.detach(), SamplingParams(temperature=1.0, top_p=0.5),
                                                     None)))
