"""The batched engine's whole-step native call (infer/models/native_batch_step.py): every layer of a step whose tokens
all attend in the native paged kernel, in one call. Held bit for bit to the per-op path (the same kernels in the same
order), to each request's solo run within bf16 rounding, and to the per-op path wherever it does not apply."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from infer.kernels.native import NativeKernels, native_kernels
from infer.models.transformer import native_packing_unavailable

if TYPE_CHECKING:
    from infer.engine import Engine

# (the whole step runs where the packed product does: AVX512-BF16's pair instruction or AVX2 with FMA)
WHY = native_packing_unavailable([torch.zeros(2, 2, dtype=torch.bfloat16)])
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no native whole batched step here: {WHY}")
# (a quantized model's packed codes)
needs_codes = pytest.mark.skipif(native_kernels() is None or not native_kernels().packed_codes_available,
                                 reason="no native packed product on codes in this build")
# An fp32 model's steps: its products on the fp32 packed product (dense), or its codes in AVX2's channel form.
F32_WHY = native_packing_unavailable([torch.zeros(2, 2)])
CODES_F32 = native_kernels() is not None and native_kernels().packed_codes_f32_available  # type: ignore[union-attr]
DTYPES = ["bfloat16", pytest.param("float32", marks=pytest.mark.skipif(F32_WHY is not None, reason=str(F32_WHY)))]
CODES_DTYPES = ["bfloat16", pytest.param("float32", marks=pytest.mark.skipif(
    not CODES_F32, reason="no native packed product on fp32 rows of codes in this build"))]


def count_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every whole-step call from now on (they still compute)."""
    rows: list[int] = []
    step = NativeKernels.batch_step

    def counted(self: NativeKernels, layers: object, shape: tuple[int, int, int, int, int], eps: float,
                x: torch.Tensor, *args: object) -> None:
        rows.append(x.numel() // shape[3])
        step(self, layers, shape, eps, x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(NativeKernels, "batch_step", counted)
    return rows


def serve(arch: str, prompts: list[list[int]], new: int | list[int], native_step: bool, packed: str | bool = "native",
          weights: str | None = None, decode_gemv: str = "auto", one_row: bool = False, dtype: str = "bfloat16",
          embed_scale: float | None = None, **engine_args: object) -> list[tuple[list[int], torch.Tensor]]:
    """Each request's greedy tokens and logits through an engine of `dtype` (bf16 unless given) on `arch`'s test
    checkpoint (its weights quantized under `weights`, their packed codes taking one-row products too under
    `one_row`; Gemma's embedding scale replaced by `embed_scale` where given; `new`: every request's new tokens, or
    each one's)."""
    import infer
    from infer.engine import Engine
    from infer.sampling import SamplingParams
    from reference import build_checkpoint

    model = infer.load_model(build_checkpoint(arch), dtype=dtype, weights=weights, decode_gemv=decode_gemv)
    model.native_step = native_step
    if embed_scale is not None:
        model.embed_scale = embed_scale
    engine = Engine(model, None, num_blocks=64, keep_logits=True, packed_products=packed,  # type: ignore[arg-type]
                    decode_attention="native", **engine_args)  # type: ignore[arg-type]
    if one_row:  # (as the engine packs where the choice times the packed codes faster at one row)
        model.pack_products(True, layout="native", one_row=True)
    news = new if isinstance(new, list) else [new] * len(prompts)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=n, temperature=0.0)) for p, n in zip(prompts, news,
                                                                                                      strict=True)]
    while engine.has_unfinished():
        engine.step()
    out = []
    for rid in ids:
        result = engine.result(rid)
        assert result.logits is not None
        out.append((result.token_ids, result.logits))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3_text"])
@settings(max_examples=3, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=2, max_size=6), new=st.integers(2, 8),
       seed=st.integers(0, 2**16))
def test_the_whole_step_is_the_per_op_path_bit_for_bit(arch: str, dtype: str, lengths: list[int], new: int,
                                                       seed: int) -> None:
    """Random batches (prompt chunks attending as rows of the paged kernel's one call, then decode steps; Qwen 2's
    q/k/v biases, Qwen 3's q/k norms, Gemma 3's norms, post-norms, GELU, its embedding's scale and sliding layers
    reading their rings' tables), bf16 models and fp32 ones: every request's tokens and logits equal the per-op
    path's, and the call ran."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 300) for _ in range(n)] for n in lengths]
    with pytest.MonkeyPatch.context() as patch:
        rows = count_calls(patch)
        fast = serve(arch, prompts, new, native_step=True, chunk_attention="native", dtype=dtype)
        assert rows, "no step took the whole-step call"
        assert sum(rows) >= sum(lengths), "the prompt chunks did not run in the whole-step call"
        rows.clear()
        slow = serve(arch, prompts, new, native_step=False, chunk_attention="native", dtype=dtype)
        assert not rows, "native_step=False still took the whole-step call"
    for (tokens, logits), (want_tokens, want_logits) in zip(fast, slow, strict=True):
        assert tokens == want_tokens and torch.equal(logits, want_logits), "the whole step parted from the per-op path"


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemmas_embedding_scale_is_rounded_as_the_per_op_path_rounds_it(dtype: str) -> None:
    """Gemma multiplies its embeddings by sqrt(hidden) rounded to the model's dtype: a real model's (hidden 1152:
    33.94..., no bf16 value, no fp32 one) set in place of the test checkpoint's (hidden 64: 8, exact in any dtype),
    the whole step's tokens and logits equal the per-op path's, bf16 and fp32 alike."""
    prompts = [[3, 14, 15, 9, 2, 6], [5, 3, 5, 8]]
    scale = 1152**0.5
    assert float(torch.tensor(scale, dtype=torch.bfloat16)) != float(torch.tensor(scale, dtype=torch.float32))
    with pytest.MonkeyPatch.context() as patch:
        rows = count_calls(patch)
        fast = serve("gemma3_text", prompts, 4, native_step=True, chunk_attention="native", dtype=dtype,
                     embed_scale=scale)
        assert rows and max(rows) > len(prompts), "the prompt chunks did not take the whole-step call"
        slow = serve("gemma3_text", prompts, 4, native_step=False, chunk_attention="native", dtype=dtype,
                     embed_scale=scale)
    for (tokens, logits), (want_tokens, want_logits) in zip(fast, slow, strict=True):
        assert tokens == want_tokens and torch.equal(logits, want_logits), "the scaled embedding parted"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3_text"])
def test_one_row_steps_take_the_whole_step_bit_for_bit(arch: str, dtype: str) -> None:
    """Steps of one token (a request alone, or the last one left) take the call too, its products the GEMV the per-op
    path's one-row products are: tokens and logits equal the per-op path's; a quantized model's one-row steps, whose
    products are the codes' own GEMV, keep the per-op path."""
    prompts = [[3, 14, 15, 9, 2, 6], [5, 3, 5]]
    with pytest.MonkeyPatch.context() as patch:
        rows = count_calls(patch)
        fast = serve(arch, prompts, [9, 3], native_step=True, decode_gemv="native", dtype=dtype)
        assert rows.count(1) >= 5, f"the one-row steps did not take the whole-step call: {rows}"
        rows.clear()
        slow = serve(arch, prompts, [9, 3], native_step=False, decode_gemv="native", dtype=dtype)
        assert not rows
    for (tokens, logits), (want_tokens, want_logits) in zip(fast, slow, strict=True):
        assert tokens == want_tokens and torch.equal(logits, want_logits), "a one-row step parted from the per-op path"


@needs_codes
@pytest.mark.parametrize(("arch", "weights"), [("llama", "int8"), ("qwen2", "int4"), ("gemma3_text", "int8")])
def test_one_row_steps_on_packed_codes_take_the_whole_step_bit_for_bit(arch: str, weights: str) -> None:
    """Where the quantized products' packed codes take one-row products too (the packing choice's `one_row`: faster
    than the codes kernel there), steps of one token take the call, its products the packed codes the per-op path's
    one-row products then are: tokens and logits equal the per-op path's (Qwen 2's biases, Gemma 3's rings)."""
    prompts = [[3, 14, 15, 9, 2, 6], [5, 3, 5]]
    with pytest.MonkeyPatch.context() as patch:
        rows = count_calls(patch)
        fast = serve(arch, prompts, [9, 3], native_step=True, weights=weights, one_row=True)
        assert rows.count(1) >= 5, f"the one-row steps did not take the whole-step call: {rows}"
        rows.clear()
        slow = serve(arch, prompts, [9, 3], native_step=False, weights=weights, one_row=True)
        assert not rows
    for (tokens, logits), (want_tokens, want_logits) in zip(fast, slow, strict=True):
        assert tokens == want_tokens and torch.equal(logits, want_logits), "a one-row step parted from the per-op path"


@pytest.mark.parametrize(("weights", "gemv"), [pytest.param("int8", "native", marks=needs_codes), (None, "linear")])
def test_one_row_steps_whose_products_are_not_the_native_gemv_keep_the_per_op_path(
        weights: str | None, gemv: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a one-row product is not the native GEMV on a bf16 weight (a quantized model's: the codes' own GEMV; or
    another decode kernel chosen), one-row steps keep the per-op path; the multi-row steps still take the call."""
    rows = count_calls(monkeypatch)
    serve("llama", [[3, 14, 15, 9], [5, 3]], [6, 2], native_step=True, weights=weights, decode_gemv=gemv)
    assert rows and 1 not in rows and 2 in rows, rows


def after_the_prompts(prompts: list[list[int]], new: int, **engine_args: object) -> tuple[Engine, list[int]]:
    """A bf16 Llama engine (as `serve` makes it) with the greedy requests added and their prompts' step run."""
    import infer
    from infer.engine import Engine
    from infer.sampling import SamplingParams
    from reference import build_checkpoint

    model = infer.load_model(build_checkpoint("llama"), dtype="bfloat16")
    engine = Engine(model, None, num_blocks=64, keep_logits=True, packed_products="native",
                    decode_attention="native", **engine_args)  # type: ignore[arg-type]
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=new, temperature=0.0)) for p in prompts]
    engine.step()
    return engine, ids


def assert_it_serves(engine: Engine, ids: list[int], want: list[tuple[list[int], torch.Tensor]]) -> None:
    """The engine's requests, run to the end, give `want`'s tokens and logits exactly."""
    while engine.has_unfinished():
        engine.step()
    for rid, (tokens, logits) in zip(ids, want, strict=True):
        result = engine.result(rid)
        assert result.token_ids == tokens and result.logits is not None and torch.equal(result.logits, logits)


def count_fills_inside(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The layer of every quantized pool layer that quantized blocks within a whole-step call: in the call itself (its
    description's fill rows, `native_quantizer`), or by calling back the pool's `quantize_filled` (they still run)."""
    from infer.cache.paged_quantized import QuantizedPoolLayer

    layers: list[int] = []
    inside = [False]
    fill, step = QuantizedPoolLayer.quantize_filled, NativeKernels.batch_step

    def counted(self: QuantizedPoolLayer) -> None:
        if inside[0] and self.pool.plan.fill:
            layers.append(self.layer)
        fill(self)

    def flagged(self: NativeKernels, descs: Any, *args: object, **kwargs: object) -> None:
        coded = [desc for desc in descs if desc.k_codes]  # (the pool's layers, in its order)
        layers.extend(i for i, desc in enumerate(coded) if desc.n_fill)
        inside[0] = True
        try:
            step(self, descs, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            inside[0] = False

    monkeypatch.setattr(QuantizedPoolLayer, "quantize_filled", counted)
    monkeypatch.setattr(NativeKernels, "batch_step", flagged)
    return layers


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quantizer", ["native", "torch"])
@pytest.mark.parametrize("chunks", ["sdpa", "native"])
@pytest.mark.parametrize(("arch", "kv"), [("llama", "int8"), ("qwen2", "int4"), ("qwen3", "fp4"),
                                        ("gemma3_text", "int8")])
def test_a_quantized_pool_in_the_whole_step_is_the_per_op_path_bit_for_bit(arch: str, kv: str, chunks: str,
                                                                           quantizer: str, dtype: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantized pool's steps in the whole-step call (its rows staged in C, the blocks they fill quantized in the
    call by the native quantizer, or by the pool's torch code called back for every layer (INFER_NATIVE_QUANTIZE=0);
    the paged kernel over codes and staging; Gemma 3's sliding layers in their exact rings beside the pool's layers
    in the same call): decode steps, and with the prompt chunks' tokens rows of the kernel ("native" chunk attention)
    the mixed steps too, whole blocks filled inside the call. Every request's tokens and logits equal the per-op
    path's (which quantizes with the same quantizer)."""
    if quantizer == "torch":
        monkeypatch.setenv("INFER_NATIVE_QUANTIZE", "0")
    rng = random.Random(kv)
    # prompts whose second block (a sink's neighbour: quantized when full) fills within the decode steps
    prompts = [[rng.randrange(1, 300) for _ in range(n)] for n in (29, 18, 5, 40)]
    with pytest.MonkeyPatch.context() as patch:
        fills = count_fills_inside(patch)
        rows = count_calls(patch)
        fast = serve(arch, prompts, 20, native_step=True, kv_cache_dtype=kv, chunk_attention=chunks, dtype=dtype)
        assert rows, "no step took the whole-step call"
        assert (max(rows) > len(prompts)) == (chunks == "native"), "the prompt chunks ran where they should not"
        assert sorted(set(fills)) == [0, 1], "no block filled inside the call in both layers of the test checkpoint"
        rows.clear()
        slow = serve(arch, prompts, 20, native_step=False, kv_cache_dtype=kv, chunk_attention=chunks, dtype=dtype)
        assert not rows
    for (tokens, logits), (want_tokens, want_logits) in zip(fast, slow, strict=True):
        assert tokens == want_tokens and torch.equal(logits, want_logits), "the whole step parted from the per-op path"


@needs_codes
@pytest.mark.parametrize("dtype", CODES_DTYPES)
@pytest.mark.parametrize(("arch", "weights", "kv"), [("llama", "int8", None), ("qwen2", "int4", None),
                                                     ("qwen3", "int8", "fp4"), ("gemma3_text", "int4", None)])
def test_quantized_weights_in_the_whole_step_are_the_per_op_path_bit_for_bit(arch: str, weights: str, kv: str | None,
                                                                             dtype: str,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantized model's steps in the whole-step call (its products on the packed codes; Qwen 2's biases, a
    quantized pool beside them, Gemma 3's rings), bf16 models and fp32 ones (codes in the channel form, fp32 sums):
    every request's tokens and logits equal the per-op path's, prompt chunks and decode steps alike."""
    rng = random.Random(weights)
    prompts = [[rng.randrange(1, 300) for _ in range(n)] for n in (13, 3, 27, 8)]
    rows = count_calls(monkeypatch)
    fast = serve(arch, prompts, 6, native_step=True, weights=weights, chunk_attention="native", kv_cache_dtype=kv,
                 dtype=dtype)
    assert rows and max(rows) > len(prompts), "the prompt chunks and decode steps did not take the whole-step call"
    rows.clear()
    slow = serve(arch, prompts, 6, native_step=False, weights=weights, chunk_attention="native", kv_cache_dtype=kv,
                 dtype=dtype)
    assert not rows
    for (tokens, logits), (want_tokens, want_logits) in zip(fast, slow, strict=True):
        assert tokens == want_tokens and torch.equal(logits, want_logits), "the whole step parted from the per-op path"


@needs_codes
@pytest.mark.parametrize("one_row", [False, True])
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_weights_in_the_engine_answer_to_the_solo_runs(weights: str, one_row: bool) -> None:
    """A quantized model's requests through the engine on its packed codes (every product of 2 rows or more, in the
    whole-step call; with `one_row`, one-row products too) within bf16 rounding of each one's solo run (the codes
    kernel's one-row products), and the packed products' copies counted."""
    import infer
    from infer.engine import Engine
    from infer.sampling import SamplingParams
    from reference import build_checkpoint
    from tests.helpers import assert_within_rounding_of_solo_runs

    model = infer.load_model(build_checkpoint("llama"), dtype="bfloat16", weights=weights)
    engine = Engine(model, None, num_blocks=32, keep_logits=True, packed_products="native",
                    decode_attention="native")
    assert model.packed_layout == "native" and model.packed_bytes > 0
    if one_row:
        model.pack_products(True, layout="native", one_row=True)
    prompts = [[5, 9, 2, 8, 8, 1], [7, 7, 1, 3], [11], [4, 4, 4, 4, 4, 4, 4]]
    # (the last request alone for its last 4 steps: one-row steps)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=n, temperature=0.0))
           for p, n in zip(prompts, [6, 3, 10, 6], strict=True)]
    while engine.has_unfinished():
        engine.step()
    assert_within_rounding_of_solo_runs(engine, model, prompts, ids)


def test_the_whole_step_answers_to_the_solo_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each request's logits through the whole-step call within bf16 rounding of its solo run (the oracle of the
    engine's batches)."""
    import infer
    from infer.engine import Engine
    from infer.sampling import SamplingParams
    from reference import build_checkpoint
    from tests.helpers import assert_within_rounding_of_solo_runs

    rows = count_calls(monkeypatch)
    model = infer.load_model(build_checkpoint("llama"), dtype="bfloat16")
    engine = Engine(model, None, num_blocks=32, keep_logits=True, packed_products="native",
                    decode_attention="native")
    prompts = [[5, 9, 2, 8, 8, 1], [7, 7, 1, 3], [11], [4, 4, 4, 4, 4, 4, 4]]
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=6, temperature=0.0)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert 4 in rows, "the decode steps of four requests did not take the whole-step call"
    assert_within_rounding_of_solo_runs(engine, model, prompts, ids)


@pytest.mark.parametrize(("arch", "packed", "why", "engine_args"), [
    ("llama", False, "products left unpacked", {}),
    ("llama", "onednn", "products in oneDNN's layout", {}),
])
def test_steps_it_cannot_take_run_the_per_op_path(arch: str, packed: str | bool, why: str,
                                                  engine_args: dict[str, object],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps the call does not take ({why}) keep the per-op path: no call, the same values as with the switch off."""
    from infer.models.transformer import packing_unavailable

    if packed == "onednn" and packing_unavailable([torch.zeros(2, 2, dtype=torch.bfloat16)]) is not None:
        pytest.skip("no oneDNN packing here")
    rows = count_calls(monkeypatch)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3]]
    got = serve(arch, prompts, 4, native_step=True, packed=packed, **engine_args)
    assert not rows, f"the whole-step call ran with {why}"
    want = serve(arch, prompts, 4, native_step=False, packed=packed, **engine_args)
    for (tokens, logits), (want_tokens, want_logits) in zip(got, want, strict=True):
        assert tokens == want_tokens and torch.equal(logits, want_logits)


@pytest.mark.parametrize("weights", [None, pytest.param("int8", marks=needs_codes)])
def test_steps_past_the_packed_rows_run_the_per_op_path(weights: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Products packed up to 4 rows (the packing choice's answer where the copies ran 10% slower at more): steps of
    at most 4 tokens take the whole-step call, steps of more the per-op path (their products of more rows unpacked),
    and every request's tokens and logits are a per-op engine's with the same range, bit for bit."""
    import infer.engine as engine_module
    from infer.tuning import Choice, PackingChoice

    choice = PackingChoice(Choice("packed products", "native", "scripted: up to 4 rows"), 1, 4)
    monkeypatch.setattr(engine_module, "choose_packed_products", lambda *args: choice)
    rows = count_calls(monkeypatch)
    prompts = [[3, 1, 4, 1, 5, 9, 2], [9, 2, 6], [5, 3]]  # a first step of 12 tokens, then decode steps of 3
    # (decode_gemv "linear": the unpacked products the same form in both engines, not a few-row kernel chosen by
    # timing at each load)
    got = serve("llama", prompts, 4, native_step=True, packed=None, weights=weights, chunk_attention="native",
                decode_gemv="linear")
    assert rows and max(rows) <= 4, f"the whole-step call ran steps of {max(rows, default=0)} tokens"
    rows.clear()
    want = serve("llama", prompts, 4, native_step=False, packed=None, weights=weights, chunk_attention="native",
                 decode_gemv="linear")
    assert not rows
    for (tokens, logits), (want_tokens, want_logits) in zip(got, want, strict=True):
        assert tokens == want_tokens and torch.equal(logits, want_logits)


def test_a_failed_call_leaves_the_engine_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """The call's error (its scratch not allocated) reaches the caller as one MemoryError and the step is undone:
    the next step serves the same tokens as an engine that never failed."""
    kernels = native_kernels()
    assert kernels is not None
    prompts = [[5, 9, 2, 8], [7, 7, 1]]
    want = serve("llama", prompts, 5, native_step=True)
    engine, ids = after_the_prompts(prompts, 5)
    step = NativeKernels.batch_step

    def failing(self: NativeKernels, *args: object) -> None:
        raise MemoryError("the native batched step could not allocate its scratch buffers")

    monkeypatch.setattr(NativeKernels, "batch_step", failing)
    with pytest.raises(MemoryError, match="could not allocate"):
        engine.step()
    monkeypatch.setattr(NativeKernels, "batch_step", step)
    assert_it_serves(engine, ids, want)


def test_positions_past_the_first_rope_tables_grow_them() -> None:
    """Requests whose positions pass the first RoPE tables the call reads (256 positions: a 250-token prompt and 12
    new tokens, and a short one beside it): the tables grow, and every token and logit is the per-op path's, bit for
    bit (which computes each step's tables afresh)."""
    prompts = [[(7 * i) % 250 + 1 for i in range(250)], [5, 9, 2]]
    fast = serve("llama", prompts, 12, native_step=True, chunk_attention="native")
    slow = serve("llama", prompts, 12, native_step=False, chunk_attention="native")
    for (tokens, logits), (want_tokens, want_logits) in zip(fast, slow, strict=True):
        assert tokens == want_tokens and torch.equal(logits, want_logits), "past 256 positions the call parted"


def test_a_position_past_the_rope_tables_is_refused_and_the_step_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables too short for a row's position (a bug in growing them) are refused by the call before anything is
    written: one ValueError naming the tables, the step undone, and the engine then serves what one that never failed
    serves."""
    from infer.models.transformer import Transformer

    prompts = [[5, 9, 2, 8, 4, 4], [7, 7, 1]]
    want = serve("llama", prompts, 5, native_step=True)
    engine, ids = after_the_prompts(prompts, 5)
    grow = Transformer._rope_tables

    def short(self: Transformer, end: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {lt: (cos[:4], sin[:4]) for lt, (cos, sin) in grow(self, end).items()}

    monkeypatch.setattr(Transformer, "_rope_tables", short)
    with pytest.raises(ValueError, match="RoPE tables"):
        engine.step()
    monkeypatch.setattr(Transformer, "_rope_tables", grow)
    assert_it_serves(engine, ids, want)


def test_a_failed_quantizing_call_back_leaves_the_engine_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error in a quantized pool's call back (the second layer's quantizing of the blocks the step fills) stops the
    whole-step call, reaches the caller as itself, and the step is undone: the requests then serve the tokens and
    logits of an engine that never failed."""
    from infer.cache.paged_quantized import QuantizedPoolLayer

    monkeypatch.setenv("INFER_NATIVE_QUANTIZE", "0")  # (the torch quantizer: the call calls back)
    prompts = [[(7 * i) % 250 + 1 for i in range(31)], [5, 9, 2, 8]]  # the first fills its second block next step
    want = serve("llama", prompts, 6, native_step=True, kv_cache_dtype="int8")
    engine, ids = after_the_prompts(prompts, 6, kv_cache_dtype="int8")
    rows = count_calls(monkeypatch)
    fill = QuantizedPoolLayer.quantize_filled

    def failing(self: QuantizedPoolLayer) -> None:
        if self.layer == 1 and self.pool.plan.fill:
            raise RuntimeError("planted: quantizing failed")
        fill(self)

    monkeypatch.setattr(QuantizedPoolLayer, "quantize_filled", failing)
    with pytest.raises(RuntimeError, match="planted"):
        engine.step()
    assert rows == [2], "the failing step did not run in the whole-step call"
    monkeypatch.setattr(QuantizedPoolLayer, "quantize_filled", fill)
    assert_it_serves(engine, ids, want)


def test_repacking_in_another_layout_drops_the_whole_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model served with the whole step, then packed in oneDNN's layout by a new engine: the description of the old
    packed copies is dropped, and the new engine's steps run the per-op path (no call)."""
    import infer
    from infer.engine import Engine
    from infer.models.transformer import packing_unavailable
    from infer.sampling import SamplingParams
    from reference import build_checkpoint

    model = infer.load_model(build_checkpoint("llama"), dtype="bfloat16")
    # (where the products upcast to fp32, a CPU without bf16 units, oneDNN's copies are fp32)
    if packing_unavailable([torch.zeros(2, 2, dtype=torch.bfloat16)], model.compute_dtype) is not None:
        pytest.skip("no oneDNN packing here")
    rows = count_calls(monkeypatch)
    for layout, calls in (("native", True), ("onednn", False)):
        rows.clear()
        engine = Engine(model, None, num_blocks=32, packed_products=layout, decode_attention="native")
        for prompt in ([5, 9, 2], [7, 7, 1, 3]):
            engine.add_request(prompt, SamplingParams(max_new_tokens=3, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
        assert bool(rows) == calls, f"packed in {layout}'s layout: whole-step calls {rows}"


@pytest.mark.parametrize("kinds", [(None, "int8"), ("int8", "int4")], ids=["exact-int8", "int8-int4"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_engines_sharing_a_model_keep_their_own_pools_when_stepped_in_turn(arch: str, kinds: tuple[str | None, str],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Two engines over different pools (exact, int8 or int4 blocks; Gemma 3's rings beside them) sharing one model,
    their steps taken in turn: every request's tokens and logits equal, bit for bit, those of its engine run alone (the
    whole step keeps a pool's fixed addresses between steps, and must not keep them across another engine's step)."""
    import infer
    from infer.engine import Engine
    from infer.sampling import SamplingParams
    from reference import build_checkpoint

    model = infer.load_model(build_checkpoint(arch), dtype="bfloat16")
    rng = random.Random(arch)
    prompts = [[rng.randrange(1, 300) for _ in range(n)] for n in (21, 9, 35)]

    def start(kv: str | None) -> tuple[Engine, list[int]]:
        engine = Engine(model, None, num_blocks=64, keep_logits=True, packed_products="native",
                        decode_attention="native", kv_cache_dtype=kv)
        return engine, [engine.add_request(p, SamplingParams(max_new_tokens=18, temperature=0.0)) for p in prompts]

    def results(engine: Engine, ids: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        return [(engine.result(i).token_ids, engine.result(i).logits) for i in ids]

    alone = {}
    for kv in kinds:
        engine, ids = start(kv)
        while engine.has_unfinished():
            engine.step()
        alone[kv] = results(engine, ids)
    rows = count_calls(monkeypatch)
    started = {kv: start(kv) for kv in kinds}
    while any(engine.has_unfinished() for engine, _ in started.values()):
        for engine, _ in started.values():
            if engine.has_unfinished():
                engine.step()
    assert len(rows) >= 2 * 10, "the engines' steps did not take the whole-step call"
    for kv in kinds:
        for (tokens, logits), (want_tokens, want_logits) in zip(results(*started[kv]), alone[kv], strict=True):
            assert logits is not None and want_logits is not None
            assert tokens == want_tokens and torch.equal(logits, want_logits), f"the {kv} pool's engine parted"
