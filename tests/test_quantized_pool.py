"""The engine's pool with quantized blocks (`Engine(kv_cache_dtype="int8" | "int4" | "fp4")`) against the exact
cache: each request's logits within the kind's registered error bounds of its exact solo run, on the random-weight
models (every architecture, Gemma 3's sliding layers in their exact rings, prefix sharing, chunked prefill,
preemption) and on the real model; tokens equal wherever the exact run's margin exceeds twice the bound; how many
more blocks the same memory holds; refusals; a step that raises leaves the pool as it was.
(tests/property/test_quantized_pool_properties.py holds the pool to the single-request quantized cache exactly.)"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import pytest
import torch

import infer
from infer.cache import CACHE_KINDS, ErrorBounds
from infer.cache.paged_quantized import KV_CACHE_DTYPES, POOL_KEY_OFFSETS
from infer.engine import Engine
from infer.families import ARCHITECTURES
from infer.models import Transformer
from infer.quality import one_pass_logits
from infer.sampling import SamplingParams
from tests.helpers import random_model, solo_logits, tiny_config


def check_within_bounds(engine: Engine, model: Transformer, prompts: list[list[int]], ids: list[int],
                        bounds: ErrorBounds) -> None:
    """Each request's logits against its exact solo run, teacher-forced on the request's own tokens: max error
    within the bound, top-1 agreement and mean KL (pooled) within the bound's, and every token the exact argmax
    wherever the exact run's top-2 margin is wider than twice the bound."""
    agree, total, kl = 0, 0, 0.0
    for i, (prompt, rid) in enumerate(zip(prompts, ids, strict=True)):
        result = engine.result(rid)
        assert result.finish_reason == "length", f"request {i}: {result.error}"
        assert result.logits is not None
        exact = (one_pass_logits(model, prompt + result.token_ids, len(prompt))[0] if model.dtype == torch.float32
                 else solo_logits(model, prompt, result.token_ids).float().cpu())  # (fp32: one pass, to rounding)
        lossy = result.logits.float()
        worst = (lossy - exact).abs().max().item()
        assert worst <= bounds.max_logit_error, f"request {i}: logit error {worst:.3f} > {bounds.max_logit_error}"
        top2 = exact.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * bounds.max_logit_error
        tokens = torch.tensor(result.token_ids)
        assert torch.equal(tokens[clear], exact.argmax(-1)[clear]), f"request {i}: a token differs at a clear margin"
        agree += int((lossy.argmax(-1) == exact.argmax(-1)).sum())
        total += len(tokens)
        kl += (exact.softmax(-1) * (exact.log_softmax(-1) - lossy.log_softmax(-1))).sum().item()
    assert agree / total >= bounds.min_top1_agreement, f"top-1 agreement {agree / total:.3f}"
    assert kl / total <= bounds.max_mean_kl, f"mean KL {kl / total:.2e} > {bounds.max_mean_kl:.2e}"


@pytest.mark.parametrize("scheme", KV_CACHE_DTYPES)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_request_stays_within_the_kinds_bounds_of_its_exact_run(arch: str, scheme: str) -> None:
    """Shared prefixes, chunked prefill (8-token budget), a pool small enough to preempt, the engine's default
    rings for Gemma 3's sliding layers."""
    config = tiny_config(arch, num_layers=3, head_dim=16, hidden_size=32, vocab_size=64, sliding_window=6)
    model = random_model(config, seed=3)
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 64, (9,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 64, (n,), generator=gen).tolist() for n in (3, 11, 0, 6)]
    engine = Engine(model, None, num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                    keep_logits=True, kv_cache_dtype=scheme)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=16, temperature=0.0)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.preemptions > 0 or arch == "gemma3_text"  # Gemma's rings keep the pool small
    bounds = CACHE_KINDS[scheme].stress_bounds
    assert bounds is not None
    check_within_bounds(engine, model, prompts, ids, bounds)
    assert engine.pool.manager.num_free == engine.pool.num_blocks
    manager = engine.pool.manager
    left = [b for b in engine.pool.staged_blocks if not manager.is_cached(b) or manager.registered_token_ids(b)
            != tuple(next(p for p in prompts if len(p) >= 4)[:4])]
    assert not left, f"finished requests left blocks staged that are not the cached first block: {left}"


@pytest.mark.real_model
@pytest.mark.parametrize(("scheme", "graphs"), [("int8", False), ("int4", False), ("int4", True)])
def test_real_model_requests_stay_within_the_kinds_bounds(scheme: str, graphs: bool) -> None:
    """Chat prompts on SmolLM2 through a quantized pool, prefilled in chunks of 32 tokens; with `graphs`, the decode
    steps padded to a graph's shapes and plan (replayed on CUDA)."""
    from infer.model_store import default_model_path

    path: Path = default_model_path()
    model = infer.load_model(path, dtype="float32")
    tokenizer = infer.Tokenizer(path)
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Name three prime numbers.",
                 "Explain how a rainbow forms.", "Give me a recipe for pancakes.", "What is recursion in programming?"]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in questions]
    engine = Engine(model, tokenizer, num_blocks=64, block_size=16, max_num_batched_tokens=32, keep_logits=True,
                    kv_cache_dtype=scheme, decode_graphs=graphs, max_num_seqs=8)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))
           for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert (engine.stats.graph_steps > 0) == graphs
    bounds = CACHE_KINDS[scheme].error_bounds
    assert bounds is not None
    if not POOL_KEY_OFFSETS[scheme]:
        # The pool's int8 keys are not centred (a block of 16 spends its bit on scales), where the int8 cache's
        # are: measured mean KL 4.7e-5 here, against the cache's bound of 3e-5.
        bounds = dataclasses.replace(bounds, max_mean_kl=8e-5)
    check_within_bounds(engine, model, prompts, ids, bounds)


@pytest.mark.real_model
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_real_model_requests_through_the_native_quantizer_are_the_torch_codes(
        scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2's real keys and values (outlier channels) through a quantized pool whose filled blocks the native
    quantizer writes (`NativeKernels.quantize_blocks`, in the whole-step call and the per-op path) and through one
    whose blocks the torch code writes (INFER_NATIVE_QUANTIZE=0, the formula): the same tokens and logits bit for bit
    (int4: its rotated values too, which the two order their sums for differently)."""
    from infer.model_store import default_model_path

    path: Path = default_model_path()
    model = infer.load_model(path, dtype="bfloat16")
    tokenizer = infer.Tokenizer(path)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in ("Write a haiku about the sea.", "Explain how a rainbow forms.")]
    runs = []
    for switch in ("1", "0"):
        monkeypatch.setenv("INFER_NATIVE_QUANTIZE", switch)
        engine = Engine(model, tokenizer, num_blocks=48, block_size=16, keep_logits=True, kv_cache_dtype=scheme)
        assert (engine.pool.quantizer is not None) == (switch == "1")
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=33, temperature=0.0, ignore_eos=True))
               for p in prompts]
        while engine.has_unfinished():
            engine.step()
        runs.append([engine.result(i) for i in ids])
    for native, formula in zip(*runs, strict=True):
        assert native.token_ids == formula.token_ids
        assert native.logits is not None and formula.logits is not None
        assert torch.equal(native.logits, formula.logits), "the native quantizer parted from the torch code"


@pytest.mark.parametrize("graphs", [False, True])
def test_the_same_memory_holds_more_quantized_blocks(graphs: bool) -> None:
    """At head_dim 64 and blocks of 16 a bf16 block is 4096 bytes per layer and KV head; int8 2208 (0.54x: codes
    2048, key scales 128, value scales 32), 4-bit 1312 (0.32x: codes 1024, key scales and offsets 256, value scales
    32): the pool holds that many more blocks, after its fixed staging (and with graph steps, as on CUDA, their
    spare block and slot), within the memory given."""
    config = tiny_config("llama", num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64, hidden_size=64)
    model = random_model(config, dtype=torch.bfloat16)
    memory = 2**22
    exact = Engine(model, None, cache_memory=memory, max_num_seqs=4, max_num_batched_tokens=32, decode_graphs=graphs)
    assert exact.memory_bytes <= memory
    for scheme, ratio in (("int8", 4096 / 2208), ("int4", 4096 / 1312), ("fp4", 4096 / 1312)):
        engine = Engine(model, None, cache_memory=memory, max_num_seqs=4, max_num_batched_tokens=32,
                        kv_cache_dtype=scheme, decode_graphs=graphs)
        assert (engine.graphs is not None) == graphs
        assert engine.memory_bytes <= memory
        staging = engine.pool.k_stage.nbytes + engine.pool.v_stage.nbytes
        expected = exact.pool.num_blocks * (memory - staging) / memory * ratio
        assert abs(engine.pool.num_blocks - expected) <= 0.01 * expected + 1, scheme


def test_refusals_name_the_argument() -> None:
    model = random_model(tiny_config("llama", head_dim=8))
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        Engine(model, None, num_blocks=8, kv_cache_dtype="bf16")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        Engine(model, None, num_blocks=8, kv_cache_dtype=8)  # type: ignore[arg-type]
    odd = random_model(tiny_config("llama", num_heads=2, num_kv_heads=1, head_dim=5, hidden_size=10))
    with pytest.raises(ValueError, match="even head_dim"):
        Engine(odd, None, num_blocks=8, kv_cache_dtype="int4")
    # int8 takes any head_dim (the budget given: measuring one runs the model, and RoPE cannot rotate an odd
    # head_dim, so this model could serve nothing; the pool's acceptance is the point here)
    Engine(odd, None, num_blocks=8, max_num_batched_tokens=16, kv_cache_dtype="int8")


def test_a_step_that_raises_leaves_the_pool_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward interrupted in its last layer (after the first layers staged and quantized) changes nothing the
    next step sees: the run ends exactly as one never interrupted, and every staging slot comes back."""
    model = random_model(tiny_config("llama", num_layers=2, head_dim=8), seed=2)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9]]
    params = SamplingParams(max_new_tokens=6, temperature=0.0)

    def run(fail_at: int | None) -> list[torch.Tensor]:
        engine = Engine(model, None, num_blocks=16, block_size=2, max_num_batched_tokens=5, keep_logits=True,
                        kv_cache_dtype="int4")
        free_slots = len(engine.pool._free_slots)
        ids = [engine.add_request(p, params) for p in prompts]
        layer = model.layers[-1].self_attn
        forward = type(layer).forward
        calls = 0

        def failing(self: object, *args: object, **kwargs: object) -> object:
            nonlocal calls
            calls += 1
            if calls == fail_at:
                raise RuntimeError("injected")
            return forward(self, *args, **kwargs)  # type: ignore[arg-type]

        with monkeypatch.context() as m:
            m.setattr(type(layer), "forward", failing)
            while engine.has_unfinished():
                with contextlib.suppress(RuntimeError):
                    engine.step()
        staged = engine.pool.staged_blocks  # only the shared first block, a sink the prefix cache still finds
        assert [engine.pool.manager.registered_token_ids(b) for b in staged] == [(1, 2)]
        assert len(engine.pool._free_slots) + len(staged) == free_slots
        return [engine.result(i).logits for i in ids]  # type: ignore[misc]

    clean = run(None)
    for fail_at in (1, 2, 4):
        for a, b in zip(run(fail_at), clean, strict=True):
            assert torch.equal(a, b)


def test_sinks_only_the_prefix_cache_keeps_give_their_slots_when_needed() -> None:
    """One request at a time (three staging slots): each finished request leaves its first block staged, a sink a
    later prompt starting the same way reads exact; when new first blocks need the slots, the oldest such sinks
    are forgotten, and a prompt that would have hit one recomputes it. Every request is the quantized cache's run
    with its first block exact, whichever way its first block came."""
    model = random_model(tiny_config("llama", num_layers=2, head_dim=8), seed=4)
    engine = Engine(model, None, num_blocks=16, block_size=4, max_num_seqs=1, max_num_batched_tokens=16,
                    keep_logits=True, kv_cache_dtype="int4")
    assert engine.pool.stage_slots == 3 + (engine.graphs is not None)  # (on CUDA, the graph steps' spare slot)
    prompts = [[10 * i + t for t in range(6)] for i in range(5)]
    params = SamplingParams(max_new_tokens=3, temperature=0.0)

    def run(prompt: list[int]) -> int:
        rid = engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        return rid

    ids = [run(p) for p in prompts]
    firsts = [tuple(p[:4]) for p in prompts]
    kept = [engine.pool.manager.registered_token_ids(b) for b in engine.pool.staged_blocks]
    assert kept == firsts[-2:], "the two newest sinks stay (the third slot went to the running request)"
    again_new, again_old = run(prompts[-1]), run(prompts[0])
    assert engine.result(again_new).num_prefix_hit_tokens == 4
    assert engine.result(again_old).num_prefix_hit_tokens == 0
    from tests.property.test_quantized_pool_properties import check_against_solo

    check_against_solo(engine, model, "int4", 4, [*prompts, prompts[-1], prompts[0]],
                       [*ids, again_new, again_old], [6])


def test_a_cached_sink_handed_out_for_other_content_takes_that_content() -> None:
    """A pool of four blocks (staging for three requests), one request at a time: a later request is handed an
    earlier one's cached first block (its sink, still staged) for new content; the block must hold the new tokens,
    not the old."""
    model = random_model(tiny_config("llama", num_layers=2, head_dim=8), seed=5)
    engine = Engine(model, None, num_blocks=4, block_size=4, max_num_seqs=3, max_num_batched_tokens=16,
                    keep_logits=True, kv_cache_dtype="int4")
    prompts = [[10 * i + t for t in range(6)] for i in range(3)]
    ids, firsts, reused = [], [], False
    for prompt in prompts:
        ids.append(engine.add_request(prompt, SamplingParams(max_new_tokens=3, temperature=0.0)))
        staged = engine.pool.staged_blocks
        engine.step()
        table = engine.pool.manager.block_table(ids[-1])
        reused |= any(b in staged and b in firsts for b in table)
        firsts.append(table[0])
        while engine.has_unfinished():
            engine.step()
    assert reused, "no request was handed a staged sink of an earlier one"
    from tests.property.test_quantized_pool_properties import check_against_solo

    check_against_solo(engine, model, "int4", 4, prompts, ids, [6])
