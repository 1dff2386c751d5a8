"""Int8 activations (opt-in, lossy): one row's products on quantized weights with x quantized per run of 32, as
llama.cpp runs its files. The quantizer against its definition, the formula against the dequantized weights, the
native kernel on every instruction-set path against the formula, whole models (the whole-step call, the per-op path
and the formula's) against each other, and the switch's refusals. The error on a real model is in
tests/test_real_model.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import infer
from infer.engine import Engine
from infer.models.transformer import QuantizedLinear
from infer.quality import teacher_forced_logits
from infer.quant_weights import QuantizedWeight, from_gguf, int8_activation_product, quantize, quantize_activation_runs
from reference.checkpoints import build_checkpoint
from tests.helpers import env_set, on_threads, weight_of
from tests.test_gguf import random_blocks
from tests.test_quant_weights import RUNNABLE, kernels_or_skip


def test_activations_quantize_as_llama_cpp_defines_it() -> None:
    """Per run of 32: d = max |x| / 127, codes round(x / d) with ties to even, in -127..127; an all-zero run has
    d = 0 and codes 0. Values worked by hand."""
    run = torch.zeros(32)
    run[:6] = torch.tensor([127.0, -63.5, 0.5, 1.5, -2.5, 126.49])
    x = torch.cat((run, torch.zeros(32), -run * 2))
    q, d = quantize_activation_runs(x)
    assert d.tolist() == [1.0, 0.0, 2.0]
    assert q[:6].tolist() == [127, -64, 0, 2, -2, 126]  # -63.5 -> -64, 0.5 -> 0, 1.5 -> 2, -2.5 -> -2: ties to even
    assert q[32:64].abs().sum().item() == 0
    assert q[64:70].tolist() == [-127, 64, 0, -2, 2, -126]
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127


def _q4_0(n: int, k: int, seed: int) -> QuantizedWeight:
    """A Q4_0 file's weight as stored (fp16 scales, mins -8 d)."""
    return from_gguf(torch.from_numpy(random_blocks("Q4_0", n * k // 32, seed)), "Q4_0", (n, k))


def _weight(scheme: str, n: int, k: int, group: int, seed: int) -> QuantizedWeight:
    if scheme == "Q4_0":
        return _q4_0(n, k, seed)
    if scheme == "int8-g32":
        return quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), "int8-g32")
    return weight_of(scheme, n, k, group, seed)


@given(scheme=st.sampled_from(["int8", "int4", "Q8_0", "Q4_0", "Q4_K", "Q4_K-factored"]), n=st.integers(1, 5),
       runs=st.integers(1, 8), group=st.sampled_from([32, 64, 128]), seed=st.integers(0, 2**31))
@settings(max_examples=30, deadline=None)
def test_the_formula_is_the_dequantized_weight_by_the_quantized_x(scheme: str, n: int, runs: int, group: int,
                                                                  seed: int) -> None:
    """The formula's per-run integer sums equal, in float64, the dequantized weight (less its mins) times x's
    dequantized codes, plus the mins times x itself: the one approximation is x's codes."""
    group = group if scheme == "int4" else 32
    k = 256 * (1 + runs % 2) if scheme.endswith("-factored") else max(runs * 32 // group, 1) * group
    w = _weight(scheme, n, k, group, seed)
    x = torch.randn(k, generator=torch.Generator().manual_seed(seed + 1)) * 3
    q, d = quantize_activation_runs(x)
    x_hat = q.double() * d.double().repeat_interleave(32)
    plain = w.unfactored()
    mins = (torch.zeros(n, k, dtype=torch.float64) if plain.mins is None
            else plain.mins.double().repeat_interleave(plain.group, dim=1))
    expected = (w.dequantize().double() - mins) @ x_hat + mins @ x.double()
    got = int8_activation_product(w, x)
    bound = 1e-6 * ((w.dequantize().double().abs() + mins.abs()) @ x.double().abs()) + 1e-30
    assert ((got.double() - expected).abs() <= bound + 2.0**-24 * expected.abs()).all()


@pytest.mark.parametrize("flavour", RUNNABLE)
@pytest.mark.parametrize("two_rows", ["1", "0"])  # INFER_A8_TWO_ROWS: fp16 scales' rows two at a time, and its check
@given(scheme=st.sampled_from(["int8", "int4", "Q8_0", "Q4_0", "Q4_K", "Q4_K-factored", "int8-g32"]),
       n=st.integers(1, 70), runs=st.integers(1, 30), group=st.sampled_from([32, 64, 128]),
       dtype=st.sampled_from(["float32", "bfloat16"]), with_bias=st.booleans(), threads=st.integers(1, 3),
       scale=st.sampled_from([1.0, 1e-3, 50.0]), seed=st.integers(0, 2**31))
@example(scheme="Q4_0", n=37, runs=24, group=32, dtype="float32", with_bias=True, threads=2, scale=1.0, seed=0)
@example(scheme="Q8_0", n=19, runs=7, group=32, dtype="bfloat16", with_bias=False, threads=1, scale=1.0, seed=1)
@settings(max_examples=30, deadline=None)
def test_the_native_kernel_is_the_formula(flavour: str, two_rows: str, scheme: str, n: int, runs: int, group: int,
                                          dtype: str, with_bias: bool, threads: int, scale: float, seed: int) -> None:
    """Every instruction-set path (VNNI pairs of runs, fp16 scales' rows two at a time or one; AVX2's runs, plain C;
    odd run and row counts; f16 scales a vector at a time, fp32, factored) gives the formula within fp32 sums in
    another order, then one rounding to x's dtype. One run of x all zeros (d = 0) in every draw."""
    kernels = kernels_or_skip(flavour)
    group = group if scheme == "int4" else 32
    k = 256 * (1 + runs % 2) if scheme.endswith("-factored") else max(runs * 32 // group, 1) * group
    w = _weight(scheme, n, k, group, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(k, generator=g) * scale
    x[:32] = 0.0
    x = x.to(getattr(torch, dtype))
    bias = torch.randn(n, generator=g).to(x.dtype) if with_bias else None
    with on_threads(threads), env_set("INFER_A8_TWO_ROWS", two_rows):
        got = kernels.quantized_gemv_a8(w, x, bias)
    expected = int8_activation_product(w, x.float(), None if bias is None else bias.float()).double()
    plain = w.unfactored()
    mins = 0.0 if plain.mins is None else plain.mins.double().abs().repeat_interleave(plain.group, dim=1)
    magnitude = (w.dequantize().double().abs() + mins) @ x.double().abs() + (0 if bias is None else bias.double().abs())
    ulp = 2.0**-8 if x.dtype == torch.bfloat16 else 2.0**-24
    err = (got.double() - expected).abs()
    bound = 2e-6 * magnitude + ulp * expected.abs() + 1e-30
    assert got.dtype == x.dtype and got.shape == (n,)
    assert (err <= bound).all(), f"{flavour} {scheme}: max excess {(err - bound).max().item():.3g}"


def test_the_kernel_refuses_what_it_cannot_take() -> None:
    kernels = kernels_or_skip()
    q6 = weight_of("Q6_K", 4, 64, 16, 0)  # groups of 16: half a run
    with pytest.raises(ValueError, match="groups of whole runs of 32"):
        kernels.quantized_gemv_a8(q6, torch.randn(64))
    with pytest.raises(ValueError, match="one row of 64 inputs"):
        kernels.quantized_gemv_a8(_q4_0(4, 64, 0), torch.randn(2, 64))
    with pytest.raises(ValueError, match="groups of whole runs of 32"):
        int8_activation_product(q6, torch.randn(64))


@pytest.fixture(scope="module")
def llama_dir() -> object:
    return build_checkpoint("llama")


def _decode_logits(model: infer.Transformer, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """fp32 logits of one-token steps over `ids` after a 3-token prefill, and their greedy picks."""
    logits, _ = teacher_forced_logits(model, "contiguous", ids, 3)
    return logits.argmax(-1).tolist(), logits


@pytest.mark.parametrize("weights", ["int4"])
def test_a_model_decodes_by_the_formula(llama_dir: object, weights: str) -> None:
    """One-token steps with int8 activations. The per-op path: every one-row product (the fused ones too) is the
    formula on its own input, within fp32 rounding. The whole-step native call (step_proj kind 5) cannot be hooked;
    its inputs round otherwise than the per-op path's, and a code that flips at a tie moves the rest, so it is held
    to the per-op path within the lossy path's own distance from the exact logits. Turned off, the logits are the
    exact ones again, bit for bit."""
    kernels_or_skip()
    model = infer.load_model(llama_dir, dtype=torch.float32, weights=weights, packed_products=False)
    ids = [3, 17, 44, 9, 250, 31, 7, 88, 120, 5, 61, 300, 2]
    exact_tokens, exact = _decode_logits(model, ids)
    assert model.quantize_activations() > 0
    model.decode_gemv = "linear"  # the fused projections dropped, then fused again from parts that carry the switch
    model.decode_gemv = "native"
    fused = [m for layer in model._decoder_layers() for m in (layer.self_attn.__dict__["qkv"],
                                                               layer.mlp.__dict__["gate_up"]) if m is not None]
    assert fused and all(m.int8_activations for m in fused)
    checked, excess = [], []

    def against_formula(module: QuantizedLinear, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        if inputs[0].numel() == module.in_features:
            ref = int8_activation_product(module.qweight, inputs[0], module.bias)
            checked.append(module)
            excess.append((out - ref).abs().max().item() - 1e-5 * max(1.0, ref.abs().max().item()))

    modules = [m for m in [*model.modules(), *fused] if isinstance(m, QuantizedLinear) and m.int8_activations]
    handles = [m.register_forward_hook(against_formula) for m in modules]
    model.native_step = False
    _, per_op = _decode_logits(model, ids)
    for h in handles:
        h.remove()
    assert len(checked) >= len(ids) - 3 and max(excess) <= 0, f"a product off the formula by {max(excess):.3g}"
    model.native_step = True
    _, whole = _decode_logits(model, ids)
    lossy = (per_op - exact).abs().max().item()
    assert lossy > 1e-4, "int8 activations changed nothing"
    assert (whole - per_op).abs().max().item() <= 2 * lossy
    assert (whole - exact).abs().max().item() > 1e-4, "the whole-step call ignored the switch"
    model.quantize_activations(False)
    again_tokens, again = _decode_logits(model, ids)
    assert again_tokens == exact_tokens and torch.equal(again, exact)


def test_the_switch_refuses_what_it_cannot_serve(llama_dir: object) -> None:
    """A dense or int8 model has no 4-bit projections to take it; the batched engine's steps are exact, so it refuses a
    model with the switch on (before allocating anything); a non-bool is refused."""
    for weights in ("dense", "int8"):  # (int8: q8 codes only, whose exact products are the faster)
        with pytest.raises(ValueError, match="no 4-bit projections"):
            infer.load_model(llama_dir, dtype=torch.float32, weights=weights).quantize_activations()
    model = infer.load_model(llama_dir, dtype=torch.float32, weights="int4", packed_products=False)
    with pytest.raises(TypeError, match="on must be True or False"):
        model.quantize_activations("yes")  # type: ignore[arg-type]
    model.quantize_activations()
    with pytest.raises(ValueError, match="quantize_activations\\(False\\)"):
        Engine(model, None, num_blocks=8)
    model.quantize_activations(False)
    assert not any(isinstance(m, QuantizedLinear) and m.int8_activations for m in model.modules())
    Engine(model, None, num_blocks=8)
