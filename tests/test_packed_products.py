"""Packed products (`Transformer.pack_products`): the batched engine's products past the few-row kernel's rows run
oneDNN's GEMM on weights packed once. Held to the formula (fp32 sums of the bf16 operands, rounded once), to F.linear
within bf16 rounding, and through the model and the engine to the unpacked model and the solo runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from infer.kernels.native import native_kernels
from infer.models.transformer import native_packing_unavailable, pack_weight, packed_linear, packing_unavailable

PACKING = packing_unavailable([torch.zeros(2, 2, dtype=torch.bfloat16)])
needs_packing = pytest.mark.skipif(PACKING is not None, reason=f"no packed products here: {PACKING}")


def bf16_bound(want: torch.Tensor, k: int) -> torch.Tensor:
    """How far a bf16 product's output may sit from the fp32 formula: its own rounding (2^-8 relative) plus fp32
    sums of k terms in another order."""
    return want.abs() * 2.0**-8 + 1e-6 * k * want.abs().amax()


@needs_packing
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 80), n=st.integers(1, 96), k=st.integers(1, 200), with_bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_the_packed_product_is_the_formula(rows: int, n: int, k: int, with_bias: bool, seed: int) -> None:
    """Any shape, with or without a bias: within bf16 rounding of the fp32 product of the same bf16 operands, and as
    close to it as F.linear is (the same kernel family, without packing the weight on every call)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    want = x.float() @ w.float().T + (bias.float() if bias is not None else 0.0)
    got = packed_linear(x, pack_weight(w), bias).float()
    linear = torch.nn.functional.linear(x, w, bias).float()
    assert got.shape == (rows, n)
    assert ((got - want).abs() <= bf16_bound(want, k)).all(), "beyond bf16 rounding of the formula"
    assert (got - want).abs().max() <= 2 * (linear - want).abs().max() + 1e-6 * want.abs().amax()


@needs_packing
def test_packing_leaves_the_weight_and_takes_three_dimensional_inputs() -> None:
    w = torch.randn(48, 32).bfloat16()
    before = w.clone()
    packed = pack_weight(w)
    x = torch.randn(2, 5, 32).bfloat16()
    assert torch.equal(w, before), "packing changed the caller's weight"
    want = torch.nn.functional.linear(x, w).float()
    got = packed_linear(x, packed, None).float()
    assert got.shape == (2, 5, 48) and ((got - want).abs() <= bf16_bound(want, 32) * 2).all()


def count_packed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every packed product from now on, oneDNN's or the native one (they still compute)."""
    import infer.models.transformer as transformer
    from infer.kernels.native import NativeKernels

    rows: list[int] = []
    product, native = transformer.packed_linear, NativeKernels.gemm_bf16_packed
    native_f32 = NativeKernels.gemm_f32_packed

    def counted(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows.append(x.numel() // x.shape[-1])
        return product(x, packed, bias)

    def counted_native(self: NativeKernels, packed: torch.Tensor, x: torch.Tensor, n: int,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
        rows.append(x.numel() // x.shape[-1])
        return native(self, packed, x, n, bias)

    def counted_f32(self: NativeKernels, packed: torch.Tensor, x: torch.Tensor, n: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        rows.append(x.numel() // x.shape[-1])
        return native_f32(self, packed, x, n, bias)

    monkeypatch.setattr(transformer, "packed_linear", counted)
    monkeypatch.setattr(NativeKernels, "gemm_bf16_packed", counted_native)
    monkeypatch.setattr(NativeKernels, "gemm_f32_packed", counted_f32)
    return rows


NATIVE_PACKING = native_packing_unavailable([torch.zeros(2, 2, dtype=torch.bfloat16)])
NATIVE_F32_PACKING = native_packing_unavailable([torch.zeros(2, 2)])
# (quantized codes pack wherever dense bf16 weights do: the pair instruction, or AVX2's FMA path on bf16 blocks)
CODES_PACKING = NATIVE_PACKING or (None if native_kernels() is not None and native_kernels().packed_codes_available
                                   else "no native packed product on codes in this build")
# (an fp32 model's codes: AVX2's channel form alone)
CODES_F32_PACKING = (None if native_kernels() is not None and native_kernels().packed_codes_f32_available
                     else "no native packed product on fp32 rows of codes in this build")
LAYOUTS = [pytest.param("onednn", marks=pytest.mark.skipif(PACKING is not None,
                                                           reason=f"no oneDNN packing: {PACKING}")),
           pytest.param("native", marks=pytest.mark.skipif(NATIVE_PACKING is not None,
                                                           reason=f"no native packed product: {NATIVE_PACKING}"))]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ["qwen2", "gemma3_text"])
def test_packed_products_run_past_the_native_rows_within_rounding(arch: str, layout: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside `few_row_products()`, products of more than `native_rows` rows take the packed weights (q/k/v and
    gate/up fused, one product each: Qwen 2's q/k/v biases included) and the logits stay within bf16 rounding of the
    unpacked model's; up to them the native kernel keeps them (oneDNN's layout; the native packed product takes
    every product of 2 rows or more); outside the engine's steps nothing changes, bit for bit. The packed copies
    survive a change of the one-row kernel (which lays the fused products out again)."""
    import infer
    from infer.models.transformer import few_row_products
    from reference import build_checkpoint

    path = build_checkpoint(arch)
    plain = infer.load_model(path, decode_gemv="linear", dtype="bfloat16")
    model = infer.load_model(path, decode_gemv="linear", dtype="bfloat16")
    model.pack_products(True, native_rows=4, layout=layout)
    layers = len(model.layers)
    assert model.packed_products and model.packed_bytes > 0 and model.packed_layout == layout
    rows = count_packed(monkeypatch)
    ids = torch.randint(0, 400, (3, 6), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(model(ids), plain(ids)) and not rows, "outside the engine's steps: F.linear's bits"
        with few_row_products():
            got, want = model(ids).float(), plain(ids).float()
            # per layer: q/k/v fused, o_proj, gate/up fused, down_proj; then the LM head
            assert rows == [18] * (4 * layers) + [18], f"not one packed product per fused projection: {rows}"
            assert (got - want).abs().max() <= 0.05 * want.abs().max(), "beyond bf16 rounding of F.linear's logits"
            rows.clear()
            model(ids[:2, :2])  # 4 rows: not past native_rows (oneDNN's layout); the native one takes them
            if layout == "onednn":
                assert not rows, "a product of native_rows rows took the packed weights"
            else:
                assert rows == [4] * (4 * layers + 1), f"the native packed product missed 4-row products: {rows}"
            rows.clear()
            model(ids[:1, :1])  # one row: the one-row kernel's, never a packed product
            assert not rows, "a one-row product took the packed weights"
    model.decode_gemv = "native"
    model.decode_gemv = "linear"  # (unpacked, this form keeps no fused products)
    assert model.packed_products, "laying the fused products out again dropped the packing"
    with torch.no_grad(), few_row_products():
        rows.clear()
        model(ids)
        assert len(rows) == 4 * layers + 1, "the packed products are no longer the fused ones"
    model.pack_products(False)
    assert not model.packed_products and model.packed_bytes == 0


def test_packing_is_refused_with_the_reason() -> None:
    """fp32 weights in oneDNN's layout (and a bad argument) get one clear error; the model is left unpacked. The
    native layout takes fp32 weights where the build has the fp32 packed product."""
    import infer
    from reference import build_checkpoint

    model = infer.load_model(build_checkpoint("llama"), dtype="float32")
    with pytest.raises(ValueError, match="not bf16"):
        model.pack_products(True)
    assert not model.packed_products
    with pytest.raises(TypeError, match="on must be True or False"):
        model.pack_products("yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="native_rows must be an int >= 1"):
        model.pack_products(False, native_rows=0)
    with pytest.raises(ValueError, match="layout must be one of onednn, native"):
        model.pack_products(True, layout="blocked")
    if NATIVE_F32_PACKING is None:
        model.pack_products(True, layout="native")
        assert model.packed_layout == "native" and all(
            isinstance(p.packed, torch.Tensor) and p.packed.dtype == torch.float32 for p in model.packable_products())
        model.pack_products(False)
    assert not model.packed_products


def test_the_engine_chooses_packing_or_takes_the_callers_word() -> None:
    """`Engine(packed_products=None)` measures (recorded with its reason), True packs, False unpacks; fp32 weights
    have no oneDNN layout (refused under True, naming why) and, where the build has the fp32 packed product, are
    measured for the native one under auto and take it when asked (refused, naming why, where it has not)."""
    import infer
    from infer.engine import Engine
    from infer.tuning import CHOICES
    from reference import build_checkpoint

    path = build_checkpoint("llama")
    fp32 = infer.load_model(path, dtype="float32")
    Engine(fp32, None, num_blocks=16)
    choice = CHOICES["packed products"]
    if NATIVE_F32_PACKING is None:
        assert choice.value in {"native", "off"} and "F.linear" in choice.reason, choice
        assert (fp32.packed_layout or "off") == choice.value
    else:
        assert not fp32.packed_products and NATIVE_F32_PACKING in choice.reason
    with pytest.raises(ValueError, match="packed_products=True needs oneDNN's bf16 GEMM: the weights are not bf16"):
        Engine(fp32, None, num_blocks=16, packed_products=True)
    with pytest.raises(TypeError, match="packed_products must be True, False, None"):
        Engine(fp32, None, num_blocks=16, packed_products=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"or a layout \(onednn, native\), got 'mkl'"):
        Engine(fp32, None, num_blocks=16, packed_products="mkl")  # type: ignore[arg-type]
    if NATIVE_F32_PACKING is None:
        Engine(fp32, None, num_blocks=16, packed_products="native")
        assert fp32.packed_layout == "native"
        # (how far ahead the bf16 packed product prefetches is timed on bf16 copies: an fp32 model has none)
        assert CHOICES["packed product prefetch"].value == "none"
    else:
        with pytest.raises(ValueError, match="packed_products='native' needs the native packed product"):
            Engine(fp32, None, num_blocks=16, packed_products="native")
    if PACKING is not None:
        return
    bf16 = infer.load_model(path, dtype="bfloat16")
    Engine(bf16, None, num_blocks=16)
    choice = CHOICES["packed products"]
    assert choice.value in {"onednn", "native", "off"} and "F.linear" in choice.reason
    assert (bf16.packed_layout or "off") == choice.value
    if NATIVE_PACKING is None:
        CHOICES.pop("packed product prefetch", None)
        Engine(bf16, None, num_blocks=16, packed_products="native")
        assert bf16.packed_layout == "native" and all(p.packed_from == 1 for p in bf16.packable_products())
        assert CHOICES["packed product prefetch"].value in {"next pair", "pair after next"}, "native packing times " \
            "how far ahead its product prefetches"
    Engine(bf16, None, num_blocks=16, packed_products=True)
    assert bf16.packed_products
    copies = [p.packed for p in bf16.packable_products()]
    bf16.pack_products(True, native_rows=3)  # packed already: the rows change, the copies stay
    assert all(p.packed is c and p.packed_from == 3 for p, c in zip(bf16.packable_products(), copies, strict=True))
    Engine(bf16, None, num_blocks=16, packed_products=False)
    assert not bf16.packed_products


UPCAST_PACKING = packing_unavailable([torch.zeros(2, 2, dtype=torch.bfloat16)], torch.float32)


def layouts_and_upcasts() -> list[object]:
    """Each layout with the products in bf16 and upcast to fp32, skipped where the layout cannot pack them."""
    why = {("onednn", False): PACKING, ("native", False): NATIVE_PACKING, ("onednn", True): UPCAST_PACKING,
           ("native", True): NATIVE_PACKING}
    return [pytest.param(layout, upcast, marks=pytest.mark.skipif(reason is not None, reason=f"cannot pack: {reason}"),
                         id=f"{layout}-{'fp32' if upcast else 'bf16'}") for (layout, upcast), reason in why.items()]


@pytest.mark.parametrize(("layout", "upcast"), layouts_and_upcasts())
def test_the_engine_with_packed_products_answers_to_the_solo_runs(layout: str, upcast: bool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 engine with packed products (prefill chunks and decode batches past the native rows take them; every
    product of 2 rows or more in the native layout), its products in bf16 or upcast to fp32 (a CPU without bf16
    units; oneDNN's copies then fp32): each request's logits within bf16 rounding of its solo run."""
    import infer
    from infer.engine import Engine
    from infer.sampling import SamplingParams
    from reference import build_checkpoint
    from tests.helpers import assert_within_rounding_of_solo_runs

    model = infer.load_model(build_checkpoint("qwen2"), dtype="bfloat16",
                             compute_dtype=torch.float32 if upcast else "exact")
    rows = count_packed(monkeypatch)
    prompts = [[5, 9, 2, 8, 8, 1], [7, 7, 1, 3], [11], [4, 4, 4, 4, 4, 4, 4], [6, 2]]
    engine = Engine(model, None, num_blocks=32, keep_logits=True, packed_products=layout)
    assert model.packed_layout == layout
    model.pack_products(True, native_rows=2, layout=layout)  # (the measured rows could cover this small workload)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=5, temperature=0.0)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert rows, "no step took the packed products"
    assert_within_rounding_of_solo_runs(engine, model, prompts, ids)


def fp32_weights() -> list[object]:
    """The fp32 engine's weights: dense (the fp32 packed product) and int8 / int4 (codes in the channel form)."""
    return [pytest.param("dense", marks=pytest.mark.skipif(NATIVE_F32_PACKING is not None,
                                                           reason=f"no fp32 packed product: {NATIVE_F32_PACKING}")),
            *[pytest.param(w, marks=pytest.mark.skipif(CODES_F32_PACKING is not None, reason=str(CODES_F32_PACKING)))
              for w in ("int8", "int4")]]


@pytest.mark.parametrize("weights", fp32_weights())
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])
def test_an_fp32_engine_on_packed_products_is_exact_to_the_solo_runs(arch: str, weights: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp32 model's engine with its products packed natively (every product of 2 rows or more: prefill chunks,
    decode batches, the LM head; Qwen 2's q/k/v biases, Gemma 3's tied head), dense or quantized (int8 / int4 codes
    in the channel form, fp32 sums unrounded), every step in the whole-step call (prompt chunks and decode batches
    attending in the native paged kernel): each request's greedy tokens those of its solo run and its fp32 logits
    within 1e-5 of the solo run fed the same tokens (whose products are F.linear's or the codes kernel's, and the
    one-row kernel's: only the order of the fp32 sums differs)."""
    import infer
    from infer.engine import Engine
    from infer.kernels.native import NativeKernels
    from infer.sampling import SamplingParams
    from reference import build_checkpoint
    from tests.helpers import assert_close, solo_logits

    model = infer.load_model(build_checkpoint(arch), dtype="float32", weights=weights)
    rows = count_packed(monkeypatch)
    coded = NativeKernels.quantized_gemm_packed

    def counted_codes(self: NativeKernels, packed: Any, x: torch.Tensor, bias: torch.Tensor | None = None
                      ) -> torch.Tensor:
        assert x.dtype == torch.float32 and packed.fmt in ("q8c", "q4c")
        rows.append(x.numel() // x.shape[-1])
        return coded(self, packed, x, bias)

    monkeypatch.setattr(NativeKernels, "quantized_gemm_packed", counted_codes)
    whole_step, whole = NativeKernels.batch_step, []

    def counted_step(self: NativeKernels, layers: Any, shape: tuple[int, int, int, int, int], eps: float,
                     x: torch.Tensor, *args: Any) -> None:
        whole.append(x.numel() // shape[3])
        whole_step(self, layers, shape, eps, x, *args)

    monkeypatch.setattr(NativeKernels, "batch_step", counted_step)
    prompts = [[5, 9, 2, 8, 8, 1, 3, 3, 9], [7, 7, 1, 3], [11], [4, 4, 4, 4, 4, 4, 4], [6, 2]]
    engine = Engine(model, None, num_blocks=32, keep_logits=True, packed_products="native",
                    decode_attention="native", chunk_attention="native")
    assert model.packed_layout == "native"
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert rows and max(rows) > 1, "no step took the packed products"
    assert whole and max(whole) > len(prompts), "the prompt chunks and decode steps did not take the whole-step call"
    for prompt, rid in zip(prompts, ids, strict=True):
        result = engine.result(rid)
        assert result.token_ids == infer.generate(model, None, prompt, params).token_ids
        solo = solo_logits(model, prompt, result.token_ids)
        assert result.logits is not None
        assert_close(result.logits, solo, 1e-5 * max(1.0, solo.abs().max().item()), f"request {rid} logits")


@needs_packing
def test_packing_stays_off_where_the_copies_would_crowd_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under auto, copies larger than half the free memory are not made (the reason names both sizes); forced on,
    the caller's word stands."""
    import infer
    import infer.tuning as tuning
    from infer.engine import Engine
    from infer.tuning import CHOICES
    from reference import build_checkpoint

    model = infer.load_model(build_checkpoint("llama"), dtype="bfloat16")
    copy = sum(p.weight.nbytes for p in model.packable_products())
    monkeypatch.setattr(tuning, "available_memory", lambda device: copy)  # the copies would take all of it
    Engine(model, None, num_blocks=16)
    assert not model.packed_products and "half the free memory" in CHOICES["packed products"].reason
    Engine(model, None, num_blocks=16, packed_products=True)
    assert model.packed_products


def test_packing_names_why_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each precondition refused with its own reason: no weights, weights off the CPU, not bf16, an upcast oneDNN
    has no copies for, no oneDNN."""
    bf16 = torch.zeros(4, 4, dtype=torch.bfloat16)
    assert packing_unavailable([]) == "no dense projections"
    assert "upcast to torch.float16" in str(packing_unavailable([bf16], torch.float16))
    meta = torch.zeros(4, 4, dtype=torch.bfloat16, device="meta")
    assert packing_unavailable([bf16, meta]) == "the weights are not on the CPU"
    assert packing_unavailable([bf16, torch.zeros(4, 4)]) == "the weights are not bf16"
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert packing_unavailable([bf16]) == "this PyTorch has no oneDNN"


def test_the_native_layout_names_why_it_cannot_take_fp32_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 weights pack natively only all on the CPU, and only where the build has the fp32 packed product (a
    build without AVX2 and FMA says so); mixed with bf16 ones, or not the model's dtype, they are refused; a model of
    another dtype is refused naming it."""
    import infer.models.transformer as transformer
    from infer.kernels.native import FLAVOURS

    fp32, bf16 = torch.zeros(4, 6), torch.zeros(4, 6, dtype=torch.bfloat16)
    assert native_packing_unavailable([fp32, torch.zeros(4, 6, device="meta")]) == "the weights are not on the CPU"
    assert native_packing_unavailable([fp32, bf16]) == "the weights are not float32"
    assert native_packing_unavailable([bf16, fp32]) == "the weights are not bf16"
    assert native_packing_unavailable([fp32], dtype=torch.bfloat16) == "the weights are not bf16"
    assert native_packing_unavailable([bf16], dtype=torch.float16) == "the activations are torch.float16, not bf16 " \
                                                                     "or float32"
    generic = native_kernels("generic") if "generic" in FLAVOURS else None
    if generic is None:
        pytest.skip("no generic build here")
    monkeypatch.setattr(transformer, "native_kernels", lambda flavour="native": generic)
    assert native_packing_unavailable([fp32]) == f"this build ({generic.isa}) has no AVX2 with FMA"


@pytest.mark.parametrize(("ratios", "want", "upto"), [
    ({"onednn": (0.9, 0.9, 1.0), "native": (0.6, 0.8, 1.0)}, "native", None),  # the native products faster
    # oneDNN's more than 5% faster on the whole
    ({"onednn": (0.6, 0.8, 0.9), "native": (0.7, 0.85, 0.9)}, "onednn", None),
    # within 5%: the native one (its one call)
    ({"onednn": (0.6, 0.8, 0.9), "native": (0.62, 0.82, 0.92)}, "native", None),
    # neither 3% faster than F.linear on the whole
    ({"onednn": (0.99, 1.0, 1.0), "native": (0.99, 0.99, 1.0)}, "off", None),
    # 10% slower at the budget's rows: taken up to 64 rows, F.linear past them
    ({"onednn": (0.5, 0.6, 1.3), "native": (0.5, 0.6, 1.2)}, "native", 64),
    ({"onednn": (1.0, 1.0, 1.0), "native": (0.9, 1.0, 1.05)}, "off", None),  # 10% faster at one count, not on the whole
    ({"onednn": (1.2, 1.0, 0.5), "native": (1.3, 0.5, 0.5)}, "off", None),  # slower at 16 rows: never taken
])
def test_the_layout_is_the_best_mean_time_against_f_linear(ratios: dict[str, tuple[float, ...]], want: str,
                                                          upto: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The choice's rule on scripted timings (each layout's time over F.linear's at 16 rows, 64 and the budget): each
    layout taken up to the count before the first at which it is 10% slower (F.linear's time past it), the least mean
    time then, the native layout kept unless oneDNN's is 5% less, off unless 3% faster than F.linear on the whole;
    the choice names the timings and the rows it is taken to."""
    import infer
    import infer.tuning as tuning
    from reference import build_checkpoint

    if NATIVE_PACKING is not None:
        pytest.skip(f"no native packed product here: {NATIVE_PACKING}")
    if PACKING is not None:  # (no oneDNN bf16 kernels here: its copies scripted as its timings are; the rule is tested)
        monkeypatch.setattr(tuning, "packing_unavailable", lambda weights, upcast=None: None)
        monkeypatch.setattr(tuning, "pack_weight", lambda weight: weight)
    model = infer.load_model(build_checkpoint("llama"), dtype="bfloat16")
    model.gemm_rows = 1  # (no few-row kernel in oneDNN's column: the ratios are the packed products')
    calls = iter(range(3))

    def scripted(forms: dict[str, object], device: torch.device, repeats: int) -> dict[str, float]:
        i = next(calls)
        return {"linear": 1.0, **{layout: ratios[layout][i] for layout in forms if layout != "linear"}}

    monkeypatch.setattr(tuning, "_time_alternately", scripted)
    choice = tuning._choose_packing(model, 128, None)
    assert choice.choice.value == want and choice.on == (want != "off") and choice.upto == upto
    assert "16 rows over " in choice.choice.reason and "128 rows over " in choice.choice.reason
    assert (f"taken up to {upto} rows" in choice.choice.reason) == (upto is not None)


@pytest.mark.parametrize(("ratios", "upto", "seen"), [
    ((0.5, 0.6, 0.9), None, (0.5, 0.6, 0.9)),
    ((0.5, 0.6, 1.3), 64, (0.5, 0.6, 1.0)),
    ((0.5, 1.15, 0.9), 16, (0.5, 1.0, 1.0)),  # (a count past the first 10% slower one is not taken either)
    ((1.1, 0.6, 0.9), 1, (1.0, 1.0, 1.0)),
    ((0.9, 1.0, 1.09), None, (0.9, 1.0, 1.09)),  # (within 10%: a shared host's noise)
])
def test_packed_copies_are_taken_up_to_the_first_count_they_lose_by_10_percent(
        ratios: tuple[float, ...], upto: int | None, seen: tuple[float, ...]) -> None:
    """`_packed_range`: the rows taken, and the ratios the steps then see (F.linear's, 1, past them)."""
    import infer.tuning as tuning

    assert tuning._packed_range((16, 64, 2048), list(ratios)) == (upto, list(seen))


@pytest.mark.skipif(NATIVE_PACKING is not None, reason=f"no native packed product here: {NATIVE_PACKING}")
def test_products_past_the_packed_rows_take_the_unpacked_form() -> None:
    """A model packed with `upto=4`: inside the engine's steps, products of 2-4 rows are the native packed product's
    and of 5 or more F.linear's on the weight (upcast where the model's products upcast), bit for bit (and counted:
    on AMX both may give the same bits); `upto` at or below the few-row kernel's rows refused."""
    import infer
    from infer.models.transformer import Linear, few_row_products
    from reference import build_checkpoint

    kernels = native_kernels()
    assert kernels is not None
    # (decode_gemv "linear": the unpacked form F.linear at every count, not the few-row kernel the load may choose)
    model = infer.load_model(build_checkpoint("llama"), dtype="bfloat16", decode_gemv="linear")
    model.pack_products(True, 1, "native", upto=4)
    product = next(p for p in model.packable_products() if isinstance(p, Linear))
    assert product.packed_upto == 4 and product.packed is not None
    up = product.upcast or torch.bfloat16  # (a CPU without bf16 units: its unpacked products upcast)
    g = torch.Generator().manual_seed(0)
    for rows in (2, 4, 5, 9):
        x = torch.randn(rows, product.in_features, generator=g).bfloat16()
        with pytest.MonkeyPatch.context() as patch, few_row_products():
            counted = count_packed(patch)
            got = product(x)
        assert counted == ([rows] if rows <= 4 else []), f"{rows} rows: packed products {counted}"
        bias = None if product.bias is None else product.bias.to(up)
        want = (kernels.gemm_bf16_packed(product.packed, x, product.out_features, product.bias) if rows <= 4
                else torch.nn.functional.linear(x.to(up), product.weight.to(up), bias).bfloat16())
        assert torch.equal(got, want), f"{rows} rows: not the {'packed' if rows <= 4 else 'unpacked'} product"
    with pytest.raises(ValueError, match="upto must be None or an int above native_rows"):
        model.pack_products(True, 1, "native", upto=1)
    model.pack_products(False)
    assert all(p.packed is None and p.packed_upto is None for p in model.packable_products())


def test_a_quantized_model_packs_its_codes_or_names_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantized model's products pack as codes in the native layout (every quantized product, the LM head
    included; their bytes counted), chosen by measuring against the quantized kernels, or forced; oneDNN's layout and
    fp32 activations are refused naming why, leaving the model unpacked."""
    import infer
    from infer.engine import Engine
    from infer.models.transformer import QuantizedLinear
    from infer.tuning import CHOICES
    from reference import build_checkpoint

    path = build_checkpoint("llama")
    fp32 = infer.load_model(path, dtype="float32", weights="int8")
    if CODES_F32_PACKING is not None:  # (a build without AVX2's channel form: refused, naming it)
        with pytest.raises(ValueError, match="native packed product: this build .* fp32 rows of codes"):
            fp32.pack_products(True, layout="native")
        with pytest.raises(ValueError, match="packed_products='native' needs the native packed product: this build"):
            Engine(fp32, None, num_blocks=16, packed_products="native")
        assert not fp32.packed_products
    else:  # fp32 rows of codes: the channel form, every quantized product
        Engine(fp32, None, num_blocks=16, packed_products="native")
        assert all(isinstance(p, QuantizedLinear) and p.packed is not None and p.packed.fmt in ("q8c", "q4c")
                   for p in fp32.packable_products())
        fp32.pack_products(False)
        kernels = native_kernels()  # (a build whose codes are laid out for the pair instruction: AVX512-BF16's)
        monkeypatch.setattr(kernels, "packed_codes_f32_available", False)
        with pytest.raises(ValueError, match="native packed product: this build .* no product of fp32 rows on codes"):
            fp32.pack_products(True, layout="native")
        assert not fp32.packed_products
    model = infer.load_model(path, dtype="bfloat16", weights="int4", packed_products=False)
    with pytest.raises(ValueError, match="quantized projections have no oneDNN layout"):
        model.pack_products(True, layout="onednn")
    with pytest.raises(ValueError, match="packed_products=True needs oneDNN's bf16 GEMM, which has no layout for"):
        Engine(model, None, num_blocks=16, packed_products=True)
    assert not model.packed_products
    if CODES_PACKING is not None:
        return
    Engine(model, None, num_blocks=16)
    choice = CHOICES["packed products"]
    assert choice.value in {"native", "off"} and "the quantized kernels" in choice.reason
    assert (model.packed_layout or "off") == choice.value
    Engine(model, None, num_blocks=16, packed_products="native")
    products = model.packable_products()
    assert products[-1] is model.lm_head and all(isinstance(p, QuantizedLinear) for p in products)
    assert all(p.packed is not None and p.packed_from == 1 for p in products)
    assert model.packed_bytes == sum(p.packed.nbytes for p in products)  # type: ignore[union-attr]
    Engine(model, None, num_blocks=16, packed_products=False)
    assert not model.packed_products and model.packed_bytes == 0


def test_a_quantized_model_packs_its_codes_at_load_by_the_build_or_as_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """`load_model`'s `packed_products`: None packs a quantized model's products for one request (one-row products
    included) where the model's rows take codes in AVX2's channel form (bf16 rows on AVX2 builds, fp32 rows on every
    build with AVX2 and FMA, AVX512-BF16's included), and names why not elsewhere; True packs them on any build that
    has the packed product for the model's dtype; False leaves them unpacked; a bad value, or True for a model
    without quantized projections, is refused naming the argument."""
    import infer
    from infer.tuning import CHOICES
    from reference import build_checkpoint

    path = build_checkpoint("llama")
    kernels = native_kernels()
    model = infer.load_model(path, dtype="bfloat16", weights="int4")
    choice = CHOICES["packed codes for one request"]
    if CODES_PACKING is None and kernels is not None and kernels.channel_codes:
        assert choice.value == "native" and "channel form" in choice.reason
        assert model.packed_products and all(p.takes_packed(1) for p in model.packable_products())
    else:
        assert choice.value == "off" and choice.reason and not model.packed_products
    fp32 = infer.load_model(path, dtype="float32", weights="int4")
    choice = CHOICES["packed codes for one request"]
    if CODES_F32_PACKING is None:  # (fp32 rows: the channel form on every build that has it)
        assert choice.value == "native" and "fp32 rows on codes in AVX2's channel form" in choice.reason
        assert fp32.packed_products and all(p.takes_packed(1) and p.packed.fmt in ("q4c", "q8c")  # type: ignore[union-attr]
                                            for p in fp32.packable_products())
    else:
        assert choice.value == "off" and choice.reason and not fp32.packed_products
    if kernels is not None:  # (a build whose bf16 rows take codes in pairs, AVX512-BF16's: fp32 rows still pack)
        monkeypatch.setattr(kernels, "channel_codes", False)
        fp32 = infer.load_model(path, dtype="float32", weights="int4")
        assert fp32.packed_products == (CODES_F32_PACKING is None)
        assert not infer.load_model(path, dtype="bfloat16", weights="int4").packed_products
        assert "lays codes out in pairs" in CHOICES["packed codes for one request"].reason
        monkeypatch.undo()
    if CODES_PACKING is None:
        packed = infer.load_model(path, dtype="bfloat16", weights="int4", packed_products=True)
        assert packed.packed_layout == "native" and all(p.takes_packed(1) for p in packed.packable_products())
        assert CHOICES["packed codes for one request"].reason == "forced by the caller"
    unpacked = infer.load_model(path, dtype="bfloat16", weights="int4", packed_products=False)
    assert not unpacked.packed_products and CHOICES["packed codes for one request"].value == "off"
    with pytest.raises(TypeError, match="packed_products must be None"):
        infer.load_model(path, weights="int4", packed_products="native")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="packed_products=True packs quantized projections' codes, and this model"):
        infer.load_model(path, dtype="bfloat16", packed_products=True)
    with pytest.raises(ValueError, match="packed_products=True packs one process's whole model, not a tensor-par"):
        infer.load_model(path, weights="int4", packed_products=True, tensor_parallel=True)


@pytest.mark.parametrize(("ratios", "want", "upto", "one_row"), [
    ((0.7, 0.9, 0.99, 0.6), "native", None, True),  # faster on the whole, and at one row
    ((0.99, 0.98, 0.99, 0.5), "off", None, False),  # not 3% faster on the whole (one row alone does not pack)
    ((0.5, 0.6, 1.15, 0.98), "native", 64, False),  # 10% slower at the budget's rows: the quantized kernels past 64;
    # one row not 3% faster: the codes kernel there
    ((1.15, 0.6, 0.5, 0.5), "off", None, False),  # 10% slower at 16 rows: never taken
])
def test_a_quantized_model_packs_where_the_packed_codes_are_faster(ratios: tuple[float, ...], want: str,
                                                                   upto: int | None, one_row: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The quantized choice's rule on scripted timings (the packed codes' time over the quantized kernels' at 16 rows,
    64 and the budget, then one row): taken up to the count before the first at which they are 10% slower, on where
    3% faster on the whole then, and for one-row products where 3% faster at one row (against the codes kernel);
    the model's own products are timed unpacked and left as they were, and the engine packs as the choice says."""
    import infer
    import infer.engine as engine_module
    import infer.tuning as tuning
    from infer.engine import Engine
    from infer.models.transformer import QuantizedLinear
    from reference import build_checkpoint

    if CODES_PACKING is not None:
        pytest.skip(f"no native packed codes here: {CODES_PACKING}")
    model = infer.load_model(build_checkpoint("qwen2"), dtype="bfloat16", weights="int8")
    model.pack_products(True, layout="native")
    before = [p.packed for p in model.packable_products()]
    calls = iter(range(4))
    rows_timed: list[int] = []

    def scripted(forms: dict[str, Callable[[], object]], device: torch.device, repeats: int) -> dict[str, float]:
        assert all(p.packed is None for p in model.packable_products() if isinstance(p, QuantizedLinear))
        forms["own"]()  # (the quantized kernels run)
        rows_timed.append(next(iter(forms["own"].args[1].values())).shape[0])  # type: ignore[attr-defined]
        return {"own": 1.0, "native": ratios[next(calls)]}

    timed_alternately = tuning._time_alternately
    monkeypatch.setattr(tuning, "_time_alternately", scripted)
    choice = tuning._choose_packing(model, 128, None)
    monkeypatch.setattr(tuning, "_time_alternately", timed_alternately)  # (the engine's other choices time)
    assert rows_timed == [16, 64, 128, 1], rows_timed
    assert choice.choice.value == want and choice.on == (want != "off") and choice.upto == upto
    assert choice.one_row == one_row
    assert "16 rows: " in choice.choice.reason and "128 rows: " in choice.choice.reason
    assert all(p.packed is c for p, c in zip(model.packable_products(), before, strict=True))
    monkeypatch.setattr(engine_module, "choose_packed_products", lambda *args: choice)
    Engine(model, None, num_blocks=16)
    coded = [p for p in model.packable_products() if isinstance(p, QuantizedLinear)]
    assert {p.packed_from for p in coded} == ({0} if one_row else {1})
    assert all(p.takes_packed(1) == one_row for p in coded)
    with pytest.raises(TypeError, match="one_row must be True or False, got 1"):
        model.pack_products(True, layout="native", one_row=1)  # type: ignore[arg-type]
    assert {p.packed_from for p in coded} == ({0} if one_row else {1}), "a refused call changed the packing"


def test_the_quantized_choice_times_more_rows_over_fewer_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past 16 rows the quantized choice times each count over a prefix of its sweep holding 16 rows' arithmetic over
    the whole sweep (as the dense choice does): the budget's rows over every weight had been most of a quantized
    engine's set-up."""
    import infer
    import infer.tuning as tuning
    from infer.models.transformer import QuantizedLinear
    from reference import build_checkpoint

    if CODES_PACKING is not None:
        pytest.skip(f"no native packed codes here: {CODES_PACKING}")
    model = infer.load_model(build_checkpoint("qwen2"), dtype="bfloat16", weights="int8")
    coded = [p for p in model.packable_products() if isinstance(p, QuantizedLinear)]
    whole = sum(2 * p.in_features * p.out_features for p in coded)
    monkeypatch.setattr(tuning, "_AHEAD_SWEEP_BYTES", whole)  # the sweep: every weight, as on a model past the cache
    monkeypatch.setattr(tuning, "last_level_cache_bytes", lambda: 0)
    monkeypatch.setattr(tuning, "_PACKING_SWEEP_MIN_BYTES", 0)
    counted: list[int] = []

    def scripted(forms: dict[str, Callable[[], object]], device: torch.device, repeats: int) -> dict[str, float]:
        weights = forms["native"].args[1]  # type: ignore[attr-defined]
        assert len(forms["own"].args[0]) == len(weights)  # type: ignore[attr-defined]
        counted.append(len(weights))
        return {"own": 1.0, "native": 0.5}

    monkeypatch.setattr(tuning, "_time_alternately", scripted)
    choice = tuning._choose_packing(model, 128, None)
    assert choice.choice.value == "native" and len(counted) == 4 and counted[3] == len(coded)  # (1 row: every weight)
    counted = counted[:3]
    rows, cuts = (16, 64, 128), [sum(2 * p.in_features * p.out_features for p in coded[:n]) for n in counted]
    assert counted[0] == len(coded) and counted[2] < counted[0]
    for m, n, cut in zip(rows, counted, cuts, strict=True):  # the shortest prefix reaching 16 rows' arithmetic
        previous = sum(2 * p.in_features * p.out_features for p in coded[:n - 1])
        assert cut >= min(whole, whole * 16 // m) > previous, (m, n)


@pytest.mark.skipif(UPCAST_PACKING is not None, reason=f"no oneDNN packing: {UPCAST_PACKING}")
def test_products_that_upcast_pack_their_copies_in_the_compute_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 weights whose products upcast to fp32 (a CPU without bf16 units: forced here) pack oneDNN's copies in fp32
    (twice the bytes) and the engine's products run on them, within bf16 rounding of the unpacked upcast products
    (Qwen 2's biases included); outside the engine's steps nothing changes, bit for bit; once the products no longer
    upcast, the fp32 copies go unused, and packing again makes them in the weights' dtype where oneDNN runs it."""
    import infer
    from infer.models.transformer import few_row_products
    from reference import build_checkpoint

    path = build_checkpoint("qwen2")
    plain = infer.load_model(path, decode_gemv="linear", dtype="bfloat16", compute_dtype=torch.float32)
    model = infer.load_model(path, decode_gemv="linear", dtype="bfloat16", compute_dtype=torch.float32)
    model.pack_products(True, layout="onednn")
    products = model.packable_products()
    assert all(p.packed is not None and p.packed.dtype == torch.float32 for p in products)
    assert model.packed_bytes == 2 * sum(p.weight.nbytes for p in products)
    rows = count_packed(monkeypatch)
    ids = torch.randint(0, 400, (3, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(ids), plain(ids)) and not rows, "outside the engine's steps: the upcast F.linear"
        with few_row_products():
            got, want = model(ids).float(), plain(ids).float()
            assert rows == [18] * (4 * len(model.layers) + 1), f"not one packed product per fused projection: {rows}"
            assert (got - want).abs().max() <= 0.05 * want.abs().max(), "beyond bf16 rounding of the upcast products"
            model.compute_dtype = None
            rows.clear()
            model(ids)
            assert not rows, "fp32 copies used by products that no longer upcast"
    if PACKING is None:  # (oneDNN runs bf16 here: packing again makes bf16 copies)
        model.pack_products(True, layout="onednn")
        assert all(p.packed is not None and p.packed.dtype == torch.bfloat16 for p in model.packable_products())
