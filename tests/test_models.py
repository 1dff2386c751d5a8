"""Logits of the engine equal the Hugging Face oracle's on the same checkpoint."""

from __future__ import annotations

import pytest
import torch

import infer
from infer.families import ARCHITECTURES
from infer.tuning import choose_prefill_dtype
from reference import Oracle, build_checkpoint
from tests.helpers import assert_close

# Qwen's sliding layers, off in the released models: layers from max_window_layers on see the last 8 keys.
QWEN_SLIDING = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}

# (arch, config format, config overrides): every architecture in both formats, odd head sizes,
# MQA, GQA and MHA, tied and untied heads, Qwen's sliding layers.
CASES = [
    *[(arch, config_format, {}) for arch in ARCHITECTURES for config_format in ("v5", "legacy")],
    ("llama", "v5", {"num_key_value_heads": 1}),
    ("llama", "v5", {"num_key_value_heads": 4, "head_dim": 80}),
    ("qwen3", "v5", {"head_dim": 40, "num_key_value_heads": 1}),
    ("gemma3_text", "v5", {"head_dim": 48, "num_key_value_heads": 4}),
    ("llama", "legacy", {"tie_word_embeddings": True}),
    ("qwen3", "v5", {"tie_word_embeddings": False}),
    ("qwen2", "legacy", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    ("qwen2", "v5", QWEN_SLIDING),
    ("qwen2", "legacy", QWEN_SLIDING),
]


def fp32_tolerance(reference: torch.Tensor) -> float:
    return 1e-5 * max(1.0, reference.abs().max().item())


@pytest.mark.parametrize(("arch", "config_format", "overrides"), CASES)
def test_logits_equal_oracle_fp32(arch: str, config_format: str, overrides: dict) -> None:
    path = build_checkpoint(arch, config_format=config_format, **overrides)
    model = infer.load_model(path)
    oracle = Oracle(path)
    ids = torch.randint(0, model.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)
    expected = oracle.logits(ids)
    assert_close(ours, expected, fp32_tolerance(expected), f"{arch}/{config_format}/{overrides}")


def test_reference_attention_path_equals_fast_path() -> None:
    model = infer.load_model(build_checkpoint("gemma3_text"))
    ids = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fast = model(ids)
        model.use_reference_attention = True
        slow = model(ids)
    assert_close(fast, slow, fp32_tolerance(slow), "reference attention vs SDPA")


def test_gemma_prompt_longer_than_window_matches() -> None:
    path = build_checkpoint("gemma3_text")
    model = infer.load_model(path)
    window = model.config.sliding_window
    assert window is not None and model.config.has_sliding_layers
    ids = torch.randint(0, model.config.vocab_size, (1, 5 * window + 3), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(ids)
    expected = Oracle(path).logits(ids)
    assert_close(ours, expected, fp32_tolerance(expected), "gemma3 beyond the sliding window")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_half_precision(arch: str, dtype: torch.dtype) -> None:
    """The reference attention path rounds where HF's eager attention rounds: identical logits.
    The SDPA fast path rounds differently inside attention; stated bound: its error against fp32
    is at most 1.5x Hugging Face's own half-precision error, and within 5% of the largest logit of HF."""
    path = build_checkpoint(arch)
    model = infer.load_model(path, dtype=dtype, compute_dtype="exact")  # bit-exactness needs the exact path
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(4))
    hf_half = Oracle(path, dtype=dtype).logits(ids)
    fp32 = Oracle(path).logits(ids)
    with torch.no_grad():
        fast = model(ids).cpu()
        model.use_reference_attention = True
        formula = model(ids).cpu()
    assert fast.dtype == dtype
    assert torch.equal(formula, hf_half), f"{arch} {dtype}: reference path differs from HF eager"
    hf_error = (hf_half.float() - fp32).abs().max().item()
    our_error = (fast.float() - fp32).abs().max().item()
    assert our_error <= 1.5 * hf_error, f"{arch} {dtype}: error vs fp32 {our_error:.3f}, HF's {hf_error:.3f}"
    assert_close(fast, hf_half, 0.05 * max(1.0, hf_half.abs().max().item()), f"{arch} {dtype} SDPA vs HF")


def test_configs_of_both_formats_are_identical() -> None:
    for arch in ARCHITECTURES:
        v5 = infer.ModelConfig.from_file(build_checkpoint(arch, config_format="v5"))
        legacy = infer.ModelConfig.from_file(build_checkpoint(arch, config_format="legacy"))
        assert v5 == legacy, arch


def test_gemma_layer_types_from_legacy_pattern() -> None:
    config = infer.ModelConfig.from_file(build_checkpoint("gemma3_text", config_format="legacy"))
    assert "full_attention" in config.layer_types and "sliding_attention" in config.layer_types
    assert config.rope_local is not None and config.rope_local.theta != config.rope.theta


def test_prefill_upcast_switch_matches_exact_path() -> None:
    """compute_dtype=float32 (the CPU prefill speed switch) against the exact bf16 path and fp32 truth."""
    path = build_checkpoint("llama")
    exact = infer.load_model(path, dtype="bfloat16", compute_dtype="exact")
    upcast = infer.load_model(path, dtype="bfloat16", compute_dtype="float32")
    assert exact.compute_dtype is None and upcast.compute_dtype == torch.float32
    # The default ("auto") follows what this CPU has; forcing either way always works (above).
    auto = infer.load_model(path, dtype="bfloat16").compute_dtype
    chosen = choose_prefill_dtype(torch.bfloat16, torch.device("cpu"))
    assert auto == (torch.float32 if chosen.value == "float32" else None), chosen
    assert infer.load_model(path).compute_dtype is None  # fp32 weights: nothing to do
    truth = infer.load_model(path)
    ids = torch.randint(0, exact.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        a, b, t = exact(ids), upcast(ids), truth(ids)
    assert not torch.equal(a, b), "the switch changed nothing: is it wired to the matmuls?"
    bound = 0.05 * max(1.0, t.abs().max().item())
    assert_close(b, a, bound, "upcast vs exact bf16")
    assert (b.float() - t).abs().max() <= 1.5 * (a.float() - t).abs().max()
    # Decode steps (one-token GEMVs narrow, attention wide) stay as close.
    steps = {}
    for name, model in (("exact", exact), ("upcast", upcast)):
        cache = infer.create_cache("contiguous", model.config, max_seq_len=24, dtype=torch.bfloat16)
        with torch.no_grad():
            model(ids[:, :16], cache)
            steps[name] = torch.cat([model(ids[:, i : i + 1], cache) for i in range(16, 24)], 1)
    assert_close(steps["upcast"], steps["exact"], bound, "upcast vs exact bf16 decode steps")
