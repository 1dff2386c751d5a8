"""The static one-token step a CUDA graph captures (`Transformer.forward_static` through `GraphedDecoder`), run
eagerly on the CPU against the ordinary cached step: the same logits, the same tokens, and nothing read from
the slots past the position. The capture itself needs CUDA: tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

import infer
from infer.errors import CacheFullError
from infer.graphs import GraphedDecoder, graphed_decoder
from reference import build_checkpoint
from tests.helpers import assert_close

ARCHS = ["llama", "qwen3", "gemma3"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_static_steps_equal_the_ordinary_steps(arch: str, dtype: str) -> None:
    """Two sequences, 10 prompt tokens, 14 static steps each from the ordinary path's state (Gemma's sliding
    layers cross their window of 8): fp32 logits within 1e-5 of the ordinary step's (bf16 within 10% of the
    logit scale, as the other bf16 form comparisons: attention over 32 masked slots rounds otherwise),
    the same greedy tokens; stale NaN past the prompt (a cache reused after an overflow) never reaches them."""
    model = infer.load_model(build_checkpoint(arch), dtype=dtype)
    ids = torch.randint(0, 400, (2, 10), generator=torch.Generator().manual_seed(13))
    caches = [infer.create_cache("contiguous", model.config, max_seq_len=32, batch_size=2,
                                 dtype=model.lm_head.weight.dtype) for _ in range(2)]
    static, ordinary = caches
    for cache in caches:
        cache.k_cache.fill_(float("nan"))
        cache.v_cache.fill_(float("nan"))
    with torch.no_grad():
        tokens = [model(ids, cache)[:, -1].argmax(-1, keepdim=True) for cache in caches]
        assert torch.equal(tokens[0], tokens[1])
        decoder = GraphedDecoder(model, static, capture=False)
        token = tokens[0]
        for step in range(14):
            n = ordinary.offset  # each step from the same state: bf16 rounding differences would compound
            static.k_cache[:, :, :, :n] = ordinary.k_cache[:, :, :, :n]
            static.v_cache[:, :, :, :n] = ordinary.v_cache[:, :, :, :n]
            got = decoder.step(token)
            want = model(token, ordinary)
            assert static.offset == ordinary.offset == 11 + step
            assert not got.isnan().any(), "a slot past the position was read"
            scale = max(1.0, want.abs().max().item())
            assert_close(got.float(), want.float(), (1e-5 if dtype == "float32" else 0.1) * scale, f"step {step}")
            if dtype == "float32":
                assert torch.equal(got.argmax(-1), want.argmax(-1))
            token = want.argmax(-1)


def test_static_step_equals_the_reference_attention_path() -> None:
    """With `use_reference_attention` the static step runs the formula over the masked full cache: the same
    logits as the ordinary reference step (softcapped Gemma: the path SDPA cannot take)."""
    model = infer.load_model(build_checkpoint("gemma3", attn_logit_softcapping=30.0, final_logit_softcapping=20.0))
    model.use_reference_attention = True
    ids = torch.randint(0, 400, (1, 9), generator=torch.Generator().manual_seed(14))
    static, ordinary = (infer.create_cache("contiguous", model.config, max_seq_len=20) for _ in range(2))
    decoder = GraphedDecoder(model, static, capture=False)
    with torch.no_grad():
        model(ids, static)
        token = model(ids, ordinary)[:, -1].argmax(-1, keepdim=True)
        for _ in range(10):
            want = model(token, ordinary)
            assert_close(decoder.step(token), want, 1e-5 * max(1.0, want.abs().max().item()), "reference path")
            token = want.argmax(-1)


def test_the_decoder_checks_its_inputs() -> None:
    model = infer.load_model(build_checkpoint("llama"))
    cache = infer.create_cache("contiguous", model.config, max_seq_len=3)
    with pytest.raises(TypeError, match="must be a ContiguousCache"):
        GraphedDecoder(model, infer.create_cache("paged", model.config, max_seq_len=3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs the model on CUDA"):
        GraphedDecoder(model, cache, capture=True)
    decoder = GraphedDecoder(model, cache, capture=False)
    with pytest.raises(ValueError, match=r"input_ids must be \(1, 1\)"):
        decoder.step(torch.tensor([[1, 2]]))
    with torch.no_grad():
        for _ in range(3):
            decoder.step(torch.tensor([[1]]))
        with pytest.raises(CacheFullError, match="max_seq_len=3"):
            decoder.step(torch.tensor([[1]]))
    assert cache.offset == 3, "a refused step changes nothing"


def test_generate_replays_graphs_only_on_cuda_with_a_contiguous_cache() -> None:
    model = infer.load_model(build_checkpoint("llama"))
    contiguous = infer.create_cache("contiguous", model.config, max_seq_len=8)
    assert graphed_decoder(model, contiguous) is None, "on the CPU the ordinary step runs"
    assert graphed_decoder(model, None) is None
    assert graphed_decoder(model, infer.create_cache("int8", model.config, max_seq_len=8)) is None
