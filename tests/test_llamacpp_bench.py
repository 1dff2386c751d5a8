"""llama.cpp as a bench contender: the GGUF conversion keeps every weight and the config (checked by reading
the file back), and llama.cpp on the converted file generates the engine's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import infer
from infer.config import ModelConfig
from infer.sampling import SamplingParams
from reference import build_checkpoint

gguf = pytest.importorskip("gguf")
from reference.gguf_convert import hf_to_gguf, permute_for_rope, tensor_reader, unpermute_for_rope  # noqa: E402


def test_rope_permutation_interleaves_each_heads_halves_and_inverts() -> None:
    heads, dim, width = 3, 8, 5
    w = np.arange(heads * dim * width, dtype=np.float32).reshape(heads * dim, width)
    p = permute_for_rope(w, heads)
    for h in range(heads):
        for i in range(dim // 2):  # HF pairs (i, i + dim/2) of a head become llama.cpp's (2i, 2i+1)
            assert (p[h * dim + 2 * i] == w[h * dim + i]).all()
            assert (p[h * dim + 2 * i + 1] == w[h * dim + i + dim // 2]).all()
    assert (unpermute_for_rope(p, heads) == w).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conversion_keeps_every_weight_and_the_config(tmp_path: Path, dtype: torch.dtype) -> None:
    path = build_checkpoint("llama")
    config = ModelConfig.from_file(path)
    reader = gguf.GGUFReader(str(hf_to_gguf(path, tmp_path / "m.gguf", dtype)))
    fields = {name: f.contents() for name, f in reader.fields.items()}
    assert fields["general.architecture"] == "llama"
    assert fields["llama.block_count"] == config.num_hidden_layers
    assert fields["llama.attention.head_count"] == config.num_attention_heads
    assert fields["llama.attention.head_count_kv"] == config.num_key_value_heads
    assert fields["llama.rope.freq_base"] == pytest.approx(config.rope.theta)
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(config.rms_norm_eps)
    assert len(fields["tokenizer.ggml.tokens"]) == config.vocab_size
    tensors = {t.name: t for t in reader.tensors}
    weights = tensor_reader(path)
    kind = "F32" if dtype == torch.float32 else "BF16"
    q = tensors["blk.0.attn_q.weight"]
    assert q.tensor_type.name == kind and tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    if dtype == torch.float32:
        hf_q = weights("model.layers.0.self_attn.q_proj.weight").numpy()
        got = unpermute_for_rope(np.asarray(q.data).reshape(hf_q.shape), config.num_attention_heads)
        assert (got == hf_q).all()
        down = weights(f"model.layers.{config.num_hidden_layers - 1}.mlp.down_proj.weight").numpy()
        assert (np.asarray(tensors[f"blk.{config.num_hidden_layers - 1}.ffn_down.weight"].data).reshape(down.shape)
                == down).all()
    expected = 2 + 9 * config.num_hidden_layers + (0 if config.tie_word_embeddings else 1)
    assert len(tensors) - ("rope_freqs.weight" in tensors) == expected


def test_what_a_gguf_cannot_carry_is_refused(tmp_path: Path) -> None:
    # llama.cpp derives Gemma 3's query scale from its head size; the tiny checkpoint's differs.
    with pytest.raises(ValueError, match="query_pre_attn_scalar=32: llama.cpp derives it"):
        hf_to_gguf(build_checkpoint("gemma3_text"), tmp_path / "g.gguf")
    with pytest.raises(ValueError, match="dtype must be one of"):
        hf_to_gguf(build_checkpoint("llama"), tmp_path / "l.gguf", "Q2_K")


def test_llamacpp_generates_the_engines_greedy_tokens(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    from reference.llamacpp_bench import llamacpp_contenders, next_token

    path = build_checkpoint("llama")
    prompt = [5, 17, 33, 2, 9, 41]
    model = infer.load_model(path)
    expected = infer.generate(model, None, prompt, SamplingParams(max_new_tokens=8, temperature=0.0,
                                                                   ignore_eos=True)).token_ids
    (contender,) = llamacpp_contenders(path, torch.float32, torch.device("cpu"), prompt, 8)
    trial = contender.run()
    assert len(trial.step_times_s) == 7 and trial.ttft_s > 0
    from llama_cpp import Llama

    from reference.gguf_convert import cached_gguf

    llm = Llama(model_path=str(cached_gguf(path, torch.float32)), n_ctx=32, verbose=False)
    llm.eval(prompt)
    tokens = []
    for _ in range(8):
        tokens.append(next_token(llm))
        llm.eval([tokens[-1]])
    assert tokens == expected


@pytest.mark.real_model
def test_llamacpp_teacher_forced_logits_line_up_with_ours() -> None:
    """reference/llamacpp_quality.py reads llama.cpp's logits position by position: on the real model with its
    exact (f16) cache they predict the tokens ours predict (an off-by-one would agree at chance)."""
    pytest.importorskip("llama_cpp")
    from infer.model_store import default_model_path
    from infer.quality import load_text, teacher_forced_logits, text_ids
    from reference.llamacpp_quality import llamacpp_logits

    path = default_model_path()
    ids = text_ids(infer.Tokenizer(path), load_text("prose"), 64)
    theirs = llamacpp_logits(path, ids, 16, "f16", threads=1)
    ours, _ = teacher_forced_logits(infer.load_model(path), "contiguous", ids, 16)
    assert theirs.shape == ours.shape
    assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("unified", [False, True])
def test_llamacpp_continuous_batching_generates_each_requests_solo_tokens(unified: bool) -> None:
    """The batched contender drives llama.cpp's sequences as llama-server does: 7 requests over 3 sequences (each
    freed sequence cleared and taken by the next request), prompts of 1-40 tokens fed 12 tokens a call beside the
    running requests' last tokens, each sequence its own cache or all of them one. Every request's greedy tokens
    equal the engine's solo run's on the same fp32 weights (a sequence's positions, its cleared cache or a misread
    logits row would part them)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from infer.bench_batched import BatchRequest
    from reference.gguf_convert import cached_gguf
    from reference.llamacpp_bench import llamacpp_continuous_batching

    path = build_checkpoint("llama")
    rng = np.random.default_rng(3)
    work = [BatchRequest([int(t) for t in rng.integers(1, 300, n)], m)
            for n, m in [(6, 5), (1, 3), (40, 4), (13, 1), (25, 6), (2, 2), (17, 3)]]
    model = infer.load_model(path)
    expected = [infer.generate(model, None, r.prompt_ids, SamplingParams(
        max_new_tokens=r.max_new_tokens, temperature=0.0, ignore_eos=True)).token_ids for r in work]
    llama_cpp.llama_backend_init()
    loaded = llama_cpp.llama_model_load_from_file(str(cached_gguf(path, torch.float32)).encode(),
                                                  llama_cpp.llama_model_default_params())
    try:
        run, tokens = llamacpp_continuous_batching(llama_cpp, loaded, work, threads=1, parallel=3, budget=12,
                                                   unified=unified)
    finally:
        llama_cpp.llama_model_free(loaded)
    assert tokens == expected
    assert run.new_tokens == sum(r.max_new_tokens for r in work)
    assert all(0 < first <= last <= run.wall_s for first, last in zip(run.ttft_s, run.latency_s, strict=True))


def test_the_batched_contender_refuses_a_sampled_workload_before_touching_llama_cpp() -> None:
    """llama.cpp's batched run picks greedily: a workload that samples gets one clear error naming the setting, raised
    before any context is made (llama_cpp itself is not needed to see it)."""
    from infer.bench_batched import BatchRequest, Sampling
    from reference.llamacpp_bench import llamacpp_continuous_batching

    work = [BatchRequest([1, 2, 3], 4), BatchRequest([4, 5], 2, Sampling(temperature=0.8))]
    with pytest.raises(ValueError, match="greedy workloads only; drop --temperature"):
        llamacpp_continuous_batching(None, None, work, threads=1)
