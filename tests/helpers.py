"""Shared test helpers: closeness with a useful message, random tiny models built in-process."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from packaging.version import Version

import infer
from infer.cache import create_cache
from infer.cache.block_manager import BlockManager
from infer.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, RopeConfig
from infer.engine import Engine
from infer.families import FAMILIES
from infer.models import Transformer
from infer.models.transformer import Linear, QuantizedEmbedding, QuantizedLinear
from infer.quant_weights import QuantizedWeight, factor, quantize_int4, quantize_int8

# Chat rendering is pinned to the transformers this suite was checked against: older releases differ
# (5.17 maps a Literal tool argument to "object", does not alias `thinking`, keeps a None `name`).
CHAT_ORACLE_VERSION = "5.23"

# Where the suites put models and caches: "cpu", or "cuda" under tests/gpu_check.py (conftest switches the
# factories' defaults to it).
TEST_DEVICE = os.environ.get("INFER_TEST_DEVICE", "cpu")


def chat_oracle_version_ok() -> bool:
    """Whether the installed transformers renders chat templates as the version the engine matches."""
    import transformers

    return Version(transformers.__version__) >= Version(CHAT_ORACLE_VERSION)


needs_chat_oracle = pytest.mark.skipif(
    not chat_oracle_version_ok(),
    reason=f"chat rendering is compared with transformers>={CHAT_ORACLE_VERSION} (pyproject's test extra)",
)


@contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Fail with TimeoutError if the body runs longer than `seconds` (a hang must fail fast, not stall CI).
    Uses SIGALRM: on platforms without it the body simply runs unbounded."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"{what} ran over {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str = "tensors") -> None:
    """Assert |actual - expected| <= atol everywhere; the message gives max and mean difference."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    diff = (actual.float().cpu() - expected.float().cpu()).abs()
    worst = diff.max().item() if diff.numel() else 0.0
    assert worst <= atol, (
        f"{what}: max |diff| {worst:.3e} > {atol:.1e} (mean {diff.mean().item():.3e}, "
        f"at index {tuple(int(i) for i in torch.nonzero(diff == worst)[0])})"
    )


def tiny_config(
    model_type: str = "llama",
    *,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 8,
    hidden_size: int = 32,
    vocab_size: int = 97,
    sliding_window: int | None = None,
    sliding_pattern: int = 2,
) -> ModelConfig:
    """A small config without a checkpoint, with the family's traits: sliding layers where the family has a
    period of them (Gemma 3 alternates sliding and full layers; Qwen's sliding layers are off, as in the released
    models), its own RoPE base on them, its activation, tying and query scale."""
    family = FAMILIES[model_type]
    periodic = family.sliding_layers == "period"
    layer_types = tuple(
        SLIDING_ATTENTION if periodic and (i + 1) % sliding_pattern else FULL_ATTENTION for i in range(num_layers)
    )
    has_sliding = SLIDING_ATTENTION in layer_types
    return ModelConfig(
        model_type=model_type,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=family.tie_word_embeddings,
        hidden_act=family.hidden_act,
        layer_types=layer_types,
        sliding_window=(sliding_window or 4) if has_sliding else None,
        rope=RopeConfig(theta=10000.0),
        rope_local=RopeConfig(theta=1000.0) if family.local_rope_theta is not None else None,
        query_pre_attn_scalar=float(head_dim + 3) if family.query_pre_attn_scalar is not None else None,
    )


def random_model(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Transformer:
    """A Transformer with seeded random weights, peaked enough that argmax ties do not occur."""
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                base = 0.0 if FAMILIES[config.model_type].norm_plus_one else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + base)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.to(dtype=dtype, device=TEST_DEVICE).eval().requires_grad_(False)


def check_pool_invariants(manager: BlockManager, tokens: dict[int, list[int]] | None = None) -> None:
    """The allocator's books balance: every block is free xor held, ref counts count the block tables that
    hold a block, each table has exactly the blocks its tokens need, and (given each sequence's tokens) a
    shared block sits at the same index of sequences with the same tokens up to it."""
    free = manager.free_block_ids()
    assert len(free) == len(set(free)), "a block is on the free list twice"
    holders = [0] * manager.num_blocks
    where: dict[int, list[tuple[int, int]]] = {}
    for seq_id in manager.seq_ids:
        table = manager.block_table(seq_id)
        assert len(set(table)) == len(table), f"sequence {seq_id} holds a block twice"
        assert len(table) == -(-manager.num_tokens(seq_id) // manager.block_size)
        for i, b in enumerate(table):
            holders[b] += 1
            where.setdefault(b, []).append((seq_id, i))
    assert holders == [manager.ref_count(b) for b in range(manager.num_blocks)], "ref counts are off"
    for b in range(manager.num_blocks):
        assert (b in free) == (holders[b] == 0), f"block {b} is both free and held, or neither"
    if tokens is None:
        return
    bs = manager.block_size
    for b, (first, *others) in where.items():
        for seq_id, i in others:
            assert i == first[1], f"block {b} sits at different positions in two sequences"
            n = min(manager.num_tokens(first[0]), manager.num_tokens(seq_id), (i + 1) * bs)
            assert tokens[first[0]][:n] == tokens[seq_id][:n], f"block {b} is shared by different prefixes"


@contextmanager
def env_set(name: str, value: str) -> Iterator[None]:
    """Environment variable `name` set to `value` for the body (the native kernels read their switches at each
    call), put back after."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


@contextmanager
def on_threads(threads: int) -> Iterator[None]:
    """Run the body on `threads` PyTorch (and native kernel) threads, restoring the count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def solo_logits(model: Transformer, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The solo cached run's logits for each generated token, fed the given tokens."""
    device = model.device
    cache = create_cache("contiguous", model.config, max_seq_len=len(prompt) + len(tokens), device=device,
                         dtype=model.dtype)
    with torch.inference_mode():
        rows = [model(torch.tensor([prompt], device=device), cache)[0, -1]]
        rows += [model(torch.tensor([[t]], device=device), cache)[0, -1] for t in tokens[:-1]]
    return torch.stack(rows)


def assert_within_rounding_of_solo_runs(engine: Engine, model: Transformer, prompts: list[list[int]],
                                        ids: list[int]) -> None:
    """Each finished request's logits (`keep_logits=True`) within bf16 rounding of its solo run, fed its own tokens:
    the batched engine's oracle where a batch changes the products' row count (5% of the solo run's largest)."""
    for prompt, rid in zip(prompts, ids, strict=True):
        result = engine.result(rid)
        assert result.logits is not None
        solo = solo_logits(model, prompt, result.token_ids).float()
        assert (result.logits.float() - solo).abs().max() <= 0.05 * solo.abs().max()


# Quantized weights (tests/test_quant_weights.py, tests/test_triton_kernels.py).

def weight_of(scheme: str, n: int, k: int, group: int, seed: int) -> QuantizedWeight:
    """A quantized weight of every storage variant the kernels meet: int8 per channel (fp32 scales), int4 (fp16),
    Q8_0 (int8 codes, fp16 scales per 32), Q6_K (int8 codes, fp32 scales per 16) and Q4_K's fp32 scales and mins;
    "Q4_K-factored" and "Q6_K-factored" as a GGUF file's blocks load (k a multiple of 256): int8 multipliers under
    float16 super-scales (Q4_K's mins under a negative one)."""
    g = torch.Generator().manual_seed(seed)
    if scheme.endswith("-factored"):
        kind, supers = scheme.removesuffix("-factored"), k // 256
        if kind == "Q6_K":
            codes = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
            sc = torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8)
            return QuantizedWeight(kind, codes, factor(sc, torch.rand(n, supers, generator=g) / 500), None, 16)
        q = quantize_int4(torch.randn(n, k, generator=g), 32)
        sc, m = (torch.randint(0, 64, (n, k // 32), generator=g) for _ in range(2))
        d, dmin = (torch.rand(n, supers, generator=g) / 100 for _ in range(2))
        return QuantizedWeight(kind, q.codes, factor(sc, d), factor(m, -dmin), 32)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 4
    if scheme == "int8":
        return quantize_int8(w)
    if scheme == "int4":
        return quantize_int4(w, group)
    if scheme == "Q8_0":
        codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        return QuantizedWeight("Q8_0", codes, (torch.rand(n, k // 32, generator=g) / 50).half(), None, 32)
    if scheme == "Q6_K":  # 6-bit codes in groups of 16 under fp32 scales of either sign
        codes = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
        return QuantizedWeight("Q6_K", codes, (torch.rand(n, k // 16, generator=g) - 0.5) / 10, None, 16)
    q = quantize_int4(w, 32)  # float32 scales of 17 significant bits, as Q4_K's d * sc (float16 times 6 bits)
    scales = with_significant_bits(q.scales.float() * 1.001, 17)
    return QuantizedWeight("Q4_K", q.codes, scales, q.mins.float() * 0.999, 32)  # type: ignore[union-attr]


def with_significant_bits(t: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 `t` cut to its first `bits` significant bits (the rest of the significand cleared)."""
    return (t.float().view(torch.int32) & ~((1 << (24 - bits)) - 1)).view(torch.float32)


def fma32(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float32 `a * b + c` rounded once, as a fused multiply-add rounds it (elementwise, broadcasting; finite float32
    operands). In float64 the product is exact (48 significant bits at most) but the sum rounds once before the
    rounding to float32, which changes the result only where it lands exactly on a float32 tie: there the sum's own
    rounding error (Knuth's TwoSum, exact) says on which side of the tie the exact value lies."""
    p, cd = a.double() * b.double(), c.double()
    s = cd + p
    v = s - cd
    err = (cd - (s - v)) + (p - v)  # s + err == cd + p exactly
    r = s.float()
    rd = r.double()
    neighbour = torch.nextafter(r, torch.where(s > rd, torch.inf, -torch.inf).float()).double()
    tie = (s != rd) & (2 * s == rd + neighbour)  # (the sum of two adjacent floats is exact in float64)
    nudged = torch.nextafter(s, torch.where(err > 0, torch.inf, -torch.inf).double())  # a float64 step toward exact
    return torch.where(tie & (err != 0), nudged.float(), r)


def reference_product(weight: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W.T (+ bias)` in fp64 for the dequantized weight: the formula the quantized kernels are held to."""
    ref = x.double() @ weight.dequantize().double().T
    return ref if bias is None else ref + bias.double()


def dequantized_twin(model: infer.Transformer, path: Path) -> infer.Transformer:
    """The dense model of the same checkpoint with every quantized weight replaced by its dequantization."""
    twin = infer.load_model(path, dtype=model.dtype, weights="dense", decode_gemv="linear")
    for name, module in model.named_modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            dense = twin.get_submodule(name)
            assert isinstance(dense, (Linear, torch.nn.Embedding))
            dense.weight.data.copy_(module.qweight.dequantize(model.dtype))
    return twin


def fp32_bound(reference: torch.Tensor) -> float:
    # The quantized products sum per group in another order than MKL's GEMM: fp32 rounding, a little above the
    # 1e-5 of the dense oracle tests.
    return 3e-5 * max(1.0, reference.abs().max().item())


