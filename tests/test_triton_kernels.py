"""The Triton kernels against the PyTorch formula, on shapes Hypothesis draws (head dims 40-256, GQA groups,
block sizes, lengths crossing block and split boundaries, sliding windows, softcap). Without a GPU they run
under Triton's interpreter (`TRITON_INTERPRET=1`, set by tests/conftest.py), so CI checks them on its CPU;
`pytest -m triton` selects them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from infer.attention import attention_reference
from infer.families import ARCHITECTURES
from infer.kernels import triton_available
from tests.helpers import assert_close, dequantized_twin, fp32_bound, weight_of
from tests.test_native_quantized_attention import check_pool_kernel, pool_layouts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not triton_available(DEVICE), reason="needs Triton (pip install triton), and CUDA or "
                                                           "TRITON_INTERPRET=1"),
]


@st.composite
def paged_problems(draw: st.DrawFn) -> dict:
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    head_dim = draw(st.sampled_from([40, 64, 80, 96, 128, 256]))
    block_size = draw(st.sampled_from([1, 3, 5, 8, 16, 17]))
    lengths = draw(st.lists(st.integers(1, 48), min_size=1, max_size=4))
    return {
        "kv_heads": kv_heads, "group": group, "head_dim": head_dim, "block_size": block_size, "lengths": lengths,
        "window": draw(st.none() | st.integers(1, 20)),
        "softcap": draw(st.none() | st.sampled_from([5.0, 30.0])),
        "num_splits": draw(st.none() | st.integers(1, 7)),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def reference(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, tables: torch.Tensor,
              lengths: list[int], scale: float, softcap: float | None, window: int | None) -> torch.Tensor:
    """Gather each sequence's keys in position order, then the textbook formula with its mask."""
    rows = []
    for b, n in enumerate(lengths):
        nb = -(-n // k_blocks.shape[2])
        keys = k_blocks[tables[b, :nb]].transpose(0, 1).flatten(1, 2)[None, :, :n]
        values = v_blocks[tables[b, :nb]].transpose(0, 1).flatten(1, 2)[None, :, :n]
        pos = torch.arange(n, device=q.device)
        visible = pos <= n - 1 if window is None else (pos <= n - 1) & (pos > n - 1 - window)
        rows.append(attention_reference(q[b][None, :, None], keys, values, visible[None], scale, softcap)[0, :, 0])
    return torch.stack(rows)


def build(p: dict, dtype: torch.dtype) -> tuple:
    gen = torch.Generator().manual_seed(p["seed"])
    B, bs = len(p["lengths"]), p["block_size"]
    most = max(-(-n // bs) for n in p["lengths"])
    num_blocks = B * most + 3
    shape = (num_blocks, p["kv_heads"], bs, p["head_dim"])
    # Every slot no sequence owns is NaN: the kernel must never read it into a sum (masked loads).
    k_blocks = torch.full(shape, float("nan"))
    v_blocks = torch.full(shape, float("nan"))
    order = torch.randperm(num_blocks, generator=gen)
    tables = order[: B * most].view(B, most).clone()
    for b, n in enumerate(p["lengths"]):
        for pos in range(n):
            blk, slot = tables[b, pos // bs], pos % bs
            k_blocks[blk, :, slot] = torch.randn(p["kv_heads"], p["head_dim"], generator=gen)
            v_blocks[blk, :, slot] = torch.randn(p["kv_heads"], p["head_dim"], generator=gen)
    q = torch.randn(B, p["kv_heads"] * p["group"], p["head_dim"], generator=gen)
    move = {"device": DEVICE, "dtype": dtype}
    return q.to(**move), k_blocks.to(**move), v_blocks.to(**move), tables.to(DEVICE)


@given(paged_problems())
def test_paged_decode_attention_equals_the_formula(p: dict) -> None:
    from infer.kernels.paged_attention import paged_decode_attention

    q, k_blocks, v_blocks, tables = build(p, torch.float32)
    scale = p["head_dim"] ** -0.5
    lengths = torch.tensor(p["lengths"], device=DEVICE)
    out = paged_decode_attention(q, k_blocks, v_blocks, tables, lengths, scale, p["softcap"], p["window"],
                                 p["num_splits"])
    expected = reference(q, k_blocks, v_blocks, tables, p["lengths"], scale, p["softcap"], p["window"])
    assert not out.isnan().any(), "a masked NaN slot reached the output"
    assert_close(out, expected, 1e-5, "paged Triton kernel vs formula (fp32)")


@given(paged_problems())
def test_paged_decode_attention_in_bf16_is_within_bf16_rounding(p: dict) -> None:
    from infer.kernels.paged_attention import paged_decode_attention

    q, k_blocks, v_blocks, tables = build(p, torch.bfloat16)
    scale = p["head_dim"] ** -0.5
    lengths = torch.tensor(p["lengths"], device=DEVICE)
    out = paged_decode_attention(q, k_blocks, v_blocks, tables, lengths, scale, p["softcap"], p["window"],
                                 p["num_splits"])
    assert out.dtype == torch.bfloat16
    expected = reference(q.float(), k_blocks.float(), v_blocks.float(), tables, p["lengths"], scale, p["softcap"],
                         p["window"])
    # Inputs are exact bf16 values and the kernel computes in fp32 (TF32 on a GPU): only the output's
    # rounding to bf16 (and TF32's) separates them.
    assert_close(out.float(), expected, 2e-2, "paged Triton kernel vs formula (bf16)")


def test_split_count_does_not_change_the_result() -> None:
    """Flash-decoding's combine: one split, more splits than blocks (some empty), and the default give the same
    rows."""
    from infer.kernels.paged_attention import paged_decode_attention

    p = {"kv_heads": 2, "group": 3, "head_dim": 64, "block_size": 4, "lengths": [1, 9, 33], "window": None,
         "softcap": None, "num_splits": None, "seed": 1}
    q, k_blocks, v_blocks, tables = build(p, torch.float32)
    lengths = torch.tensor(p["lengths"], device=DEVICE)
    outs = [paged_decode_attention(q, k_blocks, v_blocks, tables, lengths, 0.125, num_splits=s)
            for s in (None, 1, 100)]
    assert_close(outs[1], outs[2], 1e-5, "split per block vs one split")
    assert_close(outs[0], outs[2], 1e-5, "default split vs one split")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_split_written_directly_is_its_combine(dtype: torch.dtype) -> None:
    """With one split the kernel writes the rows itself (acc / sum) instead of a second launch combining one split:
    the same values as that launch (its weight exp(m - m) is 1), fp32 and bf16, a window and a softcap."""
    from infer.kernels.paged_attention import paged_decode_attention

    p = {"kv_heads": 2, "group": 3, "head_dim": 40, "block_size": 4, "lengths": [1, 9, 19], "window": 6,
         "softcap": 30.0, "num_splits": 1, "seed": 2}
    q, k_blocks, v_blocks, tables = build(p, dtype)
    lengths = torch.tensor(p["lengths"], device=DEVICE)
    direct, combined = (paged_decode_attention(q, k_blocks, v_blocks, tables, lengths, 0.125, 30.0, 6, num_splits=1,
                                               one_split_direct=d) for d in (True, False))
    assert direct.dtype == combined.dtype == dtype
    assert torch.equal(direct, combined)


@given(st.one_of(st.integers(1, 9), st.integers(10, 300)), st.sampled_from([40, 64, 128, 256]),
       st.sampled_from([torch.float32, torch.bfloat16]), st.integers(0, 2**31 - 1), st.booleans())
@example(splits=40, head_dim=64, dtype=torch.float32, seed=0, late_top=True)
def test_the_one_launch_combine_is_the_pytorch_combine(splits: int, head_dim: int, dtype: torch.dtype,
                                                        seed: int, late_top: bool) -> None:
    """Flash-decoding's combine in one Triton launch equals the PyTorch form, splits that saw no key (max -inf,
    sums 0) included, and hundreds of splits (a long context on one KV head), which it takes in chunks of 16:
    `late_top` puts the top score in the last split, 100 over every other (a late key far above the rest), so a
    maximum taken over fewer than all the chunks overflows exp."""
    from infer.kernels.paged_attention import combine_splits, combine_splits_triton

    gen = torch.Generator().manual_seed(seed)
    B, H = 2, 3
    m = torch.randn(B, H, splits, generator=gen) * 40  # maxima far apart: exp overflows unless shifted by the top
    empty = torch.rand(B, H, splits, generator=gen) < 0.3
    empty[..., 0] = False  # every row saw at least one key (lengths >= 1)
    if late_top:
        empty[..., -1] = False
        m[..., -1] = m.amax(-1) + 100.0
    m[empty] = float("-inf")
    l_sum = torch.where(empty, 0.0, torch.rand(B, H, splits, generator=gen) + 0.5)
    acc = torch.where(empty[..., None], 0.0, torch.randn(B, H, splits, head_dim, generator=gen))
    m, l_sum, acc = m.to(DEVICE), l_sum.to(DEVICE), acc.to(DEVICE)
    got = combine_splits_triton(acc, m, l_sum, dtype)
    want = combine_splits(acc, m, l_sum)  # fp32
    assert got.dtype == dtype and not got.isnan().any()
    # bf16: only the output's rounding separates them (an ulp, 2**-7 of the magnitude: Triton's interpreter
    # rounds toward zero).
    bound = 1e-5 if dtype == torch.float32 else 2**-7 * max(1.0, want.abs().max().item())
    assert_close(got.float(), want, bound, "one-launch combine")


@given(st.lists(st.integers(1, 150), min_size=1, max_size=3), st.integers(0, 40), st.integers(1, 2),
       st.sampled_from([1, 2, 4]), st.sampled_from([32, 64]), st.none() | st.integers(1, 30),
       st.none() | st.sampled_from([30.0]), st.integers(0, 2**31 - 1))
def test_the_kernel_over_a_contiguous_cache_reads_only_the_cached_positions(
        lengths: list[int], spare: int, kv_heads: int, group: int, head_dim: int, window: int | None,
        softcap: float | None, seed: int) -> None:
    """A graph-replayed one-token step attends over a contiguous cache `[B, Hkv, S, D]` through the paged kernel,
    runs of 64 positions addressed in units of one position: any S (not a multiple of 64 either), rows of
    different lengths, windows and softcap give the formula's rows; every slot past a row's length is NaN and
    is never read."""
    from infer.kernels.paged_attention import contiguous_decode_attention, contiguous_tables

    gen = torch.Generator().manual_seed(seed)
    B, S = len(lengths), max(lengths) + spare
    k = torch.full((B, kv_heads, S, head_dim), float("nan"))
    v = torch.full_like(k, float("nan"))
    for b, n in enumerate(lengths):
        k[b, :, :n] = torch.randn(kv_heads, n, head_dim, generator=gen)
        v[b, :, :n] = torch.randn(kv_heads, n, head_dim, generator=gen)
    q = torch.randn(B, kv_heads * group, head_dim, generator=gen)
    q, k, v = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    tables = contiguous_tables(B, kv_heads, S, k.device)
    got = contiguous_decode_attention(q, k, v, tables, torch.tensor(lengths, device=DEVICE), 0.125, softcap, window)
    for b, n in enumerate(lengths):
        pos = torch.arange(n, device=DEVICE)
        visible = pos <= n - 1 if window is None else pos > n - 1 - window
        want = attention_reference(q[b][None, :, None], k[b : b + 1, :, :n], v[b : b + 1, :, :n], visible[None],
                                   0.125, softcap)[0, :, 0]
        assert_close(got[b], want, 1e-5, f"row {b} of length {n} in a cache of {S} slots")


@given(paged_problems(), st.integers(1, 40 if DEVICE == "cuda" else 8))
def test_a_wider_padded_table_changes_nothing(p: dict, extra: int) -> None:
    """The batched engine's graph-captured shapes pad block tables to a width bucket: extra columns naming a
    block of NaN (never a sequence's) leave every row as it was, whatever the split count. Interpreted on a CPU, up
    to 8 columns (a wider table can take more splits, empty programs the interpreter runs in Python: 40 columns
    took 30 s of a 2-core CI run); enough to move the split count the width chooses."""
    from infer.kernels.paged_attention import paged_decode_attention

    q, k_blocks, v_blocks, tables = build(p, torch.float32)
    spare = torch.full((1, *k_blocks.shape[1:]), float("nan"), device=DEVICE)
    k_blocks, v_blocks = torch.cat([k_blocks, spare]), torch.cat([v_blocks, spare])
    wide = torch.cat([tables, torch.full((tables.shape[0], extra), k_blocks.shape[0] - 1, device=DEVICE)], 1)
    lengths = torch.tensor(p["lengths"], device=DEVICE)
    scale = p["head_dim"] ** -0.5
    args = (scale, p["softcap"], p["window"], p["num_splits"])
    narrow = paged_decode_attention(q, k_blocks, v_blocks, tables, lengths, *args)
    padded = paged_decode_attention(q, k_blocks, v_blocks, wide, lengths, *args)
    assert not padded.isnan().any(), "a padding column was read"
    assert_close(padded, narrow, 1e-6, "padded table vs exact table")


# ---- decode attention over a quantized cache, codes dequantized in the kernel ----

@st.composite
def quantized_problems(draw: st.DrawFn) -> dict:
    length = draw(st.integers(1, 70))
    quantized = draw(st.integers(0, length))
    # values may age on their own count, with their own ring (int8's values in blocks of 32 under keys' of 64)
    v_quantized = draw(st.just(quantized) | st.integers(0, length))
    return {
        "scheme": draw(st.sampled_from(["int8", "int4", "fp4"])),
        "batch": draw(st.integers(1, 3)), "kv_heads": draw(st.integers(1, 3)),
        "group": draw(st.sampled_from([1, 2, 3, 4, 8])), "head_dim": draw(st.sampled_from([40, 64, 80, 128, 256])),
        "length": length, "quantized": quantized,
        # the ring holds at least the unquantized tail; 0 slots when there is none
        "ring": 0 if quantized == length else draw(st.integers(length - quantized, length - quantized + 4)),
        "v_quantized": v_quantized,
        "v_ring": 0 if v_quantized == length else draw(st.integers(length - v_quantized, length - v_quantized + 4)),
        "window": draw(st.none() | st.integers(1, 20)),
        "softcap": draw(st.none() | st.sampled_from([5.0, 30.0])),
        "tile": draw(st.sampled_from([16, 32])), "tiles_per_split": draw(st.none() | st.integers(1, 3)),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def build_quantized(p: dict, dtype: torch.dtype) -> tuple:
    """Codes and scales of positions below `quantized` (rows past them hold NaN scales: never read), the ring of
    the rest (NaN in every slot no position owns), and the keys/values the cache stands for, dequantized."""
    from infer.cache import quant

    quantize = {"int8": quant.quantize_int8, "int4": quant.quantize_int4, "fp4": quant.quantize_fp4}[p["scheme"]]
    dequantize = {"int8": quant.dequantize_int8, "int4": quant.dequantize_int4,
                  "fp4": quant.dequantize_fp4}[p["scheme"]]
    gen = torch.Generator().manual_seed(p["seed"])
    B, Hkv, D, n = p["batch"], p["kv_heads"], p["head_dim"], p["length"]
    k_true, v_true = (torch.randn(B, Hkv, n, D, generator=gen) for _ in range(2))
    spare = 3  # code rows past the quantized ones
    codes, scales, recents, values = [], [], [], []
    counts = ((p["quantized"], p["ring"]), (p.get("v_quantized", p["quantized"]), p.get("v_ring", p["ring"])))
    for x, (nq, R) in zip((k_true, v_true), counts, strict=True):
        c, s = quantize(torch.cat((x[:, :, :nq], torch.randn(B, Hkv, spare, D, generator=gen)), 2))
        s[:, :, nq:] = float("nan")
        ring = torch.full((B, Hkv, R, D), float("nan"))
        for pos in range(nq, n):
            ring[:, :, pos % R] = x[:, :, pos]
        ring = ring.to(dtype)
        codes.append(c.to(DEVICE))
        scales.append(s.to(DEVICE))
        recents.append(ring.to(DEVICE))
        old = dequantize(c[:, :, :nq], s[:, :, :nq], torch.float32)
        values.append(torch.cat((old, ring.float()[:, :, [pos % max(R, 1) for pos in range(nq, n)]]), 2))
    q = torch.randn(B, Hkv * p["group"], D, generator=gen).to(device=DEVICE, dtype=dtype)
    return q, tuple(codes), tuple(scales), tuple(recents), values[0].to(DEVICE), values[1].to(DEVICE)


def quantized_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                        softcap: float | None, window: int | None) -> torch.Tensor:
    n = keys.shape[2]
    pos = torch.arange(n, device=q.device)
    visible = pos <= n - 1 if window is None else (pos <= n - 1) & (pos > n - 1 - window)
    return attention_reference(q.float()[:, :, None], keys, values, visible[None], scale, softcap)[:, :, 0]


@given(quantized_problems())
def test_quantized_decode_attention_equals_the_dequantized_formula(p: dict) -> None:
    from infer.kernels.quantized_attention import quantized_decode_attention

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q, codes, scales, recent, keys, values = build_quantized(p, dtype)
        scale = p["head_dim"] ** -0.5
        lengths = torch.full((p["batch"],), p["length"], device=DEVICE)
        out = quantized_decode_attention(q, codes, scales, recent, lengths, p["quantized"], p["scheme"], scale,
                                         p["softcap"], p["window"], p["tile"], p["tiles_per_split"],
                                         value_quantized=p["v_quantized"])
        assert out.dtype == dtype and out.shape == q.shape
        assert not out.isnan().any(), "a NaN scale or ring slot no position owns reached the output"
        expected = quantized_reference(q, keys, values, scale, p["softcap"], p["window"])
        assert_close(out.float(), expected, tol, f"{p['scheme']} kernel vs dequantize-then-attend ({dtype})")


@settings(max_examples=25, deadline=None)
@given(p=pool_layouts())
@example(p={"scheme": "fp4", "kv_heads": 2, "heads": 4, "head_dim": 64, "block_size": 16, "lengths": [70, 40],
            "cut": False, "window": None, "softcap": None, "dtype": torch.float32, "tiles": True, "staged": 0.3,
            "seed": 1})  # the registered 4-bit layout: offsets, rotated values, codes and staged blocks mixed
def test_quantized_paged_kernel_is_the_gathered_formula(p: dict) -> None:
    """The engine's quantized pool read in place by the Triton kernel against its dequantizing gather, then the
    formula: the native kernel's property (random codes, scales and offsets, staged blocks among coded ones,
    tables in any order and starting past the first block, windows, softcaps); fp32 within 1e-5, bf16 within 2e-2
    of the largest output (TF32 products, the output rounded to bf16), as the single-cache kernel's test."""
    check_pool_kernel(p, "triton", 1e-5, 2e-2, DEVICE)


def test_quantized_kernel_refuses_what_it_cannot_read() -> None:
    from infer.kernels.quantized_attention import quantized_decode_attention

    p = {"scheme": "int8", "batch": 1, "kv_heads": 1, "group": 2, "head_dim": 64, "length": 5, "quantized": 5,
         "ring": 0, "window": None, "softcap": None, "tile": 16, "tiles_per_split": None, "seed": 0}
    q, codes, scales, recent, _, _ = build_quantized(p, torch.float32)
    lengths = torch.full((1,), 7, device=DEVICE)
    with pytest.raises(ValueError, match="not quantized, and the cache keeps no ring"):
        quantized_decode_attention(q, codes, scales, recent, lengths, 5, "int8", 0.1)
    with pytest.raises(ValueError, match="scheme must be"):
        quantized_decode_attention(q, codes, scales, recent, lengths, 5, "nf4", 0.1)
    with pytest.raises(ValueError, match="tile must be a power of two"):
        quantized_decode_attention(q, codes, scales, recent, lengths, 5, "int8", 0.1, tile=24)


ROW_LAYOUT = {"key_scales": "row", "sink_tokens": 0, "rotate_values": False}  # the kernel's first layout
# The registered layout (keys by channel with offsets, sinks, rotated values) with blocks small enough to fill.
REGISTERED_LAYOUT = {"residual_block": 4}


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize(("kind", "residual_window"), [("int8", 1), ("int4", 4), ("fp4", 1)])
@pytest.mark.parametrize("layout", [ROW_LAYOUT, REGISTERED_LAYOUT], ids=["rows", "registered"])
def test_quantized_caches_decode_through_the_kernel_as_through_pytorch(arch: str, kind: str, residual_window: int,
                                                                      layout: dict) -> None:
    """Every one-token step of a model on a quantized cache attends in the kernel to the same fp32 logits (within
    1e-5) as the dequantizing PyTorch path from the same cache state (Gemma past its sliding window; codes and
    the exact ring both read). A residual ring keeps each step's own token exact: quantized at once, a
    rounding-level difference in an earlier layer's output can flip one of its codes in a later layer, the
    lossy kinds' own error, not the kernel's (the cache-level test below covers rings of none). Interpreted on a
    CPU, 4 steps rather than 10 (24 cases of Python-run kernels: ~5 minutes of a 2-core CI run at 10): positions
    30-33, among which a block of 4 leaves the residual ring and is quantized, for either ring."""
    import infer
    from reference import build_checkpoint

    last = 40 if DEVICE == "cuda" else 34
    model = infer.load_model(build_checkpoint(arch), decode_gemv="linear").to(DEVICE)
    ids = torch.randint(0, 400, (2, 40), generator=torch.Generator().manual_seed(11)).to(DEVICE)
    caches = {attention: infer.create_cache(kind, model.config, max_seq_len=40, batch_size=2, device=DEVICE,
                                            residual_window=residual_window, attention=attention, **layout)
              for attention in ("dequantize", "triton")}
    assert caches["triton"].attends_in_kernel and not caches["dequantize"].attends_in_kernel
    with torch.no_grad():
        model(ids[:, :30], caches["dequantize"])
        for i in range(30, last):
            caches["triton"].restore(caches["dequantize"].snapshot())
            kernel = model(ids[:, i : i + 1], caches["triton"])
            torch_path = model(ids[:, i : i + 1], caches["dequantize"])
            scale = max(1.0, torch_path.abs().max().item())
            assert_close(kernel, torch_path, 1e-5 * scale, f"{arch} {kind} kernel vs PyTorch path, step {i}")


@pytest.mark.parametrize("kind", ["int8", "int4", "fp4"])
@pytest.mark.parametrize("layout", [ROW_LAYOUT, REGISTERED_LAYOUT], ids=["rows", "registered"])
def test_quantized_cache_decode_attention_equals_update_then_attend(kind: str, layout: dict) -> None:
    """From the same state, `decode_attention` (store, then the kernel) gives what `update` then the formula
    gives, in every layer, with every token quantized on arrival; and it stores what `update` stores."""
    import copy

    import infer
    from infer.config import ModelConfig
    from reference import build_checkpoint

    config = ModelConfig.from_file(build_checkpoint("gemma3_text"))
    B, H, Hkv, D = 2, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    gen = torch.Generator().manual_seed(12)
    cache = infer.create_cache(kind, config, max_seq_len=24, batch_size=B, device=DEVICE, residual_window=0,
                               **layout)
    for _ in range(20):  # a history of 20 steps
        for layer in range(config.num_hidden_layers):
            cache.update(layer, *(torch.randn(B, Hkv, 1, D, generator=gen).to(DEVICE) for _ in range(2)))
        cache.advance(1)
    twin = copy.deepcopy(cache)
    twin.attention = "triton"
    for layer in range(config.num_hidden_layers):
        q = torch.randn(B, H, 1, D, generator=gen).to(DEVICE)
        k, v = (torch.randn(B, Hkv, 1, D, generator=gen).to(DEVICE) for _ in range(2))
        keys, values = cache.update(layer, k, v)
        window = config.sliding_window if config.is_sliding(layer) else None
        mask = None if window is None else (torch.arange(21, device=DEVICE) > 20 - window)[None]
        expected = attention_reference(q, keys, values, mask, 0.25)
        assert_close(twin.decode_attention(layer, q, k, v, 0.25, None, window), expected, 1e-5, f"layer {layer}")
    for name in ("k_data", "v_data", "k_scale", "v_scale", "k_offset", "k_sink"):
        assert torch.equal(getattr(twin, name).float(), getattr(cache, name).float()), f"{name} stored otherwise"


def test_quantized_cache_attention_choice_is_validated() -> None:
    import infer
    from infer.config import ModelConfig
    from reference import build_checkpoint

    config = ModelConfig.from_file(build_checkpoint("llama"))
    from infer.kernels.native import native_kernels

    on_cpu = "native" if native_kernels() is not None else "dequantize"  # the CPU kernel reads every layout
    auto = infer.create_cache("int8", config, max_seq_len=8, device=DEVICE, key_scales="row", sink_tokens=0,
                              rotate_values=False)
    assert auto.attention == ("triton" if torch.cuda.is_available() and DEVICE == "cuda" else on_cpu)
    # The registered kinds' layout (keys by channel, offsets, sinks, rotated values): the kernel reads it too.
    expected = "triton" if torch.cuda.is_available() and DEVICE == "cuda" else on_cpu
    assert infer.create_cache("int4", config, max_seq_len=8, device=DEVICE).attention == expected
    with pytest.raises(ValueError, match="attention must be 'auto', 'triton', 'native' or 'dequantize'"):
        infer.create_cache("int8", config, max_seq_len=8, attention="flash")


# Shapes crossing the block edges in both directions; small, since the interpreter runs each program in Python.
@given(st.integers(1, 70), st.integers(1, 600), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       st.none() | st.sampled_from([(2, 64), (4, 128), (16, 512)]), st.integers(0, 2**31 - 1))
def test_triton_gemv_equals_torch_mv(n: int, k: int, dtype: torch.dtype, blocks: tuple[int, int] | None,
                                     seed: int) -> None:
    from infer.kernels.gemv import triton_gemv

    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
    x = torch.randn(k, generator=gen).to(DEVICE, dtype)
    # The formula in fp64: both kernels sum in fp32 in their own order, then round once to `dtype`.
    exact = torch.mv(weight.double(), x.double())
    ours = triton_gemv(weight, x, blocks)
    assert ours.dtype == dtype and ours.shape == (n,)
    ulp = {torch.float32: 2e-6 * k**0.5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    assert_close(ours.double(), exact, atol=ulp * (exact.abs().max().item() + 1), what="triton_gemv")


def test_triton_gemv_refuses_a_strided_weight() -> None:
    from infer.kernels.gemv import triton_gemv

    with pytest.raises(ValueError, match="row-major"):
        triton_gemv(torch.ones(8, 4, device=DEVICE).t(), torch.ones(8, device=DEVICE))


# Under the interpreter two architectures (the plain and the most different one) keep CI's time; all on CUDA.
@pytest.mark.parametrize("arch", ARCHITECTURES if DEVICE == "cuda" else ["llama", "gemma3_text"])
def test_decode_with_the_triton_gemv_gives_the_oracle_logits(arch: str) -> None:
    import infer
    from reference import Oracle, build_checkpoint

    path = build_checkpoint(arch)
    model = infer.load_model(path, device=DEVICE, decode_gemv="triton")
    assert model.decode_gemv == "triton"
    oracle = Oracle(path, device=DEVICE)
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    cache = infer.create_cache("contiguous", model.config, max_seq_len=8, device=DEVICE)
    with torch.no_grad():
        model(ids[:, :6].to(DEVICE), cache)
        steps = torch.cat([model(ids[:, t : t + 1].to(DEVICE), cache) for t in range(6, 8)], 1)
    truth = oracle.logits(ids)[:, 6:]
    # Within 1e-5 of the logit scale, as the native CPU GEMV: fp32 sums in another order than HF's GEMM.
    assert_close(steps, truth, atol=1e-5 * max(1.0, truth.abs().max().item()),
                 what=f"{arch} decode steps through triton_gemv")


# Quantized weights (infer/kernels/qgemv.py): every storage format, rows of X crossing BLOCK_M, K crossing BLOCK_K.
@given(st.sampled_from(["int8", "int4", "Q8_0", "Q4_K", "Q6_K"]), st.integers(1, 40), st.integers(1, 6),
       st.sampled_from([32, 64, 128]), st.integers(1, 9), st.sampled_from([torch.float32, torch.bfloat16]),
       st.none() | st.sampled_from([(1, 8, 32), (4, 16, 64), (2, 32, 128)]), st.integers(0, 2**31 - 1))
def test_triton_quantized_product_is_dequantize_then_matmul(scheme: str, n: int, runs: int, group: int, m: int,
                                                            dtype: torch.dtype, blocks: tuple[int, int, int] | None,
                                                            seed: int) -> None:
    from infer.kernels.qgemv import triton_qgemm

    group = group if scheme == "int4" else 16 if scheme == "Q6_K" else 32
    k = max(runs * 32 // group, 1) * group
    weight = weight_of(scheme, n, k, group, seed).to(DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)
    ours = triton_qgemm(weight, x, blocks)
    exact = x.double() @ weight.dequantize().double().T
    assert ours.dtype == dtype and ours.shape == (m, n)
    magnitude = x.double().abs() @ weight.dequantize().double().abs().T
    ulp = 2**-7 if dtype == torch.bfloat16 else 0.0  # one bf16 ulp, as triton_gemv's test allows
    assert ((ours.double() - exact).abs() <= 1e-6 * magnitude + ulp * exact.abs() + 1e-30).all()


def test_decode_with_quantized_weights_through_triton_is_the_dequantized_model() -> None:
    import infer
    from reference import build_checkpoint

    path = build_checkpoint("qwen3")
    model = infer.load_model(path, device=DEVICE, weights="int4", decode_gemv="triton")
    assert model.layers[0].mlp.down_proj.gemv == "triton"
    twin = dequantized_twin(model, path)
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2))
    cache = infer.create_cache("contiguous", model.config, max_seq_len=6, device=DEVICE)
    with torch.no_grad():
        model(ids[:, :4].to(DEVICE), cache)
        steps = torch.cat([model(ids[:, t : t + 1].to(DEVICE), cache) for t in range(4, 6)], 1).cpu()
        truth = twin(ids)[:, 4:]
    assert_close(steps, truth, atol=fp32_bound(truth), what="int4 decode steps through triton_qgemm")
