"""The native decode GEMV (infer/kernels/cpu_decode.c) held to the formula: every instruction-set path the CPU can
run, every dtype, shapes crossing the vector widths, biases and thread counts; outputs independent of how
many rows a call holds (what makes fused decode projections exact) and of the thread count; nothing
written past the output; a build that cannot happen reported, not raised."""

from __future__ import annotations

import contextlib
import ctypes

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from infer.families import ARCHITECTURES
from infer.kernels import native
from infer.kernels.native import DTYPE_CODES, native_kernels, unavailable_reason
from infer.quant_weights import int8_activation_product
from infer.tuning import build_native_kernels, flavours_for_this_cpu
from tests.helpers import env_set, fma32, on_threads, weight_of


def runnable_flavours() -> list[str]:
    """The flavours this CPU can execute and this machine built."""
    return [f for f in flavours_for_this_cpu() if native_kernels(f) is not None]


FLAVOURS_HERE = runnable_flavours()
needs_build = pytest.mark.skipif(native_kernels() is None, reason=f"no native build here: {unavailable_reason()}")
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def error_bound(w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """|computed - exact| for fp32 sums of k products (and a bias) rounded once to `dtype`: the fp32
    accumulation bound (k+1) u32 sum|w x| plus half an ulp of `dtype` relative to the result."""
    k = w.shape[1]
    magnitude = w.double().abs() @ x.double().abs() + (0 if bias is None else bias.double().abs())
    exact = w.double() @ x.double() + (0 if bias is None else bias.double())
    return (k + 2) * 2.0**-24 * magnitude * (1 + UNIT_ROUNDOFF[dtype]) + UNIT_ROUNDOFF[dtype] * exact.abs() + 1e-30


@needs_build
@settings(max_examples=40, deadline=None)
@given(flavour=st.sampled_from(FLAVOURS_HERE or ["native"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       n=st.integers(1, 70), k=st.integers(1, 300), with_bias=st.booleans(), threads=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_every_path_computes_the_product(flavour: str, dtype: torch.dtype, n: int, k: int, with_bias: bool,
                                         threads: int, seed: int) -> None:
    kernels = native_kernels(flavour)
    assert kernels is not None
    if dtype not in kernels.dtypes:
        return
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    with on_threads(threads):
        y = kernels.gemv(w, x, bias)
    exact = w.double() @ x.double() + (0 if bias is None else bias.double())
    assert y.dtype == dtype and y.shape == (n,)
    excess = (y.double() - exact).abs() - error_bound(w, x, bias, dtype)
    assert excess.max() <= 0, f"{flavour} {dtype} n={n} k={k}: row {int(excess.argmax())} off by more than rounding"


@needs_build
@needs_build
@pytest.mark.parametrize("k", [1, 15, 17, 31, 33, 47, 63, 65, 300])
@pytest.mark.parametrize("flavour", FLAVOURS_HERE or ["native"])
def test_the_last_value_of_every_row_is_summed(flavour: str, k: int) -> None:
    """Each path's tail past its last whole vector: only the last value of x is non-zero, so a dropped tail
    element gives 0 where the product is each row's last weight (the random test can miss it under rounding)."""
    kernels = native_kernels(flavour)
    assert kernels is not None
    for dtype in kernels.dtypes:
        w = torch.arange(1, 5 * k + 1, dtype=torch.float32).view(5, k).to(dtype)
        x = torch.zeros(k, dtype=dtype)
        x[-1] = 1
        assert torch.equal(kernels.gemv(w, x).float(), w[:, -1].float()), f"{flavour} {dtype} k={k}"


@settings(max_examples=20, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16]), n=st.integers(2, 90), k=st.integers(1, 200),
       cut=st.integers(1, 89), seed=st.integers(0, 2**16))
def test_outputs_do_not_depend_on_the_rows_in_a_call_or_the_threads(dtype: torch.dtype, n: int, k: int,
                                                                     cut: int, seed: int) -> None:
    """Each output is its own row's sum: the rows of one call equal the same rows called apart (so fused q/k/v
    equal the separate products bit for bit) on any number of threads."""
    kernels = native_kernels()
    assert kernels is not None
    cut = min(cut, n - 1)
    gen = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=gen).to(dtype), torch.randn(k, generator=gen).to(dtype)
    whole = kernels.gemv(w, x)
    assert torch.equal(whole, torch.cat([kernels.gemv(w[:cut], x), kernels.gemv(w[cut:], x)]))
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            assert torch.equal(kernels.gemv(w, x), whole), f"{threads} threads"
    finally:
        torch.set_num_threads(before)


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nothing_is_written_past_the_output_and_inputs_are_untouched(dtype: torch.dtype) -> None:
    kernels = native_kernels()
    assert kernels is not None
    n, k = 37, 70
    w, x, bias = torch.randn(n, k).to(dtype), torch.randn(k).to(dtype), torch.randn(n).to(dtype)
    originals = [w.clone(), x.clone(), bias.clone()]
    out = torch.full((n + 16,), 7.0, dtype=dtype)
    kernels._gemv(DTYPE_CODES[dtype], w.data_ptr(), x.data_ptr(), bias.data_ptr(), out.data_ptr(), n, k, 2)
    assert torch.equal(out[n:], torch.full((16,), 7.0, dtype=dtype)), "written past the n outputs"
    assert torch.equal(out[:n], kernels.gemv(w, x, bias))
    assert all(torch.equal(a, b) for a, b in zip(originals, [w, x, bias], strict=True)), "an input changed"


@needs_build
def test_non_finite_values_stay_in_their_row() -> None:
    kernels = native_kernels()
    assert kernels is not None
    w = torch.ones(40, 64, dtype=torch.bfloat16)
    w[3, 5], w[20, 63] = float("nan"), float("inf")
    y = kernels.gemv(w, torch.ones(64, dtype=torch.bfloat16))
    assert y[3].isnan() and y[20] == float("inf")
    others = [i for i in range(40) if i not in (3, 20)]
    assert torch.equal(y[others], torch.full((38,), 64.0, dtype=torch.bfloat16))


@needs_build
def test_inputs_of_another_dtype_or_layout_are_converted() -> None:
    kernels = native_kernels()
    assert kernels is not None
    w = torch.randn(24, 48).to(torch.bfloat16)
    x = torch.randn(2, 48)[:, 0:48][1]  # fp32, a view
    strided = torch.randn(96).to(torch.bfloat16)[::2]
    assert torch.equal(kernels.gemv(w, x), kernels.gemv(w, x.to(torch.bfloat16)))
    assert torch.equal(kernels.gemv(w, strided), kernels.gemv(w, strided.contiguous()))
    assert not kernels.supports(w.T) and not kernels.supports(w.to(torch.float64)) and kernels.supports(w)


@needs_build
def test_read_probe_reads_every_byte() -> None:
    kernels = native_kernels()
    assert kernels is not None
    buffer = torch.arange(1000, dtype=torch.float32)
    assert kernels.read(buffer) == pytest.approx(float(buffer.sum()))


def test_a_missing_or_failing_compiler_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: object) -> None:
    monkeypatch.setenv("INFER_KERNEL_DIR", str(tmp_path))
    try:
        native_kernels.cache_clear()
        monkeypatch.setenv("CC", "/nonexistent/cc")
        assert native_kernels() is None and "CC=/nonexistent/cc not found" in str(unavailable_reason())
        native_kernels.cache_clear()
        monkeypatch.setenv("CC", "false")
        assert native_kernels() is None and "could not build cpu_decode.c" in str(unavailable_reason())
        native_kernels.cache_clear()
        monkeypatch.delenv("CC")
        monkeypatch.setenv("INFER_NATIVE", "0")
        assert native_kernels() is None and "INFER_NATIVE=0" in str(unavailable_reason())
        with pytest.raises(ValueError, match="flavour must be one of"):
            native_kernels("avx1024")
    finally:
        monkeypatch.undo()
        native_kernels.cache_clear()


@needs_build
def test_builds_are_cached_per_source_and_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    from pathlib import Path

    monkeypatch.setenv("INFER_KERNEL_DIR", str(tmp_path))
    compiler = native.shutil.which("cc") or native.shutil.which("gcc")
    assert compiler is not None
    # -O0: the cache's keys are what is tested, not the code (an -O2 build of the kernels takes ~8 s)
    first = native._build(compiler, ("-O0", "-shared", "-fPIC"))
    assert native._build(compiler, ("-O0", "-shared", "-fPIC")) == first, "an identical build is reused"
    assert native._build(compiler, ("-O0", "-shared", "-fPIC", "-DINFER_OTHER")) != first, "other flags, another build"
    assert [p.name for p in Path(str(tmp_path)).iterdir() if not p.name.startswith("gemv-")] == [], "no temp left"
    ctypes.CDLL(str(first))  # loadable


@needs_build
def test_make_setup_builds_every_flavour_this_cpu_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """`make setup`'s builds: one report per flavour the CPU's flags allow, "built" exactly where it loads (found in
    the cache the test workers read); a CPU without AVX2 or AVX512 is asked for neither."""
    report = build_native_kernels()
    assert list(report) == flavours_for_this_cpu() and report["native"] == "built"
    for flavour, how in report.items():
        assert (how == "built") == (native_kernels(flavour) is not None), (flavour, how)
    monkeypatch.setattr("infer.tuning.cpu_flags", lambda cpuinfo="/proc/cpuinfo": frozenset({"sse2"}))
    assert flavours_for_this_cpu() == ["native", "generic"]


# ---- the small ops of a one-token step, against the PyTorch formulas they replace ----

# One ulp relative to the value (2^-7 for bf16), twice: Llama's norm rounds h, then weight * h, so an h on a
# rounding boundary that the two sums round apart moves the product by up to an ulp of h plus its own rounding.
ULP = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9}


def assert_within_an_ulp(got: torch.Tensor, want: torch.Tensor, what: str, absolute: torch.Tensor | float = 0.0
                         ) -> None:
    """Equal but for the last bits of the output dtype (two roundings; fp32: the last few, from sums in another
    order), relative to the larger magnitude, plus `absolute` (where the formula cancels)."""
    tol = ULP[want.dtype] * torch.maximum(got.float().abs(), want.float().abs()) + absolute + 1e-30
    excess = (got.float() - want.float()).abs() - tol
    assert excess.max() <= 0, f"{what}: {int((excess > 0).sum())} values off by more than an ulp"


@needs_build
@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), rows=st.integers(1, 40),
       half=st.integers(1, 80), seed=st.integers(0, 2**16))
def test_native_rope_is_the_formula_bit_for_bit(dtype: torch.dtype, rows: int, half: int, seed: int) -> None:
    from infer.rope import apply_rope

    kernels = native_kernels()
    assert kernels is not None
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 2 * half, generator=gen) * 4).to(dtype)
    angles = torch.randn(2 * half, generator=gen) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want = apply_rope(x[None, :, None, :], cos[None], sin[None])[0, :, 0]
    assert torch.equal(kernels.rope(x, cos, sin), want)


@needs_build
@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       tokens=st.integers(1, 12) | st.integers(64, 80), heads=st.integers(1, 3),
       half=st.sampled_from([16, 32, 64]) | st.integers(1, 40), spare=st.integers(0, 24), seed=st.integers(0, 2**16),
       flavour=st.sampled_from(FLAVOURS_HERE or ["native"]))
def test_native_rope_of_every_row_is_the_formula_bit_for_bit(dtype: torch.dtype, tokens: int, heads: int, half: int,
                                                              spare: int, seed: int, flavour: str) -> None:
    """The engine's steps: q or k as the fused product leaves them (a view of wider rows, heads transposed), each
    token by its own position's cos/sin, against apply_rope on the same view; every build flavour this CPU runs
    (16 lanes on AVX512, 8 on AVX2, the scalar loop)."""
    from infer.rope import apply_rope

    kernels = native_kernels(flavour)
    assert kernels is not None
    gen = torch.Generator().manual_seed(seed)
    d = 2 * half
    wide = (torch.randn(1, tokens, heads * d + spare, generator=gen) * 4).to(dtype)
    x = wide[..., spare:].view(1, tokens, heads, d).transpose(1, 2)  # [1, H, T, D]
    angles = torch.randn(tokens, d, generator=gen) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got = kernels.rope_rows(x, cos, sin)
    assert got.shape == x.shape and torch.equal(got, apply_rope(x, cos, sin))
    assert torch.equal(wide[..., spare:].view(1, tokens, heads, d).transpose(1, 2), x), "the input is left as it was"


@needs_build
@pytest.mark.parametrize("flavour", FLAVOURS_HERE or ["native"])
def test_rounding_to_bf16_keeps_subnormals_and_nans_as_pytorch_does(flavour: str) -> None:
    """The rows ops' rounding to bf16 (an instruction where the build has AVX512-BF16, which flushes subnormals; the
    formula for a vector holding one): RoPE of rows whose products land below fp32's normal range, beside zeros,
    infinities, NaNs and large values in the same vectors, bit for bit the formula's (NaNs where it has them)."""
    from infer.rope import apply_rope

    kernels = native_kernels(flavour)
    assert kernels is not None
    gen = torch.Generator().manual_seed(5)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3e38, -3e38, 1.0])
    x = (torch.randn(1, 4, 8, 64, generator=gen) * 2.0**-128).bfloat16()  # products of ~2^-128: subnormal in fp32
    x[0, 1, :, :8] = specials.bfloat16()  # (rows with no subnormal lane at all too: the instruction's vectors)
    x[0, 2] = (torch.randn(8, 64, generator=gen) * 4).bfloat16()
    x[0, 3, :, 3::16] = specials[:4].repeat(2)[:, None].expand(8, 4).reshape(8, 4).bfloat16()
    angles = torch.randn(8, 64, generator=gen) * 100
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    got, want = kernels.rope_rows(x, cos, sin), apply_rope(x, cos, sin)
    assert torch.equal(got.isnan(), want.isnan()), f"{flavour}: NaNs where the formula has none, or none where it has"
    assert torch.equal(got.nan_to_num(), want.nan_to_num()), f"{flavour}: a rounding parted from the formula's"
    tiny = want.float().abs()
    assert ((tiny > 0) & (tiny < 2.0**-126)).any(), "no subnormal result: the test lost its point"


@needs_build
@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       rows=st.integers(1, 12) | st.integers(64, 90),  # 64 and more: split over threads (the engine's steps)
       d=st.integers(1, 300) | st.sampled_from([64, 768]), gemma=st.booleans(), seed=st.integers(0, 2**16),
       flavour=st.sampled_from(FLAVOURS_HERE or ["native"]))
def test_native_rms_norm_is_the_formula_within_an_ulp(dtype: torch.dtype, rows: int, d: int, gemma: bool,
                                                       seed: int, flavour: str) -> None:
    from infer.models.transformer import RMSNorm

    kernels = native_kernels(flavour)
    assert kernels is not None
    gen = torch.Generator().manual_seed(seed)
    norm = RMSNorm(d, 1e-6, gemma=gemma)
    norm.weight.data = torch.randn(d, generator=gen)
    norm = norm.to(dtype)
    x = (torch.randn(rows, d, generator=gen) * 3).to(dtype)
    with torch.no_grad():
        assert_within_an_ulp(kernels.rms_norm(x, norm.weight, norm.eps, gemma), norm(x), f"{dtype} gemma={gemma}")


@needs_build
@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), n=st.integers(1, 600),
       rows=st.integers(1, 3) | st.integers(64, 66), fused=st.booleans(), gelu=st.booleans(),
       seed=st.integers(0, 2**16), flavour=st.sampled_from(FLAVOURS_HERE or ["native"]))
def test_native_gated_activation_is_the_formula_within_an_ulp(dtype: torch.dtype, n: int, rows: int, fused: bool,
                                                               gelu: bool, seed: int, flavour: str) -> None:
    """`gated` (one row) and `gated_rows` (the engine's steps: every row, gate and up the halves of a fused
    product's rows or two tensors, split over threads; 16 lanes at a time on AVX512, 8 on AVX2) against the
    formula, in every build flavour this CPU runs."""
    import torch.nn.functional as F

    kernels = native_kernels(flavour)
    assert kernels is not None
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(rows, 2 * n, generator=gen) * 4).to(dtype)
    gate_up[0, : min(n, 4)] = torch.tensor([0.0, -100.0, 95.0, float("-inf")])[: min(n, 4)].to(dtype)
    gate, up = gate_up.split(n, -1) if fused else (gate_up[:, :n].clone(), gate_up[:, n:].clone())
    want = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
    # 1 + tanh(...) cancels for very negative gates: both sides err by ~an fp32 ulp of |gate * up| there.
    cancel = 4 * 2.0**-24 * (gate.float() * up.float()).abs().nan_to_num()
    what = f"{dtype} {'gelu' if gelu else 'silu'}"
    before = gate_up.clone()
    got = kernels.gated_rows(gate, up, gelu)
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaNs where the formula has none, or none where it has"
    assert_within_an_ulp(got.nan_to_num(), want.nan_to_num(), f"{what}, {rows} rows", cancel)
    assert torch.equal(gate_up.nan_to_num(), before.nan_to_num()), "the input is left as it was"
    if rows == 1:
        assert_within_an_ulp(kernels.gated(gate_up, gelu).nan_to_num(), want.nan_to_num(), what, cancel)


@needs_build
@pytest.mark.parametrize("flavour", FLAVOURS_HERE or ["native"])
def test_the_row_ops_at_the_engines_shapes(flavour: str) -> None:
    """The vector paths the properties above draw among other shapes, at the sizes a 150M Llama's decode step of
    16 requests has (bf16; hidden 768, 12 heads of 64, MLP 3072), in every build flavour: RoPE bit for bit, the
    norm and SiLU * up within an ulp of PyTorch's formulas."""
    import torch.nn.functional as F

    from infer.models.transformer import RMSNorm
    from infer.rope import apply_rope

    kernels = native_kernels(flavour)
    assert kernels is not None
    gen = torch.Generator().manual_seed(3)
    q = (torch.randn(1, 16, 12 * 64, generator=gen) * 4).bfloat16().view(1, 16, 12, 64).transpose(1, 2)
    angles = torch.randn(16, 64, generator=gen) * 100
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    assert torch.equal(kernels.rope_rows(q, cos, sin), apply_rope(q, cos, sin)), f"{flavour}: RoPE"
    norm = RMSNorm(768, 1e-6)
    norm.weight.data = torch.randn(768, generator=gen)
    norm = norm.bfloat16()
    x = (torch.randn(16, 768, generator=gen) * 3).bfloat16()
    with torch.no_grad():
        assert_within_an_ulp(kernels.rms_norm(x, norm.weight, norm.eps, False), norm(x), f"{flavour}: RMSNorm")
    gate, up = (torch.randn(16, 2 * 3072, generator=gen) * 4).bfloat16().split(3072, -1)
    assert_within_an_ulp(kernels.gated_rows(gate, up, False), F.silu(gate) * up, f"{flavour}: SiLU * up",
                         4 * 2.0**-24 * (gate.float() * up.float()).abs())


@needs_build
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_native_step_ops_match_pytorch_ops(arch: str) -> None:
    """A one-token step with native small ops against the same step with PyTorch's (`native_ops=False`, the
    unoptimised path): fp32 logits within 1e-5 of the logit scale, the same greedy tokens; batches and prefill
    never take them."""
    import infer
    from reference import build_checkpoint

    model = infer.load_model(build_checkpoint(arch), decode_gemv="native")
    ids = torch.randint(0, 400, (1, 14), generator=torch.Generator().manual_seed(9))
    steps = {}
    for on in (True, False):
        model.native_ops = on
        cache = infer.create_cache("contiguous", model.config, max_seq_len=14, dtype=torch.float32)
        with torch.no_grad():
            model(ids[:, :8], cache)
            steps[on] = torch.cat([model(ids[:, i : i + 1], cache) for i in range(8, 14)], 1)
    scale = max(1.0, steps[False].abs().max().item())
    assert (steps[True] - steps[False]).abs().max() <= 1e-5 * scale
    assert torch.equal(steps[True].argmax(-1), steps[False].argmax(-1))
    batch = torch.randint(0, 400, (2, 1), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        model.native_ops = True
        on = model(batch)
        model.native_ops = False
        assert torch.equal(on, model(batch)), "a batch of one-token rows takes PyTorch's ops"


needs_bf16_pairs = pytest.mark.skipif(native_kernels() is None or not native_kernels().gemm_bf16_available,
                                      reason="the few-row bf16 product needs AVX512-BF16 (and a native build)")


@needs_bf16_pairs
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 21), n=st.integers(1, 70), k=st.integers(1, 300), with_bias=st.booleans(),
       threads=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_the_few_row_bf16_product_is_the_formula(m: int, n: int, k: int, with_bias: bool, threads: int,
                                                 seed: int) -> None:
    """Every output of `gemm_bf16` (tiles of 4 weight rows by 4 input rows, spare lanes, the tail of k) within the
    rounding of fp32 sums rounded once to bf16, and bit for bit what it gives for that input row alone (each
    output is its own sum in a fixed order: the batch around a request never changes its projections)."""
    kernels = native_kernels()
    assert kernels is not None
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    x_before = x.clone()
    with on_threads(threads):
        y = kernels.gemm_bf16(w, x, bias)
        alone = [kernels.gemm_bf16(w, x[j : j + 1], bias)[0] for j in range(m)]
    assert y.dtype == torch.bfloat16 and y.shape == (m, n) and torch.equal(x, x_before)
    assert_rows_are_the_formula(y, alone, w, x, bias)


def assert_rows_are_the_formula(y: torch.Tensor, alone: list[torch.Tensor], w: torch.Tensor, x: torch.Tensor,
                                bias: torch.Tensor | None) -> None:
    """Each row of a bf16 product `y` within rounding of the fp32 formula, and bit for bit that row's product alone."""
    for j in range(x.shape[0]):
        exact = w.double() @ x[j].double() + (0 if bias is None else bias.double())
        excess = (y[j].double() - exact).abs() - error_bound(w, x[j], bias, torch.bfloat16)
        assert excess.max() <= 0, f"{tuple(y.shape)} k={w.shape[1]}: row {j}, output {int(excess.argmax())} off by " \
                                  "more than rounding"
        assert torch.equal(y[j], alone[j]), f"row {j} depends on the other rows of the call"


needs_packed_bf16 = pytest.mark.skipif(native_kernels() is None or not native_kernels().packed_bf16_available,
                                       reason="the packed bf16 product needs AVX512-BF16 or AVX2 with FMA")
# (the pair instruction's path, and AVX2's FMAs on a CPU that has both)
PACKED_FLAVOURS = [f for f in FLAVOURS_HERE if getattr(native_kernels(f), "packed_bf16_available", False)]


@pytest.mark.skipif(not PACKED_FLAVOURS, reason="the packed bf16 product needs AVX512-BF16 or AVX2 with FMA")
@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 21), n=st.integers(1, 70), pairs=st.integers(1, 150), with_bias=st.booleans(),
       threads=st.integers(1, 3), ahead=st.sampled_from([1, 2]), seed=st.integers(0, 2**16),
       flavour=st.sampled_from(PACKED_FLAVOURS or ["native"]), amx=st.booleans())
# one tile (two prefetch lines a pair) whose next pair of blocks is a lone block of an odd number of pairs: its last
# line prefetched alone
@example(m=3, n=40, pairs=7, with_bias=False, threads=1, ahead=1, seed=0,
         flavour=(PACKED_FLAVOURS or ["native"])[0], amx=False)
def test_the_packed_bf16_product_is_the_formula(m: int, n: int, pairs: int, with_bias: bool, threads: int,
                                                ahead: int, seed: int, flavour: str, amx: bool) -> None:
    """`gemm_bf16_packed` on a weight `pack_bf16` packed (blocks of 16 rows, the last one padded; tiles of 8 input
    rows by 2 blocks for the pair instruction, 6 by 1 for AVX2's FMAs, rows shared evenly over the tiles; row and
    block tails; on an AMX host its tiles for k a multiple of 32 or, INFER_AMX=0, the pair instruction's for every
    k), prefetching either pair of blocks ahead (`packed_ahead`): every output within the rounding of fp32
    sums rounded once to bf16, bit for bit what that input row alone gives, what the other prefetch distance
    gives and what the tiles give testing the prefetch range in every pair (INFER_PREFETCH_LOOPS=0, the first form
    of their loop), and packing leaves the weight as it was."""
    kernels = native_kernels(flavour)
    assert kernels is not None
    gen = torch.Generator().manual_seed(seed)
    k = 2 * pairs
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    w_before, x_before, before = w.clone(), x.clone(), kernels.packed_ahead
    try:
        with on_threads(threads), amx_switched(amx):
            packed = kernels.pack_bf16(w)
            kernels.packed_ahead = 3 - ahead
            other = kernels.gemm_bf16_packed(packed, x, n, bias)
            kernels.packed_ahead = ahead
            assert kernels.packed_ahead == ahead
            y = kernels.gemm_bf16_packed(packed, x, n, bias)
            alone = [kernels.gemm_bf16_packed(packed, x[j : j + 1], n, bias)[0] for j in range(m)]
            with amx_switched(False, "INFER_PREFETCH_LOOPS"):
                tested = kernels.gemm_bf16_packed(packed, x, n, bias)
    finally:
        kernels.packed_ahead = before
    assert torch.equal(w, w_before) and torch.equal(x, x_before), "the caller's tensors changed"
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert torch.equal(y, other), "the prefetch distance moved a value"
    assert torch.equal(y, tested), "the tiles' loops over the pairs that prefetch moved a value"
    assert_rows_are_the_formula(y, alone, w, x, bias)


@pytest.mark.parametrize(("m", "k"), [(70, 3000), (9, 6000)])
@pytest.mark.parametrize("flavour", PACKED_FLAVOURS)
def test_the_packed_bf16_product_passes_many_rows_in_groups(m: int, k: int, flavour: str) -> None:
    """Rows past what one pass keeps in cache (AVX2's widened rows, 192 KiB: 12 rows of k = 3000, 6 of 6000) go
    through the weights in groups: every row still the formula within rounding and what it gives alone."""
    kernels = native_kernels(flavour)
    assert kernels is not None
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(37, k, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    bias = torch.randn(37, generator=gen).bfloat16()
    packed = kernels.pack_bf16(w)
    y = kernels.gemm_bf16_packed(packed, x, 37, bias)
    assert_rows_are_the_formula(y, [kernels.gemm_bf16_packed(packed, x[j : j + 1], 37, bias)[0] for j in range(m)],
                                w, x, bias)


# AMX tiles: the native build on an Intel Xeon with AMX-BF16 whose kernel grants them (and INFER_AMX not 0)
AMX_HERE = native_kernels() is not None and native_kernels().amx_takes(32)
needs_amx = pytest.mark.skipif(not AMX_HERE, reason="AMX tiles need an Intel Xeon with AMX-BF16 and a native build")


def amx_switched(on: bool, name: str = "INFER_AMX") -> contextlib.AbstractContextManager[None]:
    """INFER_AMX (or another of the kernels' on / off switches, `name`) for the block, put back after."""
    return env_set(name, "1" if on else "0")


@needs_amx
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 75), n=st.integers(1, 70), steps=st.integers(1, 10), with_bias=st.booleans(),
       threads=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_amx_tiles_give_the_formula_and_each_row_alone(m: int, n: int, steps: int, with_bias: bool, threads: int,
                                                      seed: int) -> None:
    """k a multiple of 32 on AMX tiles (32 input rows by 2 blocks a pass; 17-48 rows a block at a time by every row
    tile; a last tile of fewer than 16 rows, a lone last block, threads splitting the blocks): every output within
    the rounding of fp32 sums rounded once to bf16 and bit for bit what its row gives alone and what the two-by-two
    pass gives (INFER_AMX_TALL=0); the pair instruction's tiles (INFER_AMX=0) take the same k and give the same
    rounding's numbers. The caller's tensors unchanged."""
    kernels = native_kernels()
    assert kernels is not None
    k = 32 * steps
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    x_before = x.clone()
    with on_threads(threads):
        packed = kernels.pack_bf16(w)
        with amx_switched(False):
            assert not kernels.amx_takes(k)
            pairs = kernels.gemm_bf16_packed(packed, x, n, bias)
        with amx_switched(True):
            assert kernels.amx_takes(k) and not kernels.amx_takes(k + 2)
            y = kernels.gemm_bf16_packed(packed, x, n, bias)
            alone = [kernels.gemm_bf16_packed(packed, x[j : j + 1], n, bias)[0] for j in range(m)]
            with amx_switched(False, "INFER_AMX_TALL"):
                two_by_two = kernels.gemm_bf16_packed(packed, x, n, bias)
    assert torch.equal(x, x_before), "the caller's tensors changed"
    assert_rows_are_the_formula(y, alone, w, x, bias)
    assert torch.equal(y, two_by_two), "a block at a time by every row tile parted from the two-by-two pass"
    assert_rows_are_the_formula(pairs, [pairs[j] for j in range(m)], w, x, bias)


@pytest.mark.skipif(not PACKED_FLAVOURS, reason="the packed bf16 product needs AVX512-BF16 or AVX2 with FMA")
@pytest.mark.parametrize(("flavour", "amx"),
                         [(f, False) for f in PACKED_FLAVOURS or ["native"]] + ([("native", True)] if AMX_HERE else []))
def test_the_packed_product_keeps_subnormal_outputs(flavour: str, amx: bool) -> None:
    """Outputs in bf16's subnormal range (zero sums plus a subnormal bias) come out as the formula rounds them, not
    flushed to zero (AMX's conversion instruction flushes them; those rows take the formula)."""
    kernels = native_kernels(flavour)
    assert kernels is not None
    n, k = 40, 64
    bias = (torch.arange(1, n + 1, dtype=torch.float32) * 2.0**-133 * torch.tensor([1.0, -1.0]).repeat(n // 2))
    bias = bias.bfloat16()
    assert (bias.float().abs() < torch.finfo(torch.float32).tiny).all() and (bias != 0).all()
    w, x = torch.zeros(n, k, dtype=torch.bfloat16), torch.ones(3, k, dtype=torch.bfloat16)
    with amx_switched(amx):
        assert kernels.amx_takes(k) == amx
        y = kernels.gemm_bf16_packed(kernels.pack_bf16(w), x, n, bias)
    assert torch.equal(y, bias.expand(3, n)), "subnormal outputs changed"


@needs_amx
@pytest.mark.parametrize(("m", "k"), [(150, 3072), (600, 768)])
def test_amx_tiles_pass_many_rows_in_groups(m: int, k: int) -> None:
    """Rows past what one AMX pass keeps in L2 (512 KiB of x: 64 rows of k = 3072, 320 of 768) go through the weights
    in groups, the last ending in a part tile: every row still the formula within rounding and what it gives alone."""
    kernels = native_kernels()
    assert kernels is not None
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(37, k, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    bias = torch.randn(37, generator=gen).bfloat16()
    packed = kernels.pack_bf16(w)
    with amx_switched(True):
        y = kernels.gemm_bf16_packed(packed, x, 37, bias)
        alone = [kernels.gemm_bf16_packed(packed, x[j : j + 1], 37, bias)[0] for j in range(m)]
    assert_rows_are_the_formula(y, alone, w, x, bias)


@pytest.mark.skipif(not PACKED_FLAVOURS, reason="the packed bf16 product needs AVX512-BF16 or AVX2 with FMA")
@settings(max_examples=40, deadline=None)
@given(m=st.sampled_from([1, 7, 16, 17, 33, 48, 64, 65, 150]), blocks=st.integers(1, 41), k=st.sampled_from([64, 3072]),
       threads=st.integers(2, 4), amx=st.booleans(), flavour=st.sampled_from(PACKED_FLAVOURS or ["native"]),
       seed=st.integers(0, 2**16))
def test_blocks_taken_from_other_threads_are_the_static_splits(m: int, blocks: int, k: int, threads: int, amx: bool,
                                                               flavour: str, seed: int) -> None:
    """The packed products share their pairs of blocks among the threads (each its own range from the front, then
    the others' from the back): with the others' backs taken first (INFER_BALANCE=2, every thread taking some of
    every other's blocks while their owners take from the front) or once a range is spent (the default), every
    output is bit for bit the static split's (INFER_BALANCE=0) and within rounding of the formula (a block taken
    by no thread, or by two, would leave or double its columns): 1-4 threads, odd block counts, one group of rows or
    several (k = 3072: 64 rows a group on AMX tiles)."""
    kernels = native_kernels(flavour)
    assert kernels is not None
    n = 16 * blocks - seed % 16
    gen = torch.Generator().manual_seed(seed)
    w, x, bias = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(m, k, generator=gen).bfloat16(), None
    if seed % 2:
        bias = torch.randn(n, generator=gen).bfloat16()
    packed = kernels.pack_bf16(w)
    got = {}
    with on_threads(threads), amx_switched(amx):
        for balance in ("0", "2", "1"):
            with env_set("INFER_BALANCE", balance):
                got[balance] = kernels.gemm_bf16_packed(packed, x, n, bias)
    assert torch.equal(got["2"], got["0"]), "blocks taken from the others' backs parted from the static split"
    assert torch.equal(got["1"], got["0"]), "the default split parted from the static one"
    assert_rows_are_the_formula(got["2"], list(got["0"]), w, x, bias)


@needs_build
@settings(max_examples=40, deadline=None)
@given(kernel=st.sampled_from(["gemv", "quantized_gemv", "quantized_gemv_a8"]), blocks=st.integers(1, 41),
       rows=st.integers(1, 4), k=st.sampled_from([64, 96, 256]), scheme=st.sampled_from(["int4", "int8", "Q8_0"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), threads=st.integers(2, 4),
       flavour=st.sampled_from(FLAVOURS_HERE or ["native"]), seed=st.integers(0, 2**16))
def test_one_row_products_share_their_row_blocks_as_the_static_split(kernel: str, blocks: int, rows: int, k: int,
                                                                     scheme: str, dtype: torch.dtype, threads: int,
                                                                     flavour: str, seed: int) -> None:
    """The GEMV kernels (dense weights, quantized codes, codes by int8 activations) share blocks of 16 output rows
    among the threads as the packed products share theirs: with the others' backs taken first (INFER_BALANCE=2,
    run first, so a block no thread took would hold no earlier call's values) or once a range is spent (the
    default), every output is bit for bit the static split's (INFER_BALANCE=0) and each row its formula within
    rounding (a block no thread took would leave its rows unwritten). 2-4 threads, partial last blocks."""
    kernels = native_kernels(flavour)
    assert kernels is not None
    n = 16 * blocks - seed % 16
    gen = torch.Generator().manual_seed(seed)
    bias = torch.randn(n, generator=gen).to(dtype) if seed % 2 else None
    if kernel == "gemv":
        w = torch.randn(n, k, generator=gen).to(dtype)
        x = torch.randn(k, generator=gen).to(dtype)
        dense = w.double()
        call = lambda: kernels.gemv(w, x, bias)  # noqa: E731
    else:
        weight = weight_of(scheme, n, k, 32, seed)
        dense = weight.dequantize().double()
        x = torch.randn(rows if kernel == "quantized_gemv" else 1, k, generator=gen).to(dtype)
        product = getattr(kernels, kernel)
        call = lambda: product(weight, x, bias)  # noqa: E731
    got = {}
    with on_threads(threads):
        for balance in ("2", "0", "1"):
            with env_set("INFER_BALANCE", balance):
                got[balance] = call()
    assert torch.equal(got["0"], got["2"]), f"{kernel}: rows taken from the others' backs parted from the static split"
    assert torch.equal(got["1"], got["2"]), f"{kernel}: the default split parted from the static one"
    if kernel == "quantized_gemv_a8":  # (x's codes the one approximation: the formula's own)
        exact = int8_activation_product(weight, x.float().reshape(k), None if bias is None else bias.float()).double()
    else:
        exact = x.double() @ dense.T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ dense.abs().T + (0 if bias is None else bias.double().abs())
    bound = 1e-5 * magnitude + 2 * UNIT_ROUNDOFF[dtype] * exact.abs() + 1e-30
    excess = (got["2"].double().reshape(exact.shape) - exact).abs() - bound
    assert excess.max() <= 0, f"{kernel} {scheme} n={n}: output {int(excess.argmax())} is not its row's product"


F32_PACKED_FLAVOURS = [f for f in FLAVOURS_HERE if getattr(native_kernels(f), "packed_f32_available", False)]


def fused_sums(w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The fp32 packed product's formula: each output's sum over k in order, every step a fused multiply-add rounded
    once to fp32 (from +0), then the bias added (one more rounding)."""
    acc = torch.zeros(x.shape[0], w.shape[0])
    for i in range(w.shape[1]):
        acc = fma32(acc, x[:, i : i + 1], w[:, i][None, :])
    return acc if bias is None else acc + bias


@pytest.mark.skipif(not F32_PACKED_FLAVOURS, reason="the fp32 packed product needs AVX2 with FMA")
@settings(max_examples=50, deadline=None)
@given(m=st.integers(1, 21), n=st.integers(1, 70), k=st.integers(1, 150), with_bias=st.booleans(),
       threads=st.integers(1, 3), seed=st.integers(0, 2**16),
       flavour=st.sampled_from(F32_PACKED_FLAVOURS or ["native"]))
def test_the_packed_f32_product_is_its_fused_sums_bit_for_bit(m: int, n: int, k: int, with_bias: bool, threads: int,
                                                              seed: int, flavour: str) -> None:
    """`gemm_f32_packed` on a weight `pack_f32` packed (blocks of 16 rows input-major, the last one padded; tiles of up
    to 6 input rows, rows shared evenly over the tiles; row and column tails; any thread count): every output bit for
    bit its fp32 fused multiply-adds over k in order plus the bias (so no row depends on the others), and neither
    packing nor the product touches the caller's tensors."""
    kernels = native_kernels(flavour)
    assert kernels is not None
    gen = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    w_before, x_before = w.clone(), x.clone()
    with on_threads(threads):
        packed = kernels.pack_f32(w)
        y = kernels.gemm_f32_packed(packed, x, n, bias)
    assert torch.equal(w, w_before) and torch.equal(x, x_before), "the caller's tensors changed"
    assert y.dtype == torch.float32 and y.shape == (m, n)
    want = fused_sums(w, x, bias)
    assert torch.equal(y, want), f"{(y - want).abs().max().item():.3g} from the fused sums in order"


@pytest.mark.parametrize(("m", "k"), [(70, 3000), (9, 6000)])
@pytest.mark.parametrize("flavour", F32_PACKED_FLAVOURS)
def test_the_packed_f32_product_passes_many_rows_in_groups(m: int, k: int, flavour: str) -> None:
    """Rows past what one pass keeps in L2 (192 KiB: 12 rows of k = 3000, 6 of 6000) go through the weights in groups
    (and a 3-D input keeps its shape): every output still its fused sums bit for bit."""
    kernels = native_kernels(flavour)
    assert kernels is not None
    gen = torch.Generator().manual_seed(m)
    w, x, bias = torch.randn(37, k, generator=gen), torch.randn(m, k, generator=gen), torch.randn(37, generator=gen)
    y = kernels.gemm_f32_packed(kernels.pack_f32(w), x.view(1, m, k), 37, bias)
    assert y.shape == (1, m, 37) and torch.equal(y[0], fused_sums(w, x, bias))


@needs_build
def test_the_packed_f32_product_refuses_what_it_cannot_take() -> None:
    """A weight that is not fp32, a packed weight of another shape or dtype and inputs that are not fp32: one clear
    error each; a build without AVX2 and FMA (the generic flavour) says it has no fp32 packed product."""
    kernels = native_kernels()
    assert kernels is not None
    with pytest.raises(ValueError, match="pack_f32 takes a contiguous fp32 CPU weight"):
        kernels.pack_f32(torch.zeros(4, 6, dtype=torch.bfloat16))
    packed = kernels.pack_f32(torch.zeros(20, 8))
    with pytest.raises(ValueError, match="is not \\[20, 6\\] packed by pack_f32"):
        kernels.gemm_f32_packed(packed, torch.zeros(3, 6), 20)
    with pytest.raises(ValueError, match="is not \\[20, 8\\] packed by pack_f32"):
        kernels.gemm_f32_packed(packed.bfloat16(), torch.zeros(3, 8), 20)
    with pytest.raises(ValueError, match="takes fp32 inputs and bias, got torch.bfloat16"):
        kernels.gemm_f32_packed(packed, torch.zeros(3, 8, dtype=torch.bfloat16), 20)
    generic = native_kernels("generic") if "generic" in FLAVOURS_HERE else None
    if generic is not None:
        assert not generic.packed_f32_available
        with pytest.raises(ValueError, match="the fp32 packed product needs AVX2 with FMA"):
            generic.gemm_f32_packed(generic.pack_f32(torch.zeros(20, 8)), torch.zeros(3, 8), 20)


@needs_packed_bf16
def test_the_packed_bf16_product_refuses_what_it_cannot_take() -> None:
    """An odd k, a packed weight of another shape or dtype and a weight that is not bf16: one clear error each."""
    kernels = native_kernels()
    assert kernels is not None
    with pytest.raises(ValueError, match="k even"):
        kernels.pack_bf16(torch.zeros(4, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="k even"):
        kernels.pack_bf16(torch.zeros(4, 6))
    packed = kernels.pack_bf16(torch.zeros(20, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="is not \\[20, 6\\] packed"):
        kernels.gemm_bf16_packed(packed, torch.zeros(3, 6, dtype=torch.bfloat16), 20)
    with pytest.raises(ValueError, match="torch.float32 values is not \\[20, 8\\] packed by pack_bf16"):
        kernels.gemm_bf16_packed(packed.float(), torch.zeros(3, 8, dtype=torch.bfloat16), 20)  # (as many values)


@needs_build
@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 70), kv_heads=st.integers(1, 3), d=st.sampled_from([8, 64]),
       block_size=st.sampled_from([1, 4, 16]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_native_kv_writes_are_the_engines_index_writes(tokens: int, kv_heads: int, d: int, block_size: int,
                                                       dtype: torch.dtype, seed: int) -> None:
    """write_kv against the engine's PyTorch writes (`_write_blocks`): fresh blocks zeroed first (stale values in a
    pool that is not zero), then every token's K and V, read from views of the step's fused product, in its slot."""
    from infer.backends import _write_blocks
    from infer.ragged import RaggedBatch

    kernels = native_kernels()
    assert kernels is not None
    gen = torch.Generator().manual_seed(seed)
    num_blocks = tokens + 4
    pool = [torch.randn(num_blocks, kv_heads, block_size, d, generator=gen).to(dtype) for _ in range(2)]
    width = kv_heads * d
    qkv = torch.randn(1, tokens, 3 * width, generator=gen).to(dtype)
    k, v = (qkv[..., i * width:(i + 1) * width].view(1, tokens, kv_heads, d).transpose(1, 2) for i in (1, 2))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slot_blocks, slot_offsets = slots // block_size, slots % block_size
    fresh = torch.unique(slot_blocks[: max(1, tokens // 3)])
    batch = RaggedBatch(torch.zeros(tokens, dtype=torch.long), slot_blocks, slot_offsets, [],
                        torch.zeros(0, dtype=torch.long), block_size, fresh)
    want = [t.clone() for t in pool]
    _write_blocks(k, v, want[0], want[1], batch)
    before = qkv.clone()
    kernels.write_kv(k, v, pool[0], pool[1], slot_blocks, slot_offsets, fresh)
    assert torch.equal(pool[0], want[0]) and torch.equal(pool[1], want[1])
    assert torch.equal(qkv, before), "the step's K/V are left as they were"


@pytest.mark.parametrize("flavour", FLAVOURS_HERE)
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 4), n=st.integers(1, 300), removed=st.sampled_from([0.0, 0.5, 0.95]),
       edge=st.sampled_from(["random", "0", "just below 1"]), seed=st.integers(0, 2**16))
def test_native_draw_takes_the_cumulative_sums_token(flavour: str, rows: int, n: int, removed: float, edge: str,
                                                     seed: int) -> None:
    """`draw_rows` on each instruction-set path: the token of the float64 cumulative sum's binary search (`draw`'s
    unoptimised form) at u = 0, just below 1 and between, rows of every length against its blocks of 64, many
    tokens at probability 0; a total of NaN or inf gets -1."""
    kernels = native_kernels(flavour)
    assert kernels is not None
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, n, generator=gen) * 3
    logits[torch.rand(rows, n, generator=gen) < removed] = float("-inf")
    logits[:, n // 2] = 0.0
    probs = logits.softmax(-1)
    u = {"random": torch.rand(rows, generator=gen, dtype=torch.float64), "0": torch.zeros(rows, dtype=torch.float64),
         "just below 1": torch.full((rows,), 1 - 2**-53, dtype=torch.float64)}[edge]
    cdf = probs.double().cumsum(-1)
    want = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)[:, 0]
    assert torch.equal(kernels.draw_rows(probs, u), want)
    bad = probs.clone()
    bad[0, -1] = float("inf")
    bad[-1, 0] = float("nan")
    got = kernels.draw_rows(bad, u)
    assert int(got[0]) == -1 and int(got[-1]) == -1


@pytest.mark.parametrize("flavour", FLAVOURS_HERE)
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 4), n=st.integers(1, 200), levels=st.sampled_from([2, 5, 1000]),
       top_p=st.floats(0.001, 0.999), seed=st.integers(0, 2**16))
def test_native_top_p_leaves_hfs_tokens_on_every_path(flavour: str, rows: int, n: int, levels: int, top_p: float,
                                                      seed: int) -> None:
    """`top_p_rows` on each instruction-set path (sixteen lanes at a time, or one): the removed tokens are HF's
    TopPLogitsWarper's over a stable sort, rows of few distinct values (ties at the boundary in most) and many."""
    from infer.sampling import top_p_removed_by_sort

    kernels = native_kernels(flavour)
    assert kernels is not None
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, n), generator=gen).float() * (4.0 / levels)
    ascending = x.sort(-1).values
    got = kernels.top_p_rows(x, ascending, ascending.softmax(-1), top_p)
    assert torch.equal(got, x.masked_fill(top_p_removed_by_sort(x, top_p), float("-inf")))


@needs_build
@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16]), rows=st.integers(1, 5), n=st.integers(1, 300),
       spare=st.integers(0, 3), special=st.sampled_from(["none", "-inf", "nan", "all -inf"]),
       seed=st.integers(0, 2**16), flavour=st.sampled_from(FLAVOURS_HERE or ["native"]))
def test_native_argmax_of_rows_is_torchs_index(dtype: torch.dtype, rows: int, n: int, spare: int, special: str,
                                               seed: int, flavour: str) -> None:
    """The engine's greedy picks: `argmax_rows` takes torch.argmax's index of the rows widened to fp32, ties (values
    drawn from a few integers) to the first, a row with NaN to its first NaN; rows read in place from wider ones.
    Every build the CPU runs (AVX512's 16-lane scan, AVX2's 8-lane one, the scalar loop)."""
    kernels = native_kernels(flavour)
    assert kernels is not None
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randint(-3, 3, (rows, n + spare), generator=gen).float()
    if special == "-inf":
        wide[wide == -3] = float("-inf")
    elif special == "nan":
        wide[torch.rand(rows, n + spare, generator=gen) < 0.05] = float("nan")
    elif special == "all -inf":
        wide.fill_(float("-inf"))
    x = wide.to(dtype)[:, :n]
    before = x.clone()
    got = kernels.argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.float().argmax(-1)), f"{special}: {got} vs torch's"
    assert torch.equal(x.nan_to_num(), before.nan_to_num())
    with pytest.raises(ValueError, match="argmax_rows takes fp32 or bf16 rows"):
        kernels.argmax_rows(x[0])


# The machine kinds the kernels are built for (`-march=native` on each; `infer.kernels.native.FLAVOURS`): the
# Intel Xeon with AMX-BF16 and AVX512-BF16, the same without AVX512-BF16 (the avx512f flavour), AVX512 without BF16,
# the Zen 4 EPYC (AVX512-BF16, no AMX), AVX2 + FMA (Zen 3) and plain x86-64 (generic).
MACHINE_KINDS = {
    "amx": ("-march=sapphirerapids",),
    "avx512f on the AMX Xeon": ("-march=sapphirerapids", "-mno-avx512bf16"),
    "avx512 without bf16": ("-march=icelake-server",),
    "zen 4": ("-march=znver3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16"),
    "avx2": ("-march=znver3",),
    "generic": ("-march=x86-64",),
}


@pytest.mark.parametrize("kind", list(MACHINE_KINDS))
def test_the_kernels_compile_for_every_machine_kind(kind: str) -> None:
    """cpu_decode.c compiles (syntax and types, no code generated) for each machine kind it is built for, not only
    the one at hand: a build that fails on another kind falls back there without a word (`native_kernels` tries
    `-march=native` first, then plain flags), so an error inside an `#if defined(HAVE_AMX)` block would cost the
    AMX Xeon its kernels with every test here green. (A redefined variable in the AMX path went unseen so.)"""
    import platform
    import shutil
    import subprocess
    from pathlib import Path

    compiler = shutil.which("gcc")
    if compiler is None or platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("needs gcc on x86-64")
    source = Path(native.__file__).with_name("cpu_decode.c")
    flags = MACHINE_KINDS[kind]
    probe = subprocess.run([compiler, *flags, "-fsyntax-only", "-x", "c", "-"], input="", capture_output=True,
                           text=True)
    if probe.returncode != 0:
        pytest.skip(f"this gcc does not know {' '.join(flags)}: {probe.stderr.strip()[:120]}")
    run = subprocess.run([compiler, *flags, "-fopenmp", "-ffp-contract=off", "-fsyntax-only", str(source)],
                         capture_output=True, text=True)
    errors = [line for line in run.stderr.splitlines() if "error" in line]
    assert run.returncode == 0 and not errors, f"{kind}: " + "\n".join(errors[:5])
