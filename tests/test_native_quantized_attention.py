"""One-token attention over the quantized cache's codes in the native CPU kernel (`infer_qattn` in
infer/kernels/cpu_decode.c, `QuantizedCache(attention="native")`, the CPU default) held to the dequantize-then-attend
formula: every layout (keys by row or by channel over blocks, sinks, a residual window, a ring that wrapped), every
scheme, grouped query heads, sliding windows and softcaps, every instruction-set path the CPU runs; the cache stores
what `update` stores; a model decoding over it gives the logits of the dequantizing path."""

from __future__ import annotations

import copy
import ctypes
import math
import mmap
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import infer
from infer.attention import attention_mask, attention_reference
from infer.cache import quant
from infer.cache.quantized import SCHEMES, QuantizedCache
from infer.families import ARCHITECTURES
from infer.kernels import native
from infer.kernels.native import native_kernels, unavailable_reason
from tests.helpers import assert_close, on_threads, tiny_config
from tests.test_native_kernels import FLAVOURS_HERE, amx_switched, needs_amx

needs_build = pytest.mark.skipif(native_kernels() is None, reason=f"no native build here: {unavailable_reason()}")
# The attention kernels' forms of a 16-key tile, which must give the same bits: AVX2's 8-lane register tiles (an AVX2
# build's default; other builds ignore the switch), the generic 16-lane ones with value rows summed into one query
# head at a time or into several at once.
TILE_FORMS = [{"INFER_QATTN_AVX2_TILES": "1"},
              {"INFER_QATTN_AVX2_TILES": "0", "INFER_QATTN_VALUE_HEADS": "0"},
              {"INFER_QATTN_AVX2_TILES": "0", "INFER_QATTN_VALUE_HEADS": "1"},
              # several heads' value sums over codes through a decoded tile, not widened in registers
              {"INFER_QATTN_AVX2_TILES": "0", "INFER_QATTN_VALUE_HEADS": "1", "INFER_QATTN_VALUE_REGISTERS": "0"}]


@st.composite
def layouts(draw: st.DrawFn) -> dict[str, Any]:
    kv_heads = draw(st.integers(1, 3))
    key_scales = draw(st.sampled_from(["row", "channel"]))
    return {
        "scheme": draw(st.sampled_from(["int8", "int4", "fp4"])),
        "key_scales": key_scales,
        "key_offsets": key_scales == "channel" and draw(st.booleans()),
        "rotate_values": draw(st.booleans()),
        "sink_tokens": draw(st.integers(0, 4)),
        "residual_window": draw(st.integers(0, 6)),
        "residual_block": draw(st.integers(1, 8) | st.sampled_from([16, 32])),  # 16+: whole tiles of 16 keys
        "value_block": draw(st.none() | st.integers(1, 8) | st.just(16)),  # values aging on their own count
        "batch": draw(st.integers(1, 2)),
        "kv_heads": kv_heads,
        "heads": kv_heads * draw(st.integers(1, 3)),
        "head_dim": draw(st.sampled_from([2, 6, 8, 20, 32, 64])),  # multiples of 32: the vector path
        "length": draw(st.integers(0, 110)),  # tokens cached before the step
        "window": draw(st.none() | st.integers(1, 12)),
        "softcap": draw(st.none() | st.just(5.0)),
        "outliers": draw(st.booleans()),  # a key channel 30x the rest and one off-centre, as real models have
        "flavour": draw(st.sampled_from(FLAVOURS_HERE or ["native"])),
        "tiles": draw(st.booleans()),  # INFER_QATTN_TILES: 16 keys scored at once, or one at a time
    }


def filled(p: dict[str, Any], dtype: torch.dtype, attention: str, seed: int = 0,
           values_in: torch.dtype | None = None) -> QuantizedCache:
    """A cache of `dtype` holding `p["length"]` random tokens (drawn in `values_in`, default `dtype`)."""
    config = tiny_config("llama", num_layers=1, num_heads=p["heads"], num_kv_heads=p["kv_heads"],
                         head_dim=p["head_dim"], hidden_size=16)
    cache = QuantizedCache(config, max_seq_len=p["length"] + 1, batch_size=p["batch"], dtype=dtype,
                           scheme=p["scheme"], key_scales=p["key_scales"], sink_tokens=p["sink_tokens"],
                           residual_window=p["residual_window"], residual_block=p["residual_block"],
                           key_offsets=p["key_offsets"], rotate_values=p["rotate_values"], attention=attention,
                           value_block=p.get("value_block"))
    gen = torch.Generator().manual_seed(seed)
    done = 0
    while done < p["length"]:  # a prefill, then chunks: the ring wraps and blocks age out on the way
        n = min(p["length"] - done, 1 + done % 9)
        k = torch.randn(p["batch"], p["kv_heads"], n, p["head_dim"], generator=gen)
        if p["outliers"]:
            k[..., 0] *= 30
            k[..., -1] += 4
        v = torch.randn(k.shape, generator=gen)
        cache.update(0, *(t.to(values_in or dtype).to(dtype) for t in (k, v)))
        cache.advance(n)
        done += n
    return cache


def one_step(p: dict[str, Any], dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(p["batch"], p["heads"], 1, p["head_dim"], generator=gen).to(dtype)
    k = torch.randn(p["batch"], p["kv_heads"], 1, p["head_dim"], generator=gen).to(dtype)
    return q, k, torch.randn(k.shape, generator=gen).to(dtype)


def formula(cache: QuantizedCache, p: dict[str, Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
            ) -> torch.Tensor:
    """Dequantize (update), then attend by the formula, in fp32."""
    keys, values = cache.update(0, k, v)
    positions = torch.arange(keys.shape[2])
    mask = attention_mask(positions[-1:], positions, p["window"])
    return attention_reference(q.float(), keys.float(), values.float(), mask, 0.3, p["softcap"])


@needs_build
@settings(max_examples=60, deadline=None)
@given(p=layouts())
def test_native_quantized_attention_is_the_dequantized_formula(p: dict[str, Any]) -> None:
    """fp32: within 1e-5 of the formula over the same cache, on the drawn instruction-set path; and it stores
    exactly what `update` stores."""
    reference = filled(p, torch.float32, "dequantize")
    cache = copy.deepcopy(reference)
    cache.attention = "native"
    q, k, v = one_step(p, torch.float32)
    flavour = native_kernels(p["flavour"])
    with mock.patch.object(native, "native_kernels", lambda *args: flavour), \
            mock.patch.dict("os.environ", {"INFER_QATTN_TILES": "1" if p["tiles"] else "0"}):
        out = cache.decode_attention(0, q, k, v, 0.3, p["softcap"], p["window"])
    expected = formula(reference, p, q, k, v)
    assert_close(out, expected, 1e-5 * max(1.0, expected.abs().max().item()), f"{p}")
    cache.advance(1), reference.advance(1)
    for name in ("k_data", "v_data", "k_scale", "v_scale", "k_offset", "k_recent", "v_recent", "k_sink", "v_sink"):
        assert torch.equal(getattr(cache, name).float(), getattr(reference, name).float()), name


@needs_build
@settings(max_examples=30, deadline=None)
@given(p=layouts(), dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_half_precision_caches_are_the_fp32_formula_rounded_once(p: dict[str, Any], dtype: torch.dtype) -> None:
    """bf16 / fp16 K/V: the kernel sums in fp32 from the codes, so it is the fp32 formula over the same codes (a
    twin cache in fp32 fed the same values holds the same codes and scales) up to the output's rounding."""
    half, wide = filled(p, dtype, "native"), filled(p, torch.float32, "dequantize", values_in=dtype)
    q, k, v = one_step(p, dtype)
    out = half.decode_attention(0, q, k, v, 0.3, p["softcap"], p["window"])
    expected = formula(wide, p, q.float(), k.float(), v.float())
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    assert_close(out.float(), expected, ulp * max(1.0, expected.abs().max().item()) + 1e-5, f"{p}")


@needs_build
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("kind", ["int8", "int4", "fp4"])
def test_a_model_decodes_over_the_codes_as_over_the_dequantized_cache(arch: str, kind: str) -> None:
    """The registered kinds' layout (keys by channel, sinks), Gemma past its sliding window: every one-token step's
    fp32 logits from the native kernel equal the dequantizing path's from the same cache state within 1e-5."""
    from reference import build_checkpoint

    model = infer.load_model(build_checkpoint(arch), decode_gemv="linear")
    ids = torch.randint(0, 400, (2, 48), generator=torch.Generator().manual_seed(11))
    caches = {a: infer.create_cache(kind, model.config, max_seq_len=48, batch_size=2, attention=a, residual_window=2)
              for a in ("dequantize", "native")}
    assert caches["native"].attends_in_kernel and not caches["dequantize"].attends_in_kernel
    with torch.no_grad():
        model(ids[:, :36], caches["dequantize"])
        for i in range(36, 48):
            caches["native"].restore(caches["dequantize"].snapshot())
            kernel = model(ids[:, i : i + 1], caches["native"])
            torch_path = model(ids[:, i : i + 1], caches["dequantize"])
            assert_close(kernel, torch_path, 1e-5 * max(1.0, torch_path.abs().max().item()), f"{arch} {kind} {i}")


def test_the_attention_choice_is_validated() -> None:
    config = tiny_config("llama")
    expected = "native" if native_kernels() is not None else "dequantize"
    assert infer.create_cache("int8", config, max_seq_len=8).attention == expected
    with pytest.raises(ValueError, match="attention must be 'auto', 'triton', 'native' or 'dequantize'"):
        infer.create_cache("int8", config, max_seq_len=8, attention="flash")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="attention='native' runs on the CPU"):
            infer.create_cache("int8", config, max_seq_len=8, attention="native", device="cuda")


@st.composite
def pool_layouts(draw: st.DrawFn) -> dict[str, Any]:
    kv_heads = draw(st.integers(1, 2))
    block_size = draw(st.sampled_from([1, 3, 4, 16, 32]))
    return {
        "scheme": draw(st.sampled_from(["int8", "int4", "fp4"])),
        "kv_heads": kv_heads,
        "heads": kv_heads * draw(st.integers(1, 3)),
        "head_dim": draw(st.sampled_from([4, 8, 32, 64])),
        "block_size": block_size,
        "lengths": draw(st.lists(st.integers(1, 80), min_size=1, max_size=3)),
        "cut": draw(st.booleans()),  # tables that start past the first block, as a window lets them
        "window": draw(st.none() | st.integers(1, 20)),
        "softcap": draw(st.none() | st.just(5.0)),
        "dtype": draw(st.sampled_from([torch.float32, torch.bfloat16])),
        "tiles": draw(st.booleans()),
        "staged": draw(st.sampled_from([0.0, 0.3, 1.0])),  # the share of older blocks staged too (copy-on-write)
        "seed": draw(st.integers(0, 2**16)),
    }


REGISTERED = {"key_scales": "channel", "key_offsets": True, "rotate_values": True, "sink_tokens": 4,
              "residual_window": 3, "batch": 2, "kv_heads": 2, "heads": 6, "head_dim": 64, "length": 100,
              "window": None, "softcap": None, "outliers": True, "flavour": "native"}


@needs_build
@pytest.mark.parametrize("tiles", [True, False])
@pytest.mark.parametrize(("block", "value_block"), [(32, None), (5, None), (32, 16)])
@pytest.mark.parametrize("scheme", ["int8", "int4", "fp4"])
def test_the_registered_layout_through_both_scoring_paths(scheme: str, block: int, value_block: int | None,
                                                          tiles: bool) -> None:
    """Whatever Hypothesis draws: the 4-bit kinds' layout (offsets, rotated values, sinks, a window) at head_dim 64
    scored 16 keys at a time and one at a time, blocks that hold whole tiles and blocks that do not, values aging
    with their keys or on their own (blocks of 16 under keys' of 32, as int8's 32 under 64)."""
    p = {**REGISTERED, "scheme": scheme, "residual_block": block, "value_block": value_block}
    reference = filled(p, torch.float32, "dequantize")
    cache = copy.deepcopy(reference)
    cache.attention = "native"
    q, k, v = one_step(p, torch.float32)
    with mock.patch.dict("os.environ", {"INFER_QATTN_TILES": "1" if tiles else "0"}):
        out = cache.decode_attention(0, q, k, v, 0.3, None, None)
    expected = formula(reference, p, q, k, v)
    assert_close(out, expected, 1e-5 * max(1.0, expected.abs().max().item()), f"{p}")


@needs_build
@settings(max_examples=60, deadline=None)
@given(p=pool_layouts())
@example(p={"scheme": "int4", "kv_heads": 2, "heads": 4, "head_dim": 64, "block_size": 32, "lengths": [70, 40],
            "cut": False, "window": None, "softcap": None, "dtype": torch.bfloat16, "tiles": True, "staged": 1.0,
            "seed": 1})  # every block exact and two tiles per block: the exact rows' tiles land where they belong
@example(p={"scheme": "int8", "kv_heads": 2, "heads": 6, "head_dim": 64, "block_size": 32, "lengths": [70, 40],
            "cut": False, "window": None, "softcap": None, "dtype": torch.float32, "tiles": True, "staged": 0.0,
            "seed": 2})  # every older block codes and two tiles per block: the code rows' tiles land where they belong
def test_native_paged_kernel_is_the_gathered_formula(p: dict[str, Any]) -> None:
    """The engine's quantized pool read in place (infer_qattn_paged) against its dequantizing gather, then the
    formula: random codes, scales and offsets in every block, some blocks staged exact, tables in any order and
    starting past the first block, windows and softcaps; fp32 within 1e-5 (bf16 staging: the fp32 formula over
    the same values, rounded once)."""
    check_pool_kernel(p, "native", 1e-5, 2.0**-8, "cpu")


def random_pool(p: dict[str, Any], blocks: int, device: str) -> tuple[Any, torch.Generator]:
    """A one-layer quantized pool of `blocks` + 2 blocks (and `blocks` staging slots) for the layout `p`, every block
    filled with codes of random keys (outlier and off-centre channels) and values, as a step would, the staging
    random too; and the generator, to draw on from."""
    from infer.cache.paged_quantized import QuantizedPagedPool

    config = tiny_config("llama", num_layers=1, num_heads=p["heads"], num_kv_heads=p["kv_heads"],
                         head_dim=p["head_dim"], hidden_size=16)
    bs, gen = p["block_size"], torch.Generator().manual_seed(p["seed"])
    pool = QuantizedPagedPool(config, scheme=p["scheme"], num_blocks=blocks + 2, block_size=bs, stage_slots=blocks,
                              scratch_slots=1, dtype=p["dtype"], device=device)
    keys = torch.randn(pool.num_blocks, p["kv_heads"], bs, p["head_dim"], generator=gen) * 2
    keys[..., 0] *= 20
    keys[..., -1] += 5
    values = torch.randn(keys.shape, generator=gen).to(device)
    keys = keys.to(device)
    centres = quant.channel_offsets(keys) if pool.key_offsets else None
    pool.k_codes[0], pool.k_scale[0] = quant.quantize_channels(keys, p["scheme"], centres)
    if centres is not None:
        pool.k_offset[0] = centres
    pool.v_codes[0], pool.v_scale[0] = SCHEMES[p["scheme"]][0](quant.rotate(values, pool.rotation))
    pool.k_persistent[0].copy_(torch.randn(pool.k_persistent[0].shape, generator=gen).to(device))
    pool.v_persistent[0].copy_(torch.randn(pool.v_persistent[0].shape, generator=gen).to(device))
    return pool, gen


def chunks_over_codes(p: dict[str, Any], staged: float, cut: bool = False
                      ) -> tuple[Any, torch.Generator, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pool drawn as `random_pool` does and the rows of `p["segments"]` over it: each sequence's newest block staged
    (older ones too where `stage` < `staged`; `staged` -1: its first block too), each row's table its own blocks padded
    with another block; with `cut`, each sequence's table from a later block on (a sliding layer's in the pool). The
    pool, the generator to draw on from, tables, lengths and starts."""
    bs = p["block_size"]
    spans = [-(-(prefix + rows) // bs) for prefix, rows in p["segments"]]
    pool, gen = random_pool(p, sum(spans), "cpu")
    order, stage = torch.randperm(pool.num_blocks, generator=gen).tolist(), torch.rand(sum(spans), generator=gen)
    tables, lengths, starts, used = [], [], [], 0
    for (prefix, rows), span in zip(p["segments"], spans, strict=True):
        blocks = [pool.num_blocks + used + j if j == span - 1 or stage[used + j] < staged or (staged < 0 and j == 0)
                  else order[used + j] for j in range(span)]
        used += span
        first = prefix // bs // 2 if cut else 0  # the table starts at this block of the sequence
        for n in range(prefix + 1, prefix + rows + 1):
            own = -(-n // bs)
            tables.append(blocks[first:own] + [order[-1]] * (max(spans) - own + first))
            lengths.append(n)
            starts.append(first * bs)
    return pool, gen, torch.tensor(tables), torch.tensor(lengths), torch.tensor(starts)


def check_pool_kernel(p: dict[str, Any], kernel: str, fp32_ulp: float, half_ulp: float, device: str) -> None:
    """A pool drawn as `pool_layouts` describes, its decode group read in place by `kernel` ("native" or
    "triton"), against the pool's dequantizing gather and the formula in fp32: within `fp32_ulp` (relative to the
    largest output) for an fp32 pool, `half_ulp` for a bf16 one. Drawn on the CPU, run on `device`."""
    from infer.ragged import DecodeGroup

    bs, need = p["block_size"], [-(-n // p["block_size"]) for n in p["lengths"]]
    pool, gen = random_pool(p, sum(need), device)
    order = torch.randperm(pool.num_blocks, generator=gen).tolist()
    tables, starts, used = [], [], 0
    stage = torch.rand(sum(need), generator=gen) < p["staged"]
    for b, n in enumerate(p["lengths"]):
        first = (n - 1) // bs // 2 if p["cut"] else 0  # the table starts at this block of the sequence
        blocks = order[used : used + need[b]]
        # The newest block staged (exact), as in every step; older ones too where drawn (slot = table index).
        blocks = [pool.num_blocks + used + j if j == need[b] - 1 or stage[used + j] else block
                  for j, block in enumerate(blocks)][first:]
        used += need[b]
        tables.append(blocks)
        starts.append(first * bs)
    nb = max(len(t) for t in tables)
    table = torch.tensor([t + [t[0]] * (nb - len(t)) for t in tables], device=device)
    lengths, start = torch.tensor(p["lengths"], device=device), torch.tensor(starts, device=device)
    group = DecodeGroup(kernel, torch.arange(len(tables)), table, lengths, {}, start)
    q = torch.randn(len(tables), p["heads"], p["head_dim"], generator=gen).to(device=device, dtype=p["dtype"])
    with mock.patch.dict("os.environ", {"INFER_QATTN_TILES": "1" if p["tiles"] else "0"}):
        out = pool.layers[0].decode_attention(group, q, 0.3, p["softcap"], p["window"])
        if kernel == "native":  # a sequence's KV heads block by block (2+ sequences a thread), or one head an item
            with mock.patch.dict("os.environ", {"INFER_QATTN_HEADS_AT_ONCE": "0"}):
                one_head = pool.layers[0].decode_attention(group, q, 0.3, p["softcap"], p["window"])
            assert torch.equal(one_head, out), f"{p}: the work items' order changed the sums"
            for form in TILE_FORMS:  # AVX2's register tiles or the generic ones, value rows a head at a time or not
                with mock.patch.dict("os.environ", form):
                    passes = pool.layers[0].decode_attention(group, q, 0.3, p["softcap"], p["window"])
                assert torch.equal(passes, out), f"{p}: {form} changed the sums"
    pool.dtype = torch.float32  # the gather dequantizes into fp32: the kernel sums the codes in fp32
    k_all, v_all = pool.layers[0].gather(table)
    for b in range(len(tables)):
        n = p["lengths"][b] - starts[b]
        positions = starts[b] + torch.arange(n, device=device)
        mask = attention_mask(positions[-1:], positions, p["window"])
        expected = attention_reference(q[b : b + 1, :, None].float(), k_all[b : b + 1, :, :n].float(),
                                       v_all[b : b + 1, :, :n].float(), mask, 0.3, p["softcap"])[0, :, 0]
        ulp = fp32_ulp if p["dtype"] == torch.float32 else half_ulp
        assert_close(out[b].float(), expected, ulp * max(1.0, expected.abs().max().item()) + 1e-6,
                     f"{kernel} {p} seq {b}")


@needs_build
@pytest.mark.parametrize("flavour", FLAVOURS_HERE or ["native"])
@pytest.mark.parametrize("scheme", ["int8", "int4", "fp4"])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("groups", [1, 2, 3, 4, 5])
def test_a_quantized_pool_read_in_place_is_the_formula_for_every_pass_of_heads(flavour: str, scheme: str,
                                                                               head_dim: int, groups: int) -> None:
    """The paged kernel over a pool of codes (every older block codes, the newest staged), query heads per KV head
    1-5: every split of a KV head's value sums into passes (4 heads at once at head size 64, 2 at 128, then the
    rest), their rows of codes widened in registers as they are summed (the default where several heads go at once)
    and through a decoded tile (check_pool_kernel's forms: the same bits), blocks of 32 keys (two tiles a block,
    each with its own rows' scales) and lengths whole tiles and not; head size 96 ends in 32 lanes past the 64-lane
    passes (AVX2's tiles' last pass); against the formula. Every flavour this CPU runs (the pool's kernels are the
    flavour's)."""
    p = {"scheme": scheme, "kv_heads": 2, "heads": 2 * groups, "head_dim": head_dim, "block_size": 32,
         "lengths": [1, 37, 80], "cut": False, "window": None, "softcap": None, "staged": 0.0, "tiles": True,
         "dtype": torch.float32 if groups % 2 else torch.bfloat16, "seed": head_dim + groups}
    kernels = native_kernels(flavour)
    assert kernels is not None
    with mock.patch.object(native, "native_kernels", lambda *args: kernels):
        check_pool_kernel(p, "native", 1e-5, 2.0**-8, "cpu")


@needs_build
@pytest.mark.parametrize("flavour", FLAVOURS_HERE or ["native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("groups", [1, 2, 3, 4, 5])
def test_an_exact_pool_read_in_place_is_the_formula_for_every_pass_of_heads(flavour: str, dtype: torch.dtype,
                                                                             head_dim: int, groups: int) -> None:
    """The engine's exact pool read through its tables (infer_qattn_paged, every block staged) against the formula
    over the gathered keys: query heads per KV head 1-5 cover every split of a KV head's value sums into passes
    (4 heads at once at head size 64, 2 at 128, then the rest), lengths whole 16-key tiles and not, blocks of 16
    keys (even group counts) and of 32 (odd: two tiles in a block). Every flavour this CPU runs: bf16 keys scored by
    the pair instruction (avx512_bf16) or widened in registers (the others)."""
    kernels = native_kernels(flavour)
    assert kernels is not None
    gen = torch.Generator().manual_seed(head_dim * 10 + groups)
    kv_heads, bs, lengths, scale = 2, 16 if groups % 2 == 0 else 32, [1, 15, 16, 37, 80], head_dim**-0.5
    batch, nb = len(lengths), max(-(-n // bs) for n in lengths)
    num_blocks = batch * nb + 3
    k_blocks = torch.randn(num_blocks, kv_heads, bs, head_dim, generator=gen).to(dtype)
    v_blocks = torch.randn(num_blocks, kv_heads, bs, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * nb].view(batch, nb)
    q = torch.randn(batch, kv_heads * groups, head_dim, generator=gen).to(dtype)
    def attend() -> torch.Tensor:
        return kernels.exact_paged_attention(q, k_blocks, v_blocks, tables, torch.tensor(lengths),
                                             torch.zeros(batch, dtype=torch.long), scale, None, None)

    out = attend()  # one thread: a sequence's KV heads block by block
    with on_threads(2):  # the sequences split between two threads
        assert torch.equal(attend(), out), "two threads changed the sums"
    with mock.patch.dict("os.environ", {"INFER_QATTN_HEADS_AT_ONCE": "0"}):  # one KV head per work item
        assert torch.equal(attend(), out), "one KV head per work item changed the sums"
    # A tile scored and its value rows summed by AVX2's 8-lane registers (an AVX2 build's default) or by the generic
    # 16-lane forms, value rows into one query head at a time or several at once: the same sums.
    for form in TILE_FORMS:
        with mock.patch.dict("os.environ", form):
            assert torch.equal(attend(), out), f"{form} changed the sums"
    for b, n in enumerate(lengths):
        keys, values = (blocks[tables[b]].transpose(0, 1).reshape(kv_heads, nb * bs, head_dim)[:, :n].float()
                        for blocks in (k_blocks, v_blocks))
        want = attention_reference(q[b].float()[None, :, None], keys[None], values[None], None, scale)[0, :, 0]
        # fp32 sums in another order; a bf16 pool's output rounded once, to nearest: within half its last place
        # (2^-8 of the value), where rounding toward zero would miss by up to a whole place
        err = (out[b].float() - want).abs()
        bound = want.abs() * (1e-5 if dtype == torch.float32 else 2.0**-8 * (1 + 1e-4)) + 1e-6
        assert bool((err <= bound).all()), f"{flavour} sequence {b} ({n} keys): worst {float((err - bound).max())}"


def _ending_at_a_guard_page(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor whose last byte ends a page, the page after it unreadable: a read past its end faults."""
    nbytes = math.prod(shape) * dtype.itemsize
    assert nbytes % mmap.PAGESIZE == 0
    buffer = mmap.mmap(-1, nbytes + mmap.PAGESIZE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    if ctypes.CDLL(None).mprotect(ctypes.c_void_p(address + nbytes), mmap.PAGESIZE, 0) != 0:
        pytest.skip("mprotect refused here")
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


@needs_build
@pytest.mark.parametrize("flavour", FLAVOURS_HERE or ["native"])
def test_small_blocks_last_rows_are_read_within_the_pool(flavour: str) -> None:
    """Blocks of 4 keys, bf16 (a block's last rows scored as a 16-row tile only where the block has 16 slots from
    there): the pool's last block ends a page and the next page is unreadable, so a tile read past a small block
    faults; the output is the formula's."""
    kernels = native_kernels(flavour)
    assert kernels is not None
    gen = torch.Generator().manual_seed(4)
    num_blocks, kv_heads, bs, d, lengths = 16, 2, 4, 64, [7, 14]
    pools = [_ending_at_a_guard_page((num_blocks, kv_heads, bs, d), torch.bfloat16) for _ in range(2)]
    for pool in pools:
        pool.copy_(torch.randn(pool.shape, generator=gen))
    tables = torch.tensor([[3, num_blocks - 1, 0, 0], [5, 8, 2, num_blocks - 1]])  # both end in the last block
    q = torch.randn(2, kv_heads * 3, d, generator=gen).bfloat16()
    out = kernels.exact_paged_attention(q, pools[0], pools[1], tables, torch.tensor(lengths),
                                        torch.zeros(2, dtype=torch.long), d**-0.5, None, None)
    for b, n in enumerate(lengths):
        keys, values = (pool[tables[b]].transpose(0, 1).reshape(kv_heads, -1, d)[:, :n].float() for pool in pools)
        want = attention_reference(q[b].float()[None, :, None], keys[None], values[None], None, d**-0.5)[0, :, 0]
        assert_close(out[b].float(), want, 2.0**-7 * max(1.0, want.abs().max().item()), f"sequence {b}")


# Prompt chunks on AMX tiles (amx_chunk_attention in cpu_decode.c): runs of 8 or more rows of one sequence's
# consecutive positions over one table, exact bf16 pools.
AMX_RUN_ROWS = 8


@st.composite
def chunk_batches(draw: st.DrawFn) -> dict[str, Any]:
    """A step's rows as the engine lays them out: segments of one sequence each, a prompt chunk (consecutive
    positions after a prefix already in the pool) or a decode row; grouped heads, head sizes 32-256 (96: a last
    pass of two column groups), blocks of 4-32 keys, softcaps and windows."""
    kv_heads, groups = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 3]))
    segments = [(draw(st.integers(0, 60)), draw(st.integers(1, 40)) if draw(st.booleans()) else 1)
                for _ in range(draw(st.integers(1, 3)))]  # (prefix, rows)
    return {"kv_heads": kv_heads, "heads": kv_heads * groups, "head_dim": draw(st.sampled_from([32, 64, 96, 128, 256])),
            "block_size": draw(st.sampled_from([4, 16, 32])), "segments": segments,
            "softcap": draw(st.sampled_from([None, 5.0])), "window": draw(st.sampled_from([None, 1, 9, 50])),
            "threads": draw(st.sampled_from([1, 2])), "seed": draw(st.integers(0, 2**16))}


def chunk_rows(p: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """q, the pools, each row's table (its sequence's blocks up to its own keys, padded with another block),
    lengths and starts (0) for the layout."""
    gen = torch.Generator().manual_seed(p["seed"])
    bs, d, kv_heads = p["block_size"], p["head_dim"], p["kv_heads"]
    spans = [-(-(prefix + rows) // bs) for prefix, rows in p["segments"]]
    num_blocks, nb = sum(spans) + 2, max(spans)
    k_blocks, v_blocks = (torch.randn(num_blocks, kv_heads, bs, d, generator=gen).bfloat16() for _ in range(2))
    order = torch.randperm(num_blocks, generator=gen)  # every sequence its own blocks, anywhere in the pool
    tables, lengths, used = [], [], 0
    for (prefix, rows), span in zip(p["segments"], spans, strict=True):
        for n in range(prefix + 1, prefix + rows + 1):  # each row's own blocks, then another block
            own = -(-n // bs)
            tables.append(torch.cat([order[used : used + own], order[-1:].repeat(nb - own)]))
            lengths.append(n)
        used += span
    q = torch.randn(len(lengths), p["heads"], d, generator=gen).bfloat16()
    starts = torch.zeros(len(lengths), dtype=torch.long)
    return q, k_blocks, v_blocks, torch.stack(tables), torch.tensor(lengths), starts


def chunk_formula(p: dict[str, Any], q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  lengths: torch.Tensor, scale: float, rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's output in fp64 over its gathered keys and values `[B, Hkv, S, D]` and, per output, the scale of its
    fp32 sums' rounding: sum_t p_t |v_t| (values stored rotated: sum_t p_t ||v_t||, the length a rotation keeps)."""
    kv_heads, d, group = p["kv_heads"], p["head_dim"], p["heads"] // p["kv_heads"]
    want, size = torch.empty(q.shape, dtype=torch.float64), torch.empty(q.shape, dtype=torch.float64)
    for b, n in enumerate(lengths.tolist()):
        k, v = keys[b, :, :n].double(), values[b, :, :n].double()
        s = torch.einsum("hgd,htd->hgt", q[b].double().view(kv_heads, group, d), k) * scale
        if p["softcap"]:
            s = p["softcap"] * torch.tanh(s / p["softcap"])
        if p["window"]:
            s[:, :, : max(0, n - p["window"])] = -math.inf  # key t seen where t > (n - 1) - window
        probs = torch.softmax(s, -1)
        want[b] = torch.einsum("hgt,htd->hgd", probs, v).reshape(-1, d)
        size[b] = (torch.einsum("hgt,htd->hgd", probs, v.abs()) if not rotated else
                   torch.einsum("hgt,ht->hg", probs, v.norm(dim=-1))[..., None].expand(-1, -1, d)).reshape(-1, d)
    return want, size


def assert_chunk_rows(name: str, out: torch.Tensor, want: torch.Tensor, size: torch.Tensor) -> None:
    """The fp64 formula rounded once, to within the fp32 sums' rounding before it (`size` times 2^-14, and 1e-6)."""
    err = (out.double() - want).abs()
    bound = want.abs() * 2.0**-8 + size * 2.0**-14 + 1e-6
    assert bool((err <= bound).all()), f"{name}: worst {float((err - bound).max())} over the bound"


@needs_build
@needs_amx
@settings(max_examples=60, deadline=None)
@given(p=chunk_batches())
@example(p={"kv_heads": 2, "heads": 6, "head_dim": 64, "block_size": 16, "segments": [(0, 20), (20, 12)],
            "softcap": None, "window": None, "threads": 2, "seed": 1})  # the second prompt's first row follows the
# first's last position (21 after 20): another table, so another run
@example(p={"kv_heads": 1, "heads": 3, "head_dim": 96, "block_size": 4, "segments": [(5, 7), (3, 8), (0, 1)],
            "softcap": 5.0, "window": 9, "threads": 1, "seed": 2})  # 7 rows: the row kernel; 8: tiles
def test_prompt_chunks_on_amx_tiles_are_the_formula(p: dict[str, Any]) -> None:
    """The exact pool's paged attention with AMX tiles: runs of 8 or more rows (a prompt chunk) on tiles, every
    other row on the row kernel, and each row the fp64 formula rounded once, to within the fp32 sums' rounding
    (sum_t p_t |v_t| times 2^-14; the probabilities summed against the values in two bf16 parts, within 2^-16 of
    them, where one part would miss by 2^-9). The same rows with INFER_AMX=0 (the row kernel alone) also are."""
    kernels = native_kernels()
    assert kernels is not None
    q, k_blocks, v_blocks, tables, lengths, starts = chunk_rows(p)
    scale = p["head_dim"] ** -0.5

    def attend() -> torch.Tensor:
        with on_threads(p["threads"]):
            return kernels.exact_paged_attention(q, k_blocks, v_blocks, tables, lengths, starts, scale, p["softcap"],
                                                 p["window"])

    before = kernels.amx_attention_rows()
    with amx_switched(True):
        tiles = attend()
    taken = kernels.amx_attention_rows() - before
    assert taken == sum(rows for _, rows in p["segments"] if rows >= AMX_RUN_ROWS), f"{taken} rows on tiles"
    with amx_switched(False):
        alone = attend()
    assert kernels.amx_attention_rows() - before == taken, "INFER_AMX=0 still took the tiles"
    keys, values = (blocks[tables].transpose(1, 2).flatten(2, 3) for blocks in (k_blocks, v_blocks))
    want, size = chunk_formula(p, q, keys, values, lengths, scale)
    assert_chunk_rows("tiles", tiles, want, size)
    assert_chunk_rows("row kernel", alone, want, size)


@needs_build
@needs_amx
@settings(max_examples=30, deadline=None)
@given(p=chunk_batches(), staged=st.sampled_from([0.0, 0.3, -1.0]), scheme=st.sampled_from(["int8", "int4", "fp4"]))
# (always: 32 keys of codes alone, then codes and the staged newest block, in a 4-bit pool's two passes; and 16
# staged keys before codes in one group of key tiles)
@example(p={"kv_heads": 1, "heads": 2, "head_dim": 64, "block_size": 16, "segments": [(40, 12)], "softcap": None,
            "window": None, "threads": 2, "seed": 3}, staged=0.0, scheme="int4")
@example(p={"kv_heads": 1, "heads": 2, "head_dim": 64, "block_size": 16, "segments": [(40, 12)], "softcap": None,
            "window": None, "threads": 1, "seed": 4}, staged=-1.0, scheme="int8")
def test_prompt_chunks_over_codes_on_amx_tiles_are_the_formula(p: dict[str, Any], staged: float, scheme: str) -> None:
    """A quantized pool's prompt chunks on AMX tiles (codes times their scales split into two bf16 parts, exactly;
    the 4-bit pools' key offsets added to the scores per block, their rotated values summed apart from the staged
    rows' and turned back): every row the fp64 formula over the pool's dequantizing gather, rounded once, as the row
    kernel's (INFER_AMX=0) also is, and the tiles' rows bit for bit with every tile product taken
    (INFER_AMX_SKIP_ZEROS=0: the products of zeros left out change nothing); each sequence's newest block staged
    (older ones too where drawn; `staged` -1: its first block too, exact keys before codes), each row's table its own
    blocks padded with another block, so the tiles read the run's last row's."""
    from infer.ragged import DecodeGroup

    p = {**p, "scheme": scheme, "dtype": torch.bfloat16}
    pool, gen, table, lengths_t, starts = chunks_over_codes(p, staged)
    group = DecodeGroup("native", torch.arange(len(table)), table, lengths_t, {}, starts)
    q = torch.randn(len(table), p["heads"], p["head_dim"], generator=gen).bfloat16()
    kernels = native_kernels()
    assert kernels is not None

    def attend() -> torch.Tensor:
        with on_threads(p["threads"]):
            return pool.layers[0].decode_attention(group, q, 0.3, p["softcap"], p["window"])

    before = kernels.amx_attention_rows()
    with amx_switched(True):
        tiles = attend()
        with amx_switched(False, "INFER_AMX_SKIP_ZEROS"):
            every_product = attend()
    assert kernels.amx_attention_rows() - before == 2 * sum(rows for _, rows in p["segments"] if rows >= AMX_RUN_ROWS)
    assert torch.equal(tiles, every_product), "leaving out the tile products of zeros changed the rows"
    with amx_switched(False):
        alone = attend()
    pool.dtype = torch.float32  # the gather dequantizes into fp32: the kernel sums the codes in fp32
    keys, values = pool.layers[0].gather(table)
    want, size = chunk_formula(p, q, keys, values, lengths_t, 0.3, rotated=pool.rotation is not None)
    assert_chunk_rows("tiles", tiles, want, size)
    assert_chunk_rows("row kernel", alone, want, size)


@needs_build
@settings(max_examples=40, deadline=None)
@given(p=chunk_batches(), staged=st.sampled_from([0.0, 0.3, -1.0]), scheme=st.sampled_from(["int8", "int4", "fp4"]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), form=st.sampled_from(TILE_FORMS), cut=st.booleans())
# (always: a run of 40 rows in three parts of up to 16 over 16-key blocks, and one over 32-key blocks, two tiles each,
# its table cut under a window)
@example(p={"kv_heads": 2, "heads": 6, "head_dim": 64, "block_size": 16, "segments": [(20, 40), (3, 1)],
            "softcap": None, "window": None, "threads": 2, "seed": 5}, staged=0.3, scheme="int4", dtype=torch.bfloat16,
         form=TILE_FORMS[0], cut=False)
@example(p={"kv_heads": 1, "heads": 3, "head_dim": 128, "block_size": 32, "segments": [(150, 21)], "softcap": 5.0,
            "window": 50, "threads": 1, "seed": 6}, staged=0.0, scheme="int8", dtype=torch.float32, form=TILE_FORMS[1],
         cut=True)
def test_prompt_chunks_over_codes_as_runs_are_the_row_kernel_bit_for_bit(p: dict[str, Any], staged: float,
                                                                         scheme: str, dtype: torch.dtype,
                                                                         form: dict[str, str], cut: bool) -> None:
    """Without AMX tiles (INFER_AMX=0, and every CPU without them), a quantized pool's prompt chunks are taken as runs:
    each tile of codes decoded once for up to 16 of a run's rows, which score it and sum its values in turn. Every row
    bit for bit what the row kernel gives it alone (INFER_QATTN_RUNS=0), on the drawn tile form; the rows of every
    run of 2 or more taken so (the kernel's count), none by the row kernel; both within the fp64 formula over the
    pool's dequantizing gather (tables from the first block: with `cut` each sequence's table starts at a later block,
    as a sliding layer's in the pool do, held to the row kernel alone). Each sequence's newest block staged (older
    ones too where drawn; `staged` -1: its first block too), each row's table its own blocks padded with another."""
    from infer.ragged import DecodeGroup

    p = {**p, "scheme": scheme, "dtype": dtype}
    pool, gen, table, lengths_t, starts = chunks_over_codes(p, staged, cut)
    group = DecodeGroup("native", torch.arange(len(table)), table, lengths_t, {}, starts)
    q = torch.randn(len(table), p["heads"], p["head_dim"], generator=gen).to(dtype)
    kernels = native_kernels()
    assert kernels is not None

    def attend() -> torch.Tensor:
        with on_threads(p["threads"]), amx_switched(False), mock.patch.dict("os.environ", form):
            return pool.layers[0].decode_attention(group, q, 0.3, p["softcap"], p["window"])

    before = kernels.qattn_run_rows()
    runs = attend()
    taken = kernels.qattn_run_rows() - before
    assert taken == sum(rows for _, rows in p["segments"] if rows >= 2), f"{taken} rows taken as runs"
    with mock.patch.dict("os.environ", {"INFER_QATTN_RUNS": "0"}):
        alone = attend()
    assert kernels.qattn_run_rows() - before == taken, "INFER_QATTN_RUNS=0 still took runs"
    assert torch.equal(runs, alone), f"{p}: the runs changed a row's sums"
    if bool(starts.any()):
        return
    pool.dtype = torch.float32  # the gather dequantizes into fp32: the kernel sums the codes in fp32
    keys, values = pool.layers[0].gather(table)
    want, size = chunk_formula(p, q, keys, values, lengths_t, 0.3, rotated=pool.rotation is not None)
    assert_chunk_rows("runs", runs, want, size)
