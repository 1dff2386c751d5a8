"""asv benchmarks: decode-step latency by context x cache kind x architecture (every one in infer.families),
prefill latency, peak memory of a generation, decode tokens/s, cache bytes, the batched engine greedy and
sampling, and the native packed product at a few rows on bf16, int8 and int4 weights.

Models are built in-process from a seeded `ModelConfig` (no checkpoint, no transformers): mid-sized
so one commit's full run stays under 20 minutes on 2 CPU cores. Every decode sample starts from the
same prefilled cache (restored from a snapshot in `setup`, outside the timing), so a sample measures
exactly one step at exactly `context` tokens.
"""

from __future__ import annotations

import functools

import torch

import infer
from infer.bench_batched import Sampling, batched_workload, run_engine
from infer.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, RopeConfig
from infer.families import ARCHITECTURES, FAMILIES
from infer.generation import generate
from infer.quant_weights import PackedCodes
from infer.sampling import SamplingParams

KINDS = ["contiguous", "sliding", "paged", "int8", "int4", "fp4"]
CONTEXTS = [128, 1024, 4096]


def bench_config(model_type: str) -> ModelConfig:
    """A ~20M-parameter model of the architecture: big enough that the matmuls dominate Python. The family's
    traits decide the layout (Gemma 3's period of sliding layers, its RoPE base on them, activation, query
    scale); the head is tied except for Llama, as in the 1B-class models the README measures."""
    family = FAMILIES[model_type]
    periodic = family.sliding_layers == "period"
    layers = 6
    layer_types = tuple(SLIDING_ATTENTION if periodic and (i + 1) % 3 else FULL_ATTENTION for i in range(layers))
    return ModelConfig(
        model_type=model_type, vocab_size=8192, hidden_size=512, intermediate_size=1536,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=8192, tie_word_embeddings=model_type != "llama",
        hidden_act=family.hidden_act, layer_types=layer_types,
        sliding_window=256 if periodic else None, rope=RopeConfig(theta=500000.0),
        rope_local=RopeConfig(theta=10000.0) if family.local_rope_theta is not None else None,
        query_pre_attn_scalar=64.0 if family.query_pre_attn_scalar is not None else None,
    )


@functools.cache
def bench_model(model_type: str) -> infer.Transformer:
    gen = torch.Generator().manual_seed(0)
    model = infer.Transformer(bench_config(model_type))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model.eval().requires_grad_(False)


def prompt(n: int) -> torch.Tensor:
    return torch.randint(0, 8192, (1, n), generator=torch.Generator().manual_seed(n))


@functools.cache
def prefilled(arch: str, kind: str, context: int) -> tuple[infer.KVCache, infer.cache.CacheSnapshot]:
    """A cache of `kind` with `context` tokens prefilled, and a snapshot to reset it to."""
    model = bench_model(arch)
    cache = infer.create_cache(kind, model.config, max_seq_len=context + 1)
    with torch.inference_mode():
        model(prompt(context), cache)
    return cache, cache.snapshot()


class DecodeStep:
    """One decode step at a fixed context length."""

    params = (ARCHITECTURES, KINDS, CONTEXTS)
    param_names = ["architecture", "cache", "context"]
    number = 1
    repeat = (5, 20, 10.0)
    timeout = 300

    def setup(self, arch: str, kind: str, context: int) -> None:
        self.model = bench_model(arch)
        self.cache, snapshot = prefilled(arch, kind, context)
        self.cache.restore(snapshot)
        self.token = torch.tensor([[7]])

    def time_decode_step(self, arch: str, kind: str, context: int) -> None:
        with torch.inference_mode():
            self.model(self.token, self.cache)


class Prefill:
    """Prefill of a prompt into an empty contiguous cache."""

    params = (ARCHITECTURES, [128, 1024])
    param_names = ["architecture", "prompt_len"]
    number = 1
    repeat = (3, 10, 20.0)
    timeout = 300

    def setup(self, arch: str, prompt_len: int) -> None:
        self.model = bench_model(arch)
        self.ids = prompt(prompt_len)
        self.cache = infer.create_cache("contiguous", self.model.config, max_seq_len=prompt_len)

    def time_prefill(self, arch: str, prompt_len: int) -> None:
        self.cache.reset()
        with torch.inference_mode():
            self.model(self.ids, self.cache)


class Generation:
    """A whole generation: its peak memory, and its decode rate as a tracked figure."""

    params = (ARCHITECTURES, KINDS)
    param_names = ["architecture", "cache"]
    timeout = 300

    def setup(self, arch: str, kind: str) -> None:
        self.model = bench_model(arch)
        self.params = SamplingParams(max_new_tokens=32, ignore_eos=True)
        self.prompt = prompt(256)[0].tolist()

    def peakmem_generate(self, arch: str, kind: str) -> None:
        generate(self.model, None, self.prompt, self.params, cache=kind)

    def track_decode_tokens_per_s(self, arch: str, kind: str) -> float:
        generate(self.model, None, self.prompt, self.params, cache=kind)  # warm-up
        return generate(self.model, None, self.prompt, self.params, cache=kind).decode_tokens_per_s

    track_decode_tokens_per_s.unit = "tokens/s"  # type: ignore[attr-defined]


class CacheMemory:
    """Bytes the cache holds for a context, per kind (deterministic: a regression is a real change)."""

    # The bytes depend only on the layer layout: one family without sliding layers and one with them.
    params = (["llama", "gemma3_text"], KINDS, CONTEXTS)
    param_names = ["architecture", "cache", "context"]

    def track_cache_bytes(self, arch: str, kind: str, context: int) -> int:
        cache = infer.create_cache(kind, bench_config(arch), max_seq_len=context, dtype=torch.bfloat16)
        return cache.memory_bytes

    track_cache_bytes.unit = "bytes"  # type: ignore[attr-defined]

    def peakmem_cache_filled(self, arch: str, kind: str, context: int) -> None:
        """Peak memory of a bf16 cache filled with `context` positions: differs by kind (no model is loaded
        here, and every position is written, so the cache's pages are all resident)."""
        config = bench_config(arch)
        cache = infer.create_cache(kind, config, max_seq_len=context, dtype=torch.bfloat16)
        chunk = min(context, 128)  # small writes: the temporaries of quantizing stay small beside the cache
        k = torch.ones(1, config.num_key_value_heads, chunk, config.head_dim, dtype=torch.bfloat16)
        for _ in range(context // chunk):
            for layer in range(config.num_hidden_layers):
                cache.update(layer, k, k)
            cache.advance(chunk)


SAMPLINGS = {"greedy": Sampling(), "top-p": Sampling(temperature=0.8, top_p=0.9)}


class BatchedEngine:
    """A mixed workload through the batched engine (16 requests, prompts 16-128 tokens, 8-32 new tokens,
    greedy or sampled with top-p, all arriving at once): wall time, and generated tokens/s as a tracked figure."""

    params = [ARCHITECTURES, list(SAMPLINGS)]
    param_names = ["architecture", "sampling"]
    number = 1
    repeat = (2, 5, 60.0)
    timeout = 600

    def setup(self, arch: str, sampling: str) -> None:
        self.model = bench_model(arch)
        self.work = batched_workload(8192, num_requests=16, prompt_lens=(16, 128), new_tokens=(8, 32),
                                     sampling=SAMPLINGS[sampling])

    def time_engine(self, arch: str, sampling: str) -> None:
        run_engine(self.model, self.work)

    def track_engine_tokens_per_s(self, arch: str, sampling: str) -> float:
        run_engine(self.model, self.work[:2])  # warm-up
        run = run_engine(self.model, self.work)
        return run.new_tokens / run.wall_s

    track_engine_tokens_per_s.unit = "tokens/s"  # type: ignore[attr-defined]


@functools.cache
def bf16_model(arch: str, form: str) -> infer.Transformer:
    """The bench model in bf16 on huge pages (as the loader places weights) with one decode GEMV form; "native"
    with the native small ops layer by layer, "native-no-ops" without them, "native-step" every layer in one
    native call (infer/models/native_step.py)."""
    from infer.memory import on_huge_pages

    model = infer.Transformer(bench_config(arch))
    source = bench_model(arch).state_dict()
    model.load_state_dict({k: on_huge_pages(v.to(torch.bfloat16)) for k, v in source.items()}, assign=True)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.huge_pages = True
    model.decode_gemv = form.removesuffix("-no-ops").removesuffix("-step")
    model.native_ops = form in ("native", "native-step")
    model.native_step = form == "native-step"
    return model.eval().requires_grad_(False)


@functools.cache
def prefilled_bf16(arch: str, form: str) -> tuple[infer.KVCache, infer.cache.CacheSnapshot]:
    model = bf16_model(arch, form)
    cache = infer.create_cache("contiguous", model.config, max_seq_len=1025, dtype=torch.bfloat16)
    with torch.inference_mode():
        model(prompt(1024), cache)
    return cache, cache.snapshot()


class DecodeForm:
    """A bf16 decode step at context 1024 by one-row product form: ATen's `F.linear` (the unoptimised
    path) and `torch.mv`, the native GEMV with and without the native small ops, and the whole step in one native
    call. Skipped where no native build loads."""

    # Two families keep the run short: the plain block and the one with the most small ops (Gemma's norms).
    params = (["llama", "gemma3_text"], ["linear", "mv", "native-no-ops", "native", "native-step"])
    param_names = ["architecture", "form"]
    number = 1
    repeat = (5, 20, 10.0)
    timeout = 300

    def setup(self, arch: str, form: str) -> None:
        from infer.kernels.native import native_kernels

        if form.startswith("native") and native_kernels() is None:
            raise NotImplementedError("no native build on this machine")
        self.model = bf16_model(arch, form)
        self.cache, snapshot = prefilled_bf16(arch, form)
        self.cache.restore(snapshot)  # each sample: one step at exactly 1024 tokens
        self.token = torch.tensor([[7]])

    def time_decode_step(self, arch: str, form: str) -> None:
        with torch.inference_mode():
            self.model(self.token, self.cache)


@functools.cache
def packed_weight(weights: str) -> torch.Tensor | PackedCodes:
    """A 3072 x 768 weight (the 150M Llama's gate and up shape), packed for the native packed product: bf16, or
    int8 / int4 codes in this build's form."""
    from infer.kernels.native import native_kernels
    from infer.quant_weights import quantize

    kernels = native_kernels()
    assert kernels is not None
    w = (torch.randn(3072, 768, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    return kernels.pack(w) if weights == "bf16" else kernels.pack_codes(quantize(w, weights))


class PackedProducts:
    """The batched engine's product at a decode step's few rows (as many as requests): the native packed product
    on a 3072 x 768 weight in bf16, int8 codes and int4 codes (dequantized in the tile up to 8 rows on AVX512-BF16,
    into a buffer past them). Skipped where the build has no packed product."""

    params = (["bf16", "int8", "int4"], [2, 8, 16])
    param_names = ["weights", "rows"]
    number = 20
    repeat = (5, 20, 10.0)
    timeout = 120

    def setup(self, weights: str, rows: int) -> None:
        from infer.kernels.native import native_kernels

        kernels = native_kernels()
        if kernels is None or not kernels.packed_bf16_available or (
                weights != "bf16" and not kernels.packed_codes_available):
            raise NotImplementedError("no native packed product on this machine")
        self.kernels, self.packed = kernels, packed_weight(weights)
        self.x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)

    def time_product(self, weights: str, rows: int) -> None:
        if isinstance(self.packed, torch.Tensor):
            self.kernels.gemm_packed(self.packed, self.x, 3072)
        else:
            self.kernels.quantized_gemm_packed(self.packed, self.x)
