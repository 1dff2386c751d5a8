"""The whole-step native decode call (infer/models/native_step.py, cpu_decode.c's infer_decode_step) held to the
oracle and to the per-op path it replaces: every architecture, the contiguous and sliding caches (rings and
windows crossed) and the quantized ones, dense and quantized weights, fp32 and bf16; taken exactly where it
applies; all or nothing when it fails part-way; rebuilt when the model's tensors change."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import infer
from infer.families import ARCHITECTURES
from infer.kernels.native import NativeKernels, native_kernels, unavailable_reason
from infer.models.native_step import PACKED_KIND, QUANTIZED_KINDS, NativeStep
from reference import Oracle, build_checkpoint
from tests.helpers import env_set

needs_build = pytest.mark.skipif(native_kernels() is None, reason=f"no native build here: {unavailable_reason()}")
pytestmark = needs_build
KINDS = ("contiguous", "sliding")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts native decode-step calls (each still runs)."""
    seen: list[int] = []
    real = NativeKernels.decode_step

    def counting(self: NativeKernels, *args: Any) -> None:
        seen.append(1)
        real(self, *args)

    monkeypatch.setattr(NativeKernels, "decode_step", counting)
    yield seen


def decode(model: infer.Transformer, ids: torch.Tensor, kind: str, prefill: int, **cache: Any) -> torch.Tensor:
    """Logits `[1, steps, vocab]` of one-token steps after a prefill of `prefill` tokens."""
    c = infer.create_cache(kind, model.config, max_seq_len=ids.shape[1], dtype=model.dtype, **cache)
    with torch.no_grad():
        model(ids[:, :prefill], c)
        return torch.cat([model(ids[:, i : i + 1], c) for i in range(prefill, ids.shape[1])], 1)


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 400, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_native_step_is_the_oracle(arch: str, kind: str, calls: list[int]) -> None:
    """fp32 logits of every step within 1e-5 of transformers' on the whole sequence, past Gemma 3's window of 8."""
    path = build_checkpoint(arch)
    model = infer.load_model(path, decode_gemv="native")
    ids = prompt(24, seed=3)
    got = decode(model, ids, kind, prefill=5)
    assert len(calls) == 24 - 5, "every one-token step ran in one native call"
    want = Oracle(path).logits(ids)[:, 5:]
    scale = max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() <= 1e-5 * scale
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_quantized_native_step_matches_the_per_op_path(arch: str, weights: str, packed: bool,
                                                       calls: list[int]) -> None:
    """Quantized products (fused and separate parts) in the whole step give the per-op path's logits within fp32
    rounding of attention's other summation order, on the codes kernel or on codes packed at load for one request's
    products (`packed_products`, fp32 rows: AVX2's channel form); the per-op path is held to the dequantized model
    elsewhere."""
    kernels = native_kernels()
    if packed and kernels is not None and not kernels.packed_codes_f32_available:
        pytest.skip(f"fp32 rows of packed codes are AVX2's channel form (this build: {kernels.isa})")
    model = infer.load_model(build_checkpoint(arch), decode_gemv="native", weights=weights, packed_products=packed)
    assert model.packed_products == packed
    ids = prompt(20, seed=4)
    got = decode(model, ids, "sliding", prefill=3)
    assert len(calls) == 17
    step = model.__dict__["_native_step"]
    kinds = {p.kind for layer in step.layers for p in (*layer.qkv[:layer.n_qkv], layer.o,
                                                          *layer.gate_up[:layer.n_gate_up], layer.down)}
    assert kinds == ({PACKED_KIND} if packed else {QUANTIZED_KINDS["q8" if weights == "int8" else "q4"]})
    model.native_step = False
    want = decode(model, ids, "sliding", prefill=3)
    assert len(calls) == 17, "native_step=False runs the per-op path"
    scale = max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() <= 1e-5 * scale
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_q4_0_weights_form_their_mins_in_the_native_step(dtype: str, calls: list[int]) -> None:
    """q4 weights as a GGUF file's Q4_0 loads (each min -8 x its scale) in the whole-step call: every q4 product's
    descriptor carries the flag that has the codes kernel form the mins instead of reading them, and the step's
    logits are bit for bit the same step's reading them (`INFER_QGEMV_FORMED_MINS=0`)."""
    from infer.kernels.native import MINS_EIGHT_SCALES
    from infer.models.transformer import QuantizedLinear

    model = infer.load_model(build_checkpoint("llama"), decode_gemv="native", dtype=dtype, weights="int4",
                             packed_products=False)
    fused = [m for layer in model.layers for m in (layer.self_attn.__dict__["qkv"], layer.mlp.__dict__["gate_up"])]
    converted = 0
    for module in [*model.modules(), *fused]:  # (the fused parts the step runs are no submodules)
        if isinstance(module, QuantizedLinear) and module.scheme == "int4":
            module.scheme, module.mins = "Q4_0", -8 * module.scales
            converted += 1
    assert converted
    ids = prompt(12, seed=9)
    with env_set("INFER_QGEMV_FORMED_MINS", "1"):
        got = decode(model, ids, "contiguous", prefill=4)
    assert calls, "the whole-step call did not run"
    step = model.__dict__["_native_step"]
    q4 = [p for layer in step.layers for p in (*layer.qkv[:layer.n_qkv], layer.o, *layer.gate_up[:layer.n_gate_up],
                                               layer.down) if p.kind == QUANTIZED_KINDS["q4"]]
    assert q4 and {p.fmt for p in q4} == {MINS_EIGHT_SCALES}
    with env_set("INFER_QGEMV_FORMED_MINS", "0"):
        want = decode(model, ids, "contiguous", prefill=4)
    assert torch.equal(got, want)


def test_bf16_native_step_on_packed_codes_follows_the_per_op_path(calls: list[int]) -> None:
    """A bf16 model's int4 products packed at load for one request (`packed_products=True`: the packed codes' one-row
    tiles in the whole step, kind 4, as in the per-op path): logits within a few bf16 ulps of the per-op path's."""
    model = infer.load_model(build_checkpoint("llama"), decode_gemv="native", dtype="bfloat16", weights="int4",
                             packed_products=True)
    ids = prompt(16, seed=6)
    got = decode(model, ids, "contiguous", prefill=4).float()
    assert len(calls) == 12
    step = model.__dict__["_native_step"]
    assert {p.kind for layer in step.layers for p in (*layer.qkv[:layer.n_qkv], layer.o,
                                                      *layer.gate_up[:layer.n_gate_up], layer.down)} == {PACKED_KIND}
    model.native_step = False
    want = decode(model, ids, "contiguous", prefill=4).float()
    scale = max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() <= 0.05 * scale


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_bf16_native_step_follows_the_per_op_path(arch: str, calls: list[int]) -> None:
    """In bf16 only attention's rounding differs: logits within a few bf16 ulps of the logit scale."""
    model = infer.load_model(build_checkpoint(arch), decode_gemv="native", dtype="bfloat16")
    ids = prompt(16, seed=5)
    got = decode(model, ids, "contiguous", prefill=4).float()
    assert len(calls) == 12
    model.native_step = False
    want = decode(model, ids, "contiguous", prefill=4).float()
    scale = max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() <= 0.05 * scale


def test_taken_only_where_it_applies(calls: list[int]) -> None:
    """Not for batches, prefill chunks, other cache kinds, the reference attention, the per-op forms or a full
    cache (which raises the cache's own error)."""
    path = build_checkpoint("llama")
    model = infer.load_model(path, decode_gemv="native")
    ids = prompt(6, seed=6)
    decode(model, ids, "paged", prefill=3)
    decode(model, ids, "int8", prefill=3, attention="dequantize")  # the quantized caches' check path
    decode(model, ids[:, :4], "int8", prefill=3)  # a step that writes a sink
    batch = infer.create_cache("contiguous", model.config, max_seq_len=8, batch_size=2)
    with torch.no_grad():
        model(ids[:, :3].repeat(2, 1), batch)
        model(ids[:, 3:4].repeat(2, 1), batch)
    model.use_reference_attention = True
    decode(model, ids, "contiguous", prefill=3)
    model.use_reference_attention = False
    model.native_ops = False
    decode(model, ids, "contiguous", prefill=3)
    model.native_ops = True
    model.decode_gemv = "linear"
    decode(model, ids, "contiguous", prefill=3)
    assert calls == []
    model.decode_gemv = "native"
    full = infer.create_cache("contiguous", model.config, max_seq_len=3)
    with torch.no_grad():
        model(ids[:, :3], full)
        with pytest.raises(infer.CacheFullError, match="max_seq_len=3"):
            model(ids[:, 3:4], full)
    assert calls == [] and full.offset == 3
    decode(model, ids, "contiguous", prefill=3)
    assert len(calls) == 3


@pytest.mark.parametrize(("kind", "layout"), [("int8", {}), ("int4", {}), ("fp4", {}),
                                              ("int8", {"residual_block": 40, "value_block": 24})])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_quantized_caches_step_natively_as_layer_by_layer(arch: str, kind: str, layout: dict[str, int],
                                                          calls: list[int]) -> None:
    """A quantized cache's one-token steps that only write its exact rings run in one native call, attending with
    the kernel the per-layer path calls (infer_qattn): fp32 logits bit for bit that path's, over key and value
    blocks filling (those steps quantize in PyTorch, layer by layer; blocks of values that do not divide the keys'
    fill at other steps), the sinks and Gemma 3's window; every other step taken."""
    path = build_checkpoint(arch)
    model = infer.load_model(path, decode_gemv="native")
    ids = prompt(150, seed=4)
    got = decode(model, ids, kind, prefill=2, **layout)
    # Per layer: the steps at the 4 sinks, and those whose token fills a key or value block (int8: keys in blocks
    # of 64, values of 32; the 4-bit kinds: both 32 past a window of 16), quantized as it is written.
    blocks, window = ((64, 32), 0) if kind == "int8" else ((32,), 16)
    if layout:
        blocks = (layout["residual_block"], layout["value_block"])
    fills = [p for p in range(4, 150) if p - 4 + 1 > window and any((p - 4 + 1 - window) % b == 0 for b in blocks)]
    assert len(calls) == 150 - 4 - len(fills)
    model.native_step = False
    assert torch.equal(got, decode(model, ids, kind, prefill=2, **layout))
    # The same step bound to an exact cache next reads its rows as exact again.
    exact = decode(model, ids[:, :12], "contiguous", prefill=2)
    model.native_step = True
    # (relative to the logits: the native kernel sums in another order, 1.4e-5 apart on an AVX2 build's logits)
    assert (decode(model, ids[:, :12], "contiguous", prefill=2) - exact).abs().max() < 1e-5 * max(
        1.0, float(exact.abs().max())), "the native step parted from the per-op path beyond fp32 rounding"


@pytest.mark.parametrize("kind", ["sliding", "int4"])
def test_a_step_that_fails_part_way_leaves_cache_and_model_as_they_were(kind: str) -> None:
    """The last layer's quantized product refuses its group after every layer wrote its K/V slot (the rings' past
    the window of 8 overwrite live tokens; the quantized cache's ring slot): the call raises, every slot is put
    back, the offset stays, and the next steps equal a run that never failed."""
    model = infer.load_model(build_checkpoint("gemma3_text"), decode_gemv="native", weights="int8")
    ids = prompt(20, seed=7)
    decode(model, ids[:, :3], "contiguous", prefill=2)  # builds the step
    step = model.__dict__["_native_step"]
    assert isinstance(step, NativeStep)
    cache = infer.create_cache(kind, model.config, max_seq_len=20)
    with torch.no_grad():
        model(ids[:, :12], cache)
        before = {name: t.clone() for name, t in vars(cache).items() if isinstance(t, torch.Tensor)}
        down = step.layers[len(step.layers) - 1].down
        group, down.group = down.group, 48  # not a multiple of 32: infer_qgemv refuses it, nothing written
        with pytest.raises(ValueError, match="shape"):
            model(ids[:, 12:13], cache)
        down.group = group
        assert cache.offset == 12
        for name, t in vars(cache).items():
            if isinstance(t, torch.Tensor):
                assert torch.equal(t, before[name]), name
        got = torch.cat([model(ids[:, i : i + 1], cache) for i in range(12, 20)], 1)
    assert torch.equal(got, decode(model, ids, kind, prefill=12))


def test_shapes_are_checked_before_anything_is_written() -> None:
    model = infer.load_model(build_checkpoint("llama"), decode_gemv="native")
    ids = prompt(8, seed=9)
    decode(model, ids[:, :3], "contiguous", prefill=2)
    step = model.__dict__["_native_step"]
    assert isinstance(step, NativeStep)
    cache = infer.create_cache("contiguous", model.config, max_seq_len=8)
    with torch.no_grad():
        model(ids[:, :5], cache)
        before = cache.k_cache.clone(), cache.v_cache.clone()
        step.layers[1].o.n += 1
        with pytest.raises(ValueError, match="shape"):
            model(ids[:, 5:6], cache)
    assert torch.equal(cache.k_cache, before[0]) and torch.equal(cache.v_cache, before[1]) and cache.offset == 5


def test_rebuilt_when_the_weights_change(calls: list[int]) -> None:
    """`.to(dtype)` and load_state_dict(assign=True) give new tensors: the next step reads those, not the old ones."""
    path = build_checkpoint("qwen3")
    model = infer.load_model(path, decode_gemv="native")
    ids = prompt(10, seed=8)
    decode(model, ids, "contiguous", prefill=4)
    # (bf16 loaded with the model's own exact products: `.to()` keeps the fp32 model's, where a CPU without bf16
    # units would otherwise upcast the fresh load's prefill)
    fresh = infer.load_model(path, decode_gemv="native", dtype="bfloat16", compute_dtype="exact")
    model.to(torch.bfloat16)
    model.decode_gemv = "native"
    assert torch.equal(decode(model, ids, "contiguous", prefill=4), decode(fresh, ids, "contiguous", prefill=4))
    other = infer.load_model(build_checkpoint("qwen3", seed=1), decode_gemv="native", dtype="bfloat16",
                             compute_dtype="exact")
    model.load_state_dict(other.state_dict(), assign=True)
    model.decode_gemv = "native"
    assert torch.equal(decode(model, ids, "contiguous", prefill=4), decode(other, ids, "contiguous", prefill=4))
    assert len(calls) == 5 * 6
