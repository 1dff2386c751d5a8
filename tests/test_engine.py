"""The batched engine's API: prompts of every form, results in order, incremental serving, bad input that
hurts only its own request, prefix caching across requests, and the pool figures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import infer
from infer.cache.batch_storage import DEFAULT_CPU_POOL_CAP, default_num_blocks
from infer.engine import Engine, RequestOutput
from infer.sampling import SamplingParams
from tests.helpers import TEST_DEVICE


@pytest.fixture(scope="module")
def llama(llama_dir: Path) -> tuple[infer.Transformer, infer.Tokenizer]:
    return infer.load_model(llama_dir), infer.Tokenizer(llama_dir)


def test_text_chat_and_id_prompts_match_solo_runs_in_prompt_order(llama: tuple) -> None:
    model, tok = llama
    prompts = ["Once upon a time", [{"role": "user", "content": "Hi there"}], [5, 6, 7, 8, 9, 10]]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in (9, 4, 12)]
    results = Engine(model, tok, num_blocks=64, block_size=4, max_num_batched_tokens=8).generate(prompts, params)
    for prompt, p, result in zip(prompts, params, results, strict=True):
        solo = infer.generate(model, tok, prompt, p)
        assert (result.token_ids, result.text, result.finish_reason) == (solo.token_ids, solo.text,
                                                                         solo.finish_reason)
        assert result.prompt_ids == solo.prompt_ids
        assert result.queue_time_s >= 0 and result.prefill_time_s > 0
        assert len(result.decode_times_s) == len(result.token_ids) - 1 and all(t > 0 for t in result.decode_times_s)


def test_a_steps_greedy_picks_are_each_requests_own(llama: tuple) -> None:
    """The plain greedy requests of a step are picked in one argmax over their rows; sampled ones and greedy ones
    under a repetition penalty (which changes these tokens) in between keep their own rule: every request equals its
    solo run."""
    model, _ = llama
    prompts = [[5, 6, 7, 8], [9, 9, 9], [3, 1, 4, 1, 5], [2, 7], [8, 8, 8, 8, 8, 8]]
    params = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=3),
              SamplingParams(max_new_tokens=12, temperature=0.0),
              SamplingParams(max_new_tokens=12, temperature=0.0, repetition_penalty=8.0),
              SamplingParams(max_new_tokens=12, temperature=0.0),
              SamplingParams(max_new_tokens=12, temperature=0.0)]
    plain = infer.generate(model, None, prompts[2], SamplingParams(max_new_tokens=12, temperature=0.0))
    penalised = infer.generate(model, None, prompts[2], params[2])
    assert plain.token_ids != penalised.token_ids, "the penalty changes nothing here"
    results = Engine(model, None, num_blocks=64, block_size=4).generate(prompts, params)
    for prompt, p, result in zip(prompts, params, results, strict=True):
        assert result.token_ids == infer.generate(model, None, prompt, p).token_ids, f"{prompt} {p}"


def test_a_steps_sampled_picks_are_each_requests_own(llama: tuple) -> None:
    """The sampling requests of a step with equal settings are processed and drawn in one call, each row from its
    own seeded generator; other settings in their own group, a repetition penalty on its own: every request equals
    its solo run, and equal prompts with other seeds draw other tokens."""
    model, _ = llama
    same = dict(max_new_tokens=10, temperature=0.9, top_p=0.8, ignore_eos=True)
    prompts = [[5, 6, 7, 8]] * 3 + [[9, 9, 9], [3, 1, 4, 1, 5], [2, 7], [4, 4], [6, 1, 6], [7, 3, 5]]
    params = [SamplingParams(**same, seed=1), SamplingParams(**same, seed=2), SamplingParams(**same, seed=3),
              # each setting of the group's but one changed: a group of its own
              *(SamplingParams(**{**same, name: value}, seed=4 + i)
                for i, (name, value) in enumerate([("temperature", 1.3), ("top_k", 3), ("top_p", 0.3),
                                                   ("min_p", 0.2)])),
              SamplingParams(max_new_tokens=10, temperature=1.0, repetition_penalty=1.5, seed=9, ignore_eos=True),
              SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)]
    results = Engine(model, None, num_blocks=64, block_size=4).generate(prompts, params)
    for prompt, p, result in zip(prompts, params, results, strict=True):
        assert result.token_ids == infer.generate(model, None, prompt, p).token_ids, f"{prompt} {p}"
    assert len({tuple(r.token_ids) for r in results[:3]}) > 1, "three seeds drew the same tokens"


def test_a_steps_picks_equal_each_rows_own_sample_next() -> None:
    """`Engine._batched_picks` over rows of mixed settings picks what `sample_next` (held to HF's processors) picks for
    each row alone, with its own tokens and generator: greedy rows, penalised greedy rows of other lengths (a shorter
    row's tokens padded for the group), sampled rows with and without a penalty."""
    from types import SimpleNamespace

    from infer.sampling import sample_next

    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0)) * 2
    logits[:, 0] = 10.0  # token 0 first everywhere: penalising it (a padding's or a wrong group's) changes the pick
    sampled = dict(temperature=0.9, top_p=0.8)
    rows = [  # (settings, the row's tokens so far)
        (SamplingParams(temperature=0.0, repetition_penalty=8.0), [5, 6]),
        (SamplingParams(temperature=0.0, repetition_penalty=8.0), [7, 8, 9, 10, 11]),
        (SamplingParams(temperature=0.0), [1]),
        (SamplingParams(temperature=0.0), [2, 3]),
        (SamplingParams(**sampled, repetition_penalty=8.0, seed=1), [0, 12, 13]),
        (SamplingParams(**sampled, repetition_penalty=8.0, seed=2), [0]),
        (SamplingParams(**sampled, seed=3), [0, 4]),
    ]
    live = [SimpleNamespace(params=p, request=SimpleNamespace(token_ids=ids),
                            generator=torch.Generator().manual_seed(p.seed or 0)) for p, ids in rows]
    picks = Engine._batched_picks(live, logits)  # type: ignore[arg-type]
    for i, (p, ids) in enumerate(rows):
        seen = torch.tensor([ids]) if p.repetition_penalty != 1.0 else None
        solo = int(sample_next(logits[i : i + 1], p, seen, torch.Generator().manual_seed(p.seed or 0))[0])
        assert picks[i] == solo, (i, p, ids)
    assert picks[0] == picks[6] == 0 and picks[5] != 0, "the penalty on token 0 (or its absence) decides these rows"


def test_incremental_api_streams_text_and_aborts(llama: tuple) -> None:
    model, tok = llama
    engine = Engine(model, tok, num_blocks=64, block_size=4)
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    a = engine.add_request("Once upon a time", params)
    b = engine.add_request("The sea", params)
    pieces: dict[int, list[str]] = {a: [], b: []}
    outputs: list[RequestOutput] = []
    for out in engine.stream():
        outputs.append(out)
        pieces[out.request_id].append(out.new_text)
        if out.request_id == b and sum(len(o.new_token_ids) for o in outputs if o.request_id == b) == 5:
            engine.abort(b)
    assert not engine.has_unfinished()
    ra, rb = engine.result(a), engine.result(b)
    assert "".join(pieces[a]) == ra.text == infer.generate(model, tok, "Once upon a time", params).text
    assert ra.finish_reason == "length" and len(ra.token_ids) == 20
    assert rb.finish_reason == "abort" and len(rb.token_ids) == 5
    assert "".join(pieces[b]) == rb.text
    finished = [o for o in outputs if o.finished]
    assert sorted(o.request_id for o in finished) == [a, b], "each request reports finished exactly once"
    assert engine.pool.manager.num_free == engine.pool.num_blocks


def test_bad_requests_fail_alone(llama: tuple) -> None:
    model, tok = llama
    engine = Engine(model, tok, num_blocks=8, block_size=4)  # 32 slots
    context = model.config.max_position_embeddings
    good = SamplingParams(max_new_tokens=5, temperature=0.0)
    results = engine.generate(
        [[1, 2, 3], [1] * context, [4, 5, 6], [7] * 40, "Once", [1, 2]],
        [good, good, good, good, good, "not params"],  # type: ignore[list-item]
    )
    ok = [results[i] for i in (0, 2, 4)]
    assert [r.finish_reason for r in ok] == [infer.generate(model, tok, p, good).finish_reason
                                            for p in ([1, 2, 3], [4, 5, 6], "Once")]
    assert all(r.error is None and r.token_ids for r in ok)
    assert results[1].finish_reason == "error" and "context" in (results[1].error or "")
    assert results[3].finish_reason == "error" and "KV blocks" in (results[3].error or "")
    assert results[5].finish_reason == "error" and "SamplingParams" in (results[5].error or "")
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        engine.add_request("Once", {"temperature": 0})  # type: ignore[arg-type]
    assert not engine.has_unfinished() and engine.pool.manager.num_free == 8


def test_a_request_that_outgrows_the_pool_fails_and_the_others_finish(llama: tuple) -> None:
    model, tok = llama
    engine = Engine(model, tok, num_blocks=6, block_size=4)  # 24 slots
    long = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    big, small = engine.generate([[1, 2, 3, 4], [5, 6]], [long, short])
    assert big.finish_reason == "error" and "pool" in (big.error or "") and 0 < len(big.token_ids) < 40
    assert small.token_ids == infer.generate(model, tok, [5, 6], short).token_ids


def test_a_shared_system_prompt_is_computed_once(llama: tuple) -> None:
    model, tok = llama
    engine = Engine(model, tok, num_blocks=128, block_size=4)
    system = {"role": "system", "content": "You are a helpful assistant who answers briefly and politely."}
    chats = [[system, {"role": "user", "content": q}] for q in ("Hi", "What is the sea?", "Count to three")]
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    first = engine.generate(chats[:1], params)
    rest = engine.generate(chats[1:], params)
    shared = len(tok.apply_chat_template([system], add_generation_prompt=False)) // 4 * 4
    assert first[0].num_prefix_hit_tokens == 0
    assert all(r.num_prefix_hit_tokens >= shared > 0 for r in rest)
    for chat, r in zip(chats[1:], rest, strict=True):
        assert r.token_ids == infer.generate(model, tok, chat, params).token_ids
    assert engine.stats.prefix_hit_rate > 0


def test_waste_stays_under_one_block_per_running_request(llama: tuple) -> None:
    model, tok = llama
    engine = Engine(model, tok, num_blocks=256, block_size=8, max_num_seqs=6)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 200, (int(n),), generator=gen).tolist() for n in (3, 17, 30, 9, 41, 12)]
    engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True))
    assert engine.stats.peak_blocks_used > 0
    assert engine.stats.max_waste_per_running_seq < 8


def test_default_pool_fits_the_machine(llama: tuple) -> None:
    model, tok = llama
    engine = Engine(model, tok, max_num_seqs=4)
    config = model.config
    assert engine.pool.num_blocks == 4 * -(-config.max_position_embeddings // 16)
    block_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * 16 * config.head_dim * 4
    huge = default_num_blocks(block_bytes, 16, 10**9, 10**6, torch.device("cpu"), None)
    assert 0 < huge * block_bytes <= DEFAULT_CPU_POOL_CAP
    # The memory given holds every block the pool allocates: on CUDA, where decode steps replay from graphs, that
    # includes the spare block their padding rows write, so one fewer is handed out (found on an H200, 2026-11-29).
    sized = Engine(model, tok, cache_memory=block_bytes * 10)
    assert sized.pool.num_blocks == 10 - (sized.graphs is not None)
    assert sized.memory_bytes == block_bytes * 10
    with_graphs = Engine(model, tok, cache_memory=block_bytes * 10, decode_graphs=True)  # (uncaptured off CUDA)
    assert (with_graphs.pool.num_blocks, with_graphs.memory_bytes) == (9, block_bytes * 10)
    with pytest.raises(ValueError, match="num_blocks or cache_memory"):
        Engine(model, tok, num_blocks=4, cache_memory=10**6)
    with pytest.raises(ValueError, match="holds no KV block"):
        Engine(model, tok, cache_memory=10)
    # With graphs the spare block is a fixed cost: the error names it, not costs this pool does not have.
    with pytest.raises(ValueError, match=r"holds no KV block of \d+ bytes beside the decode graphs' spare block "
                                         r"\(\d+ bytes\); raise it"):
        Engine(model, tok, cache_memory=block_bytes + 1, decode_graphs=True)


@pytest.mark.parametrize("kernel", ["sdpa", "matmul"])
def test_stale_values_in_the_pool_never_reach_a_request(llama: tuple, kernel: str) -> None:
    """Batched decode reads whole blocks and padding, masked; a masked NaN would still poison the sum. A pool
    full of NaN (what a previous owner could leave) must not change any request's tokens."""
    model, tok = llama
    engine = Engine(model, tok, num_blocks=64, block_size=4, decode_attention=kernel)
    engine.pool.k_blocks.fill_(float("nan"))
    engine.pool.v_blocks.fill_(float("nan"))
    # Blocks another holder keeps (NaN, never written by the engine): the first ones handed out, so a request
    # reading blocks outside its own table would meet them.
    engine.pool.manager.new_sequence(10**6)
    engine.pool.manager.append(10**6, 3 * 4)
    prompts = [[5, 6, 7], list(range(10, 27)), [40] * 9]
    params = SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True)
    results = engine.generate(prompts, params)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == infer.generate(model, tok, prompt, params).token_ids


def test_gemma_sliding_layers_live_in_rings_bounded_by_the_window(gemma3_dir: Path) -> None:
    """Gemma 3's local layers keep only window + chunk keys per request, whatever the context; the global
    layers use the pool. A generation far past the ring still equals its solo run."""
    model, tok = infer.load_model(gemma3_dir), infer.Tokenizer(gemma3_dir)
    config = model.config
    window = config.sliding_window
    assert window is not None
    sliding = [i for i, t in enumerate(config.layer_types) if t == "sliding_attention"]
    assert sliding and len(sliding) < config.num_hidden_layers
    engine = Engine(model, tok, num_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=8)
    ring = engine.ring
    assert ring is not None and engine.storage.ring_layers == sliding
    assert ring.blocks_per_ring == -(-(window + 8 - 1) // 4) + 1
    spare = 1 if engine.graphs is not None else 0  # the block a graph's padded rows write (on CUDA)
    assert ring.k.shape[:2] == (len(sliding), 3 * ring.blocks_per_ring + spare), \
        "rings: per running request, not per token"
    assert engine.pool.num_layers == config.num_hidden_layers - len(sliding)
    assert not engine.prefix_caching, "a prefix hit would skip K/V the rings need"
    long = ring.blocks_per_ring * 4 * 3  # past three turns of the ring
    params = SamplingParams(max_new_tokens=long, temperature=0.0, ignore_eos=True)
    prompts = ["Once upon a time", list(range(3, 3 + 2 * window + 5))]
    for prompt, result in zip(prompts, engine.generate(prompts, params), strict=True):
        assert result.token_ids == infer.generate(model, tok, prompt, params).token_ids
    unbounded = Engine(model, tok, num_blocks=64, block_size=4, bound_sliding_layers=False)
    assert unbounded.ring is None and unbounded.pool.num_layers == config.num_hidden_layers
    assert unbounded.prefix_caching
    # The whole long prompt in one first chunk (budget 512), longer than the window: the local layers' mask cuts it.
    short = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    got = unbounded.generate([prompts[1]], short)[0].token_ids
    assert got == infer.generate(model, tok, prompts[1], short).token_ids


def test_rings_come_back_when_requests_end(gemma3_dir: Path) -> None:
    """A ring is held only while its request runs: finished and aborted requests give theirs back, so an engine
    with `max_num_seqs` rings serves any number of requests over its life, each equal to its solo run."""
    model, tok = infer.load_model(gemma3_dir), infer.Tokenizer(gemma3_dir)
    engine = Engine(model, tok, num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
    ring = engine.ring
    assert ring is not None
    num_rings = len(ring.free)
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = [[5 + i, 6, 7, 8] for i in range(5)]  # five requests through two rings
    for prompt, result in zip(prompts, engine.generate(prompts, params), strict=True):
        assert result.token_ids == infer.generate(model, tok, prompt, params).token_ids
    rid = engine.add_request([9, 9, 9], params)
    engine.step()
    assert ring.owner, "a running request holds a ring"
    engine.abort(rid)
    assert sorted(ring.free) == list(range(num_rings)) and not ring.owner


def test_decode_attention_choice_is_validated(llama: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    model, tok = llama
    with pytest.raises(ValueError, match="decode_attention must be"):
        Engine(model, tok, num_blocks=8, decode_attention="flash")
    with pytest.raises(ValueError, match="chunk_attention must be 'auto', 'native', 'triton' or 'sdpa'"):
        Engine(model, tok, num_blocks=8, chunk_attention="flash")
    with pytest.raises(ValueError, match="chunk_attention='native' joins the decode rows' kernel, but they attend by "
                                         "'sdpa'"):
        Engine(model, tok, num_blocks=8, decode_attention="sdpa", chunk_attention="native")
    if model.embed_tokens.weight.device.type == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a CPU without the interpreter cannot run Triton
        with pytest.raises(ValueError, match="decode_attention='triton' needs Triton"):
            Engine(model, tok, num_blocks=8, decode_attention="triton")
        # The in-place native kernel needs its build: without one the choice is refused by name.
        monkeypatch.setattr("infer.tuning.native_kernels", lambda *args: None)
        with pytest.raises(ValueError, match="decode_attention='native' runs on the CPU with the native kernels"):
            Engine(model, tok, num_blocks=8, decode_attention="native")


@pytest.mark.parametrize("kernel", ["sdpa", "matmul", "native", "per-sequence"])
def test_decode_rows_beside_a_prompt_chunk_match_solo_runs(llama: tuple, kernel: str) -> None:
    """Steps where two requests' one-token rows share the step with a later prompt's chunk (the decode group is
    some of the step's rows, not all, so its queries are gathered and its output scattered): every request equals
    its solo run, and such steps happened."""
    from infer.kernels.native import native_kernels

    model, tok = llama
    if kernel == "native" and (native_kernels() is None or TEST_DEVICE != "cpu"):
        pytest.skip("the native kernel runs on the CPU with its build; none here")
    engine = Engine(model, tok, num_blocks=64, block_size=4, decode_attention=kernel, max_num_batched_tokens=8)
    engine.trace = []
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9], list(range(10, 30))]
    ids = [engine.add_request(p, params) for p in prompts[:2]]
    engine.step()  # both prompts in one step; decoding from the next
    ids.append(engine.add_request(prompts[2], params))  # 20 tokens: chunks beside the two decode rows
    while engine.has_unfinished():
        engine.step()
    assert any(r.phase == "mixed" and sum(c.decode for c in r.chunks) >= 2 for r in engine.trace)
    assert any(r.phase == "decode" and len(r.chunks) >= 2 for r in engine.trace)
    for rid, prompt in zip(ids, prompts, strict=True):
        assert engine.result(rid).token_ids == infer.generate(model, tok, prompt, params).token_ids, prompt


@pytest.mark.parametrize("chunk_attention", ["sdpa", "native"])
def test_a_bf16_engine_with_native_norms_and_rotations_answers_to_the_solo_runs(
        monkeypatch: pytest.MonkeyPatch, chunk_attention: str) -> None:
    """A bf16 engine's per-op steps run the decoder norms and the rotations of all rows as native calls (prefill
    chunks, mixed and decode steps): each request's logits within bf16 rounding of its solo run, and the same greedy
    tokens as with PyTorch's ops (`native_ops` off, the check). The batched whole step (which rotates inside its one
    native call) is off, or it would take every step where the chunks attend natively, as the choice measured on
    an AVX512 machine has them do: both chunk kernels here, whatever the machine would choose."""
    from infer.kernels.native import NativeKernels, native_kernels
    from reference import build_checkpoint
    from tests.helpers import assert_within_rounding_of_solo_runs

    kernels = native_kernels()
    if kernels is None or not kernels.rows_vectorized or TEST_DEVICE != "cpu":
        pytest.skip("no vectorized native build here (or the models are on a GPU)")
    calls: list[int] = []
    rope_rows = NativeKernels.rope_rows

    def counted(self: NativeKernels, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[2])
        return rope_rows(self, x, cos, sin)

    monkeypatch.setattr(NativeKernels, "rope_rows", counted)
    model = infer.load_model(build_checkpoint("llama"), dtype="bfloat16")
    model.native_step = False
    prompts = [[5, 9, 2, 8, 8, 1], [7, 7, 1, 3], [11], list(range(20, 40)), [6, 2]]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = {}
    for on in (True, False):
        model.native_ops = on
        engine = Engine(model, None, num_blocks=32, keep_logits=True, max_num_batched_tokens=16,
                        decode_attention="native", chunk_attention=chunk_attention)
        ids = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        tokens[on] = [engine.result(rid).token_ids for rid in ids]
        if on:
            assert max(calls) > 1, "no step rotated its rows natively"
            assert_within_rounding_of_solo_runs(engine, model, prompts, ids)
    assert tokens[True] == tokens[False]
    model.native_ops = True
