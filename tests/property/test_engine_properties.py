"""The batched engine, as properties: every request equals its solo run, whatever it is batched with.

Hypothesis draws a model shape (every architecture), request sets (prompt lengths, greedy or seeded
sampling with per-request parameters, arrival steps, aborts), pools small enough to force preemption,
block sizes, `max_num_seqs` and token budgets. Each request's tokens must equal `infer.generate` run on it
alone, and its logits at every step the solo cached run's (teacher-forced on the same tokens) within fp32
rounding; the allocator's books must balance after every step, and every block is free at the end."""

from __future__ import annotations

from dataclasses import replace

import torch
from hypothesis import event, given
from hypothesis import strategies as st

import infer
from infer.config import ModelConfig
from infer.engine import Engine
from infer.kernels import triton_available
from infer.models.transformer import native_packing_unavailable
from infer.ragged import DECODE_KERNELS, IN_PLACE_KERNELS
from infer.sampling import SamplingParams
from tests.helpers import TEST_DEVICE, assert_close, check_pool_invariants, random_model, solo_logits
from tests.property.strategies import model_configs

# The Triton kernel joins where it can run (on CUDA, or the CPU under TRITON_INTERPRET=1, as tests/conftest.py
# sets without a GPU); the native paged kernel is the CPU's alone.
KERNELS = [k for k in DECODE_KERNELS if (k != "triton" or triton_available(torch.device(TEST_DEVICE).type))
           and (k != "native" or TEST_DEVICE == "cpu")]
# The fp32 models' products as F.linear's, or packed for the native fp32 packed product where the build has it.
PACKINGS: list[bool | str] = [False] + (["native"] if TEST_DEVICE == "cpu" and native_packing_unavailable(
    [torch.zeros(2, 2)]) is None else [])


@st.composite
def sampling(draw: st.DrawFn) -> SamplingParams:
    new = draw(st.integers(1, 8))
    if draw(st.booleans()):  # greedy, plain (the step picks these together) or under a repetition penalty
        return SamplingParams(max_new_tokens=new, temperature=0.0,
                              repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.3])))
    return SamplingParams(
        max_new_tokens=new,
        temperature=draw(st.sampled_from([0.5, 1.0, 1.5])),
        top_k=draw(st.sampled_from([0, 5])),
        top_p=draw(st.sampled_from([1.0, 0.9])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.3])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@st.composite
def workloads(draw: st.DrawFn, config: ModelConfig) -> dict:
    n = draw(st.integers(1, 5))
    requests = [{
        "prompt": draw(st.lists(st.integers(0, config.vocab_size - 1), min_size=1, max_size=14)),
        "params": draw(sampling()),
        "arrival": draw(st.integers(0, 2)),
        "abort_at": draw(st.none() | st.integers(0, 12)),
    } for _ in range(n)]
    if draw(st.booleans()):  # a shared prefix: prefix caching and copy-on-write get exercised
        shared = draw(st.lists(st.integers(0, config.vocab_size - 1), min_size=1, max_size=10))
        for r in requests:
            r["prompt"] = shared + r["prompt"]
    block_size = draw(st.integers(1, 5))
    kernel = draw(st.sampled_from(KERNELS))
    longest = max(len(r["prompt"]) + r["params"].max_new_tokens for r in requests)
    min_blocks = -(-longest // block_size) + 1
    w = {
        "requests": requests,
        "block_size": block_size,
        "num_blocks": draw(st.integers(min_blocks, min_blocks + 3)),
        "max_num_seqs": draw(st.integers(1, 5)),
        "budget": draw(st.integers(1, 16)),
        "prefix_caching": draw(st.booleans()),
        "decode_attention": kernel,
        # With the native or Triton kernel, the prompt chunks' tokens as its rows too, or each chunk by SDPA.
        "chunk_attention": draw(st.sampled_from([kernel, "sdpa"])) if kernel in ("native", "triton") else "sdpa",
        # Pure-decode steps at padded static shapes (what CUDA graphs replay), run eagerly here.
        "decode_graphs": kernel != "per-sequence" and draw(st.booleans()),
        "mixed_graphs": False,
        "packed_products": draw(st.sampled_from(PACKINGS)),
    }
    # With the padded path and every token a kernel row, steps carrying prompt chunks padded too (`mixed_graphs`).
    if w["decode_graphs"] and w["chunk_attention"] in IN_PLACE_KERNELS:
        w["mixed_graphs"] = draw(st.booleans())
    return w


@given(data=st.data(), config=model_configs(), seed=st.integers(0, 999))
def test_each_request_equals_its_solo_run(data: st.DataObject, config: ModelConfig, seed: int) -> None:
    model = random_model(config, seed=seed)
    w = data.draw(workloads(config))
    engine = Engine(model, None, num_blocks=w["num_blocks"], block_size=w["block_size"],
                    max_num_seqs=w["max_num_seqs"], max_num_batched_tokens=w["budget"],
                    enable_prefix_caching=w["prefix_caching"], keep_logits=True,
                    decode_attention=w["decode_attention"], decode_graphs=w["decode_graphs"],
                    chunk_attention=w["chunk_attention"], mixed_graphs=w["mixed_graphs"],
                    packed_products=w["packed_products"])
    ids: dict[int, int] = {}  # request index -> engine id
    step = 0
    while step < 500 and (step <= 4 or engine.has_unfinished()):
        for i, r in enumerate(w["requests"]):
            if r["arrival"] == step:
                ids[i] = engine.add_request(r["prompt"], r["params"])
            if r["abort_at"] == step and i in ids:
                engine.abort(ids[i])
        engine.step()
        tokens = {}
        for rid in engine.pool.manager.seq_ids:
            tokens[rid] = engine.scheduler.requests[rid].token_ids
        check_pool_invariants(engine.pool.manager, tokens)
        step += 1
    assert not engine.has_unfinished(), "the engine did not finish"
    manager = engine.pool.manager
    assert manager.num_free == manager.num_blocks, "blocks still held after every request ended"
    event(f"preempted: {engine.stats.preemptions > 0}")
    event(f"padded decode steps: {engine.stats.graph_steps > 0}")
    event(f"products packed: {w['packed_products'] or 'no'}")
    event(f"padded steps with prompt tokens: {engine.stats.graph_prompt_steps > 0}")
    if engine.ring is not None:  # sliding layers in rings: did a ring wrap (a sequence outgrow its ring)?
        ring_slots = engine.ring.blocks_per_ring * w["block_size"]
        longest = max(len(r["prompt"]) + r["params"].max_new_tokens for r in w["requests"])
        event(f"sliding ring wrapped: {longest > ring_slots}")
    for i, r in enumerate(w["requests"]):
        result = engine.result(ids[i])
        solo = infer.generate(model, None, r["prompt"], r["params"])
        if result.finish_reason == "abort":
            assert solo.token_ids[: len(result.token_ids)] == result.token_ids
            continue
        assert result.token_ids == solo.token_ids, f"request {i}: batched tokens differ from its solo run"
        assert result.finish_reason == solo.finish_reason
        forced = solo_logits(model, r["prompt"], result.token_ids)
        assert result.logits is not None
        assert_close(result.logits, forced, 1e-5 * max(1.0, forced.abs().max().item()), f"request {i} logits")


@given(config=model_configs(), seed=st.integers(0, 999), n=st.integers(2, 4))
def test_randomness_never_depends_on_the_batch(config: ModelConfig, seed: int, n: int) -> None:
    """The same seeded request alone and beside others draws the same tokens (no shared generator)."""
    model = random_model(config, seed=seed)
    params = SamplingParams(max_new_tokens=6, temperature=1.5, seed=seed)
    prompt = [1 % config.vocab_size, 2 % config.vocab_size]
    alone = Engine(model, None, num_blocks=64, block_size=2).generate([prompt], params)[0]
    others = [replace(params, seed=seed + k + 1) for k in range(n - 1)]
    batched = Engine(model, None, num_blocks=64, block_size=2).generate([prompt] * n, [params, *others])
    assert batched[0].token_ids == alone.token_ids


@given(config=model_configs(), seed=st.integers(0, 999))
def test_unseeded_requests_draw_independently_and_follow_the_global_seed(config: ModelConfig, seed: int) -> None:
    """Requests without a seed each draw their own randomness (two identical ones batched together part ways), and
    the global generator decides it, as for a solo run: the same global seed gives the same tokens again."""
    model = random_model(config, seed=seed)
    params = SamplingParams(max_new_tokens=24, temperature=5.0, ignore_eos=True)  # near-uniform: ties impossible
    prompt = [1 % config.vocab_size, 2 % config.vocab_size]

    def run() -> list[list[int]]:
        torch.manual_seed(seed)
        return [r.token_ids for r in Engine(model, None, num_blocks=64, block_size=2).generate([prompt] * 3, params)]

    first = run()
    assert len({tuple(t) for t in first}) == 3, "identical unseeded requests drew the same tokens"
    assert run() == first, "the global seed did not reproduce the unseeded requests"
