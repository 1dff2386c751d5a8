"""Speed choices by capability: the prefill dtype follows the CPU's half-precision units, can be forced, and
is reported with its reason."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from infer.families import ARCHITECTURES
from infer.tuning import CHOICES, _sweep_weights, choose_prefill_dtype, cpu_flags

CPU = torch.device("cpu")
AMX_XEON = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"})
AVX2_EPYC = frozenset({"avx2", "fma", "f16c"})


@pytest.mark.parametrize(("weights", "flags", "value", "reason"), [
    (torch.bfloat16, AMX_XEON, "exact", "native here (amx_bf16, avx512_bf16)"),
    (torch.bfloat16, AVX2_EPYC, "float32", "no amx_bf16 or avx512_bf16"),
    (torch.float16, AMX_XEON, "float32", "no amx_fp16 or avx512_fp16"),
    (torch.float16, AVX2_EPYC | {"avx512_fp16"}, "exact", "native here (avx512_fp16)"),
    (torch.float32, AVX2_EPYC, "exact", "nothing to choose"),
])
def test_prefill_dtype_follows_the_cpus_units(weights: torch.dtype, flags: frozenset[str], value: str,
                                              reason: str) -> None:
    choice = choose_prefill_dtype(weights, CPU, flags=flags)
    assert (choice.value, reason in choice.reason) == (value, True), choice
    assert CHOICES["prefill matmul dtype"] == choice, "the latest choice is what reports print"


def test_unreadable_flags_fall_back_to_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    import infer.tuning

    monkeypatch.setattr(infer.tuning, "_time_prefill_matmul", lambda dtype: (2.0, 1.0))
    monkeypatch.setattr(infer.tuning, "cpu_flags", lambda: None)
    choice = choose_prefill_dtype(torch.bfloat16, CPU)
    assert choice.value == "float32" and "measured" in choice.reason
    monkeypatch.setattr(infer.tuning, "_time_prefill_matmul", lambda dtype: (1.0, 2.0))
    assert choose_prefill_dtype(torch.bfloat16, CPU).value == "exact"


def test_gpu_and_fp32_have_nothing_to_choose() -> None:
    assert choose_prefill_dtype(torch.bfloat16, torch.device("cuda")).value == "exact"


def test_cpu_flags_parse_proc_cpuinfo(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "cpuinfo"
    path.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\nbogomips\t: 1\n")
    assert cpu_flags(str(path)) == frozenset({"fpu", "avx2", "amx_bf16"})
    assert cpu_flags(str(path) + ".missing") is None


def native_here() -> bool:
    from infer.kernels.native import native_kernels

    return native_kernels() is not None


FORMS = ["mv", pytest.param("native", marks=pytest.mark.skipif(not native_here(), reason="no native build here"))]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("arch", "overrides"), [(a, {}) for a in ARCHITECTURES] + [
    ("llama", {"attention_bias": True, "mlp_bias": True})], ids=[*ARCHITECTURES, "llama-biases"])
def test_decode_gemv_forms_equal_the_oracle_and_the_linear_form(arch: str, overrides: dict, form: str) -> None:
    """The torch.mv and native forms of one-row products compute F.linear's sums in another order: every
    decode step's fp32 logits equal the oracle's, and the linear form's within 1e-5; bf16 steps agree within
    bf16 rounding. (The native form runs q/k/v and gate/up fused: that is in these steps too.)"""
    import infer
    from reference import Oracle, build_checkpoint
    from tests.helpers import assert_close

    path = build_checkpoint(arch, **overrides)
    ids = torch.randint(0, 400, (1, 20), generator=torch.Generator().manual_seed(3))
    full = Oracle(path).logits(ids)
    for dtype, tol in (("float32", 1e-5), ("bfloat16", 0.1)):
        steps = {}
        for gemv in ("linear", form):
            model = infer.load_model(path, dtype=dtype, decode_gemv=gemv, compute_dtype="exact")
            assert model.decode_gemv == gemv
            cache = infer.create_cache("contiguous", model.config, max_seq_len=20, dtype=model.lm_head.weight.dtype)
            with torch.no_grad():
                model(ids[:, :12], cache)
                steps[gemv] = torch.cat([model(ids[:, i : i + 1], cache) for i in range(12, 20)], 1).float()
        scale = max(1.0, full.abs().max().item())
        assert_close(steps[form], steps["linear"], tol * scale, f"{arch} {dtype} {form} vs linear")
        if dtype == "float32":
            assert_close(steps[form], full[:, 12:20], tol * scale, f"{arch} {form} vs oracle")


# The bias path of the one-row forms, and the shape where a fused q/k/v GEMM rounds differently (hidden 48).
PREFILL_CASES = [("qwen3", {"attention_bias": True}),
                 ("gemma3_text", {"num_key_value_heads": 1, "num_attention_heads": 1, "head_dim": 8,
                                  "hidden_size": 48, "intermediate_size": 64})]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("arch", "overrides"), PREFILL_CASES, ids=["qwen3-bias", "gemma3-h48"])
@pytest.mark.parametrize("form", FORMS)
def test_one_row_forms_leave_batches_and_prefill_to_linear(form: str, arch: str, overrides: dict,
                                                           dtype: str) -> None:
    """Batches and prefills are bit for bit what F.linear and separate products give, whatever the one-row form
    (under the native one, q/k/v and gate/up are fused for one-row products only)."""
    import infer
    from reference import build_checkpoint

    path = build_checkpoint(arch, **overrides)
    linear, other = (infer.load_model(path, decode_gemv=f, dtype=dtype) for f in ("linear", form))
    if form == "native":
        other.gemm_rows = 1  # bf16 batches of a few rows have their own kernel (the test below)
    ids = torch.randint(0, 400, (2, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(linear(ids), other(ids)), "batches and prefill never take the one-row path"
        assert torch.equal(linear(ids[:, :1]), other(ids[:, :1])), "a batch of one-token rows is not one row"
        assert torch.equal(linear(ids[:1]), other(ids[:1])), "a one-sequence prefill is not one row"


def few_row_kernel_here() -> bool:
    from infer.kernels.native import native_kernels

    kernels = native_kernels()
    return kernels is not None and kernels.gemm_bf16_available


def count_few_row_products(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every `NativeKernels.gemm_bf16` call from now on (the calls still compute)."""
    from infer.kernels.native import NativeKernels

    rows: list[int] = []
    product = NativeKernels.gemm_bf16

    def counted(self: NativeKernels, w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
        rows.append(x.numel() // w.shape[1])
        return product(self, w, x, bias)

    monkeypatch.setattr(NativeKernels, "gemm_bf16", counted)
    return rows


@pytest.mark.skipif(not few_row_kernel_here(), reason="no AVX512-BF16 native build here")
@pytest.mark.parametrize(("arch", "overrides"), PREFILL_CASES, ids=["qwen3-bias", "gemma3-h48"])
def test_bf16_batches_of_a_few_rows_take_the_native_product_within_rounding(
        arch: str, overrides: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `gemm_rows`, inside `few_row_products()` (the batched engine's steps), bf16 products of 2 to that many
    rows (a batch of one-token rows, a short prefill) run the native few-row kernel, longer ones F.linear; the
    logits stay within bf16 rounding of the F.linear model's (fp32 sums in another order, each rounded once to
    bf16). Outside it, every multi-row product is F.linear's, bit for bit."""
    import infer
    from infer.models.transformer import few_row_products
    from reference import build_checkpoint

    path = build_checkpoint(arch, **overrides)
    linear = infer.load_model(path, decode_gemv="linear", dtype="bfloat16")
    native = infer.load_model(path, decode_gemv="native", dtype="bfloat16")
    native.gemm_rows, native.native_step = 8, False
    rows = count_few_row_products(monkeypatch)
    ids = torch.randint(0, 400, (6, 3), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(native(ids[:2]), linear(ids[:2])) and not rows, "outside the engine: F.linear's bits"
        with few_row_products():
            for batch in (ids[:, :1], ids[:2], ids[:1]):  # 6 one-token rows, 2 x 3 = 6 rows, 3 rows
                rows.clear()
                got, want = native(batch).float(), linear(batch).float()
                assert rows and set(rows) == {batch.numel()}, f"{tuple(batch.shape)}: the few-row kernel was not used"
                assert (got - want).abs().max() <= 0.05 * want.abs().max(), "beyond bf16 rounding of F.linear's logits"
            rows.clear()
            native(ids)  # 18 rows: past gemm_rows
            assert not rows, "more rows than gemm_rows still took the few-row kernel"
    with pytest.raises(ValueError, match="gemm_rows must be an int >= 1"):
        native.gemm_rows = 0


@pytest.mark.skipif(not native_here(), reason="no native build here")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_native_decode_fuses_projections_without_changing_a_bit(arch: str, dtype: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the native form one-row q/k/v and gate/up run as one product each, and every logit equals the
    separate native products' exactly (each output is its own row's sum); prefill keeps the separate
    products, and state_dict is the checkpoint's."""
    import infer
    from infer.models.transformer import Linear
    from reference import build_checkpoint

    model = infer.load_model(build_checkpoint(arch), dtype=dtype, decode_gemv="native")
    model.native_step = False  # the per-op path's modules (the whole step's C call reads the same fused weights)
    assert not model.fused_projections, "fused for one-row products only"
    assert model.layers[0].self_attn.__dict__["qkv"] is not None and model.layers[0].mlp.__dict__["gate_up"] is not None
    ids = torch.randint(0, 400, (1, 16), generator=torch.Generator().manual_seed(6))

    def decode() -> torch.Tensor:
        cache = infer.create_cache("contiguous", model.config, max_seq_len=16, dtype=model.lm_head.weight.dtype)
        with torch.no_grad():
            model(ids[:, :10], cache)
            return torch.cat([model(ids[:, i : i + 1], cache) for i in range(10, 16)], 1)

    calls: list[int] = []
    for layer in model.layers:
        for fused_linear in (layer.self_attn.__dict__["qkv"], layer.mlp.__dict__["gate_up"]):
            fused_linear.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[-2]))
    with torch.no_grad():
        model(ids[:, :5])
    assert calls == [], "a prefill runs the separate products (a fused GEMM may round otherwise)"
    fused = decode()
    assert calls and set(calls) == {1}, "one-row steps run the fused products"
    monkeypatch.setattr(Linear, "fuses", lambda self, x: self.all_rows)  # the parts, each its own native product
    assert torch.equal(decode(), fused)
    assert sorted(model.state_dict()) == sorted(infer.load_model(build_checkpoint(arch), decode_gemv="linear")
                                                .state_dict())


def test_decode_gemv_choice_is_measured_or_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    import infer.tuning
    from infer.tuning import choose_decode_gemv

    w = [torch.randn(64, 32), torch.randn(32, 64)]
    auto = choose_decode_gemv(w)
    assert auto.value in ("linear", "mv", "native") and "F.linear" in auto.reason and "torch.mv" in auto.reason
    assert ("native (" in auto.reason) == native_here(), auto.reason
    assert "a sweep over 2 weights" in auto.reason
    assert choose_decode_gemv(w, "mv").value == "mv"
    with pytest.raises(ValueError, match="decode_gemv must be"):
        choose_decode_gemv(w, "gemm")
    monkeypatch.setattr(infer.tuning, "native_kernels", lambda: None)
    monkeypatch.setattr(infer.tuning, "unavailable_reason", lambda: "no C compiler on PATH")
    with pytest.raises(ValueError, match="'native' is unavailable here: no C compiler"):
        choose_decode_gemv(w, "native")
    assert "native not tried (no C compiler on PATH)" in choose_decode_gemv(w).reason


@pytest.fixture
def restore_prefetch() -> object:
    """The native kernels' prefetch level is process-wide: put back what the test found."""
    from infer.kernels.native import native_kernels

    kernels = native_kernels()
    level = kernels.prefetch_level if kernels is not None else None
    yield
    if kernels is not None and level is not None:
        kernels.prefetch_level = level


@pytest.mark.skipif(not native_here(), reason="no native build here")
def test_the_prefetch_level_is_set_measured_or_forced_and_changes_no_result(restore_prefetch: object,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefetching into L1 or L2 moves no value: the GEMV, the few-row product and the read probe give the same
    bits at both levels; the level reads back as set; the choice applies what it reports."""
    import infer.tuning
    from infer.kernels.native import native_kernels
    from infer.tuning import PREFETCH_LEVELS, choose_prefetch

    kernels = native_kernels()
    assert kernels is not None
    torch.manual_seed(0)
    w = torch.randn(96, 200).bfloat16()
    x = torch.randn(200).bfloat16()
    rows = torch.randn(5, 200).bfloat16()
    results = []
    for level in (1, 2):
        kernels.prefetch_level = level
        assert kernels.prefetch_level == level
        gemm = kernels.gemm_bf16(w, rows) if kernels.gemm_bf16_available else None
        results.append((kernels.gemv(w, x), gemm, kernels.read(w)))
    assert torch.equal(results[0][0], results[1][0]) and results[0][2] == results[1][2]
    if kernels.gemm_bf16_available:
        assert torch.equal(results[0][1], results[1][1])
    assert torch.allclose(results[1][0].float(), (w.float() @ x.float()), rtol=2e-2, atol=2e-2)
    for forced, level in PREFETCH_LEVELS.items():
        kernels.prefetch_level = 3 - level
        assert choose_prefetch([w], forced).value == forced and kernels.prefetch_level == level
        assert CHOICES["native prefetch"].value == forced
    auto = choose_prefetch([w])
    assert auto.value in PREFETCH_LEVELS and kernels.prefetch_level == PREFETCH_LEVELS[auto.value], auto
    assert "L1" in auto.reason and "L2" in auto.reason and "1 weights" in auto.reason
    for times, start in (({"l1": 2.0, "l2": 1.0}, 1), ({"l1": 1.0, "l2": 0.99}, 2)):  # L2 3% faster, or not
        monkeypatch.setattr(infer.tuning, "_time_alternately", lambda forms, device, repeats, t=times: t)
        kernels.prefetch_level = start
        chosen = choose_prefetch([w])
        assert chosen.value == f"l{3 - start}" and kernels.prefetch_level == 3 - start, chosen
    with pytest.raises(ValueError, match="prefetch_level must be 1"):
        kernels.prefetch_level = 3
    with pytest.raises(ValueError, match="native_prefetch must be 'auto', 'l1' or 'l2', got 'L3'"):
        choose_prefetch([w], "L3")


def test_a_bad_prefetch_choice_is_refused_before_the_checkpoint_is_read(tmp_path: object) -> None:
    import infer

    with pytest.raises(ValueError, match="native_prefetch must be 'auto', 'l1' or 'l2', got 'fast'"):
        infer.load_model(str(tmp_path) + "/missing", native_prefetch="fast")


@pytest.mark.skipif(not native_here(), reason="no native build here")
def test_load_model_applies_a_forced_prefetch_level(restore_prefetch: object) -> None:
    import infer
    from infer.kernels.native import native_kernels
    from reference import build_checkpoint

    kernels = native_kernels()
    assert kernels is not None
    for forced, level in (("l2", 2), ("l1", 1)):
        infer.load_model(build_checkpoint("llama"), dtype="bfloat16", native_prefetch=forced)
        assert kernels.prefetch_level == level and CHOICES["native prefetch"].value == forced


def test_the_packed_products_prefetch_distance_is_measured_or_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """`choose_packed_ahead` applies what it reports: forced, or the next pair where it timed 2% faster than the
    pair after next over the model's natively packed products (and not where it did not); the choice stays the
    model's, applied again without timing; a model without such products gets "none"; a bad distance is refused,
    naming it."""
    import infer
    import infer.tuning
    from infer.models.transformer import native_packing_unavailable
    from infer.tuning import choose_packed_ahead
    from reference import build_checkpoint

    fp32 = infer.load_model(build_checkpoint("llama"), dtype="float32")
    assert choose_packed_ahead(fp32).value == "none" and "no bf16 product packed" in CHOICES[
        "packed product prefetch"].reason
    if native_packing_unavailable([torch.zeros(2, 2, dtype=torch.bfloat16)]) is not None:
        return
    from infer.kernels.native import native_kernels

    kernels = native_kernels()
    assert kernels is not None
    before = kernels.packed_ahead
    labels = {1: "next pair", 2: "pair after next"}
    try:
        model = infer.load_model(build_checkpoint("llama"), dtype="bfloat16")
        model.pack_products(True, layout="native")
        auto = choose_packed_ahead(model)
        assert kernels.packed_ahead == (1 if auto.value == labels[1] else 2) and "16 rows" in auto.reason
        with pytest.raises(ValueError, match="packed_ahead must be 1 .* or 2 .*, got 3"):
            choose_packed_ahead(model, 3)
        for times, want in (({labels[1]: 0.97, labels[2]: 1.0}, 1), ({labels[1]: 0.99, labels[2]: 1.0}, 2)):
            monkeypatch.setattr(infer.tuning, "_time_alternately", lambda forms, device, repeats, t=times: t)
            model.__dict__.pop("_packed_ahead")
            kernels.packed_ahead = 3 - want
            assert choose_packed_ahead(model).value == labels[want] and kernels.packed_ahead == want
            assert CHOICES["packed product prefetch"].value == labels[want]
        monkeypatch.setattr(infer.tuning, "_time_alternately", lambda *args, **kwargs: 1 / 0)
        for forced in (1, 2):
            kernels.packed_ahead = 3 - forced
            assert choose_packed_ahead(model, forced).value == labels[forced] and kernels.packed_ahead == forced
            kernels.packed_ahead = 3 - forced  # the model's choice, applied again without timing
            assert choose_packed_ahead(model).reason == "forced by the caller" and kernels.packed_ahead == forced
    finally:
        kernels.packed_ahead = before


def test_the_sweep_takes_each_weight_once_up_to_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import infer.tuning

    a, b, c = torch.randn(8, 8), torch.randn(16, 8), torch.randn(4, 4)
    assert infer.tuning._sweep_weights([a, b, a, c]) == [a, b, c], "tied weights are read once a step"
    monkeypatch.setattr(infer.tuning, "last_level_cache_bytes", lambda: 0)
    monkeypatch.setattr(infer.tuning, "_SWEEP_MIN_BYTES", a.nbytes)
    assert infer.tuning._sweep_weights([a, b, c]) == [a], "cut once the limit is reached"


def test_last_level_cache_is_read_from_sysfs(tmp_path: object) -> None:
    from pathlib import Path

    from infer.tuning import last_level_cache_bytes

    root = Path(str(tmp_path))
    for index, size in enumerate(["48K", "2048K", "480M", "bogus"]):
        (root / f"index{index}").mkdir()
        (root / f"index{index}" / "size").write_text(size + "\n")
    assert last_level_cache_bytes(str(root)) == 480 * 2**20
    assert last_level_cache_bytes(str(root / "missing")) == 0


# The default tiny shapes, biases, and the shape where fusing changed the rounding (hidden 48, one head).
FUSION_CASES = [(a, {}) for a in ARCHITECTURES] + [
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("gemma3_text", {"num_key_value_heads": 1, "num_attention_heads": 1, "head_dim": 8, "hidden_size": 48,
                     "intermediate_size": 64}),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("arch", "overrides"), FUSION_CASES, ids=[*ARCHITECTURES, "llama-biases", "gemma3-h48"])
def test_fused_projections_match_the_separate_products(arch: str, overrides: dict, dtype: str) -> None:
    """q/k/v and gate/up fused into one product each (opt-in) give the separate products' prefill and decode
    logits within rounding (fp32: 1e-5 relative; bf16: 2% of the logit scale), share the weights (memory
    unchanged) and leave state_dict as it was; the loader leaves them off, so the default stays oracle-exact."""
    import infer
    from reference import build_checkpoint
    from tests.helpers import assert_close

    model = infer.load_model(build_checkpoint(arch, **overrides), dtype=dtype)
    assert not model.fused_projections, "the oracle-exact default keeps the separate products"
    keys = list(model.state_dict())
    ids = torch.randint(0, 400, (2, 14), generator=torch.Generator().manual_seed(5))
    logits = {}
    for fused in (False, True):
        model.fused_projections = fused
        cache = infer.create_cache("contiguous", model.config, max_seq_len=14, batch_size=2,
                                   dtype=model.lm_head.weight.dtype)
        with torch.no_grad():
            prefill = model(ids[:, :10], cache)
            steps = [model(ids[:, i : i + 1], cache) for i in range(10, 14)]
        logits[fused] = torch.cat([prefill[:, -1:], *steps], 1).float()
    scale = max(1.0, logits[False].abs().max().item())
    assert_close(logits[True], logits[False], (1e-5 if dtype == "float32" else 0.02) * scale, f"{arch} {dtype}")
    weight_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for t in model.state_dict().values()}.values())
    model.fused_projections = False
    model.fused_projections = True
    assert list(model.state_dict()) == keys
    assert sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in model.state_dict().values()}.values()) == weight_bytes


@pytest.fixture
def restore_threads() -> object:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_thread_count_is_timed_or_forced(restore_threads: object) -> None:
    import infer
    from infer.tuning import choose_threads

    model = infer.load_model()
    default = torch.get_num_threads()
    forced = choose_threads(model, forced=1)
    assert (forced.value, torch.get_num_threads()) == ("1", 1)
    torch.set_num_threads(default)
    auto = choose_threads(model)
    assert auto.value in {"1", str(default)} and torch.get_num_threads() == int(auto.value)
    if default > 1:
        assert "on 1 thread" in auto.reason and f"on {default}" in auto.reason
    assert CHOICES["CPU threads"] == auto


@pytest.mark.skipif(not native_here(), reason="no native build here")
def test_native_form_is_refused_off_the_cpu() -> None:
    import infer
    from reference import build_checkpoint

    model = infer.load_model(build_checkpoint("llama"), decode_gemv="linear").to("meta")
    with pytest.raises(ValueError, match="runs on the CPU; this model is on meta"):
        model.decode_gemv = "native"
    assert model.decode_gemv == "linear", "a refused form changes nothing"


def test_few_row_product_rows_are_measured_forced_or_one() -> None:
    """fp32 weights keep F.linear for every multi-row product; forcing skips the timing; bf16 weights on a build
    with the kernel get a measured count (2 to 64 rows timed) that the timing shows."""
    from infer.tuning import choose_gemm_rows

    assert choose_gemm_rows([torch.randn(64, 64)]).value == "1"
    assert choose_gemm_rows([torch.randn(64, 64).bfloat16()], forced=16).value == "16"
    chosen = choose_gemm_rows([torch.randn(256, 128).bfloat16()])
    if few_row_kernel_here():
        assert chosen.value in {"1", "2", "4", "8", "16", "32", "64"} and "2: " in chosen.reason
    else:
        assert chosen.value == "1", "no kernel here: F.linear for every multi-row product"


@pytest.mark.skipif(not few_row_kernel_here(), reason="no AVX512-BF16 native build here")
def test_the_batched_engine_steps_take_the_few_row_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's steps run inside `few_row_products()`: a bf16 model's batched decode steps take the kernel, and
    each request's logits stay within bf16 rounding of its solo run."""
    import infer
    from infer.engine import Engine
    from infer.sampling import SamplingParams
    from reference import build_checkpoint
    from tests.helpers import assert_within_rounding_of_solo_runs

    model = infer.load_model(build_checkpoint("llama"), decode_gemv="native", dtype="bfloat16")
    model.gemm_rows = 8
    calls = count_few_row_products(monkeypatch)
    prompts = [[5, 9, 2], [7, 7, 1, 3], [11]]
    # unpacked: packed copies (measured at load) would take these products from the few-row kernel
    engine = Engine(model, None, num_blocks=32, keep_logits=True, packed_products=False)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=4, temperature=0.0)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert 3 in calls, "three one-token rows of a batched decode step took the few-row kernel"
    assert_within_rounding_of_solo_runs(engine, model, prompts, ids)


@pytest.mark.skipif(not few_row_kernel_here(), reason="no AVX512-BF16 native build here")
def test_quantized_batches_past_the_codes_kernel_take_the_tile_kernel_in_the_engine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """int4 weights in bf16: inside `few_row_products()` products of more than `quantized_rows` and up to
    `gemm_rows` rows take the tile kernel (outside it, or past `gemm_rows`, they dequantize into the GEMM), and the
    logits stay within bf16 rounding of the dequantize-then-GEMM path's."""
    import infer
    from infer.kernels.native import NativeKernels
    from infer.models.transformer import few_row_products
    from reference import build_checkpoint

    path = build_checkpoint("llama", hidden_size=64, intermediate_size=128)
    model = infer.load_model(path, dtype="bfloat16", weights="int4", decode_gemv="native")
    model.native_step, model.quantized_rows, model.gemm_rows = False, 2, 16
    calls: list[int] = []
    product = NativeKernels.quantized_gemm_bf16

    def counted(self: NativeKernels, w: object, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.numel() // x.shape[-1])
        return product(self, w, x, bias)  # type: ignore[arg-type]

    monkeypatch.setattr(NativeKernels, "quantized_gemm_bf16", counted)
    ids = torch.randint(0, 400, (1, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        plain = model(ids).float()
        assert not calls, "outside the engine's steps the GEMM path runs"
        with few_row_products():
            tiled = model(ids).float()
            assert calls and set(calls) == {12}, "12 rows (past quantized_rows 2, within gemm_rows 16)"
            calls.clear()
            model(torch.cat([ids, ids], 1))
            assert not calls, "24 rows: past gemm_rows"
    assert (tiled - plain).abs().max() <= 0.05 * plain.abs().max()


def test_prompt_chunk_attention_is_measured_forced_or_sdpa() -> None:
    """The prompt chunks join the native or Triton decode kernel only with it; "auto" times both ways (4 prompts of
    128 tokens on a CPU) and names them; "sdpa" forced is taken as given, a kernel the decode rows do not use
    refused."""
    from infer.config import ModelConfig
    from infer.tuning import choose_chunk_attention

    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    cpu = torch.device("cpu")
    off = choose_chunk_attention(config, torch.float32, cpu, "matmul")
    assert off.value == "sdpa" and "the decode rows attend by 'matmul'" in off.reason
    with pytest.raises(ValueError, match="chunk_attention='native' joins the decode rows' kernel, but they attend "
                                         "by 'sdpa'"):
        choose_chunk_attention(config, torch.float32, cpu, "sdpa", "native")
    with pytest.raises(ValueError, match="chunk_attention='triton' joins the decode rows' kernel, but they attend "
                                         "by 'native'"):
        choose_chunk_attention(config, torch.float32, cpu, "native", "triton")
    assert choose_chunk_attention(config, torch.float32, cpu, "native", "sdpa").value == "sdpa"
    if native_here():
        auto = choose_chunk_attention(config, torch.bfloat16, cpu, "native")
        assert auto.value in ("native", "sdpa") and "native " in auto.reason and "sdpa " in auto.reason, auto.reason


@pytest.mark.parametrize(("dtype", "native_ms", "value"), [
    (torch.bfloat16, 1.9, "native"), (torch.bfloat16, 2.1, "sdpa"), (torch.float32, 0.9, "native"),
    (torch.float32, 1.0, "sdpa")])
def test_prompt_chunk_attention_credits_the_whole_native_step(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                              native_ms: float, value: str) -> None:
    """With the native kernel a bf16 model's steps run as one native call (SDPA's chunks take the per-op path: whole
    prompt steps 1.19-1.36x slower on a 2-core Xeon where the attention alone timed either way), so "auto" takes the
    kernel there unless SDPA's attention is twice as fast; elsewhere (fp32: per-op either way) at 5% faster. The
    timings are stubbed: the rule, not this machine, is under test."""
    import infer.tuning
    from infer.config import ModelConfig

    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    monkeypatch.setattr(infer.tuning, "_time_chunk_attention",
                        lambda *args, **kw: {"native": native_ms * 1e-3, "sdpa": 1e-3})
    chosen = infer.tuning.choose_chunk_attention(config, dtype, torch.device("cpu"), "native")
    assert chosen.value == value, chosen.reason
    assert ("one native call" in chosen.reason) == (dtype == torch.bfloat16)



def test_the_kernels_rows_follow_the_summed_gains_not_the_first_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_rows_the_kernel_wins` keeps the kernel up to the row count where its relative gains summed from 2 rows are
    largest: one noisy loss (4 rows here) does not cut it to 2 rows, a loss that outweighs the gains before it does
    (64 rows), and a kernel that never gains 3% in sum keeps none."""
    import infer.tuning
    from infer.tuning import _rows_the_kernel_wins

    def scripted(ratios: list[float]) -> None:  # other / kernel at 2, 4, .. 64 rows
        it = iter(ratios)
        monkeypatch.setattr(infer.tuning, "_time_alternately",
                            lambda forms, device, repeats: {"kernel": 1.0, "other": next(it)})

    sweep = [torch.randn(8, 8).bfloat16()]
    kernels = SimpleNamespace(gemm_bf16=None)  # never called: the timing is scripted
    scripted([1.4, 0.95, 1.4, 1.2, 1.05, 0.9])
    rows, timed = _rows_the_kernel_wins(kernels, sweep, lambda inputs: None, 64)  # type: ignore[arg-type]
    assert rows == 32 and len(timed) == 6 and timed[1] == "4: 1000.0 / 950.0 ms"
    scripted([1.01, 1.0, 1.01, 0.9])
    assert _rows_the_kernel_wins(kernels, sweep, lambda inputs: None, 16)[0] == 1  # type: ignore[arg-type]


@given(st.dictionaries(st.sampled_from([256, 512, 1024, 2048, 4096, 8192]), st.floats(1e9, 1e15), min_size=1),
       st.floats(1e6, 1e10), st.floats(0.0, 1.0), st.integers(1, 3000))
def test_the_token_budget_is_the_fewest_rows_near_the_least_cost_a_token(
        rates: dict[int, float], flops: float, fixed_s: float, max_num_seqs: int) -> None:
    """The rule, restated: a token at R rows costs its FLOPs at the rate there plus an R-th of the step's fixed
    cost; scan the rows upward, stop at the first within 5% of the least such cost; never below the cap on running
    requests."""
    from infer.tuning import pick_token_budget

    def cost(rows: int) -> float:
        return flops / rates[rows] + fixed_s / rows

    least = min(cost(rows) for rows in rates)
    first = next(rows for rows in sorted(rates) if cost(rows) <= 1.05 * least)
    assert pick_token_budget(rates, flops, fixed_s, max_num_seqs) == max(first, max_num_seqs)


def test_a_steps_fixed_cost_is_a_one_token_step_measured_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`step_fixed_cost` times one-token forwards of the model (a positive time, of the order of a real one),
    once per model and dtype; `token_flops` counts the decoder's products, not the LM head."""
    import time

    import infer
    import infer.tuning
    from infer.roofline import projection_weights_per_token
    from reference import build_checkpoint

    model = infer.load_model(build_checkpoint("gemma3_text"), dtype="float32")
    cache = infer.create_cache("contiguous", model.config, max_seq_len=16)
    with torch.inference_mode():
        model(torch.ones(1, 8, dtype=torch.long), cache)
        start = time.perf_counter()
        for _ in range(5):
            model(torch.ones(1, 1, dtype=torch.long), cache)
        one = (time.perf_counter() - start) / 5
    fixed = infer.tuning.step_fixed_cost(model)
    assert one / 20 < fixed < one * 20
    monkeypatch.setattr(infer.tuning, "_median_time", lambda *args, **kwargs: 1 / 0)
    assert infer.tuning.step_fixed_cost(model) == fixed, "measured once"
    config = model.config
    assert infer.tuning.token_flops(model) == 2.0 * config.num_hidden_layers * projection_weights_per_token(config)


def test_the_products_rate_is_one_layers_flops_over_the_faster_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """`product_rates` counts the first layer's products (2 x rows x its projections' weights, from the config)
    over the faster form's time; it measures each row count once per model and dtype."""
    import infer
    import infer.tuning
    from infer.roofline import projection_weights_per_token
    from reference import build_checkpoint

    model = infer.load_model(build_checkpoint("qwen3"), dtype="float32")
    calls: list[list[str]] = []

    def timed(forms: dict, device: object, repeats: int) -> dict[str, float]:
        calls.append(list(forms))
        for form in forms.values():
            form()  # (each form runs)
        return {key: 0.5 if i else 0.25 for i, key in enumerate(forms)}  # the products' own forward the faster

    monkeypatch.setattr(infer.tuning, "_time_alternately", timed)
    rates = infer.tuning.product_rates(model, (256, 512))
    flops = 2.0 * projection_weights_per_token(model.config)
    assert rates == {256: 256 * flops / 0.25, 512: 512 * flops / 0.25} and len(calls) == 2
    assert infer.tuning.product_rates(model, (512, 256)) == {512: rates[512], 256: rates[256]} and len(calls) == 2
    model.to(torch.bfloat16)
    assert infer.tuning.product_rates(model, (256,)) == {256: rates[256]} and len(calls) == 3, \
        "another dtype is measured again, by the faster form"
    from infer.kernels.native import native_kernels
    from infer.models.transformer import native_packing_unavailable

    if native_packing_unavailable([model.layers[0].mlp.down_proj.weight]) is None:
        assert calls[-1] == ["own", "native"], "bf16 weights are timed in the native packed product too"
    if native_packing_unavailable([model.layers[0].mlp.down_proj.weight]) is None and \
            native_kernels().packed_codes_available:  # type: ignore[union-attr]
        coded = infer.load_model(build_checkpoint("qwen3"), dtype="bfloat16", weights="int8")
        infer.tuning.product_rates(coded, (256,))
        assert calls[-1] == ["own", "native"], "a quantized model's codes too, packed as the engine packs them"


def test_the_engine_takes_the_measured_or_the_given_token_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, the engine's budget is the choice from the products' rates (printed as "token budget"), at least
    its cap on running requests; a given budget is taken as it is, without timing; a bad one is refused, naming
    it. Either way its greedy tokens are each request's solo run's."""
    import infer
    import infer.tuning
    from infer.engine import Engine
    from infer.sampling import SamplingParams
    from reference import build_checkpoint

    model = infer.load_model(build_checkpoint("llama"), dtype="float32")
    curve = {256: 400e9, 512: 700e9, 1024: 960e9, 2048: 1000e9, 4096: 1000e9, 8192: 1000e9}
    monkeypatch.setattr(infer.tuning, "product_rates", lambda model, rows: {r: curve[r] for r in rows})
    monkeypatch.setattr(infer.tuning, "step_fixed_cost", lambda model: 0.0)
    engine = Engine(model, cache_memory=2**20)  # (no fixed cost: the rates alone, 1024 rows within 5%)
    assert engine.scheduler.max_num_batched_tokens == 1024 == int(CHOICES["token budget"].value)
    assert "1024 rows 960" in CHOICES["token budget"].reason
    assert Engine(model, max_num_seqs=1500, cache_memory=2**20).scheduler.max_num_batched_tokens == 1500
    monkeypatch.setattr(infer.tuning, "product_rates", lambda model, rows: dict.fromkeys(rows, 1e12))
    monkeypatch.setattr(infer.tuning, "step_fixed_cost", lambda model: 1.0)  # (a step's cost shared: the most rows)
    assert Engine(model, cache_memory=2**20).scheduler.max_num_batched_tokens == 2048
    monkeypatch.setattr(infer.tuning, "product_rates", lambda *args: 1 / 0)
    assert Engine(model, max_num_batched_tokens=96, cache_memory=2**20).scheduler.max_num_batched_tokens == 96
    assert CHOICES["token budget"].reason == "forced by the caller"
    for name, bad in (("max_num_batched_tokens", 0), ("max_num_batched_tokens", True), ("max_num_seqs", "64")):
        with pytest.raises(ValueError, match=f"{name} must be an int >= 1"):
            Engine(model, **{name: bad})
    prompts = [[5, 6, 7] * 40, [9, 10]]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    solo = [infer.generate(model, None, p, params).token_ids for p in prompts]
    assert [r.token_ids for r in engine.generate(prompts, params)] == solo


def test_building_an_engine_leaves_the_global_random_state_alone() -> None:
    """The engine's measured choices (the token budget's rates, the packed products and their prefetch distance)
    draw their timing inputs from generators of their own: an unseeded request after `torch.manual_seed` draws
    what it would have without the engine's start-up."""
    import infer
    from infer.engine import Engine
    from reference import build_checkpoint

    model = infer.load_model(build_checkpoint("llama"), dtype="bfloat16")
    torch.manual_seed(0)
    state = torch.get_rng_state()
    Engine(model, cache_memory=2**20)
    assert torch.equal(torch.get_rng_state(), state)


def test_the_packing_sweep_is_cut_to_the_first_weights_holding_the_bytes() -> None:
    """Past 16 rows the packing choice times the first weights of its sweep that hold as much arithmetic (at least 4
    MiB, cut by `_sweep_weights`): at least the bytes asked, never past the first weight that reaches them."""
    mib = 2**20
    sweep = [torch.empty(n * mib, dtype=torch.uint8) for n in (3, 3, 3)]
    assert [len(_sweep_weights(sweep, b * mib)) for b in (1, 3, 4, 6, 7, 9, 100)] == [1, 1, 2, 2, 3, 3, 3]
