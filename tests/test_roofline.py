"""The batched bench's roofline (infer/roofline.py) from the outside: a step's FLOPs against the model's own
modules and the attention mask's visible keys, its bytes against the stored tensors, the engine's step trace
against what the engine computed, the nearest-rows matmul rate, and the profiling hooks leaving nothing behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from infer.attention import attention_mask
from infer.backends import PagedBackend
from infer.engine import Engine
from infer.models.transformer import Linear
from infer.roofline import (
    ChunkShape,
    ForwardProfile,
    Limits,
    ModelShape,
    StepPoint,
    StepRecord,
    plot_roofline,
    profile_forward,
    profile_table,
    slow_steps,
    steal_seconds,
    step_cost,
    summarize_phases,
)
from infer.sampling import SamplingParams
from tests.helpers import random_model, tiny_config

try:
    import resource
except ImportError:  # (not on Windows)
    resource = None  # type: ignore[assignment]

GEMMA = random_model(tiny_config("gemma3_text", num_layers=4, sliding_window=5), seed=1)


def visible_keys(start: int, num_tokens: int, window: int | None) -> int:
    """Keys the chunk's queries see, counted on the model's own mask."""
    q = torch.arange(start, start + num_tokens)
    k = torch.arange(start + num_tokens)
    return int(attention_mask(q, k, window).sum())


chunks = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12), st.booleans(), st.booleans()), min_size=1,
                  max_size=5)


@given(chunks)
def test_step_flops_and_bytes_count_what_the_model_computes_and_reads(drawn: list[tuple[int, int, bool, bool]]
                                                                      ) -> None:
    model, config = GEMMA, GEMMA.config
    shape = ModelShape.of(model, kv_elem_bytes=2)
    step = [ChunkShape(start, n, decode, sample) for start, n, decode, sample in drawn]
    cost = step_cost(shape, step)
    tokens = sum(c.num_tokens for c in step)
    sampled = sum(c.sample for c in step)
    layer_macs = sum(m.in_features * m.out_features for name, m in model.named_modules()
                     if isinstance(m, Linear) and name.startswith("layers."))
    flops = 2 * tokens * layer_macs + 2 * sampled * model.lm_head.in_features * model.lm_head.out_features
    kv_bytes = 0
    for layer in model.layers:
        window = layer.self_attn.window
        for c in step:
            flops += 4 * config.num_attention_heads * config.head_dim * visible_keys(c.start, c.num_tokens, window)
            read = visible_keys(c.start + c.num_tokens - 1, 1, window) if window else c.start + c.num_tokens
            kv_bytes += 2 * config.num_key_value_heads * config.head_dim * 2 * (read + c.num_tokens)
    assert cost.flops == flops
    state = model.state_dict()
    weights = sum(t.nbytes for n, t in state.items() if n.startswith("layers."))
    head = state["embed_tokens.weight"].nbytes if sampled else 0  # Gemma's head is the tied embedding
    assert cost.bytes == weights + head + kv_bytes


def test_limits_take_the_rate_at_the_nearest_row_count_and_phases_sum_to_the_run() -> None:
    limits = Limits({1: 10.0, 16: 160.0, 512: 1000.0}, bandwidth=1e9)
    assert limits.peak_flops == 1000.0
    assert [limits.flops_at(r) for r in (1, 3, 5, 16, 60, 100, 600)] == [10.0, 10.0, 160.0, 160.0, 160.0, 1000.0,
                                                                          1000.0]
    shape = ModelShape.of(GEMMA, 4)
    records = [StepRecord([ChunkShape(0, 8, False, True)], forward_s=0.5),
               StepRecord([ChunkShape(8, 1, True, True), ChunkShape(0, 4, False, False)], forward_s=0.25),
               StepRecord([ChunkShape(9, 1, True, True)], schedule_s=0.1, forward_s=0.1)]
    assert [r.phase for r in records] == ["prefill", "mixed", "decode"]
    rows = {row.phase: row for row in summarize_phases(records, shape, limits)}
    assert rows["all"].steps == 3 and abs(rows["all"].seconds - 0.95) < 1e-12
    assert rows["all"].flops == sum(rows[p].flops for p in ("prefill", "mixed", "decode"))
    # the decode step: one token, so its compute limit is the 1-row rate, not the peak
    cost = step_cost(shape, records[2].chunks)
    assert rows["decode"].shape_bound_s == max(cost.flops / 10.0, cost.bytes / 1e9)
    assert rows["decode"].roofline_s == max(cost.flops / 1000.0, cost.bytes / 1e9)
    # the median step's own fraction: each step's bound over its own time, the middle one of the three
    bounds = [max(step_cost(shape, r.chunks).flops / 1000.0, step_cost(shape, r.chunks).bytes / 1e9) for r in records]
    own = sorted(b / r.total_s for b, r in zip(bounds, records, strict=True))
    assert rows["all"].fraction_p50 == pytest.approx(own[1]) and rows["decode"].fraction_p50 == pytest.approx(
        bounds[2] / 0.2)
    slow = [*records, *(StepRecord([ChunkShape(9, 1, True, True)], schedule_s=0.1, forward_s=0.1) for _ in range(2)),
            StepRecord([ChunkShape(9, 1, True, True)], forward_s=50.0)]  # one step a one-off cost slowed
    decode = {row.phase: row for row in summarize_phases(slow, shape, limits)}["decode"]
    assert decode.fraction_p50 == pytest.approx(bounds[2] / 0.2), "the typical step's fraction"
    assert decode.fraction < 0.05 * decode.fraction_p50, "the mean-based fraction takes the slow step, the median not"


def test_the_engine_trace_records_every_step_it_computed() -> None:
    model = random_model(tiny_config("llama", num_layers=2), seed=2)
    engine = Engine(model, None, num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                    enable_prefix_caching=False)
    engine.trace = []
    # 9 tokens in a budget of 8: the prompt's last token is a one-token chunk that is not a decode
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [11, 12, 13], [14, 15, 16, 17, 18]]
    new = [4, 6, 3]
    results = engine.generate(prompts, [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
                                        for n in new])
    trace = engine.trace
    assert len(trace) == engine.stats.steps
    # every prompt token and every generated token but the last is fed once (no preemption, no prefix hits)
    assert sum(c.num_tokens for r in trace for c in r.chunks) == sum(map(len, prompts)) + sum(new) - len(new)
    assert sum(c.sample for r in trace for c in r.chunks) == sum(len(r.token_ids) for r in results)
    assert sum(c.decode for r in trace for c in r.chunks) == sum(new) - len(new)
    assert trace[0].phase == "prefill" and trace[-1].phase == "decode"
    assert all(c.num_tokens == 1 for r in trace for c in r.chunks if c.decode)
    assert all(r.total_s > 0 and min(r.schedule_s, r.build_s, r.forward_s, r.sample_s) >= 0 for r in trace)


@pytest.mark.skipif(resource is None or not Path("/proc/stat").exists(),
                    reason="page faults and steal as Linux counts them (getrusage, /proc/stat)")
def test_a_traced_step_records_the_page_faults_and_steal_taken_in_it() -> None:
    """A fresh engine's pool (a lazy map: 32 MiB a layer's K here) takes its first writes, the first step's K/V rows,
    as page faults in that step; each step's faults are its own (together no more than the process took over the
    run, which also holds the requests' own allocations); steal is measured and never negative."""
    model = random_model(tiny_config("llama", num_layers=2), seed=2)
    engine = Engine(model, None, num_blocks=16384, block_size=16, enable_prefix_caching=False)
    engine.trace = []
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    engine.generate([[1, 2, 3, 4, 5], [6, 7, 8]], SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    taken = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    trace = engine.trace
    assert trace[0].faults > 0, "the pool's first writes fault in its pages"
    assert 0 <= sum(r.faults for r in trace) <= taken, "each step's own faults, not a running count"
    assert all(r.steal_s is not None and r.steal_s >= 0 for r in trace)


def test_steal_is_the_cpu_lines_eighth_count_in_clock_ticks() -> None:
    """/proc/stat's first line: `cpu user nice system idle iowait irq softirq steal guest guest_nice` in ticks."""
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    assert steal_seconds(b"cpu  10 20 30 40 50 60 70 250 90 100\ncpu0 1 2 3 4 5 6 7 8 9 10\n") == pytest.approx(
        250 / hz)
    assert steal_seconds(b"cpu  10 20 30 40 50 60 70\n") is None, "no steal column (kernels before 2.6.11)"
    assert steal_seconds(b"intr 1 2 3 4 5 6 7 8 9\n") is None, "not the CPUs' line"


def test_profiling_splits_the_forward_and_leaves_nothing_behind() -> None:
    model = random_model(tiny_config("qwen3", num_layers=2), seed=3)
    attend, forward = PagedBackend.attend, type(model).forward
    engine = Engine(model, None, num_blocks=64, block_size=4, max_num_batched_tokens=8)
    engine.trace = []
    profile = ForwardProfile()
    with profile_forward(model, profile):
        engine.generate([[1, 2, 3, 4, 5], [6, 7]], SamplingParams(max_new_tokens=3, temperature=0.0))
    assert profile.projections_s > 0 and profile.attention_s > 0
    assert profile.projections_s + profile.attention_s <= profile.forward_s
    parts = profile_table(engine.trace, profile)
    assert abs(sum(float(p["share"]) for p in parts) - 1.0) < 1e-9
    assert PagedBackend.attend is attend and type(model).forward is forward
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_the_limits_take_the_faster_of_the_weights_and_the_compute_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 model whose products upcast to float32 (a CPU without bf16 units, where a bf16 matmul is emulated 10-100x
    slower) is held to the faster of the two dtypes' matmul rates at every row count; a model that does not upcast,
    to its own dtype's."""
    import infer.roofline as roofline
    from reference import build_checkpoint

    rates = {torch.bfloat16: {1: 5.0, 512: 1.0}, torch.float32: {1: 2.0, 512: 90.0}}
    monkeypatch.setattr(roofline, "matmul_rate", lambda dtype, device, m, k, n: rates[dtype].get(m, 3.0) * m)
    limits = roofline.measure_limits((torch.bfloat16, torch.float32), torch.device("cpu"), 8, 8, 24, 1e9)
    assert limits.flops_by_rows[1] == 5.0 and limits.flops_by_rows[512] == 90.0 * 512
    assert limits.flops_by_rows[24] == 3.0 * 24 and limits.peak_flops == 90.0 * 512
    import infer

    model = infer.load_model(build_checkpoint("llama"), dtype="bfloat16")
    model.compute_dtype = torch.float32
    assert roofline.limit_dtypes(model) == (torch.bfloat16, torch.float32)
    model.compute_dtype = None
    assert roofline.limit_dtypes(model) == (torch.bfloat16,)
    model.compute_dtype = torch.bfloat16  # (an upcast to its own dtype is no second dtype)
    assert roofline.limit_dtypes(model) == (torch.bfloat16,)


def test_the_limits_take_the_native_product_where_it_beats_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the native packed product runs a shape faster than the library's matmul (oneDNN's fp32 GEMM on a Zen 3
    EPYC), the limit is its rate: a limit the engine's own products beat would put the engine above 1.0 of it. The
    product timed is the weights' dtype's (an fp32 model's fp32 packed product, a bf16 model's bf16 one)."""
    import infer.roofline as roofline

    asked: list[torch.dtype] = []

    def native_rate(kernels: object, m: int, k: int, n: int, dtype: torch.dtype = torch.bfloat16) -> float:
        asked.append(dtype)
        return 50.0 * m if m >= 16 else 1.0

    monkeypatch.setattr(roofline, "matmul_rate", lambda dtype, device, m, k, n: 10.0 * m)
    monkeypatch.setattr(roofline, "native_product_rate", native_rate)
    native = object()
    limits = roofline.measure_limits((torch.float32,), torch.device("cpu"), 8, 8, 24, 1e9, native)  # type: ignore[arg-type]
    assert set(asked) == {torch.float32}, "an fp32 model's limit timed another dtype's packed product"
    asked.clear()
    roofline.measure_limits((torch.bfloat16, torch.float32), torch.device("cpu"), 8, 8, 24, 1e9, native)  # type: ignore[arg-type]
    assert set(asked) == {torch.bfloat16}, "a bf16 model's limit timed another dtype's packed product"
    assert limits.flops_by_rows[1] == 10.0 and limits.flops_by_rows[4] == 40.0
    assert limits.flops_by_rows[16] == 50.0 * 16 and limits.peak_flops == 50.0 * 512
    without = roofline.measure_limits((torch.float32,), torch.device("cpu"), 8, 8, 24, 1e9)
    assert without.peak_flops == 10.0 * 512
    assert roofline.native_product_kernels(torch.device("meta")) is None


@pytest.mark.parametrize(("dtype", "name"), [(torch.bfloat16, "gemm_bf16_packed"), (torch.float32, "gemm_f32_packed")])
def test_the_native_product_rate_times_the_product_it_names(dtype: torch.dtype, name: str) -> None:
    """The rate is the packed product's FLOPs over its time, the product of the dtype asked (the calls counted: not a
    constant, nor the library's matmul or another dtype's product timed under its name)."""
    import infer.roofline as roofline

    kernels = roofline.native_product_kernels(torch.device("cpu"), dtype)
    if kernels is None:
        pytest.skip(f"this build has no native packed {dtype} product")
    calls: list[int] = []
    product = getattr(type(kernels), name)

    def counted(self: object, packed: torch.Tensor, x: torch.Tensor, n: int, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
        calls.append(x.shape[0])
        return product(self, packed, x, n, bias)  # type: ignore[no-any-return]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(kernels), name, counted)
        rate = roofline.native_product_rate(kernels, 64, 256, 512, repeats=3, dtype=dtype)
    assert calls == [64] * 4 and rate > 0.0


def test_several_timings_of_the_limits_give_their_median_and_their_best_at_every_row_count() -> None:
    """`typical_limits`: each row count's rate and the bandwidth the median of the timings (one slow or fast moment of
    a shared host does not set the bar); `best_limits`: the highest of them."""
    from infer.roofline import Limits, best_limits, typical_limits

    timings = [Limits({1: 5.0, 16: 80.0, 512: 100.0}, 10e9), Limits({1: 7.0, 16: 60.0, 512: 140.0}, 8e9),
               Limits({1: 6.0, 16: 90.0, 512: 90.0}, 12e9)]
    typical = typical_limits(timings)
    assert typical.flops_by_rows == {1: 6.0, 16: 80.0, 512: 100.0} and typical.bandwidth == 10e9
    assert typical.peak_flops == 100.0
    best = best_limits(timings)
    assert best.flops_by_rows == {1: 7.0, 16: 90.0, 512: 140.0} and best.bandwidth == 12e9
    two = typical_limits(timings[:2])  # (an even count: the mean of the middle two)
    assert two.flops_by_rows == {1: 6.0, 16: 70.0, 512: 120.0} and two.bandwidth == 9e9
    assert typical_limits(timings[:1]) == timings[0]


def test_an_emulated_dtype_is_timed_no_further_once_it_runs_10x_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dtype 10x behind the fastest contender from 16 rows on (bf16 on a CPU without bf16 units: ~1 GFLOP/s, most
    of the limits' time at 256 and 512 rows) is not timed at the larger row counts; one that keeps up, or lags
    only below 16 rows, is timed at every row count."""
    import infer.roofline as roofline

    timed: list[tuple[torch.dtype, int]] = []
    rates = {torch.bfloat16: 0.05, torch.float32: 1.0, torch.float16: 0.5}  # from 16 rows on
    few_rows = {torch.bfloat16: 0.01, torch.float32: 0.01, torch.float16: 0.0005}  # float16 20x behind here

    def rate(dtype: torch.dtype, device: torch.device, m: int, k: int, n: int) -> float:
        timed.append((dtype, m))
        return (few_rows if m < 16 else rates)[dtype] * m

    monkeypatch.setattr(roofline, "matmul_rate", rate)
    limits = roofline.measure_limits((torch.bfloat16, torch.float32, torch.float16), torch.device("cpu"), 8, 8, 24,
                                     1e9)
    assert [m for d, m in timed if d == torch.bfloat16] == [1, 4, 16]
    assert [m for d, m in timed if d == torch.float16] == [1, 4, 16, 24, 64, 256, 512]
    assert limits.flops_by_rows[512] == 512.0 and limits.flops_by_rows[4] == 0.04


def test_without_matplotlib_the_plots_say_so_and_write_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """matplotlib is the bench extra's: without it both plots return False (the CLI prints how to install it) and
    leave no file behind."""
    import infer.bench
    import infer.bench_common

    monkeypatch.setattr(infer.bench_common, "pyplot", lambda: None)
    monkeypatch.setattr(infer.bench, "pyplot", lambda: None)
    point = StepPoint("decode", 1, 0.01, 1e9, 1e8, 0.005, 0.005)
    assert not plot_roofline({"engine": [point]}, Limits({1: 1e11}, 1e10), tmp_path / "roofline.png")
    assert not infer.bench.plot_steps([], 1, tmp_path / "steps.png")
    assert not list(tmp_path.iterdir())


def test_slow_steps_are_those_over_twice_their_phases_median_and_their_time_past_it() -> None:
    decode = [StepRecord([ChunkShape(9, 1, True, True)], forward_s=t) for t in (0.1, 0.1, 0.1, 0.5, 0.21)]
    prefill = [StepRecord([ChunkShape(0, 8, False, True)], forward_s=t) for t in (1.0, 0.3)]
    slow = slow_steps([prefill[0], *decode, prefill[1]])
    # decode's median 0.1: 0.5 is over 2x (0.4 past it), 0.21 too (0.11); prefill's median 0.65: 1.0 is not
    assert slow.count == 2 and slow.excess_s == pytest.approx(0.51)
    assert slow.share == pytest.approx(0.51 / 2.31)
    assert slow_steps(decode[:3]).count == 0 and slow_steps(decode[:3]).excess_s == 0


def test_slow_steps_count_the_page_faults_and_steal_in_them_and_in_the_run() -> None:
    drawn = [(0.1, 1, 0.0), (0.1, 0, 0.01), (0.1, 2, 0.0), (0.5, 24, 0.0), (0.3, 1, 0.2), (0.1, 0, 0.0)]
    decode = [StepRecord([ChunkShape(9, 1, True, True)], forward_s=t, faults=f, steal_s=s) for t, f, s in drawn]
    slow = slow_steps(decode)  # the median 0.1: the steps of 0.5 (24 faults) and 0.3 (0.2 s stolen) are slow
    # the run's usual: a median step's 1 fault; past 2 x 1 + 2 only the 24 (a pool's fresh huge pages, one a tensor)
    assert (slow.count, slow.faults, slow.faulting) == (2, 25, 1)
    assert slow.steal_s == pytest.approx(0.2)
    assert slow.run_faults == 28 and slow.run_steal_s == pytest.approx(0.21)
    unmeasured = [*decode[:4], StepRecord([ChunkShape(9, 1, True, True)], forward_s=0.1)]  # (steal None: not read)
    assert slow_steps(unmeasured).steal_s == 0.0 and slow_steps(unmeasured).run_steal_s is None
