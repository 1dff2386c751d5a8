"""Speed choices made for the machine at hand, by capability where it is unambiguous, else by a short
measurement, each cached per process and recorded with its reason so `python -m infer bench` can print
what was chosen and why. Every choice can be forced by the caller.

The 2-core machines this engine runs on range from an AMD EPYC with AVX2 and no bf16 units (bf16 GEMMs are
emulated there and run several times slower than fp32) to an Intel Xeon with AMX-BF16 (bf16 GEMMs fastest):
one fixed dtype is wrong on one of them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from infer.cache import create_cache
from infer.config import ModelConfig
from infer.kernels import triton_available
from infer.kernels.native import FLAVOUR_NEEDS, FLAVOURS, NativeKernels, native_kernels, unavailable_reason
from infer.memory import available_memory, huge_pages_mode, synchronize
from infer.models import Transformer
from infer.models.transformer import (
    GEMV_FORMS,
    Linear,
    QuantizedLinear,
    dequantized_product,
    few_row_products,
    native_packing_unavailable,
    pack_weight,
    packed_linear,
    packing_unavailable,
)
from infer.quant_weights import PackedCodes, QuantizedWeight
from infer.ragged import DECODE_KERNELS, IN_PLACE_KERNELS


@dataclass(frozen=True)
class Choice:
    """One speed decision: what was chosen and why."""

    name: str
    value: str
    reason: str


# Every choice made in this process, by name (the latest wins), for reports.
CHOICES: dict[str, Choice] = {}

# CPU flags meaning the half-precision type has matrix or vector units (so its GEMMs are native).
HALF_UNITS = {torch.bfloat16: ("amx_bf16", "avx512_bf16"), torch.float16: ("amx_fp16", "avx512_fp16")}


@functools.cache
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The CPU's feature flags (Linux), or None where they cannot be read."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def flavours_for_this_cpu() -> list[str]:
    """The flavours whose instructions this CPU has (the narrower x86 paths run on any CPU with their units)."""
    flags = cpu_flags() or frozenset()
    return [f for f in FLAVOURS if set(FLAVOUR_NEEDS[f]) <= flags]


def build_native_kernels() -> dict[str, str]:
    """Build every flavour this CPU runs at once, one compiler process each (30-35 s apiece on a 2-core EPYC), and
    say how each went: "built" (or found built) or why not. `make setup` calls it, so that the test workers, which
    each ask for every flavour as they collect, find them built instead of compiling the same files side by side."""
    wanted = flavours_for_this_cpu()
    with ThreadPoolExecutor(max_workers=max(1, len(wanted))) as pool:
        built = dict(zip(wanted, pool.map(native_kernels, wanted), strict=True))
    return {f: "built" if kernels is not None else unavailable_reason(f) or "unknown" for f, kernels in built.items()}


def record(choice: Choice) -> Choice:
    """Remember `choice` for reports and return it."""
    CHOICES[choice.name] = choice
    return choice


def record_weight_pages(huge_pages: bool, device: torch.device) -> Choice:
    """Record where the loader put the weights (infer.memory.on_huge_pages does the placing)."""
    name = "weight pages"
    if device.type != "cpu":
        return record(Choice(name, "device", f"weights on {device.type}: the device's allocator"))
    if not huge_pages:
        return record(Choice(name, "normal", "huge_pages=False"))
    mode = huge_pages_mode()
    if mode in ("always", "madvise"):
        return record(Choice(name, "huge", f"transparent huge pages ({mode}): weights of 2 MiB and more on 2 MiB "
                                           "pages (fewer TLB misses and prefetcher restarts per decode step)"))
    return record(Choice(name, "normal", f"the kernel offers no transparent huge pages ({mode or 'no THP'})"))


def choose_prefill_dtype(weight_dtype: torch.dtype, device: torch.device,
                         flags: frozenset[str] | None = None) -> Choice:
    """The dtype multi-token (prefill) matmuls run in: the weights' own unless they are half precision on a
    CPU without units for it, where fp32 is faster (one-token decode stays in the weights' dtype: it is
    bandwidth-bound). Without readable flags the two are timed on a prefill-sized matmul."""
    name = "prefill matmul dtype"
    if device.type != "cpu" or weight_dtype == torch.float32:
        return record(Choice(name, "exact", f"{_short(weight_dtype)} weights on {device.type}: nothing to choose"))
    flags = cpu_flags() if flags is None else flags
    units = [f for f in HALF_UNITS.get(weight_dtype, ()) if flags is not None and f in flags]
    if units:
        return record(Choice(name, "exact", f"{_short(weight_dtype)} GEMMs are native here ({', '.join(units)})"))
    if flags is not None:
        wanted = " or ".join(HALF_UNITS.get(weight_dtype, ("half-precision units",)))
        return record(Choice(name, "float32", f"no {wanted} on this CPU: {_short(weight_dtype)} GEMMs are emulated"))
    half_s, wide_s = _time_prefill_matmul(weight_dtype)
    value = "float32" if wide_s < half_s else "exact"
    return record(Choice(name, value, f"CPU flags unreadable; measured {_short(weight_dtype)} {half_s * 1e3:.2f} ms "
                                      f"vs fp32 (with casts) {wide_s * 1e3:.2f} ms per 128x1024x1024 matmul"))


@functools.cache
def _time_prefill_matmul(dtype: torch.dtype, tokens: int = 128, size: int = 1024) -> tuple[float, float]:
    """Median seconds of a prefill-shaped matmul in `dtype`, and in fp32 including the casts."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, size, generator=gen).to(dtype)
    w = torch.randn(size, size, generator=gen).to(dtype)

    def half() -> object:
        return x @ w.T

    def wide() -> object:
        return (x.float() @ w.float().T).to(dtype)

    return _median_time(half), _median_time(wide)


def choose_decode_gemv(weights: list[torch.Tensor], forced: str = "auto") -> Choice:
    """The kernel of one-token decode products: `F.linear`, `torch.mv`, the native kernel (infer/kernels/
    cpu_decode.c) on a CPU or the Triton one (infer/kernels/gemv.py) on CUDA, whichever streams this model's
    weights fastest here. Timed as a decode step reads them: a sweep over the weights in model order (at least
    twice the last-level cache where the model is that large, so a sweep measures memory, not cache), the forms
    alternating; another form must beat F.linear by 3% to replace it. `forced` skips the timing."""
    name = "decode GEMV form"
    if forced != "auto":
        if forced not in GEMV_FORMS:
            raise ValueError(f"decode_gemv must be 'auto' or one of {', '.join(map(repr, GEMV_FORMS))}, "
                             f"got {forced!r}")
        if forced == "native" and native_kernels() is None:
            raise ValueError(f"decode_gemv='native' is unavailable here: {unavailable_reason()}; use 'auto'")
        if forced == "triton" and weights and not triton_available(weights[0].device.type):
            raise ValueError("decode_gemv='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1); use 'auto'")
        return record(Choice(name, forced, "forced by the caller"))
    sweep = _sweep_weights(weights)
    device = sweep[0].device
    inputs = {w.shape[1]: _random(w.shape[1]).to(device, w.dtype) for w in sweep}
    forms: dict[str, Callable[[], object]] = {
        "linear": lambda: [torch.nn.functional.linear(inputs[w.shape[1]][None], w) for w in sweep],
        "mv": lambda: [torch.mv(w, inputs[w.shape[1]]) for w in sweep],
    }
    kernels = native_kernels() if device.type == "cpu" else None
    if kernels is not None and all(kernels.supports(w) for w in sweep):
        forms["native"] = lambda: [kernels.gemv(w, inputs[w.shape[1]]) for w in sweep]
    if device.type == "cuda" and triton_available("cuda"):
        from infer.kernels.gemv import triton_gemv

        forms["triton"] = lambda: [triton_gemv(w, inputs[w.shape[1]]) for w in sweep]
    times = _time_alternately(forms, device, repeats=5)
    best = min(times, key=times.__getitem__)
    value = best if times[best] < 0.97 * times["linear"] else "linear"  # a clear win only
    labels = {"linear": "F.linear", "mv": "torch.mv", "native": f"native ({kernels.isa if kernels else ''})",
              "triton": "Triton"}
    timed = ", ".join(f"{labels[k]} {t * 1e3:.2f} ms" for k, t in times.items())
    if "native" not in forms:
        timed += f"; native not tried ({_native_absence(kernels, device)})"
    megabytes = sum(w.nbytes for w in sweep) / 2**20
    return record(Choice(name, value, f"a sweep over {len(sweep)} weights ({megabytes:.0f} MiB): {timed} "
                                      "(medians, alternately)"))


PREFETCH_LEVELS = {"l1": 1, "l2": 2}


def choose_prefetch(weights: list[torch.Tensor], forced: str = "auto") -> Choice:
    """Where the native kernels' software prefetches land (`NativeKernels.prefetch_level`, process-wide): the L1
    cache (prefetcht0, the unoptimised default) or the L2 (prefetcht1). Timed as `choose_decode_gemv` times the
    native GEMV (the same sweep over the weights), the two alternately; L2 where it is 3% faster. On a 2-core EPYC
    (Zen 4) L2 streamed 16% faster and the engine's decode steps of 1-8 rows ran 1.13-1.44x faster; a prefetch
    changes no result. `forced` ("l1" or "l2") skips the timing."""
    name = "native prefetch"
    kernels = native_kernels()
    if forced != "auto" and forced not in PREFETCH_LEVELS:
        raise ValueError(f"native_prefetch must be 'auto', 'l1' or 'l2', got {forced!r}")
    if kernels is None:
        return record(Choice(name, "none", f"no native kernels ({unavailable_reason()})"))
    if forced != "auto":
        kernels.prefetch_level = PREFETCH_LEVELS[forced]
        return record(Choice(name, forced, "forced by the caller"))
    sweep = [w for w in _sweep_weights(weights) if kernels.supports(w)]
    if not sweep:
        kernels.prefetch_level = 1
        return record(Choice(name, "l1", "no weight the native GEMV takes to time it on"))
    inputs = {w.shape[1]: _random(w.shape[1]).to(w.dtype) for w in sweep}

    def sweep_at(level: int) -> list[object]:
        kernels.prefetch_level = level
        return [kernels.gemv(w, inputs[w.shape[1]]) for w in sweep]

    times = _time_alternately({key: functools.partial(sweep_at, level) for key, level in PREFETCH_LEVELS.items()},
                              torch.device("cpu"), repeats=5)
    value = "l2" if times["l2"] < 0.97 * times["l1"] else "l1"
    kernels.prefetch_level = PREFETCH_LEVELS[value]
    megabytes = sum(w.nbytes for w in sweep) / 2**20
    return record(Choice(name, value, f"native GEMV over {len(sweep)} weights ({megabytes:.0f} MiB), prefetch into "
                                      f"L1 {times['l1'] * 1e3:.2f} ms, L2 {times['l2'] * 1e3:.2f} ms (medians, "
                                      "alternately)"))


def choose_quantized_gemv(device: torch.device, forced: str = "auto") -> Choice:
    """The kernel of one-token products for a model with quantized weights: the native kernel on a CPU and the
    Triton one on CUDA where they are, since every other form dequantizes the whole weight on each call (no
    timing needed to rule those out); F.linear over the dequantized weight otherwise. `forced` skips the rule."""
    name = "decode GEMV form"
    if forced != "auto":
        if forced == "triton" and not triton_available(device.type):
            raise ValueError("decode_gemv='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1); use 'auto'")
        return choose_decode_gemv([], forced)
    kernels = native_kernels() if device.type == "cpu" else None
    if kernels is not None:
        return record(Choice(name, "native", f"quantized weights: the native kernel ({kernels.isa}) reads the codes; "
                                             "every other form dequantizes each weight on every call"))
    if device.type == "cuda" and triton_available("cuda"):
        return record(Choice(name, "triton", "quantized weights: the Triton kernel reads the codes"))
    why = _native_absence(kernels, device) if device.type == "cpu" else f"no Triton for {device.type}"
    return record(Choice(name, "linear", f"quantized weights dequantized on every call ({why})"))


def choose_quantized_rows(weight: QuantizedWeight, dtype: torch.dtype, compute: torch.dtype | None,
                          forced: int | None = None) -> Choice:
    """Rows of input up to which a quantized product runs the native kernel on the codes rather than dequantizing
    the weight into the GEMM (prefill chunks, the engine's batches): timed on `weight` (the model's largest
    projection) in `dtype` (the GEMM in `compute` where set), doubling the rows from 4 while the kernel is the
    faster, alternately. `forced` skips the timing."""
    name = "quantized product rows"
    if forced is not None:
        return record(Choice(name, str(forced), "forced by the caller"))
    kernels = native_kernels()
    if kernels is None or not kernels.takes(weight) or dtype not in kernels.dtypes:
        return record(Choice(name, "0", "no native kernel for these weights: every product dequantizes"))
    gemm = compute or dtype
    rows, timed = 1, []
    for m in (4, 8, 16, 32, 64, 128):
        x = _random(m, weight.shape[1]).to(dtype)
        times = _time_alternately({
            "kernel": functools.partial(kernels.quantized_gemv, weight, x),
            "gemm": functools.partial(dequantized_product, kernels, x.to(gemm), weight, None),
        }, torch.device("cpu"), repeats=5)
        timed.append(f"{m}: {times['kernel'] * 1e3:.2f} / {times['gemm'] * 1e3:.2f} ms")
        if times["kernel"] >= times["gemm"]:
            break
        rows = m
    return record(Choice(name, str(rows), f"native kernel / dequantize + GEMM on {tuple(weight.shape)} "
                                          f"({weight.scheme}): {', '.join(timed)}"))


def choose_gemm_rows(weights: list[torch.Tensor], forced: int | None = None) -> Choice:
    """Rows of input up to which dense bf16 products run the native few-row kernel (infer/kernels/cpu_decode.c,
    `infer_gemm_bf16`) rather than F.linear: the batched engine's decode steps. Timed as a step reads the weights
    (a sweep over them in model order, as `choose_decode_gemv` does) at 2, 4, .. 64 rows alternately, up to the count
    where the kernel's gains summed from 2 rows are largest (`_rows_the_kernel_wins`). 1 where the weights are not
    bf16 or the build lacks AVX512-BF16. `forced` skips the timing."""
    name = "few-row bf16 product rows"
    if forced is not None:
        return record(Choice(name, str(forced), "forced by the caller"))
    kernels = native_kernels()
    sweep = _sweep_weights(weights)
    if kernels is None or not kernels.gemm_bf16_available:
        why = unavailable_reason() if kernels is None else f"no AVX512-BF16 in this build ({kernels.isa})"
        return record(Choice(name, "1", f"F.linear for every multi-row product: {why}"))
    if not sweep or any(w.dtype != torch.bfloat16 or not kernels.supports(w) for w in sweep):
        return record(Choice(name, "1", "F.linear for every multi-row product: the weights are not bf16"))
    rows, timed = _rows_the_kernel_wins(kernels, sweep, functools.partial(
        _sweep_products, torch.nn.functional.linear, sweep, swap=True), 64)
    megabytes = sum(w.nbytes for w in sweep) / 2**20
    return record(Choice(name, str(rows), f"native kernel / F.linear over {len(sweep)} weights ({megabytes:.0f} "
                                          f"MiB) by rows: {', '.join(timed)} (medians, alternately)"))


@dataclass(frozen=True)
class PackingChoice:
    """`choose_packed_products`'s answer: whether (and in which layout) the engine packs the weights, the rows up
    to which the native few-row kernel stays ahead of oneDNN's packed product (at most the model's `gemm_rows`), and
    the rows up to which the packed copies are taken (None: every count)."""

    choice: Choice
    native_rows: int
    upto: int | None = None
    one_row: bool = False  # quantized codes: the packed copies take one-row products too (faster than the codes kernel)

    @property
    def on(self) -> bool:
        """Whether to pack."""
        return self.choice.value != "off"

    @property
    def layout(self) -> str:
        """The packed copies' layout ("onednn" or "native"; "onednn" where off)."""
        return self.choice.value if self.on else "onednn"


_PACKING_SWEEP_BYTES = 64 * 2**20
_PACKING_SWEEP_MIN_BYTES = 4 * 2**20


def choose_packed_products(model: Transformer, batch_rows: int, forced: bool | str | None = None) -> PackingChoice:
    """Whether the batched engine runs its products on weights packed once (`Transformer.pack_products`) rather than
    F.linear, which packs them on every call, and in which layout: oneDNN's (its GEMM past the native few-row
    kernel's rows) or the native packed product's (every product of 2 rows or more). Timed over the products the
    engine runs (`packable_products`, in model order, cut after max(64 MiB, 2 x last-level cache)) at 16 rows, and at
    64 rows and `batch_rows` (a step's token budget) over the first of them that make as much arithmetic (at least 4
    MiB), every layout and F.linear alternately; oneDNN's layout counted at
    each row count as what the engine would run (the few-row kernel where it is faster, within `gemm_rows`). The
    layout whose mean time relative to F.linear is least (the native one unless oneDNN's is 5% less: it also lets a
    step run every layer in one native call) is taken where that mean is 3% or more below F.linear's, each layout
    counted up to the count before the first at which it is 10% slower (`_packed_range`; F.linear's time past it,
    where the engine then runs it: `PackingChoice.upto`; within 10%, a shared host's noise). Where oneDNN's layout
    is taken and the few-row kernel runs, the rows it keeps are measured
    against the packed product (`_rows_the_kernel_wins`). Off without timing where the copies would take more than
    half the memory left. `forced` (True or "onednn": oneDNN's; "native"; False: off) skips the choice of layout and
    that check (a layout that cannot run raises). Cached per model and `batch_rows`."""
    cached: dict[tuple[int, bool | str | None, int], PackingChoice] = model.__dict__.setdefault("_packing_choices", {})
    key = (batch_rows, forced, model.gemm_rows)
    if key not in cached:
        cached[key] = _choose_packing(model, batch_rows, forced)
    record(cached[key].choice)
    return cached[key]


def _packed_range(counts: tuple[int, ...], ratios: list[float]) -> tuple[int | None, list[float]]:
    """The rows up to which packed copies timed at `counts` (ratios of their time to the unpacked products') are
    taken: up to the count before the first at which they are 10% slower (None: at every count), and the ratios the
    steps then see (1, the unpacked products', past that count). On an Intel Xeon with AMX the native packed product
    ran 16 rows 1.4x faster than F.linear and 2048 rows 1.2-1.4x slower: the 2048-row guard turned the layout off,
    halving decode, where the rows past 64 can take F.linear instead."""
    for i, ratio in enumerate(ratios):
        if ratio >= 1.1:
            return (counts[i - 1] if i else 1), ratios[:i] + [1.0] * (len(ratios) - i)
    return None, list(ratios)


def _crowding(copy: int) -> str | None:
    """Why packed copies of `copy` bytes are not made unasked: more than half the free memory (None: they fit)."""
    free = available_memory(torch.device("cpu"))
    if free is not None and copy > free // 2:
        return (f"the packed copies ({copy / 2**20:.0f} MiB) would take more than half the free memory "
                f"({free / 2**20:.0f} MiB)")
    return None


def _choose_packing(model: Transformer, batch_rows: int, forced: bool | str | None) -> PackingChoice:
    name = "packed products"
    products = model.packable_products()
    weights = [m.weight for m in products if isinstance(m, Linear)]
    coded = [m for m in products if isinstance(m, QuantizedLinear)]
    if coded:
        return _choose_quantized_packing(model, coded, weights, batch_rows, forced)
    # A CPU without bf16 units multiplies the products in float32 (the model's compute dtype): oneDNN's copies are
    # then made in it, against the products widening every weight on every call.
    upcast = model.compute_dtype
    unavailable = {"onednn": packing_unavailable(weights, upcast),
                   "native": native_packing_unavailable(weights, dtype=model.dtype) if upcast in (None, torch.float32)
                   else f"the products upcast to {upcast}, and it sums in float32"}
    wanted = "onednn" if forced is True else forced if isinstance(forced, str) else None
    gemm_rows = model.gemm_rows
    if wanted == "onednn" and unavailable["onednn"] is not None:
        raise ValueError(f"packed_products=True needs oneDNN's bf16 GEMM: {unavailable['onednn']}; leave it None or "
                         "False")
    if wanted == "native" and unavailable["native"] is not None:
        raise ValueError(f"packed_products='native' needs the native packed product: {unavailable['native']}; leave "
                         "it None or False")
    layouts = [wanted] if wanted else [key for key, why in unavailable.items() if why is None]
    why = None if layouts else unavailable["onednn"]
    copies = {"onednn": sum(w.numel() * (upcast or w.dtype).itemsize for w in weights),
              "native": sum(w.nbytes for w in weights)}
    if why is None and not wanted:
        crowded = {layout: _crowding(copies[layout]) for layout in layouts}
        layouts = [layout for layout in layouts if crowded[layout] is None]
        why = None if layouts else next(iter(crowded.values()))
    if forced is False or why is not None:
        return PackingChoice(Choice(name, "off", why if why is not None else "forced off by the caller"), gemm_rows)
    limit = max(_PACKING_SWEEP_BYTES, 2 * last_level_cache_bytes())
    sweep = _sweep_weights(weights, limit)
    kernels = native_kernels()
    packed = {"onednn": [pack_weight(w if upcast is None else w.to(upcast)) for w in sweep] if "onednn" in layouts
              else [],
              "native": [kernels.pack(w) for w in sweep] if "native" in layouts and kernels else []}
    few_rows = kernels is not None and gemm_rows > 1
    megabytes = sum(w.nbytes for w in sweep) / 2**20
    timed: list[str] = []
    ratios: dict[str, list[float]] = {layout: [] for layout in layouts}
    counts = (16, 64, max(batch_rows, 65))
    for m in counts:
        # Past 16 rows a product is bound by its arithmetic, not by the weights streaming in: each count's sweep is
        # cut to the arithmetic of 16 rows over the whole sweep (at least 4 MiB): the 512-row sweep of every form
        # over 64 MiB took 22 of an engine's 30 s of set-up on a 2-core Zen 3, its products upcast.
        part = len(_sweep_weights(sweep, max(limit * 16 // m, _PACKING_SWEEP_MIN_BYTES)))
        timed_weights, cut = sweep[:part], {layout: copies[:part] for layout, copies in packed.items()}
        inputs = {w.shape[1]: _random(m, w.shape[1]).to(w.dtype) for w in timed_weights}
        forms: dict[str, Callable[[], object]] = {
            "linear": functools.partial(_sweep_products, torch.nn.functional.linear, timed_weights, inputs, swap=True)
            if upcast is None else functools.partial(_upcast_products, timed_weights, inputs, upcast)}
        if "onednn" in layouts:
            forms["onednn"] = functools.partial(_packed_products, timed_weights, cut["onednn"], inputs, upcast)
            if few_rows and kernels is not None and m <= gemm_rows:
                forms["few-row"] = functools.partial(_sweep_products, kernels.gemm_bf16, timed_weights, inputs)
        if "native" in layouts and kernels is not None:
            forms["native"] = functools.partial(_native_packed_products, kernels, timed_weights, cut["native"],
                                                inputs)
        times = _time_alternately(forms, torch.device("cpu"), repeats=3)
        if "few-row" in times:  # what the engine runs at these rows with oneDNN's layout
            times["onednn"] = min(times["onednn"], times.pop("few-row"))
        for layout in layouts:
            ratios[layout].append(times[layout] / times["linear"])
        timed.append(f"{m} rows over {sum(w.nbytes for w in timed_weights) / 2**20:.0f} MiB: "
                     + " / ".join(f"{times[key] * 1e3:.1f}" for key in (*layouts, "linear")) + " ms")
    # The native layout also lets a step run every layer in one call (infer/models/native_batch_step.py: 1.13-1.24x
    # on decode steps of 64-16 rows of a 150M Llama on a 2-core EPYC), which the products' timings do not see: it is
    # kept unless oneDNN's products are 5% faster on the whole (a noisy host swung their 512-row ratio by 10%).
    ranges = {layout: _packed_range(counts, ratios[layout]) for layout in layouts}
    scores = {layout: sum(ranges[layout][1]) * (1.0 if layout == "onednn" else 0.95) for layout in layouts}
    best = min(layouts, key=scores.__getitem__)
    upto, seen = (None, ratios[best]) if wanted else ranges[best]
    on = bool(wanted) or sum(seen) / len(seen) < 0.97  # (no count taken: every ratio 1)
    # (where the products upcast, oneDNN's copy is in the compute dtype, the native one bf16 summed in float32)
    named = [f"{layout} ({str(upcast).removeprefix('torch.')})" if upcast is not None and layout == "onednn"
             else layout for layout in layouts]
    unpacked = "F.linear" if upcast is None else "F.linear upcast per call"
    reason = (f"{' / '.join(named)} packed / {unpacked} over {len(sweep)} weights ({megabytes:.0f} MiB), "
              f"{', '.join(timed)} (medians, alternately); {'forced by the caller; ' if wanted else ''}packed copies "
              f"{copies[best] / 2**20:.0f} MiB")
    if on and upto is not None:
        reason += f"; taken up to {upto} rows ({unpacked} past them, where the packed copies ran 10% slower)"
    rows = 1
    if on and best == "onednn" and few_rows and kernels is not None:
        packed_form = functools.partial(_packed_products, sweep, packed["onednn"], upcast=upcast)
        rows, kept = _rows_the_kernel_wins(kernels, sweep, packed_form, gemm_rows if upto is None
                                           else min(gemm_rows, upto - 1))
        reason += f"; native few-row kernel / packed by rows: {', '.join(kept)} -> {rows} rows (largest summed gain)"
    return PackingChoice(Choice(name, best if on else "off", reason), rows, upto if on else None)


_AHEAD_SWEEP_BYTES = 256 * 2**20
_AHEAD_NAME, _AHEAD_LABELS = "packed product prefetch", {1: "next pair", 2: "pair after next"}


def choose_packed_ahead(model: Transformer, forced: int | None = None) -> Choice:
    """How far ahead the native packed product prefetches its weights (`NativeKernels.packed_ahead`, process-wide):
    the next pair of blocks or the pair after next. Timed over the model's bf16 products packed natively (in
    model order, cut after max(256 MiB, 4 x last-level cache): a sweep of 64 MiB saw half the gain a step sees) at
    16 rows, the decode steps' regime where the weights stream beside the arithmetic, the two alternately; the next
    pair where it is 2% faster, else the pair after next (the kernel's first setting). The same results either way.
    `forced` (1 or 2) skips the timing. The choice, forced or timed, stays the model's: the engines built on it
    apply it again."""
    name, labels, kernels = _AHEAD_NAME, _AHEAD_LABELS, native_kernels()
    if forced is not None:
        if kernels is None:
            raise ValueError(f"packed_ahead needs the native kernels: {unavailable_reason()}")
        kernels.packed_ahead = forced  # (refuses anything but 1 or 2)
        model.__dict__["_packed_ahead"] = Choice(name, labels[forced], "forced by the caller")
    elif "_packed_ahead" not in model.__dict__:
        model.__dict__["_packed_ahead"] = _choose_packed_ahead(model, kernels)
    choice: Choice = model.__dict__["_packed_ahead"]
    if kernels is not None and choice.value in labels.values():
        kernels.packed_ahead = 1 if choice.value == labels[1] else 2
    return record(choice)


def _choose_packed_ahead(model: Transformer, kernels: NativeKernels | None) -> Choice:
    name, labels = _AHEAD_NAME, _AHEAD_LABELS
    products = [m for m in model.packable_products()
                if isinstance(m, Linear) and m.packed is not None and m.packed_layout == "native"
                and m.packed.dtype == torch.bfloat16]  # (an fp32 copy's product prefetches the next block itself)
    if kernels is None or not products:
        return Choice(name, "none", "no bf16 product packed for the native packed product")
    kept = {w.data_ptr() for w in _sweep_weights([m.weight for m in products],
                                                 max(_AHEAD_SWEEP_BYTES, 4 * last_level_cache_bytes()))}
    sweep = [m for m in products if m.weight.data_ptr() in kept]
    total = sum(m.weight.nbytes for m in sweep)
    inputs = {m.weight.shape[1]: _random(16, m.weight.shape[1]).to(torch.bfloat16) for m in sweep}

    def sweep_at(ahead: int) -> list[object]:
        kernels.packed_ahead = ahead
        return [kernels.gemm_bf16_packed(cast(torch.Tensor, m.packed), inputs[m.weight.shape[1]], m.weight.shape[0])
                for m in sweep]

    times = _time_alternately({labels[a]: functools.partial(sweep_at, a) for a in (1, 2)}, torch.device("cpu"),
                              repeats=11)
    value = labels[1] if times[labels[1]] < 0.98 * times[labels[2]] else labels[2]
    return Choice(name, value, f"native packed product at 16 rows over {len(sweep)} weights ({total / 2**20:.0f} MiB): "
                               f"the next pair {times[labels[1]] * 1e3:.2f} ms, the pair after next "
                               f"{times[labels[2]] * 1e3:.2f} ms (medians, alternately)")


def _choose_quantized_packing(model: Transformer, coded: list[QuantizedLinear], weights: list[torch.Tensor],
                              batch_rows: int, forced: bool | str | None) -> PackingChoice:
    """`choose_packed_products` for a model with quantized projections: their codes packed for the native packed
    product (`pack_codes`; oneDNN has no layout for codes) where that beats the quantized products' own kernels
    (`QuantizedLinear` unpacked: the codes kernel, the tile kernel or dequantizing into the GEMM, by rows) over the
    quantized products the engine runs (cut as above), at 16 and 64 rows and at `batch_rows`, alternately: taken where
    the mean ratio is 3% or more below 1 and no count is 10% slower. Forced "native", packed without timing."""
    name = "packed products"
    if forced is True or forced == "onednn":
        raise ValueError(f"packed_products={forced!r} needs oneDNN's bf16 GEMM, which has no layout for quantized "
                         "projections; leave it None, False or 'native'")
    why = native_packing_unavailable(weights, coded, model.dtype)
    if forced == "native" and why is not None:
        raise ValueError(f"packed_products='native' needs the native packed product: {why}; leave it None or False")
    copy = _packed_copy_bytes(coded, weights)
    if why is None and forced is None:
        why = _crowding(copy)
    if forced is False or why is not None:
        return PackingChoice(Choice(name, "off", why if why is not None else "forced off by the caller"), 1)
    if forced == "native":
        return PackingChoice(Choice(name, "native", f"forced by the caller; packed copies up to {copy / 2**20:.0f} "
                                                    "MiB"), 1)
    # (cut as the dense sweep is, by the products' bf16 bytes: the same work to time, not 2-4x as much)
    limit = max(_AHEAD_SWEEP_BYTES, 4 * last_level_cache_bytes())
    sweep = _first_within(coded, limit)
    kernels = native_kernels()
    if kernels is None:  # (native_packing_unavailable found it)
        return PackingChoice(Choice(name, "off", f"no native kernels: {unavailable_reason()}"), 1)
    packed = [kernels.pack_codes(m.qweight, model.dtype) for m in sweep]
    own, timed, ratios = [m.packed for m in sweep], [], []
    counts = (16, 64, max(batch_rows, 65))
    try:
        for module in sweep:  # (the model may be packed already: its own kernels are timed unpacked)
            module.packed = None
        for m in counts:
            # each count's sweep cut to the arithmetic of 16 rows over the whole sweep, as the dense choice cuts its
            # own (the token budget's rows over every weight took 11 of an int4 engine's 19 s of set-up on a 2-core
            # Zen 3)
            part = len(_first_within(sweep, max(limit * 16 // m, _PACKING_SWEEP_MIN_BYTES)))
            inputs = {k: _random(m, k).to(model.dtype) for k in {p.shape[1] for p in packed[:part]}}
            times = _time_alternately({
                "native": functools.partial(_quantized_packed_products, kernels, packed[:part], inputs),
                "own": functools.partial(_own_products, sweep[:part], inputs),
            }, torch.device("cpu"), repeats=3)
            ratios.append(times["native"] / times["own"])
            timed.append(f"{m} rows: {times['native'] * 1e3:.1f} / {times['own'] * 1e3:.1f} ms over {part} weights")
        # one row (the engine's steps of one request): the packed codes against the codes kernel (the GEMV)
        one_row, timed_one = _packed_one_row_wins(kernels, sweep, packed, model.dtype)
    finally:
        for module, copy_before in zip(sweep, own, strict=True):
            module.packed = copy_before
    upto, seen = _packed_range(counts, ratios)
    on = sum(seen) / len(seen) < 0.97  # (no count taken: every ratio 1)
    one_row = on and one_row
    timed.append(timed_one)
    megabytes = sum(m.qweight.nbytes for m in sweep) / 2**20
    form = "channel" if packed[0].channel_form else "pairs"  # (AVX2's codes multiplied as they are)
    reason = (f"native packed codes ({form} form) / the quantized kernels over {len(sweep)} quantized weights "
              f"({megabytes:.0f} MiB), {', '.join(timed)} (medians, alternately); packed copies up to "
              f"{copy / 2**20:.0f} MiB")
    if on and upto is not None:
        reason += f"; taken up to {upto} rows (the quantized kernels past them, where the packed codes ran 10% slower)"
    if on:
        reason += "; one-row products on the packed codes" if one_row else "; one-row products on the codes kernel"
    return PackingChoice(Choice(name, "native" if on else "off", reason), 1, upto if on else None, one_row)


def _packed_copy_bytes(coded: list[QuantizedLinear], weights: list[torch.Tensor]) -> int:
    """At most the bytes of a quantized model's packed copies: the codes, float32 scales (at most twice the stored
    ones' bytes), and the dense products' copies."""
    return sum(t.nbytes * (1 if t is m.codes else 2) for m in coded for t in m.qweight.tensors()) + sum(
        w.nbytes for w in weights)


def _packed_one_row_wins(kernels: NativeKernels, sweep: list[QuantizedLinear], packed: list[PackedCodes],
                         dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the packed codes run one row of input 3% or more faster than the products' own one-row kernel (the
    codes kernel, `quantized_gemv`) over the sweep (its weights streamed from memory, as in a step): over a 150M
    Llama's int8 products on a 2-core Zen 3 the packed codes' few-row tiles ran 1.12-1.17x; AVX512 builds' codes
    kernel has the pair instruction. Also the timing, for the choice's reason."""
    inputs = {k: _random(1, k).to(dtype) for k in {p.shape[1] for p in packed}}
    times = _time_alternately({
        "native": functools.partial(_quantized_packed_products, kernels, packed, inputs),
        "own": functools.partial(_own_products, sweep, inputs),
    }, torch.device("cpu"), repeats=3)
    return (times["native"] <= 0.97 * times["own"],
            f"1 row: {times['native'] * 1e3:.2f} / {times['own'] * 1e3:.2f} ms over {len(sweep)} weights")


def choose_one_request_packing(model: Transformer, forced: bool | None = None) -> Choice:
    """Whether a model with quantized projections runs them outside the engine (one request's prompt and decode steps,
    `infer.generate`) on its codes packed for the native packed product, one-row products included
    (`Transformer.pack_products(True, layout="native", one_row=True)`), rather than on the codes kernel (row-major
    codes, a row at a time) and dequantizing into the GEMM: by the build and the model's dtype, without timing. Taken
    where the model's rows take codes in AVX2's channel form: SmolLM2-135M's Q4_1 file on a 2-core Zen 3 EPYC, its
    121 products packed against their own kernels, alternately: 1 row 0.68-0.76x the time, 16 rows 0.38x, 64 rows
    0.29x, 512 rows 0.79x; an fp32 model on an AVX512-BF16 build too, whose fp32 rows take that form (on a 2-core
    Zen 4 EPYC, SmolLM2's products at one row 0.66-0.69x the AVX512 codes kernel's time). A bf16 model there keeps the
    codes kernel: its codes pack in pairs for the bf16 pair instruction, which the codes kernel has too (the packed
    pairs 1.2x its time at one row). Off where the copies would take more than half the memory left. `forced`: True
    packs (raising where the native packed product cannot take the model), False leaves the products unpacked."""
    name = "packed codes for one request"
    products = model.packable_products()
    coded = [m for m in products if isinstance(m, QuantizedLinear)]
    weights = [m.weight for m in products if isinstance(m, Linear)]
    if not coded:
        return record(Choice(name, "off", "no quantized projections"))
    why = (native_packing_unavailable(weights, coded, model.dtype) if model.compute_dtype in (None, torch.float32)
           else f"the products upcast to {model.compute_dtype}, and it sums in float32")
    if forced is True:
        if why is not None:
            raise ValueError(f"packed_products=True needs the native packed product: {why}; leave it None or False")
        return record(Choice(name, "native", "forced by the caller"))
    if forced is False:
        return record(Choice(name, "off", "forced off by the caller"))
    kernels = native_kernels()
    fp32 = model.dtype == torch.float32  # (fp32 rows take the channel form wherever they take packed codes)
    if why is None and kernels is not None and not fp32 and not kernels.channel_codes:
        why = (f"this build ({kernels.isa}) lays codes out in pairs for the bf16 pair instruction, which the codes "
               "kernel has too")
    copy = _packed_copy_bytes(coded, weights)
    if why is None:
        why = _crowding(copy)
    if why is not None:
        return record(Choice(name, "off", why))
    return record(Choice(name, "native", f"{'fp32' if fp32 else 'bf16'} rows on codes in AVX2's channel form, one row "
                                         "and many (0.3-0.8x the quantized kernels' time on SmolLM2, 2-core Zen 3); "
                                         f"packed copies up to {copy / 2**20:.0f} MiB"))


def _first_within(modules: list[QuantizedLinear], limit: int) -> list[QuantizedLinear]:
    """The first of `modules` up to `limit` bytes of their weights in bf16 (the one that reaches it included)."""
    kept, total = [], 0
    for module in modules:
        if total >= limit:
            break
        kept.append(module)
        total += 2 * module.in_features * module.out_features
    return kept


def _quantized_packed_products(kernels: NativeKernels, packed: list[PackedCodes], inputs: dict[int, torch.Tensor]
                               ) -> list[object]:
    return [kernels.quantized_gemm_packed(p, inputs[p.shape[1]]) for p in packed]


def _rows_the_kernel_wins(kernels: NativeKernels, sweep: list[torch.Tensor],
                          other: Callable[[dict[int, torch.Tensor]], object], limit: int) -> tuple[int, list[str]]:
    """Rows of bf16 input up to which the native few-row kernel beats `other(inputs)` over the sweep: each of 2, 4,
    .. `limit` (at most 64) rows timed alternately, the kernel kept up to the count where its relative gains summed
    from 2 rows on are largest, if that sum is 3% or more; 1 otherwise. (Stopping at the first count it did not win
    by 3% let one noisy timing on a shared host cut it to 2 rows where it wins to 32.) Also the timings, for the
    choice's reason."""
    timed: list[str] = []
    best, rows, gains = 0.03, 1, 0.0
    for m in (m for m in (2, 4, 8, 16, 32, 64) if m <= limit):
        inputs = {w.shape[1]: _random(m, w.shape[1]).to(torch.bfloat16) for w in sweep}
        times = _time_alternately({
            "kernel": functools.partial(_sweep_products, kernels.gemm_bf16, sweep, inputs),
            "other": functools.partial(other, inputs),
        }, torch.device("cpu"), repeats=3)
        timed.append(f"{m}: {times['kernel'] * 1e3:.1f} / {times['other'] * 1e3:.1f} ms")
        gains += times["other"] / times["kernel"] - 1.0
        if gains >= best:
            best, rows = gains, m
    return rows, timed


def _packed_products(sweep: list[torch.Tensor], packed: list[torch.Tensor], inputs: dict[int, torch.Tensor],
                     upcast: torch.dtype | None = None) -> list[object]:
    if upcast is not None:  # (as Linear runs a copy packed in the dtype its products upcast to)
        return [packed_linear(inputs[w.shape[1]].to(upcast), p, None).to(w.dtype)
                for w, p in zip(sweep, packed, strict=True)]
    return [packed_linear(inputs[w.shape[1]], p, None) for w, p in zip(sweep, packed, strict=True)]


def _upcast_products(sweep: list[torch.Tensor], inputs: dict[int, torch.Tensor], upcast: torch.dtype) -> list[object]:
    """What an unpacked Linear whose products upcast runs: the input and the whole weight widened on every call."""
    return [torch.nn.functional.linear(inputs[w.shape[1]].to(upcast), w.to(upcast)).to(w.dtype) for w in sweep]


def _native_packed_products(kernels: NativeKernels, sweep: list[torch.Tensor], packed: list[torch.Tensor],
                            inputs: dict[int, torch.Tensor]) -> list[object]:
    return [kernels.gemm_packed(p, inputs[w.shape[1]], w.shape[0]) for w, p in zip(sweep, packed, strict=True)]


def choose_quantized_tile_rows(weight: QuantizedWeight, quantized_rows: int, forced: int | None = None) -> Choice:
    """Rows of bf16 input up to which a quantized product past `quantized_rows` runs the native tile kernel (each
    tile of 4 weight rows dequantized in cache, infer/kernels/cpu_decode.c's `infer_qgemm_bf16`) rather than
    dequantizing the whole weight into the GEMM: the batched engine's decode steps. Timed on `weight` (the model's
    largest projection), doubling the rows from twice `quantized_rows` while the kernel is faster by 3%,
    alternately; 1 (never) without AVX512-BF16. `forced` skips the timing."""
    name = "few-row bf16 product rows"
    if forced is not None:
        return record(Choice(name, str(forced), "forced by the caller"))
    kernels = native_kernels()
    if kernels is None or not kernels.gemm_bf16_available or not kernels.takes(weight):
        return record(Choice(name, "1", "quantized products past the codes kernel's rows dequantize into the GEMM "
                                        "(no AVX512-BF16 tile kernel here)"))
    rows, timed, m = 1, [], max(2 * quantized_rows, 2)
    while m <= 64:
        x = _random(m, weight.shape[1]).to(torch.bfloat16)
        times = _time_alternately({
            "kernel": functools.partial(kernels.quantized_gemm_bf16, weight, x),
            "gemm": functools.partial(dequantized_product, kernels, x, weight, None),
        }, torch.device("cpu"), repeats=5)
        timed.append(f"{m}: {times['kernel'] * 1e3:.2f} / {times['gemm'] * 1e3:.2f} ms")
        if times["kernel"] >= 0.97 * times["gemm"]:
            break
        rows, m = m, 2 * m
    return record(Choice(name, str(rows), f"tile kernel / dequantize + GEMM on {tuple(weight.shape)} "
                                          f"({weight.scheme}) by rows: {', '.join(timed)}"))


def _sweep_products(product: Callable[..., object], sweep: list[torch.Tensor], inputs: dict[int, torch.Tensor],
                    swap: bool = False) -> list[object]:
    """`product(weight, x)` (`product(x, weight)` with `swap`) for every weight of the sweep."""
    return [product(inputs[w.shape[1]], w) if swap else product(w, inputs[w.shape[1]]) for w in sweep]


_SWEEP_MIN_BYTES = 2**30


def _sweep_weights(weights: list[torch.Tensor], limit: int | None = None) -> list[torch.Tensor]:
    """The distinct weights in order, cut after `limit` (default max(1 GiB, 2 x last-level cache)) bytes."""
    limit = max(_SWEEP_MIN_BYTES, 2 * last_level_cache_bytes()) if limit is None else limit
    distinct: dict[int, torch.Tensor] = {}
    total = 0
    for w in weights:
        if w.data_ptr() not in distinct and total < limit:
            distinct[w.data_ptr()] = w
            total += w.nbytes
    return list(distinct.values())


def _native_absence(kernels: NativeKernels | None, device: torch.device) -> str:
    if device.type != "cpu":
        return f"CPU only, the model is on {device.type}"
    if kernels is None:
        return str(unavailable_reason())
    return "a weight it cannot take (dtype or layout)"


@functools.cache
def last_level_cache_bytes(sysfs: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """Size of the CPU's largest cache (Linux sysfs), 0 where it cannot be read."""
    sizes = [0]
    for entry in Path(sysfs).glob("index*/size"):
        text = entry.read_text().strip() if entry.is_file() else ""
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes)


def _time_alternately(forms: dict[str, Callable[[], object]], device: torch.device,
                      repeats: int) -> dict[str, float]:
    """Median seconds of each form, after one warm-up call each, the forms timed in turn (so drift in the
    machine's speed hits them alike)."""
    times: dict[str, list[float]] = {key: [] for key in forms}
    with torch.inference_mode():
        for fn in forms.values():
            fn()
        for _ in range(repeats):
            for key, fn in forms.items():
                start = time.perf_counter()
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[key].append(time.perf_counter() - start)
    return {key: _median(t) for key, t in times.items()}


def choose_decode_attention(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                            forced: str = "auto") -> Choice:
    """How the batched engine attends the one-token sequences of a step together: PyTorch's fused SDPA, two
    batched matmuls (`decode_attention_matmul`) over gathered blocks, or on the CPU the native paged kernel over the
    blocks in place, whichever is faster here on this model's head shapes (16 sequences of 256 keys, timed
    alternately); `forced` ("sdpa", "matmul", "native", or "per-sequence": no batching, the check; "triton": the
    paged kernel) skips that; on CUDA with Triton the kernel is the choice. On a 2-core EPYC the matmul form
    measured 2.3x faster than SDPA in bf16."""

    name = "batched decode attention"
    if forced != "auto":
        if forced not in DECODE_KERNELS:
            raise ValueError(f"decode_attention must be 'auto' or one of {', '.join(map(repr, DECODE_KERNELS))}, "
                             f"got {forced!r}")
        if forced == "triton" and not triton_available(device.type):
            raise ValueError(f"decode_attention='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 on "
                             f"the CPU, for tests); this is {device.type}: use 'auto'")
        if forced == "native" and (device.type != "cpu" or native_kernels() is None):
            raise ValueError(f"decode_attention='native' runs on the CPU with the native kernels built; this is "
                             f"{device.type}{'' if device.type != 'cpu' else ' and they did not build'}: use 'auto'")
        return record(Choice(name, forced, "forced by the caller"))
    if device.type == "cuda" and triton_available("cuda"):
        return record(Choice(name, "triton", "CUDA with Triton: the paged kernel reads the pool in place"))
    times = _time_decode_attention(config.num_attention_heads, config.num_key_value_heads, config.head_dim, dtype,
                                   device)
    value = "matmul" if times["matmul"] < 0.95 * times["sdpa"] else "sdpa"
    if "native" in times and times["native"] < 0.95 * times[value]:
        value = "native"
    return record(Choice(name, value, "16 sequences x 256 keys: " + ", ".join(
        f"{k} {t * 1e3:.2f} ms" for k, t in times.items()) + " (medians, alternately)"))


@functools.cache
def _time_decode_attention(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                           batch: int = 16, keys: int = 256, repeats: int = 7) -> dict[str, float]:
    from infer.attention import decode_attention, decode_attention_matmul
    from infer.backends import gather_blocks, native_paged_attention
    from infer.ragged import DecodeGroup

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, 1, head_dim, generator=gen).to(dtype=dtype, device=device)
    # The keys as the engine holds them, a pool of blocks of 16 with a table per sequence: SDPA and the matmuls
    # gather them first (timed with them, as each step pays it), the native kernel reads them in place.
    blocks = torch.randn(batch * keys // 16, kv_heads, 16, head_dim, generator=gen).to(dtype=dtype, device=device)
    tables = torch.randperm(batch * keys // 16, generator=gen).view(batch, -1).to(device)
    lengths = torch.randint(1, keys + 1, (batch,), generator=gen).to(device)
    mask = (torch.arange(keys, device=device)[None] < lengths[:, None])[:, None, None]

    def gathered(attend: Callable[..., torch.Tensor]) -> Callable[[], object]:
        return lambda: attend(q, gather_blocks(blocks, tables), gather_blocks(blocks, tables), mask, 0.125)

    contenders = {"sdpa": gathered(decode_attention), "matmul": gathered(decode_attention_matmul)}
    if device.type == "cpu" and native_kernels() is not None:
        group = DecodeGroup("native", torch.arange(batch), tables, lengths, {}, torch.zeros(batch, dtype=torch.long))
        contenders["native"] = lambda: native_paged_attention(q[:, :, 0], blocks, blocks, group, 0.125, None, None)
    return _time_alternately(contenders, device, repeats)


CHUNK_ATTENTION = (*IN_PLACE_KERNELS, "sdpa")


def choose_chunk_attention(config: ModelConfig, dtype: torch.dtype, device: torch.device, decode_attention: str,
                           forced: str = "auto") -> Choice:
    """How the batched engine attends the prompt chunks of a step: "native" (CPU) or "triton" (CUDA), every token a
    row of the decode group's in-place kernel (each masked by its own position: no gather, no per-sequence call;
    over a quantized pool's codes and staging too), or "sdpa", each chunk by SDPA over its gathered keys (a quantized
    pool's dequantized). A kernel needs the decode rows to attend by it; "auto" takes it where it is 5% faster than
    SDPA here on this model's head shapes (prompts of 128 tokens, 4 on a CPU and 32 on a GPU, timed alternately over
    exact blocks; a quantized pool's gathers also dequantize, so the kernel gains there at least as much), and for a
    bf16 model on the CPU unless SDPA is twice as fast (the kernel's steps run as one native call): on a 2-core
    EPYC at the 150M Llama's heads 2.03 vs 3.27 ms in bf16 (SDPA's CPU flash kernel ran such chunks at 30-70
    GFLOP/s), 3.27 vs 3.33 in fp32; on a 2-core Xeon with AMX, where an exact pool's chunks of 8 rows or more take
    the AMX tiles (a chunk's keys laid out once for 16 rows at a time), 1.27 vs 1.79 ms (the row kernel alone 3.26).
    On CUDA the SDPA form is one gather and one call per chunk and layer: host-bound
    at many prompts a step (a quantized pool's prefill step of 64 prompts took 522 ms against the exact pool's 96
    on an H200)."""
    name = "prompt chunk attention"
    if forced not in ("auto", *CHUNK_ATTENTION):
        raise ValueError(f"chunk_attention must be 'auto', 'native', 'triton' or 'sdpa', got {forced!r}")
    kernel = decode_attention if decode_attention in IN_PLACE_KERNELS else None
    if forced in IN_PLACE_KERNELS and forced != kernel:
        raise ValueError(f"chunk_attention={forced!r} joins the decode rows' kernel, but they attend by "
                         f"{decode_attention!r}; use 'auto' or 'sdpa'")
    if forced != "auto":
        return record(Choice(name, forced, "forced by the caller"))
    if kernel is None:
        return record(Choice(name, "sdpa", f"the decode rows attend by {decode_attention!r}, not in place"))
    if kernel == "triton" and device.type != "cuda":
        return record(Choice(name, "sdpa", "Triton runs interpreted off CUDA (a check, not a speed); force 'triton'"))
    prompts = 32 if device.type == "cuda" else 4
    times = _time_chunk_attention(config.num_attention_heads, config.num_key_value_heads, config.head_dim, dtype,
                                  str(device), kernel, prompts)
    # A bf16 model's steps whose every token is a row of the native kernel run as one native call
    # (infer_batch_step); SDPA's chunks take the per-op path around their attention. On a 2-core Xeon the attention
    # alone timed either way (the kernel 0.89-1.52x SDPA's time in eight runs: a coin toss) while whole prompt steps
    # ran 1.19-1.36x faster with the kernel in two runs (1.38x over an int4 pool), so there SDPA must be twice as fast
    # to be taken.
    whole_steps = kernel == "native" and dtype == torch.bfloat16
    value = kernel if times[kernel] < (2.0 if whole_steps else 0.95) * times["sdpa"] else "sdpa"
    return record(Choice(name, value, f"{prompts} prompts x 128 tokens: " + ", ".join(
        f"{k} {t * 1e3:.2f} ms" for k, t in times.items()) + " (medians, alternately)" +
        ("; the kernel's steps run as one native call: taken unless SDPA is twice as fast" if whole_steps else "")))


@functools.cache
def _time_chunk_attention(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device_name: str,
                          kernel: str, prompts: int, tokens: int = 128, repeats: int = 5) -> dict[str, float]:
    from infer.backends import paged_attention
    from infer.ragged import SeqChunk, build_ragged_batch

    device = torch.device(device_name)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, prompts * tokens, head_dim, generator=gen).to(device, dtype)
               for h in (heads, kv_heads, kv_heads))
    per_prompt = tokens // 16
    k_blocks, v_blocks = (torch.zeros(prompts * per_prompt, kv_heads, 16, head_dim, dtype=dtype, device=device)
                          for _ in range(2))
    chunks = [SeqChunk(0, tokens, list(range(i * per_prompt, (i + 1) * per_prompt))) for i in range(prompts)]
    sample = [True] * prompts
    batches = {way: build_ragged_batch(chunks, sample, block_size=16, windows=[None], device=device,
                                       decode_kernel=kernel, every_token=way == kernel)
               for way in (kernel, "sdpa")}
    rows = native_kernels() if kernel == "native" else None
    return _time_alternately({way: functools.partial(paged_attention, q, k, v, k_blocks, v_blocks, batch, None,
                                                     head_dim**-0.5, native=rows)
                              for way, batch in batches.items()}, device, repeats)


def choose_threads(model: Transformer, forced: int = 0, steps: int = 6) -> Choice:
    """Set and return the CPU thread count for decoding `model`: `forced` when > 0, else the faster of one
    thread and PyTorch's default, timed alternately on real decode steps of this model. Small models (and
    any model on a machine busy with other work) can be faster on one thread than on all cores."""
    name = "CPU threads"
    default = torch.get_num_threads()
    if forced > 0:
        torch.set_num_threads(forced)
        return record(Choice(name, str(forced), "forced by the caller"))
    device = next(model.parameters()).device
    if device.type != "cpu" or default == 1:
        return record(Choice(name, str(default), f"nothing to choose ({device.type}, {default} thread default)"))
    cache = create_cache("contiguous", model.config, max_seq_len=64 + steps * 4, dtype=next(model.parameters()).dtype)
    token = torch.tensor([[1]])
    with torch.inference_mode():
        model(torch.ones(1, 64, dtype=torch.long), cache)
        times: dict[int, list[float]] = {1: [], default: []}
        for _ in range(steps):
            for n in times:
                torch.set_num_threads(n)
                start = time.perf_counter()
                model(token, cache)
                times[n].append(time.perf_counter() - start)
    one, many = _median(times[1][1:]), _median(times[default][1:])
    best = 1 if one < many else default
    torch.set_num_threads(best)
    return record(Choice(name, str(best), f"decode step {one * 1e3:.2f} ms on 1 thread, {many * 1e3:.2f} ms on "
                                          f"{default} (medians, timed alternately)"))


def _random(*shape: int) -> torch.Tensor:
    """Inputs for a timing, drawn from a generator of their own: loading a model or building an engine leaves the
    caller's global random state as it was (its unseeded requests follow the global seed)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _median_time(fn: Callable[[], object], repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return _median(times)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Rows a step's products are timed at for the token budget: a CPU's products stop gaining within a few hundred
# rows, a GPU's far later.
BUDGET_ROWS = {"cpu": (256, 512, 1024, 2048), "cuda": (256, 512, 1024, 2048, 4096, 8192)}
BUDGET_SLACK = 1.05


def choose_token_budget(model: Transformer, max_num_seqs: int, forced: int | None = None) -> Choice:
    """The batched engine's tokens per step (`max_num_batched_tokens`): `forced` where given, else the fewest of
    the candidate rows (256 .. 2048 on a CPU, .. 8192 on a GPU) at which a prompt token costs within 5% of the
    least it costs at any of them, and at least `max_num_seqs` (a step holds every running request's decode token).
    A token's cost at R rows is the model's products per token at their rate at R rows (`product_rates`) plus a
    step's fixed cost shared by its R tokens, measured as a one-token step of the model (`step_fixed_cost`: the
    weights streamed once, the Python around a forward). Past the budget a bigger prompt chunk saves the
    throughput little and lengthens every step the running requests' tokens wait on. The value is an int's
    digits; the measurements are made once per model. The engine is exact at every budget: it moves speed only."""
    name = "token budget"
    if forced is not None:
        if isinstance(forced, bool) or not isinstance(forced, int) or forced < 1:
            raise ValueError(f"max_num_batched_tokens must be an int >= 1 or None (measured), got {forced!r}")
        return record(Choice(name, str(forced), "forced by the caller"))
    rates = product_rates(model, BUDGET_ROWS.get(model.device.type, BUDGET_ROWS["cpu"]))
    fixed = step_fixed_cost(model)
    budget = pick_token_budget(rates, token_flops(model), fixed, max_num_seqs)
    table = ", ".join(f"{rows} rows {rate / 1e9:.0f}" for rows, rate in rates.items())
    return record(Choice(name, str(budget), f"the products' GFLOP/s by rows: {table}; a one-token step "
                                            f"{fixed * 1e3:.2f} ms (medians): the fewest rows whose cost a token is "
                                            f"within 5% of the least, at least max_num_seqs ({max_num_seqs})"))


def pick_token_budget(rates: dict[int, float], flops: float, fixed_s: float, max_num_seqs: int) -> int:
    """The token budget from the products' rates by rows, their FLOPs a token and a step's fixed cost in seconds
    (`choose_token_budget`'s rule)."""
    cost = {rows: flops / rate + fixed_s / rows for rows, rate in rates.items()}
    least = min(cost.values())
    return max(min(rows for rows, c in cost.items() if c <= BUDGET_SLACK * least), max_num_seqs)


def token_flops(model: Transformer) -> float:
    """FLOPs of one token through the model's decoder products (2 x their weights; the LM head runs for the rows
    that sample only)."""
    return _row_flops(_distinct_products(model)[:-1])


def _distinct_products(model: Transformer) -> list[Linear | QuantizedLinear]:
    """The step's products, each once, in model order (the LM head last)."""
    return list({id(m): m for m in model.packable_products()}.values())


def _row_flops(products: Sequence[Linear | QuantizedLinear]) -> float:
    """FLOPs of one row through `products` (2 x their weights)."""
    return 2.0 * sum(p.in_features * p.out_features for p in products)


def step_fixed_cost(model: Transformer, steps: int = 7) -> float:
    """Seconds of a one-token step of the model (the median of `steps` after a warm-up, on a contiguous cache
    holding 8 tokens): what any step pays whatever its rows (the weights streamed once, the Python around a
    forward), the cost a step's tokens share. Measured once per model, device and dtype."""
    cached: dict[tuple[str, torch.dtype], float] = model.__dict__.setdefault("_step_fixed_cost", {})
    key = (str(model.device), model.dtype)
    if key not in cached:
        device = model.device
        cache = create_cache("contiguous", model.config, max_seq_len=8 + steps + 1, dtype=model.dtype, device=device)
        token = torch.ones(1, 1, dtype=torch.long, device=device)

        def step() -> None:
            model(token, cache)
            synchronize(device)

        with torch.inference_mode():
            model(torch.ones(1, 8, dtype=torch.long, device=device), cache)
            cached[key] = _median_time(step, repeats=steps)
    return cached[key]


def product_rates(model: Transformer, rows: tuple[int, ...]) -> dict[int, float]:
    """FLOP/s of the model's first layer's products (in a step's order) at each of `rows`, by the faster of what
    the engine can run them with: the products' own forward (as in a step: `few_row_products`) and the native
    packed product, of bf16 weights or of a quantized model's packed codes where it takes them (medians of 3, the
    forms alternately). At a few hundred rows and more the products are bound by arithmetic, so one layer's (in
    cache or not) stands for the model's. Measured once per model, device and dtype."""
    cached: dict[tuple[str, torch.dtype, int], float] = model.__dict__.setdefault("_product_rates", {})
    keys = {r: (str(model.device), model.dtype, r) for r in rows}
    wanted = [r for r, key in keys.items() if key not in cached]
    if wanted:
        cached.update({keys[r]: rate for r, rate in _time_product_rates(model, wanted).items()})
    return {r: cached[key] for r, key in keys.items()}


def _time_product_rates(model: Transformer, rows: list[int]) -> dict[int, float]:
    products = _distinct_products(model)
    sweep = products[:max(1, (len(products) - 1) // model.config.num_hidden_layers)]  # (the LM head is last)
    dense = [p.weight for p in sweep if isinstance(p, Linear)]
    coded = [p for p in sweep if isinstance(p, QuantizedLinear)]
    kernels, device = native_kernels(), model.device
    native: Callable[[dict[int, torch.Tensor]], object] | None = None
    if kernels is not None and native_packing_unavailable(dense, coded, model.dtype) is None:
        if len(dense) == len(sweep):
            native = functools.partial(_native_packed_products, kernels, dense, [kernels.pack(w) for w in dense])
        elif len(coded) == len(sweep):
            native = functools.partial(_quantized_packed_products, kernels,
                                       [kernels.pack_codes(p.qweight, model.dtype) for p in coded])
    flops = _row_flops(sweep)
    rates: dict[int, float] = {}
    for m in rows:
        inputs = {p.in_features: _random(m, p.in_features).to(device, model.dtype) for p in sweep}
        forms: dict[str, Callable[[], object]] = {"own": functools.partial(_own_products, sweep, inputs)}
        if native is not None:
            forms["native"] = functools.partial(native, inputs)
        times = _time_alternately(forms, device, repeats=3)
        rates[m] = m * flops / min(times.values())
    return rates


def _own_products(sweep: Sequence[Linear | QuantizedLinear], inputs: dict[int, torch.Tensor]) -> list[object]:
    with few_row_products():  # (forward, not __call__: no hooks, so no tensor-parallel collective)
        return [p.forward(inputs[p.in_features]) for p in sweep]
