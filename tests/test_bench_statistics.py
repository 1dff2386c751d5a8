"""The benches' statistics held to their definitions, computed independently: percentiles as numpy's linear
interpolation; a one-by-one run's times measured from the workload's start (every request arrives at once), so a
request's time to first token includes waiting for every earlier request, and its latency is when it finished."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from infer.bench_batched import BatchedRun, BatchRequest, run_one_by_one, summarize_batched
from infer.bench_common import format_table, percentile, speed_ratio
from infer.generation import GenerationResult


@given(values=st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=40), q=st.floats(0, 100))
def test_percentile_is_numpys_linear_interpolation(values: list[float], q: float) -> None:
    expected = float(np.percentile(np.array(values, dtype=np.float64), q))
    assert percentile(values, q) == pytest.approx(expected, rel=1e-12, abs=1e-9)


def test_percentile_of_nothing_is_nan_and_the_input_is_not_reordered() -> None:
    assert np.isnan(percentile([], 50))
    values = [3.0, 1.0, 2.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 3.0 and percentile(values, 50) == 2.0
    assert values == [3.0, 1.0, 2.0]


def test_one_by_one_times_count_from_the_workloads_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake generate taking known times (prefill P, then decode steps D each) on a fake clock (the bench's
    `time.perf_counter`; a real sleep overshoots on a loaded machine): request i's first token comes after every
    earlier request's whole run and its own prefill; it finishes after its own whole run."""
    prefill, step = 0.02, 0.01
    work = [BatchRequest([1, 2], n) for n in (3, 1, 2)]
    clock = [100.0]  # any start: the bench counts from the workload's own

    def fake_generate(model: Any, tokenizer: Any, prompt: Any, params: Any, cache: str = "contiguous"
                      ) -> GenerationResult:
        clock[0] += prefill
        decode = []
        for _ in range(params.max_new_tokens - 1):
            clock[0] += step
            decode.append(step)
        return GenerationResult(prompt_ids=list(prompt), token_ids=[0] * params.max_new_tokens, text="",
                                finish_reason="length", prefill_time_s=prefill, decode_times_s=decode)

    monkeypatch.setattr("infer.generation.generate", fake_generate)
    monkeypatch.setattr("infer.bench_batched.time", SimpleNamespace(perf_counter=lambda: clock[0]))
    run = run_one_by_one(None, work)  # type: ignore[arg-type]
    durations = [prefill + step * (r.max_new_tokens - 1) for r in work]
    finished = np.cumsum(durations)
    for i in range(len(work)):
        waited = finished[i] - durations[i]
        assert run.ttft_s[i] == pytest.approx(waited + prefill), f"request {i} ttft"
        assert run.latency_s[i] == pytest.approx(finished[i]), f"request {i} latency"
    assert run.new_tokens == sum(r.max_new_tokens for r in work)
    assert run.wall_s == pytest.approx(finished[-1]), "the wall time is the whole run's"
    row = summarize_batched(run)
    assert row["ttft_p50_ms"] == pytest.approx(1e3 * float(np.percentile(run.ttft_s, 50)))
    assert row["latency_p99_ms"] == pytest.approx(1e3 * float(np.percentile(run.latency_s, 99)))
    assert row["tok_s"] == pytest.approx(run.new_tokens / run.wall_s)


def test_report_table_is_right_aligned_under_a_rule() -> None:
    """The report's table, written out by hand: header, a dashed rule, rows; columns right-aligned to the widest
    cell and two spaces apart; floats to two decimals; a missing cell blank."""
    table = format_table([{"name": "engine", "tok/s": 312.456}, {"name": "hf", "tok/s": 98.0, "x": "1"}],
                         ["name", "tok/s", "x"])
    assert table == ("  name   tok/s  x\n"
                     "------  ------  -\n"
                     "engine  312.46   \n"
                     "    hf   98.00  1")


@pytest.mark.parametrize(("ratio", "text"), [(1.0, "1.00x faster"), (2.5, "2.50x faster"), (0.5, "2.00x slower"),
                                             (0.0, "no comparison (zero rate)")])
def test_speed_ratio_words_a_slowdown_as_one(ratio: float, text: str) -> None:
    assert speed_ratio(ratio) == text


def test_batched_summary_from_a_hand_built_run() -> None:
    """Throughput over the wall time, and each percentile of the per-request times, against numpy."""
    ttft, latency = [0.1, 0.4, 0.2, 0.9], [1.0, 2.0, 1.5, 3.0]
    row = summarize_batched(BatchedRun("x", 4.0, ttft, latency, 200))
    assert row["name"] == "x" and row["wall_s"] == 4.0 and row["tok_s"] == 50.0 and row["req_s"] == 1.0
    for key, values, q in [("ttft_p50_ms", ttft, 50), ("ttft_p99_ms", ttft, 99), ("latency_p50_ms", latency, 50),
                           ("latency_p99_ms", latency, 99)]:
        assert row[key] == pytest.approx(1e3 * float(np.percentile(values, q))), key
