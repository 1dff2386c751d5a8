"""Speed choices by capability: the prefill dtype follows the CPU's half-precision units, can be forced, and
is reported with its reason."""

from __future__ import annotations

import pytest
import torch

from infer.tuning import CHOICES, choose_prefill_dtype, cpu_flags

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


ARCHS = ["llama", "qwen3", "gemma3"]


@pytest.mark.parametrize(("arch", "overrides"), [(a, {}) for a in ARCHS] + [
    ("llama", {"attention_bias": True, "mlp_bias": True})], ids=[*ARCHS, "llama-biases"])
def test_mv_decode_equals_the_oracle_and_the_linear_form(arch: str, overrides: dict) -> None:
    """The torch.mv form of one-row products is the same math as F.linear: every decode step's fp32 logits
    equal the oracle's, and the linear form's within 1e-5; bf16 steps agree within bf16 rounding."""
    import infer
    from reference import Oracle, build_checkpoint
    from tests.helpers import assert_close

    path = build_checkpoint(arch, **overrides)
    ids = torch.randint(0, 400, (1, 20), generator=torch.Generator().manual_seed(3))
    full = Oracle(path).logits(ids)
    for dtype, tol in (("float32", 1e-5), ("bfloat16", 0.1)):
        steps = {}
        for form in ("linear", "mv"):
            model = infer.load_model(path, dtype=dtype, decode_gemv=form, compute_dtype="exact")
            assert model.decode_gemv == form
            cache = infer.create_cache("contiguous", model.config, max_seq_len=20, dtype=model.lm_head.weight.dtype)
            with torch.no_grad():
                model(ids[:, :12], cache)
                steps[form] = torch.cat([model(ids[:, i : i + 1], cache) for i in range(12, 20)], 1).float()
        scale = max(1.0, full.abs().max().item())
        assert_close(steps["mv"], steps["linear"], tol * scale, f"{arch} {dtype} mv vs linear")
        if dtype == "float32":
            assert_close(steps["mv"], full[:, 12:20], tol * scale, f"{arch} mv vs oracle")


def test_mv_form_leaves_batches_and_prefill_to_linear() -> None:
    import infer
    from reference import build_checkpoint

    path = build_checkpoint("qwen3", attention_bias=True)  # the bias path of the mv form
    linear, mv = (infer.load_model(path, decode_gemv=f) for f in ("linear", "mv"))
    ids = torch.randint(0, 400, (2, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(linear(ids), mv(ids)), "batches and prefill never take the one-row path"
        assert torch.equal(linear(ids[:, :1]), mv(ids[:, :1])), "a batch of one-token rows is not one row"


def test_decode_gemv_choice_is_measured_or_forced() -> None:
    from infer.tuning import choose_decode_gemv

    w = [torch.randn(64, 32), torch.randn(32, 64)]
    auto = choose_decode_gemv(w)
    assert auto.value in ("linear", "mv") and "F.linear" in auto.reason and "torch.mv" in auto.reason
    assert choose_decode_gemv(w, "mv").value == "mv"
    with pytest.raises(ValueError, match="decode_gemv must be"):
        choose_decode_gemv(w, "gemm")


# The default tiny shapes, biases, and the shape where fusing changed the rounding (hidden 48, one head).
FUSION_CASES = [(a, {}) for a in ARCHS] + [
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("gemma3", {"num_key_value_heads": 1, "num_attention_heads": 1, "head_dim": 8, "hidden_size": 48,
                "intermediate_size": 64}),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("arch", "overrides"), FUSION_CASES, ids=[*ARCHS, "llama-biases", "gemma3-h48"])
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
