"""The batched engine with quantized blocks (`Engine(kv_cache_dtype=...)`), as properties.

The contract: a request's K/V go through the pool exactly as through the single-request quantized cache with the same
layout (`QuantizedCache(key_scales="channel", residual_block=block_size, sink_tokens=block_size)`: keys one scale per
channel over each block of tokens (4-bit: around each channel's midpoint), values one per row (4-bit: rotated), a block
quantized in the step that fills it and exact until then, the first block exact throughout), whatever else is batched
with it, shares its prefix, preempts it or copies its blocks. A key is read quantized from the step in which its block
fills, so the reference replays the engine's chunks: token by token when the engine runs one token per step, the
engine's own chunk sizes for a lone request. Logits must then agree within fp32 rounding: a scale not copied on
copy-on-write, a block quantized a step late or read from stale staging shows up at once, where a lossy bound would
hide it (tests/test_quantized_pool.py holds the pool to the exact cache by the bounds).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import replace
from unittest import mock

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from infer.cache import quant
from infer.cache.paged_quantized import KV_CACHE_DTYPES, POOL_KEY_OFFSETS
from infer.cache.quantized import DEFAULT_ROTATE_VALUES, QuantizedCache
from infer.config import ModelConfig
from infer.engine import Engine
from infer.kernels import triton_available
from infer.kernels.native import native_kernels
from infer.models import Transformer
from infer.sampling import SamplingParams
from tests.helpers import TEST_DEVICE, assert_close, check_pool_invariants, random_model, solo_logits, tiny_config
from tests.property.strategies import model_configs

# How the decode steps of these CPU models read the pool: dequantizing gathers ("sdpa", "matmul"), one sequence at
# a time, or in place (the native kernel; the Triton one under its interpreter, TRITON_INTERPRET=1).
KERNELS = ["sdpa", "matmul", "per-sequence"] + (
    ["native"] if native_kernels() is not None and TEST_DEVICE == "cpu" else []) + (
    ["triton"] if triton_available(torch.device(TEST_DEVICE).type) else [])
# How a prompt chunk's tokens attend: each chunk by SDPA over its gathered keys, or every token a row of the native
# or Triton kernel's one call (Triton's on CUDA: interpreted, its rows cost ~100x; on the CPU its chunk rows are
# held to the pool's run by test_triton_chunk_rows_read_the_pool_as_the_quantized_cache below).
IN_PLACE_CHUNKS = [k for k in ("native", "triton") if k in KERNELS and (k != "triton" or TEST_DEVICE == "cuda")]
CHUNK_KERNELS = ["sdpa", *IN_PLACE_CHUNKS]


def chunks_with(decode_kernel: str) -> str:
    """The prompt chunks' attention beside `decode_kernel`: its rows in the in-place kernel's call where the decode
    rows are (named, not timed: the engine's "auto" would time it for every drawn model's head shape)."""
    return decode_kernel if decode_kernel in IN_PLACE_CHUNKS else "sdpa"


def quantized_solo_logits(model: Transformer, scheme: str, block_size: int, prompt: list[int], tokens: list[int],
                          chunks: Sequence[int] | None = None, noise: int | None = None) -> torch.Tensor:
    """Logits predicting each of `tokens` from a solo run over the single-request quantized cache with the pool's
    layout, fed `prompt + tokens` in `chunks` (default: one token at a time). `noise` (a seed): the quantizer's
    inputs, keys and values, carry fp32-level noise (a few units in their last place), as a batch's rounding does."""
    sequence = prompt + tokens[:-1]
    cache = QuantizedCache(model.config, max_seq_len=len(sequence), scheme=scheme, key_scales="channel",
                           residual_block=block_size, sink_tokens=block_size, residual_window=0,
                           key_offsets=POOL_KEY_OFFSETS[scheme], rotate_values=DEFAULT_ROTATE_VALUES[scheme],
                           device=model.embed_tokens.weight.device)
    keys_jittered: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if noise is not None:
        gen = torch.Generator().manual_seed(noise)

        def jitter(x: torch.Tensor) -> torch.Tensor:
            return x * (1 + 2.0**-21 * torch.randn(x.shape, generator=gen)).to(x.device, x.dtype)

        quantize_values, quantize_keys = cache._quantize, quant.quantize_channels
        cache._quantize = lambda x: quantize_values(jitter(x))  # type: ignore[method-assign]
        keys_jittered = mock.patch.object(quant, "quantize_channels",
                                          lambda x, *args: quantize_keys(jitter(x), *args))
    sizes = list(chunks) if chunks is not None else [1] * len(sequence)
    sizes += [1] * (len(sequence) - sum(sizes))
    rows, start = [], 0
    with torch.inference_mode(), keys_jittered:
        for n in sizes:
            ids = torch.tensor([sequence[start : start + n]], device=cache.k_data.device)
            out = model(ids, cache)[0, -1]
            start += n
            if start >= len(prompt):
                rows.append(out)
    return torch.stack(rows)


def check_against_solo(engine: Engine, model: Transformer, scheme: str, block_size: int,
                       prompts: list[list[int]], ids: list[int], chunks: Sequence[int] | None = None) -> None:
    """Each request's logits are its solo quantized run's. Quantization is a step function: where the batch's
    fp32 rounding moves a key across a rounding boundary one code differs by one step, so the tolerance is fp32
    rounding plus 10% of what quantizing did to the logits (a wrong scale, a stale or unquantized block, moves
    them by about all of it)."""
    for i, (prompt, rid) in enumerate(zip(prompts, ids, strict=True)):
        result = engine.result(rid)
        assert result.logits is not None
        expected = quantized_solo_logits(model, scheme, block_size, prompt, result.token_ids, chunks)
        exact = solo_logits(model, prompt, result.token_ids)
        lossy = (expected - exact).abs().max().item()
        # 10%: one int8 code a step off (a key on a rounding boundary) moved a logit by 4.4% of what quantizing did
        # at head_dim 4, and by 6.1% at Gemma's head_dim 6 with a window of 3 (Hypothesis found both; in the
        # second the exact pool's run is its solo run's to 1.1e-6, the int8 one's parts from the step a block is
        # quantized on); a missing scale or a stale block moves it by about all of it.
        bound = 1e-5 * max(1.0, expected.abs().max().item()) + 0.10 * lossy
        if (result.logits - expected).abs().max().item() > bound:
            # A key's channel scale one bf16 step apart moves a whole channel of a block: at blocks of 2 keys
            # (where int8 codes are all but exact) Hypothesis found it at 42% of what quantizing did, the batch's
            # keys 2.4e-7 from the solo run's. So past the bound, the solo run's own spread under fp32-level noise
            # at its quantizer's inputs (16 draws) is allowed too; a bug's error stays far outside it.
            spread = max((quantized_solo_logits(model, scheme, block_size, prompt, result.token_ids, chunks,
                                                noise=seed) - expected).abs().max().item() for seed in range(16))
            bound += 2 * spread
        assert_close(result.logits, expected, bound, f"request {i} ({scheme}, block {block_size})")


def even_head_dim(config: ModelConfig) -> ModelConfig:
    """The 4-bit schemes pack two values per byte (the pool refuses an odd head_dim, tests/test_quantized_pool.py)."""
    return replace(config, head_dim=config.head_dim + config.head_dim % 2)


@st.composite
def token_by_token_workloads(draw: st.DrawFn, config: ModelConfig) -> dict:
    """Requests that share prefixes (some whole prompts: a cached last block is recomputed into), arrive at
    different steps, in a pool that may force preemption; one token per step."""
    shared = draw(st.lists(st.integers(0, config.vocab_size - 1), min_size=0, max_size=9))
    prompts = []
    for _ in range(draw(st.integers(1, 4))):
        tail = draw(st.lists(st.integers(0, config.vocab_size - 1), min_size=0, max_size=5))
        prompts.append((shared + tail) or [0])
    block_size = draw(st.integers(1, 4))
    new = draw(st.integers(1, 6))
    longest = max(len(p) for p in prompts) + new
    min_blocks = -(-longest // block_size) + 1
    return {"prompts": prompts, "block_size": block_size, "new": new,
            "arrivals": [draw(st.integers(0, 3)) for _ in prompts],
            "num_blocks": draw(st.integers(min_blocks, min_blocks + 4)),
            "max_num_seqs": draw(st.integers(1, 4)),
            "scheme": draw(st.sampled_from(KV_CACHE_DTYPES))}


@given(data=st.data(), config=model_configs(), seed=st.integers(0, 999), graphs=st.booleans(),
       torch_quantizer=st.booleans())
def test_one_token_per_step_equals_the_quantized_cache(data: st.DataObject, config: ModelConfig, seed: int,
                                                       graphs: bool, torch_quantizer: bool) -> None:
    """Prefix sharing, copy-on-write, preemption with recompute and interleaving: each request's logits are its
    token-by-token run over the single-request quantized cache; with `graphs`, the decode steps padded to a graph's
    static shapes and plan (run eagerly here: replayed on CUDA, tests/test_gpu.py). The pool's filled blocks
    quantized natively where the build allows, or (`torch_quantizer`: INFER_NATIVE_QUANTIZE=0) by its torch code,
    which a GPU runs."""
    config = even_head_dim(config)
    model = random_model(config, seed=seed)
    w = data.draw(token_by_token_workloads(config))
    with mock.patch.dict("os.environ", {"INFER_NATIVE_QUANTIZE": "0" if torch_quantizer else "1"}):
        engine = Engine(model, None, num_blocks=w["num_blocks"], block_size=w["block_size"],
                        max_num_seqs=w["max_num_seqs"], max_num_batched_tokens=1, keep_logits=True,
                        kv_cache_dtype=w["scheme"], bound_sliding_layers=False, decode_attention="sdpa",
                        decode_graphs=graphs)
    if torch_quantizer:
        assert engine.pool.quantizer is None
    params = SamplingParams(max_new_tokens=w["new"], temperature=0.0)
    ids: dict[int, int] = {}
    step = 0
    while step < 1000 and (step <= 3 or engine.has_unfinished()):
        for i, arrival in enumerate(w["arrivals"]):
            if arrival == step:
                ids[i] = engine.add_request(w["prompts"][i], params)
        engine.step()
        check_pool_invariants(engine.pool.manager)
        step += 1
    assert not engine.has_unfinished()
    event(f"preempted: {engine.stats.preemptions > 0}")
    event(f"padded decode steps: {engine.stats.graph_steps > 0}")
    event(f"prefix hits: {engine.stats.prefix_hit_tokens > 0}")
    check_against_solo(engine, model, w["scheme"], w["block_size"], w["prompts"], [ids[i] for i in range(len(ids))])


@given(config=model_configs(), seed=st.integers(0, 999), scheme=st.sampled_from(KV_CACHE_DTYPES),
       block_size=st.integers(1, 5), n=st.integers(2, 5), new=st.integers(1, 12),
       kernel=st.sampled_from(KERNELS), graphs=st.booleans(), spread=st.integers(0, 2))
def test_batched_decode_steps_equal_the_quantized_cache(config: ModelConfig, seed: int, scheme: str, block_size: int,
                                                        n: int, new: int, kernel: str, graphs: bool,
                                                        spread: int) -> None:
    """One-token prompts, so every step is a batch of one-token chunks read by one padded gather of codes and
    staging, in place by a kernel, or one sequence at a time: each request is its token-by-token quantized run.
    With `graphs`, each step padded to a graph's batch bucket (requests ending `spread` tokens apart leave batches
    of every size), its plan too: padding rows write, zero and quantize only the spare slot and block."""
    if graphs and kernel == "per-sequence":
        kernel = "sdpa"  # a padded step attends in one call
    config = even_head_dim(config)
    model = random_model(config, seed=seed)
    prompts = [[(7 * i + 3) % config.vocab_size] for i in range(n)]
    news = [new + spread * i for i in range(n)]
    engine = Engine(model, None, num_blocks=sum(-(-(m + 1) // block_size) for m in news), block_size=block_size,
                    max_num_seqs=n, max_num_batched_tokens=n, keep_logits=True, kv_cache_dtype=scheme,
                    bound_sliding_layers=False, decode_attention=kernel, chunk_attention=chunks_with(kernel),
                    decode_graphs=graphs)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=m, temperature=0.0))
           for p, m in zip(prompts, news, strict=True)]
    while engine.has_unfinished():
        engine.step()
    assert (engine.stats.graph_steps > 0) == graphs
    check_against_solo(engine, model, scheme, block_size, prompts, ids)


@given(config=model_configs(), seed=st.integers(0, 999), scheme=st.sampled_from(KV_CACHE_DTYPES),
       block_size=st.integers(1, 6), budget=st.integers(2, 9), length=st.integers(2, 20), new=st.integers(1, 6),
       chunk_attention=st.sampled_from(CHUNK_KERNELS))
def test_chunked_prefill_equals_the_quantized_cache_fed_the_same_chunks(
        config: ModelConfig, seed: int, scheme: str, block_size: int, budget: int, length: int, new: int,
        chunk_attention: str) -> None:
    """A lone request prefilled in chunks of the token budget: multi-token writes fill blocks mid-step, and its
    logits are the quantized cache's fed the same chunks; its chunks attending each by SDPA over gathered codes and
    staging, or every token a row of the native or Triton kernel's one call over the pool in place."""
    config = even_head_dim(config)
    model = random_model(config, seed=seed)
    prompt = [(5 * i + 1) % config.vocab_size for i in range(length)]
    engine = Engine(model, None, num_blocks=-(-(length + new) // block_size) + 1, block_size=block_size,
                    max_num_seqs=1, max_num_batched_tokens=budget, keep_logits=True, kv_cache_dtype=scheme,
                    bound_sliding_layers=False, chunk_attention=chunk_attention,
                    decode_attention=chunk_attention if chunk_attention != "sdpa" else "auto")
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=new, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    chunks = [budget] * (length // budget) + ([length % budget] if length % budget else [])
    check_against_solo(engine, model, scheme, block_size, [prompt], [rid], chunks)


@given(config=model_configs(), seed=st.integers(0, 999), scheme=st.sampled_from(KV_CACHE_DTYPES),
       block_size=st.integers(2, 4), blocks=st.integers(1, 3), followers=st.integers(1, 3), new=st.integers(2, 8),
       kernel=st.sampled_from(KERNELS))
def test_copy_on_write_of_a_quantized_block_keeps_its_codes_and_scales(
        config: ModelConfig, seed: int, scheme: str, block_size: int, blocks: int, followers: int, new: int,
        kernel: str) -> None:
    """A prompt of whole blocks, prefilled in one chunk, then asked again while it runs: the followers hit every
    block but recompute the last token, whose write into a copy of the shared last block must leave the
    copied codes and scales as they were. Every request is the quantized cache fed the prompt in one chunk, then
    one token at a time."""
    config = even_head_dim(config)
    model = random_model(config, seed=seed)
    prompt = [(3 * i + 2) % config.vocab_size for i in range(blocks * block_size)]
    engine = Engine(model, None, num_blocks=(followers + 1) * (blocks + -(-new // block_size) + 1),
                    block_size=block_size, max_num_seqs=followers + 1, max_num_batched_tokens=len(prompt) + followers,
                    keep_logits=True, kv_cache_dtype=scheme, bound_sliding_layers=False, decode_attention=kernel,
                    chunk_attention=chunks_with(kernel))
    params = SamplingParams(max_new_tokens=new, temperature=0.0)
    copied: list[object] = []
    copy_blocks = engine.pool.copy_blocks
    engine.pool.copy_blocks = lambda copies: (copied.extend(copies), copy_blocks(copies))[1]  # type: ignore
    ids = [engine.add_request(prompt, params)]
    engine.step()
    ids += [engine.add_request(prompt, params) for _ in range(followers)]
    while engine.has_unfinished():
        engine.step()
    assert len(copied) == followers, "each follower copies the shared last block once"
    assert all(engine.result(rid).num_prefix_hit_tokens == len(prompt) - 1 for rid in ids[1:])
    check_against_solo(engine, model, scheme, block_size, [prompt] * len(ids), ids, [len(prompt)])


@given(data=st.data(), seed=st.integers(0, 999))
def test_staging_sized_for_the_engine_never_runs_out(data: st.DataObject, seed: int) -> None:
    """Many requests with their own first blocks (each a sink held exact) and shared ones, prefilled in chunks the
    token budget cuts mid-block, arriving over time, in pools small enough to preempt: the staging the engine sizes
    (`staging_for`) is always enough, and between steps every running request holds at most two staged blocks
    (its sink and its partly filled block) besides the sinks only the prefix cache keeps."""
    config = even_head_dim(data.draw(model_configs()))
    model = random_model(config, seed=seed)
    block_size = data.draw(st.integers(1, 4))
    shared = data.draw(st.lists(st.integers(0, config.vocab_size - 1), max_size=2 * block_size))
    prompts = [shared + data.draw(st.lists(st.integers(0, config.vocab_size - 1), min_size=1, max_size=20))
               for _ in range(data.draw(st.integers(2, 8)))]
    arrivals = [data.draw(st.integers(0, 6)) for _ in prompts]
    new = data.draw(st.integers(1, 5))
    longest = max(len(p) for p in prompts) + new
    engine = Engine(model, None, num_blocks=data.draw(st.integers(-(-longest // block_size) + 1, 40)),
                    block_size=block_size, max_num_seqs=data.draw(st.integers(1, 4)),
                    max_num_batched_tokens=data.draw(st.integers(2, 9)), kv_cache_dtype=data.draw(
                        st.sampled_from(KV_CACHE_DTYPES)), bound_sliding_layers=False, decode_attention="sdpa")
    pool, params = engine.pool, SamplingParams(max_new_tokens=new, temperature=0.0)
    ids = []
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        ids += [engine.add_request(p, params) for p, a in zip(prompts, arrivals, strict=True) if a == step]
        engine.step()  # raises CacheFullError if staging ran out
        manager = pool.manager
        pool.release_unheld()  # as the next step's plan does first (a newer identical block may have won the entry)
        held = {b for s in manager.seq_ids for b in manager.block_table(s)}
        assert len(set(pool.staged_blocks) & held) <= 2 * len(manager.seq_ids)
        assert all(manager.is_cached(b) for b in set(pool.staged_blocks) - held), "a stale block kept its slot"
        step += 1
    assert all(engine.result(i).finish_reason == "length" for i in ids)


@pytest.mark.skipif("triton" not in KERNELS, reason="needs Triton, and CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("scheme", KV_CACHE_DTYPES)
def test_the_triton_kernel_reads_the_pool_as_the_quantized_cache(arch: str, scheme: str) -> None:
    """Decode steps read in place by the Triton kernel (codes, the first block staged as a sink, blocks filling and
    quantized while the requests run; Gemma's sliding layers in the pool, so the kernel applies the window): each
    request is its token-by-token quantized run, as through the gathers."""
    config = tiny_config(arch, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=32,
                         vocab_size=64, sliding_window=5)
    model = random_model(config, seed=5)
    prompts = [[(7 * i + 3) % 64] for i in range(3)]
    engine = Engine(model, None, num_blocks=3 * 5, block_size=4, max_num_seqs=3, max_num_batched_tokens=3,
                    keep_logits=True, kv_cache_dtype=scheme, bound_sliding_layers=False, decode_attention="triton")
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=10, temperature=0.0)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    check_against_solo(engine, model, scheme, 4, prompts, ids)


@pytest.mark.skipif("triton" not in KERNELS, reason="needs Triton, and CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("scheme", KV_CACHE_DTYPES)
def test_triton_chunk_rows_read_the_pool_as_the_quantized_cache(scheme: str) -> None:
    """A lone request prefilled in chunks of 4 tokens whose every token is a row of the Triton kernel's one call
    (chunk_attention="triton": blocks filling and quantized mid-chunk, the first block a staged sink, later chunks
    reading earlier chunks' codes): its logits are the quantized cache's fed the same chunks."""
    config = tiny_config("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=32,
                         vocab_size=64)
    model = random_model(config, seed=6)
    prompt = [(5 * i + 1) % 64 for i in range(11)]
    engine = Engine(model, None, num_blocks=8, block_size=4, max_num_seqs=1, max_num_batched_tokens=4,
                    keep_logits=True, kv_cache_dtype=scheme, bound_sliding_layers=False, decode_attention="triton",
                    chunk_attention="triton")
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=5, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    check_against_solo(engine, model, scheme, 4, [prompt], [rid], [4, 4, 3])
