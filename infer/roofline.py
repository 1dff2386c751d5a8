"""The batched engine against the machine's limits: what each step costs (FLOPs, bytes), the time the roofline
allows for it, and where a step's time goes.

A step's roofline time is `max(flops / peak FLOP/s, bytes / read bandwidth)`, both limits measured on the machine
in the same run (`measure_limits`: matmul rates at the workload's projection shape, the library's or the native
packed product's, whichever is faster; the read bandwidth as the single-request bench measures it). Its FLOPs are
the projections' (2 x rows x weights, the LM head only for the rows that sample) and attention's (QK^T and PV over
the keys each query sees); its bytes are every weight read once, each sequence's K/V read once per layer and the
new K/V written. `engine_trace` records each step of an engine run (phase, chunks, time split into scheduling, batch
building, forward, sampling) and what the host took over it (`host_counters`: page faults, steal);
`profile_forward` splits the forward into projections, attention and the rest by timing hooks, in a run of its own.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from infer.config import ModelConfig
from infer.memory import synchronize

try:
    import resource
except ImportError:  # (not on Windows: no page-fault counts there)
    resource = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from infer.kernels.native import NativeKernels

PHASES = ("prefill", "mixed", "decode")


@dataclass(frozen=True)
class ChunkShape:
    """One chunk of a step: `num_tokens` new tokens at positions `start ..`; `decode`: one token of a request
    past its prompt; `sample`: it yields a token (its LM head row is computed)."""

    start: int
    num_tokens: int
    decode: bool
    sample: bool


@dataclass
class StepRecord:
    """One engine step: its chunks and where its wall time went (seconds)."""

    chunks: list[ChunkShape]
    schedule_s: float = 0.0  # the scheduler's plan and the storage following it
    build_s: float = 0.0  # block tables and the ragged batch's tensors
    forward_s: float = 0.0  # the model's forward (and CoW copies)
    sample_s: float = 0.0  # sampling and stop checks
    faults: int = 0  # this process's page faults during the step (`host_counters`)
    steal_s: float | None = None  # the host's steal from this machine's CPUs during the step; None: not measured

    @property
    def phase(self) -> str:
        """"prefill" (no decode chunk), "decode" (only decode chunks) or "mixed"."""
        decodes = sum(c.decode for c in self.chunks)
        return "decode" if decodes == len(self.chunks) else "prefill" if decodes == 0 else "mixed"

    @property
    def total_s(self) -> float:
        """The step's wall time."""
        return self.schedule_s + self.build_s + self.forward_s + self.sample_s


@dataclass(frozen=True)
class HostCounters:
    """What the host has taken so far, outside the engine's own work: this process's page faults (minor ones: each
    first touch of fresh memory, a 2 MiB huge page's zeroing among them) and the time the hypervisor ran something
    else on this machine's CPUs (`steal`, all CPUs summed, seconds; None where the kernel does not report it)."""

    faults: int
    steal_s: float | None

    def since(self, before: HostCounters) -> tuple[int, float | None]:
        """The faults and steal taken between `before` and these counters (steal None where either went
        unmeasured; rounded to the microsecond, as the ticks' difference is)."""
        steal = None if self.steal_s is None or before.steal_s is None else round(self.steal_s - before.steal_s, 6)
        return self.faults - before.faults, steal


def host_counters() -> HostCounters:
    """The host's counters now (`HostCounters`): a step's record holds their change over the step. About 10 us (the
    steal is read from /proc/stat on a descriptor kept open)."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0
    fd = _proc_stat()
    return HostCounters(faults, None if fd is None else steal_seconds(os.pread(fd, 256, 0)))


def steal_seconds(stat: bytes) -> float | None:
    """The steal time of all CPUs, in seconds, from the text of /proc/stat (its first line: `cpu user nice system idle
    iowait irq softirq steal ...`, in clock ticks); None where the line has no steal column."""
    fields = stat.split(b"\n", 1)[0].split()
    if len(fields) < 9 or fields[0] != b"cpu":
        return None
    return int(fields[8]) / _clock_ticks()


@functools.cache
def _proc_stat() -> int | None:
    """A descriptor on /proc/stat, opened once (pread at offset 0 reads it afresh), or None where there is none."""
    try:
        fd = os.open("/proc/stat", os.O_RDONLY)
    except OSError:
        return None
    return fd if steal_seconds(os.pread(fd, 256, 0)) is not None else None


@functools.cache
def _clock_ticks() -> int:
    """The kernel's clock ticks a second (USER_HZ), the unit of /proc/stat (100 where it cannot be asked)."""
    return os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class StepCost:
    """What a step must do: floating-point operations and bytes moved to and from memory."""

    flops: float
    bytes: float


@dataclass(frozen=True)
class ModelShape:
    """What the costs need of a model: its config, the bytes of its stored weights (the decoder's and the LM
    head's) and of one K or V element."""

    config: ModelConfig
    layer_weight_bytes: int
    head_weight_bytes: int
    kv_elem_bytes: float  # (a quantized pool's: its codes and their scales, per element)

    @classmethod
    def of(cls, model: nn.Module, kv_elem_bytes: float) -> ModelShape:
        """The shape of a loaded model (its projections' storage as it is: dense or quantized)."""
        stored = [*model.named_parameters(), *model.named_buffers()]
        layers = sum(t.nbytes for name, t in stored if name.startswith("layers."))
        head = sum(t.nbytes for name, t in stored if name.startswith("lm_head."))
        if not head:  # tied: the head reads the embedding
            head = sum(t.nbytes for name, t in stored if name.startswith("embed_tokens."))
        return cls(model.config, layers, head, kv_elem_bytes)  # type: ignore[arg-type]


def projection_weights_per_token(config: ModelConfig) -> int:
    """Multiply-adds per token in one layer's projections (q, k, v, o, gate, up, down)."""
    d, h, kv, hidden = config.head_dim, config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    return hidden * d * (2 * h + 2 * kv) + 3 * hidden * config.intermediate_size


def step_cost(shape: ModelShape, chunks: list[ChunkShape]) -> StepCost:
    """FLOPs and bytes of one step over `chunks` (see the module docstring)."""
    config = shape.config
    tokens = sum(c.num_tokens for c in chunks)
    sampled = sum(c.sample for c in chunks)
    layers = config.num_hidden_layers
    flops = 2.0 * tokens * layers * projection_weights_per_token(config)
    flops += 2.0 * sampled * config.hidden_size * config.vocab_size
    kv_row = 2 * config.num_key_value_heads * config.head_dim * shape.kv_elem_bytes  # K and V of one position
    kv_bytes = 0.0
    for layer in range(layers):
        window = config.sliding_window if config.is_sliding(layer) else None
        for c in chunks:
            # keys the chunk's queries see: position p sees min(p + 1, window) keys
            seen = sum(min(p + 1, window or p + 1) for p in range(c.start, c.start + c.num_tokens))
            flops += 4.0 * config.num_attention_heads * config.head_dim * seen
            end = c.start + c.num_tokens
            kv_bytes += kv_row * (min(end, window or end) + c.num_tokens)  # read once, the new ones written
    weight_bytes = shape.layer_weight_bytes + (shape.head_weight_bytes if sampled else 0)
    return StepCost(flops, weight_bytes + kv_bytes)


@dataclass(frozen=True)
class Limits:
    """The machine's limits, measured: `torch.matmul`'s FLOP/s at the workload's projection shape for several
    row counts (a step's tokens), and the read bandwidth."""

    flops_by_rows: dict[int, float]
    bandwidth: float

    @property
    def peak_flops(self) -> float:
        """The best matmul rate measured: the classic roofline's compute limit."""
        return max(self.flops_by_rows.values())

    def flops_at(self, rows: int) -> float:
        """The matmul rate measured at the row count nearest `rows` (on a log scale): the compute limit of a step
        of that many tokens (a 16-row product cannot reach a 512-row one's rate)."""
        nearest = min(self.flops_by_rows, key=lambda r: abs(math.log2(r) - math.log2(max(rows, 1))))
        return self.flops_by_rows[nearest]


def roofline_s(cost: StepCost, peak_flops: float, bandwidth: float) -> float:
    """The least time the machine's limits allow for a step of `cost`."""
    return max(cost.flops / peak_flops, cost.bytes / bandwidth)


def typical_limits(samples: list[Limits]) -> Limits:
    """The median of several timings of the limits (before the runs, between their trials, after them) at every row
    count, and of the bandwidths: the machine's speed while the runs ran. A shared host's speed moves 1.5-2x between
    minutes; a single timing, or the best of several, read against the runs' median steps measures that noise (on a
    2-core Zen 3 the 16-row product ran at 0.95 of the best 256/512-row rate timed in the same moment, 0.87 of the
    best over the minutes, and a 16-request decode run had read 0.55-0.67 of the best of two timings)."""
    rows = samples[0].flops_by_rows
    return Limits({r: statistics.median(s.flops_by_rows[r] for s in samples) for r in rows},
                  statistics.median(s.bandwidth for s in samples))


def best_limits(samples: list[Limits]) -> Limits:
    """The highest of several timings of the limits at every row count, and of the bandwidths: the strict bar (the
    machine at its fastest moment of the run)."""
    rows = samples[0].flops_by_rows
    return Limits({r: max(s.flops_by_rows[r] for s in samples) for r in rows}, max(s.bandwidth for s in samples))


def limit_dtypes(model: nn.Module) -> tuple[torch.dtype, ...]:
    """The dtypes whose matmul rates bound the model's products: the weights', and the one its products upcast to
    (`compute_dtype`, float32 for bf16 weights on a CPU without bf16 units), where they do."""
    dtypes: list[torch.dtype | None] = [getattr(model, "dtype", None), getattr(model, "compute_dtype", None)]
    return tuple(dict.fromkeys(d for d in dtypes if d is not None))


def measure_limits(dtypes: tuple[torch.dtype, ...], device: torch.device, inputs: int, outputs: int, max_rows: int,
                   bandwidth: float, native: NativeKernels | None = None) -> Limits:
    """`Limits` with matmul rates of `[rows, inputs] @ [inputs, outputs]` for rows 1, 4, 16, 64, 256, 512 and
    `max_rows` (the step's token budget), each the fastest of `dtypes` (the weights' dtype and the one the products
    compute in: on a CPU without bf16 units a bf16 matmul is emulated 10-100x below an fp32 one, which is then the
    machine's real limit for the same math) and, with `native` kernels, of their packed product in the weights' dtype
    (`dtypes[0]`, bf16 or fp32; where it runs faster than the library's matmul, as on a Zen 3 EPYC, that is the
    machine's limit, not the slower library's: a limit the engine beats is none): the peak is the machine's, not the
    budget's (a budget below 512 rows would otherwise lower the bar)."""
    rows = sorted({1, 4, 16, 64, 256, 512, max_rows})
    rates: dict[int, float] = {}
    emulated: set[torch.dtype] = set()
    for r in rows:
        dtype_rates = {dtype: matmul_rate(dtype, device, r, inputs, outputs) for dtype in dtypes
                       if dtype not in emulated}
        contenders = list(dtype_rates.values())
        if native is not None:
            contenders.append(native_product_rate(native, r, inputs, outputs, dtype=dtypes[0]))
        rates[r] = max(contenders)
        if r >= 16:  # a dtype 10x behind from 16 rows on is emulated (bf16 on a CPU without its units: ~1 GFLOP/s
            # on a Zen 3, 25 of the 28 s the limits took there); the larger row counts skip it
            emulated |= {dtype for dtype, rate in dtype_rates.items() if rate < rates[r] / 10}
    return Limits(rates, bandwidth)


def native_product_kernels(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> NativeKernels | None:
    """The native kernels where their packed product of `dtype` weights (bf16 or fp32) runs on `device` (a CPU build
    that has it), else None."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return None
    from infer.kernels.native import native_kernels

    kernels = native_kernels()
    runs = kernels is not None and (kernels.packed_f32_available if dtype == torch.float32
                                    else kernels.packed_bf16_available)
    return kernels if runs else None


def native_product_rate(kernels: NativeKernels, m: int, k: int, n: int, repeats: int = 5,
                        dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP/s of the native packed product of `dtype` weights (`NativeKernels.gemm_packed`, the engine's batched
    products) on `[m, k] @ [k, n]`, the best of `repeats` after a warm-up."""
    packed = kernels.pack(torch.randn(n, k).to(dtype))
    x = torch.randn(m, k).to(dtype)
    kernels.gemm_packed(packed, x, n)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        kernels.gemm_packed(packed, x, n)
        best = min(best, time.perf_counter() - start)
    return 2.0 * m * k * n / best


def matmul_rate(dtype: torch.dtype, device: torch.device, m: int, k: int, n: int, repeats: int = 5) -> float:
    """FLOP/s of `torch.matmul` in `dtype` on `[m, k] @ [k, n]`, the best of `repeats` after a warm-up."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    torch.matmul(a, b)  # first-call costs out
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        torch.matmul(a, b)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * m * k * n / best


@dataclass
class PhaseSummary:
    """The steps of one phase: how many, their time, what they had to do, and the fraction of the roofline."""

    phase: str
    steps: int = 0
    seconds: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    roofline_s: float = 0.0  # against the peak matmul rate
    shape_bound_s: float = 0.0  # against the matmul rate at each step's row count
    step_fractions: list[float] = field(default_factory=list)  # each step's roofline time over its own time

    @property
    def fraction(self) -> float:
        """Roofline time over measured time (1.0: at the machine's limit)."""
        return self.roofline_s / self.seconds if self.seconds else 0.0

    @property
    def fraction_p50(self) -> float:
        """The median step's fraction of its own roofline: the phase's typical step, without the few steps a
        one-off cost slowed (a first touch of pool memory, a preemption's recompute)."""
        return statistics.median(self.step_fractions) if self.step_fractions else 0.0

    @property
    def fraction_at_shape(self) -> float:
        """The same against the matmul rate at each step's own row count."""
        return self.shape_bound_s / self.seconds if self.seconds else 0.0


@dataclass(frozen=True)
class StepPoint:
    """One step of a run against the limits: its phase, tokens, wall time, what it had to do, and the time the
    limits allow (`roofline_s` against the peak matmul rate, `shape_bound_s` against the rate at its own rows)."""

    phase: str
    tokens: int
    seconds: float
    flops: float
    bytes: float
    roofline_s: float
    shape_bound_s: float
    faults: int = 0  # page faults during the step (`StepRecord`)
    steal_s: float | None = None  # the host's steal during it

    @property
    def fraction(self) -> float:
        """The step's roofline time over its own time."""
        return self.roofline_s / self.seconds


def step_points(records: list[StepRecord], shape: ModelShape, limits: Limits) -> list[StepPoint]:
    """Each step of a run, in order, with its cost and the time the limits allow for it."""
    points = []
    for record in records:
        cost = step_cost(shape, record.chunks)
        tokens = sum(c.num_tokens for c in record.chunks)
        points.append(StepPoint(record.phase, tokens, record.total_s, cost.flops, cost.bytes,
                                roofline_s(cost, limits.peak_flops, limits.bandwidth),
                                roofline_s(cost, limits.flops_at(tokens), limits.bandwidth), record.faults,
                                record.steal_s))
    return points


def summarize_phases(records: list[StepRecord], shape: ModelShape, limits: Limits) -> list[PhaseSummary]:
    """Per phase (and "all"): steps, seconds, FLOPs, bytes, and the time the limits allow."""
    return summarize_points(step_points(records, shape, limits))


def summarize_points(points: list[StepPoint]) -> list[PhaseSummary]:
    """`summarize_phases` of steps already costed (`step_points`)."""
    rows = {p: PhaseSummary(p) for p in (*PHASES, "all")}
    for point in points:
        for row in (rows[point.phase], rows["all"]):
            row.steps += 1
            row.seconds += point.seconds
            row.flops += point.flops
            row.bytes += point.bytes
            row.roofline_s += point.roofline_s
            row.shape_bound_s += point.shape_bound_s
            row.step_fractions.append(point.fraction)
    return [row for row in rows.values() if row.steps]


def plot_roofline(runs: dict[str, list[StepPoint]], limits: Limits, path: Path) -> bool:
    """PNG of each run's steps against the machine's limits (False if matplotlib is missing): left, the classic
    roofline (a step's FLOP/s against its FLOPs per byte, under min(peak, bandwidth x intensity), the matmul rate at
    each timed row count dashed); right, each step's fraction of its roofline through the run, so the phases and the
    one-off slow steps (a pool's first touch of fresh pages, a preemption's recompute) show where they fall."""
    from infer.bench_common import pyplot

    plt = pyplot()
    if plt is None:
        return False
    colours = {"prefill": "tab:blue", "mixed": "tab:orange", "decode": "tab:green"}
    markers = "o^sDvP*X"
    fig, (roof, through) = plt.subplots(1, 2, figsize=(13, 5))
    intensities = [p.flops / p.bytes for points in runs.values() for p in points if p.bytes]
    lo, hi = min(intensities, default=1.0) / 2, max(intensities, default=1.0) * 2
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    roof.plot(xs, [min(limits.peak_flops, limits.bandwidth * x) / 1e9 for x in xs], color="black",
              label=f"roofline: {limits.peak_flops / 1e9:.0f} GFLOP/s, {limits.bandwidth / 1e9:.1f} GB/s")
    labelled = 0.0
    for rate, rows in sorted((rate, rows) for rows, rate in limits.flops_by_rows.items()):
        roof.axhline(rate / 1e9, color="grey", linestyle="--", linewidth=0.7)
        if rate > 1.1 * labelled:  # rates within 10% of one labelled share its label's place
            roof.annotate(f"{rows} row{'s' * (rows > 1)}", (lo, rate / 1e9), fontsize=7, color="grey", va="bottom")
            labelled = rate
    for (name, points), marker in zip(runs.items(), markers, strict=False):
        for phase in PHASES:
            mine = [p for p in points if p.phase == phase and p.bytes]
            if mine:
                roof.scatter([p.flops / p.bytes for p in mine], [p.flops / p.seconds / 1e9 for p in mine], s=12,
                             marker=marker, color=colours[phase], alpha=0.6, label=f"{name}: {phase}")
        through.scatter(range(len(points)), [p.fraction for p in points], s=8, marker=marker,
                        c=[colours[p.phase] for p in points], alpha=0.6)
        many = many_faults([p.faults for p in points])
        for steps, ring in (([i for i, p in enumerate(points) if p.faults > many], "o"),
                            ([i for i, p in enumerate(points) if p.steal_s], "s")):  # (what the host took)
            through.scatter(steps, [points[i].fraction for i in steps], s=60, marker=ring, facecolors="none",
                            edgecolors="red" if ring == "o" else "purple", linewidths=0.8)
    roof.set(xscale="log", yscale="log", xlabel="FLOPs per byte read or written", ylabel="GFLOP/s",
             title="Each step against the roofline")
    roof.grid(alpha=0.3, which="both")
    roof.legend(fontsize=7)
    through.axhline(1.0, color="black", linewidth=0.8)
    through.set(xlabel="step", ylabel="the step's roofline time / its time",
                title="Fraction of the roofline, step by step (colour: phase)")
    through.set_ylim(bottom=0)
    through.grid(alpha=0.3)
    keys = [plt.Line2D([], [], linestyle="", marker="o", color=colour, label=phase)
            for phase, colour in colours.items()]
    keys += [plt.Line2D([], [], linestyle="", marker=marker, color="black", label=name)
             for name, marker in zip(runs, markers, strict=False)]
    keys += [plt.Line2D([], [], linestyle="", marker="o", markerfacecolor="none", color="red",
                        label="more page faults than usual (fresh memory)"),
             plt.Line2D([], [], linestyle="", marker="s", markerfacecolor="none", color="purple",
                        label="the host's steal")]
    through.legend(handles=keys, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


@dataclass
class ForwardProfile:
    """Seconds of the profiled forwards spent in the projections, in attention, in whole-step native calls (every
    layer's products, attention and small ops in one call: infer/models/native_batch_step.py), and in everything
    else."""

    projections_s: float = 0.0
    attention_s: float = 0.0
    native_step_s: float = 0.0
    forward_s: float = 0.0
    _starts: dict[int, float] = field(default_factory=dict)

    @property
    def other_s(self) -> float:
        """Norms, RoPE, embedding, residuals, the LM head's gather and Python between the ops."""
        return max(0.0, self.forward_s - self.projections_s - self.attention_s - self.native_step_s)


@contextlib.contextmanager
def profile_forward(model: nn.Module, profile: ForwardProfile) -> Iterator[None]:
    """Time every projection (forward hooks on each Linear / QuantizedLinear, fused ones included) and every
    attention call (the backend's `attend`) of the forwards run inside, into `profile`; the device is
    synchronised around each, so the figures are a profile, not a throughput."""
    from infer.backends import PagedBackend
    from infer.kernels.native import NativeKernels
    from infer.models.transformer import Linear, QuantizedLinear

    device = next(model.parameters()).device
    projections = [m for m in model.modules() if isinstance(m, (Linear, QuantizedLinear))]
    for layer in model.layers:  # type: ignore[union-attr]
        projections += [f for f in (layer.self_attn.__dict__["qkv"], layer.mlp.__dict__["gate_up"]) if f is not None]

    def before(module: nn.Module, args: object) -> None:
        synchronize(device)
        profile._starts[id(module)] = time.perf_counter()

    def after(module: nn.Module, args: object, out: object) -> None:
        synchronize(device)
        profile.projections_s += time.perf_counter() - profile._starts.pop(id(module))

    handles = [h for m in projections for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]
    attend, forward, batch_step = PagedBackend.attend, type(model).forward, NativeKernels.batch_step

    def timed_batch_step(self: NativeKernels, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        batch_step(self, *args, **kwargs)
        profile.native_step_s += time.perf_counter() - start

    def timed_attend(self: PagedBackend, *args: object, **kwargs: object) -> torch.Tensor:
        synchronize(device)
        start = time.perf_counter()
        out = attend(self, *args, **kwargs)  # type: ignore[arg-type]
        synchronize(device)
        profile.attention_s += time.perf_counter() - start
        return out

    def timed_forward(self: nn.Module, *args: object, **kwargs: object) -> torch.Tensor:
        synchronize(device)
        start = time.perf_counter()
        out = forward(self, *args, **kwargs)
        synchronize(device)
        profile.forward_s += time.perf_counter() - start
        return out

    PagedBackend.attend = timed_attend  # type: ignore[method-assign]
    NativeKernels.batch_step = timed_batch_step  # type: ignore[method-assign]
    type(model).forward = timed_forward
    try:
        yield
    finally:
        PagedBackend.attend = attend  # type: ignore[method-assign]
        NativeKernels.batch_step = batch_step  # type: ignore[method-assign]
        type(model).forward = forward
        for handle in handles:
            handle.remove()


def profile_table(records: list[StepRecord], profile: ForwardProfile) -> list[dict[str, float | str]]:
    """Where a step's time goes, as rows of (part, seconds, share): the profiled run's steps split into
    scheduling, batch building, sampling and the forward, the forward split by `profile`."""
    schedule = sum(r.schedule_s for r in records)
    build = sum(r.build_s for r in records)
    sample = sum(r.sample_s for r in records)
    forward = sum(r.forward_s for r in records)
    # The hooks time the forward itself; what the step's forward time holds beyond it (copy-on-write copies,
    # the call's own overhead) goes with "other".
    parts = {"projections (matmuls)": profile.projections_s, "attention": profile.attention_s,
             "layers in one native call": profile.native_step_s,
             "other forward ops and Python": max(0.0, forward - profile.projections_s - profile.attention_s
                                                 - profile.native_step_s),
             "sampling and stop checks": sample, "scheduling": schedule, "batch building": build}
    total = sum(parts.values()) or 1.0
    return [{"part": name, "seconds": seconds, "share": seconds / total} for name, seconds in parts.items()]


def median_step_ms(records: list[StepRecord], phase: str) -> float:
    """The median wall time of the phase's steps, in ms (0 when there are none)."""
    times = [r.total_s for r in records if r.phase == phase]
    return statistics.median(times) * 1e3 if times else 0.0


@dataclass(frozen=True)
class SlowSteps:
    """A run's one-off slow steps: those over `factor` times their phase's median step (a first touch of fresh pool
    pages, a collection, the host's hiccup), how many, and the time they took beyond that median; what the host took
    in them (page faults, in how many of them, and steal) and in the whole run (None: steal not measured)."""

    factor: float
    count: int
    excess_s: float
    total_s: float
    faults: int = 0
    faulting: int = 0  # the slow steps with more than the run's usual faults (`many_faults`)
    steal_s: float | None = None
    run_faults: int = 0
    run_steal_s: float | None = None

    @property
    def share(self) -> float:
        """The excess over the run's step time: what the whole-run fraction loses to them."""
        return self.excess_s / self.total_s if self.total_s else 0.0


def slow_steps(records: list[StepRecord], factor: float = 2.0) -> SlowSteps:
    """The steps of `records` over `factor` times the median step of their phase, their time past it, and the page
    faults and steal in them and in the run."""
    medians = {p: statistics.median(r.total_s for r in records if r.phase == p)
               for p in {r.phase for r in records}}
    slow = [r for r in records if r.total_s > factor * medians[r.phase]]
    many = many_faults([r.faults for r in records])
    return SlowSteps(factor, len(slow), sum(r.total_s - medians[r.phase] for r in slow),
                     sum(r.total_s for r in records), sum(r.faults for r in slow), sum(r.faults > many for r in slow),
                     _steal(slow), sum(r.faults for r in records), _steal(records))


def many_faults(faults: list[int]) -> float:
    """The page faults past which a step of a run took more than its usual few (its own allocations'): over twice
    the run's median step's, plus 2 (a pool's fresh pages: one fault for each 2 MiB huge page, each pool tensor's)."""
    return 2 * statistics.median(faults) + 2 if faults else 0.0


def _steal(records: list[StepRecord]) -> float | None:
    """The steal over `records`, None where any went unmeasured."""
    steals = [r.steal_s for r in records]
    return None if None in steals else sum(s for s in steals if s is not None)
