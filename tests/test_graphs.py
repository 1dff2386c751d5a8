"""The static one-token step a CUDA graph captures (the forward over a `StaticBackend`), run
eagerly on the CPU against the ordinary cached step: the same logits, the same tokens, and nothing read from
the slots past the position. The batched engine's padded pure-decode steps (`BatchedDecodeGraphs`) likewise:
every request equals its solo run (also drawn by Hypothesis in tests/property/test_engine_properties.py), the
padding rows touch no block but the spare (a quantized pool's: no code block or staging slot but its spare ones),
and only pure-decode steps take the padded path. The capture itself needs CUDA: tests/test_gpu.py."""

from __future__ import annotations

from typing import cast

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import infer
from infer.cache.paged_quantized import QuantizedPagedPool
from infer.engine import Engine
from infer.errors import CacheFullError
from infer.families import ARCHITECTURES
from infer.graphs import (
    BATCH_BUCKETS,
    MIN_TABLE_WIDTH,
    GraphedDecoder,
    batch_bucket,
    graphed_decoder,
    table_width,
)
from infer.kernels import triton_available
from infer.kernels.native import native_kernels
from infer.ragged import SeqChunk, long_tensors
from infer.sampling import SamplingParams
from reference import build_checkpoint
from tests.helpers import assert_close, random_model, solo_logits, tiny_config
from tests.property.test_quantized_pool_properties import check_against_solo


@pytest.mark.parametrize("kernel", [True, False], ids=["triton-kernel", "masked"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_static_steps_equal_the_ordinary_steps(arch: str, dtype: str, kernel: bool) -> None:
    """Two sequences, 10 prompt tokens, 14 static steps each from the ordinary path's state (Gemma's sliding
    layers cross their window of 8): fp32 logits within 1e-5 of the ordinary step's (bf16 within 10% of the
    logit scale, as the other bf16 form comparisons: attention over 32 masked slots rounds otherwise),
    the same greedy tokens; stale NaN past the prompt (a cache reused after an overflow) never reaches them.
    Both forms of the step's attention: the Triton kernel over the cached positions (under the interpreter on
    a CPU), and every slot under a mask."""
    if kernel and not triton_available("cuda" if torch.cuda.is_available() else "cpu"):
        pytest.skip("needs Triton (on CUDA, or TRITON_INTERPRET=1 on a CPU)")
    model = infer.load_model(build_checkpoint(arch), dtype=dtype)
    model.static_attention_kernel = kernel
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
    model = infer.load_model(build_checkpoint("gemma3_text", attn_logit_softcapping=30.0, final_logit_softcapping=20.0))
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


@given(n=st.integers(1, 600), max_batch=st.integers(1, 600))
def test_a_step_pads_to_the_smallest_bucket_that_holds_it(n: int, max_batch: int) -> None:
    bucket = batch_bucket(n, max_batch)
    if n > max_batch or n > BATCH_BUCKETS[-1]:
        assert bucket is None
        return
    buckets = sorted({min(b, max_batch) for b in BATCH_BUCKETS})
    assert bucket == min(b for b in buckets if b >= n)
    assert bucket <= max(n + 1, int(1.5 * n)) or bucket <= 8, "padding past 8 rows stays under 1.5x"


@given(st.lists(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=300), min_size=1, max_size=6))
def test_step_inputs_reach_a_tensor_unchanged(lists: list[list[int]]) -> None:
    """The steps' fast list-to-tensor conversion (several lists through one array's buffer: the graph step's inputs,
    a ragged batch's fields) gives `torch.tensor`'s tensor for each list, empty ones included."""
    tensors = long_tensors(*lists)
    assert len(tensors) == len(lists)
    for values, tensor in zip(lists, tensors, strict=True):
        assert tensor.dtype == torch.long and tensor.is_contiguous()
        assert torch.equal(tensor, torch.tensor(values, dtype=torch.long))


@given(blocks=st.integers(1, 5000), max_blocks=st.integers(1, 5000))
def test_block_tables_pad_to_a_power_of_two_width(blocks: int, max_blocks: int) -> None:
    width = table_width(blocks, max_blocks)
    if blocks > max_blocks:
        assert width is None
        return
    assert width is not None and blocks <= width <= max_blocks
    assert width == max_blocks or (width & (width - 1) == 0 and width >= MIN_TABLE_WIDTH)
    assert width in (max_blocks, MIN_TABLE_WIDTH) or width < 2 * blocks


def assert_each_is_its_solo_run(model: infer.Transformer, prompts: list[list[int]], params: list[SamplingParams],
                                results: list) -> None:
    """Each request's tokens are its solo run's, its fp32 logits within 1e-5 of the model's on those tokens."""
    for prompt, p, result in zip(prompts, params, results, strict=True):
        solo = infer.generate(model, None, prompt, p)
        assert result.token_ids == solo.token_ids
        forced = solo_logits(model, prompt, result.token_ids)
        assert result.logits is not None
        assert_close(result.logits, forced, 1e-5 * max(1.0, forced.abs().max().item()), "logits")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_padded_decode_steps_give_each_request_its_solo_run(arch: str) -> None:
    """Five requests of different lengths (block tables of different widths, padded batches), greedy and
    seeded: each equals its solo run, tokens and fp32 logits; every step after the first
    (all prompts prefilled at once) is a pure-decode step taking the padded path."""
    model = infer.load_model(build_checkpoint(arch))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 400, (n,), generator=gen).tolist() for n in (3, 9, 17, 5, 2)]
    params = [SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True) for new in (12, 4, 10, 7)]
    params.append(SamplingParams(max_new_tokens=9, temperature=1.0, top_k=20, seed=5, ignore_eos=True))
    engine = Engine(model, None, num_blocks=64, block_size=4, keep_logits=True, decode_graphs=True)
    results = engine.generate(prompts, params)
    assert engine.graphs is not None and engine.stats.graph_steps == engine.stats.steps - 1
    # 5, 4, 3, 2 and then 1 request running (they stop after 4, 7, 9, 10 and 12 tokens): 5 and 3 are padded;
    # the 17-token prompt's table needs 8 columns until it finishes, the others 4.
    assert {batch for batch, _ in engine.graphs.shapes} == {8, 4, 2, 1}
    assert {width for _, width in engine.graphs.shapes} == {4, 8}
    assert_each_is_its_solo_run(model, prompts, params, results)


def test_only_pure_decode_steps_take_the_padded_path() -> None:
    """A token budget that splits prompts into chunks: steps that carry a prompt chunk run as ordinary ragged
    batches; with decode_graphs=False none takes the padded path."""
    model = infer.load_model(build_checkpoint("llama"))
    prompts = [list(range(1, 30)), list(range(40, 46))]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    counts = {}
    for graphs in (True, False):
        engine = Engine(model, None, num_blocks=64, block_size=4, max_num_batched_tokens=8, decode_graphs=graphs)
        engine.generate(prompts, params)
        counts[graphs] = (engine.stats.graph_steps, engine.stats.steps)
    # 35 prompt tokens at 8 a step: 5 steps carry prompt chunks (the last ones with a decode token beside
    # them); the 6-token prompt finishes first, so the longer one's last tokens decode in pure-decode steps.
    graphed, steps = counts[True]
    assert counts[False] == (0, steps)
    assert steps == 10 and graphed == 5


needs_native = pytest.mark.skipif(native_kernels() is None, reason="the native kernels are not built here (no C "
                                  "compiler): prompt tokens as kernel rows need an in-place kernel")


# Triton's interpreter costs ~10-20 s a run here: one architecture (the native kernel takes every one, rings too).
@pytest.mark.parametrize(("arch", "kernel"), [(a, "native") for a in ARCHITECTURES] + [("llama", "triton")])
def test_steps_with_prompt_tokens_pad_too_and_give_each_request_its_solo_run(arch: str, kernel: str) -> None:
    """`mixed_graphs`: a token budget that splits prompts into chunks beside other requests' decode rows, every
    token a row of the in-place kernel (the native one, or Triton's, interpreted on the CPU); every step takes the
    padded path (row buckets past max_num_seqs among them), and each request, greedy or seeded, equals its solo
    run: tokens and fp32 logits."""
    if kernel == "native" and native_kernels() is None:
        pytest.skip("the native kernels are not built here (no C compiler)")
    if kernel == "triton" and not triton_available("cpu"):
        pytest.skip("Triton cannot run here (not installed, or TRITON_INTERPRET unset without a GPU)")
    model = infer.load_model(build_checkpoint(arch))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 400, (n,), generator=gen).tolist() for n in (3, 29, 17, 5, 2)]
    params = [SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True) for new in (9, 4, 8, 6)]
    params.append(SamplingParams(max_new_tokens=7, temperature=1.0, top_k=20, seed=5, ignore_eos=True))
    engine = Engine(model, None, num_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=13,
                    keep_logits=True, decode_graphs=True, decode_attention=kernel, chunk_attention=kernel,
                    mixed_graphs=True)
    results = engine.generate(prompts, params)
    assert engine.graphs is not None and engine.graphs.max_rows == 13
    assert engine.stats.graph_steps == engine.stats.steps and engine.stats.graph_prompt_steps > 0
    assert {rows for rows, _ in engine.graphs.shapes} > {13}, "a step of 13 tokens pads to the budget, past 3 rows"
    assert_each_is_its_solo_run(model, prompts, params, results)


@needs_native
def test_prompt_steps_pad_within_max_rows_only() -> None:
    """The padded shape of a step: pure decode within max_num_seqs' buckets; with prompt tokens (`max_rows`), the
    same buckets up to max_num_seqs and max_rows' past it, the table wide enough for each chunk's last token, and
    none past max_rows (the ordinary step runs it). Capturing up front lays out both kinds of bucket."""
    model = infer.load_model(build_checkpoint("llama"))
    engine = Engine(model, None, num_blocks=64, block_size=4, max_num_seqs=6, max_num_batched_tokens=20,
                    decode_graphs=True, decode_attention="native", chunk_attention="native", mixed_graphs=True)
    graphs = engine.graphs
    assert graphs is not None
    decode = [[SeqChunk(5, 1, [0, 1]), SeqChunk(2, 1, [2])]]
    assert graphs.shape_for(decode) == (2, 4)
    assert graphs.shape_for([[SeqChunk(0, 3, [3]), SeqChunk(9, 1, [4, 5, 6])]]) == (4, 4)
    assert graphs.shape_for([[SeqChunk(0, 17, list(range(5))), SeqChunk(9, 1, [5, 6, 7])]]) == (20, 8)
    assert graphs.shape_for([[SeqChunk(0, 20, list(range(5))), SeqChunk(9, 1, [5, 6, 7])]]) is None
    # Batches 1, 2, 4, 6 up to max_num_seqs, then 8, 12, 16, 20 up to max_rows; widths 4 and 8 for 8 blocks.
    assert engine.capture_decode_graphs(32) == len(graphs.shapes) == 16
    # A step's inputs: ids and positions, then per row its slot, offset, fresh block, length, and up to max_num_seqs
    # rows a table each; past them each row's table index and a table per sequence and a spare one (7 of 8 blocks).
    assert graphs.shapes[(4, 8)].inputs.numel() == 2 * 4 + 4 * 4 + 4 * 8
    assert graphs.shapes[(20, 8)].inputs.numel() == 2 * 20 + 5 * 20 + 7 * 8
    plain = Engine(model, None, num_blocks=64, block_size=4, max_num_seqs=6, max_num_batched_tokens=20,
                   decode_graphs=True, decode_attention="native", chunk_attention="native")
    assert plain.graphs is not None and plain.graphs.shape_for([[SeqChunk(0, 3, [3])]]) is None
    assert plain.capture_decode_graphs(32) == 8


def test_mixed_graphs_is_validated() -> None:
    """`mixed_graphs=True` needs the padded path, prompt tokens as kernel rows and an unquantized pool: each
    missing one is named, and only those."""
    model = infer.load_model(build_checkpoint("llama"))
    with pytest.raises(TypeError, match="mixed_graphs must be True, False or None"):
        Engine(model, None, num_blocks=8, mixed_graphs="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_attention 'native' or 'triton' \\(chosen: 'sdpa'\\)$") as refused:
        Engine(model, None, num_blocks=8, decode_graphs=True, chunk_attention="sdpa", mixed_graphs=True,
               packed_products=True)
    assert "decode graphs" not in str(refused.value) and "unquantized" not in str(refused.value)
    assert not model.packed_products, "refused before the model's products were packed"
    if native_kernels() is None:
        return
    rows = {"decode_attention": "native", "chunk_attention": "native"}
    with pytest.raises(ValueError, match="it needs decode graphs \\(decode_graphs=False: pass True off CUDA\\)$"):
        Engine(model, None, num_blocks=8, decode_graphs=False, mixed_graphs=True, **rows)
    with pytest.raises(ValueError, match="it needs an unquantized pool \\(kv_cache_dtype='int8'\\)$"):
        Engine(model, None, num_blocks=8, decode_graphs=True, kv_cache_dtype="int8", mixed_graphs=True, **rows)
    # The default (None) never refuses: off the GPU the padded mixed steps are the check, not the default.
    assert not Engine(model, None, num_blocks=8, decode_graphs=True, **rows).mixed_graphs
    assert not Engine(model, None, num_blocks=8, decode_graphs=True, kv_cache_dtype="int8", **rows).mixed_graphs


@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "with-prompt-tokens"])
def test_padding_rows_write_only_the_spare_block(mixed: bool) -> None:
    """A pool full of NaN, with blocks another holder keeps: three requests pad to a bucket of four, and the
    padding row's writes land in the spare block only: the held blocks and every block never handed out stay
    NaN, and each request equals its solo run. With `mixed_graphs` the prompts arrive in chunks of up to 7 tokens
    beside the decode rows, those steps padded too, past max_num_seqs=3 rows (a table per chunk, the padding
    rows' the spare's)."""
    if mixed and native_kernels() is None:
        pytest.skip("the native kernels are not built here: prompt tokens as kernel rows need an in-place kernel")
    model = infer.load_model(build_checkpoint("llama"))
    rows = {"max_num_batched_tokens": 7, "max_num_seqs": 3, "decode_attention": "native",
            "chunk_attention": "native"} if mixed else {}
    engine = Engine(model, None, num_blocks=64, block_size=4, decode_graphs=True, mixed_graphs=mixed, **rows)
    pool = engine.pool
    pool.k_blocks.fill_(float("nan"))
    pool.v_blocks.fill_(float("nan"))
    pool.manager.new_sequence(10**6)
    pool.manager.append(10**6, 3 * 4)
    held = pool.manager.block_table(10**6)
    prompts = [[5, 6, 7], list(range(10, 27)), [40] * 9]
    params = SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True)
    used: set[int] = set(held)
    tables = pool.manager.block_table

    def recorded(seq_id: int) -> list[int]:  # every table a forward writes through
        table = tables(seq_id)
        used.update(table)
        return table

    pool.manager.block_table = recorded  # type: ignore[method-assign]
    graphs = engine.graphs
    assert graphs is not None
    padded: list[tuple[int, int]] = []  # (bucket, rows) of every padded step
    shape_for = graphs.shape_for

    def recorded_shape(chunk_sets: list[list[SeqChunk]]) -> tuple[int, int] | None:
        key = shape_for(chunk_sets)
        if key is not None:
            padded.append((key[0], sum(c.num_tokens for c in chunk_sets[0])))
        return key

    graphs.shape_for = recorded_shape  # type: ignore[method-assign]
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    if mixed:  # every step padded, some with a prompt chunk past max_num_seqs rows and padding rows beside it
        assert engine.stats.graph_steps == engine.stats.steps and engine.stats.graph_prompt_steps > 0
        assert any(rows < bucket and bucket > 3 for bucket, rows in padded), padded
    else:
        assert (4, 3) in padded
    untouched = [b for b in range(pool.num_blocks) if b not in used] + list(held)
    assert torch.isnan(pool.k_blocks[:, untouched]).all() and torch.isnan(pool.v_blocks[:, untouched]).all()
    for prompt, rid in zip(prompts, ids, strict=True):
        assert engine.result(rid).token_ids == infer.generate(model, None, prompt, params).token_ids


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_pools_padding_touches_only_its_spare_block_and_slot(scheme: str) -> None:
    """A quantized pool's padded steps: codes, scales, offsets and staging full of sentinels, three requests padded
    to a bucket of four whose blocks fill and are quantized while they run. The padding's writes, zeroing and
    quantizing land in the spare code block and staging slot only: every code block no request held and every
    staging slot no plan used keep their sentinels, and each request equals its quantized solo run."""
    config = tiny_config("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=32,
                         vocab_size=64)
    model = random_model(config, seed=5)
    engine = Engine(model, None, num_blocks=32, block_size=4, max_num_seqs=4, keep_logits=True,
                    kv_cache_dtype=scheme, decode_graphs=True)
    pool = cast(QuantizedPagedPool, engine.pool)
    assert pool.spare_block == 32 and pool.code_blocks == 33 and pool.spare_slot is not None
    for t in (pool.k_scale, pool.v_scale, pool.k_offset, pool.k_stage, pool.v_stage):
        t.fill_(float("nan"))
    pool.k_codes.fill_(0x55)
    pool.v_codes.fill_(0x55)
    blocks: set[int] = set()
    slots: set[int] = set()
    tables, plan_step = pool.manager.block_table, pool.plan_step

    def recorded_table(seq_id: int) -> list[int]:
        table = tables(seq_id)
        blocks.update(table)
        return table

    def recorded_plan(chunks: list[SeqChunk]) -> list[SeqChunk]:
        planned = plan_step(chunks)
        slots.update(s for s in pool.plan.writes + pool.plan.fresh if s < pool.stage_slots)
        return planned

    pool.manager.block_table = recorded_table  # type: ignore[method-assign]
    pool.plan_step = recorded_plan  # type: ignore[method-assign]
    prompts = [[5, 6, 7], [(3 * i) % 64 for i in range(9)], [40] * 6]
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=9, temperature=0.0)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert engine.graphs is not None and (4, 4) in engine.graphs.shapes and engine.stats.graph_steps > 5
    untouched = [b for b in range(pool.num_blocks) if b not in blocks]
    assert untouched and (pool.k_codes[:, untouched] == 0x55).all() and (pool.v_codes[:, untouched] == 0x55).all()
    assert torch.isnan(pool.k_scale[:, untouched]).all() and torch.isnan(pool.v_scale[:, untouched]).all()
    assert torch.isnan(pool.k_offset[:, untouched]).all()
    unused = [s for s in range(pool.stage_slots) if s not in slots and s != pool.spare_slot]
    assert unused and torch.isnan(pool.k_persistent[:, unused]).all()
    assert torch.isnan(pool.v_persistent[:, unused]).all()
    assert (pool.k_codes[:, pool.spare_block] != 0x55).any(), "the padding quantized its fills into the spare block"
    for prompt, rid in zip(prompts, ids, strict=True):  # (each prompt prefilled in one chunk, then token by token)
        check_against_solo(engine, model, scheme, 4, [prompt], [rid], chunks=[len(prompt)])


def test_decode_graphs_is_validated() -> None:
    model = infer.load_model(build_checkpoint("llama"))
    with pytest.raises(TypeError, match="decode_graphs must be True, False or None"):
        Engine(model, None, num_blocks=8, decode_graphs="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="decode_attention='per-sequence' attends one sequence at a time"):
        Engine(model, None, num_blocks=8, decode_graphs=True, decode_attention="per-sequence")
    assert Engine(model, None, num_blocks=8).graphs is None, "off the GPU the ordinary step runs by default"
    assert Engine(model, None, num_blocks=8).pool.k_blocks.shape[1] == 8, "no spare block without graphs"


def test_shapes_captured_up_front_cover_every_step() -> None:
    """`capture_decode_graphs(n)` lays out every padded shape a pure-decode step of sequences up to n tokens
    can take (captured on CUDA): serving requests within n then needs no new shape, and they still equal their
    solo runs (the up-front steps wrote only the spare block)."""
    model = infer.load_model(build_checkpoint("llama"))
    engine = Engine(model, None, num_blocks=64, block_size=4, max_num_seqs=6, decode_graphs=True)
    assert engine.graphs is not None
    count = engine.capture_decode_graphs(40)  # 10 blocks: widths 4, 8 and 16; batches 1, 2, 4 and 6
    assert count == len(engine.graphs.shapes) == 12
    prepared = set(engine.graphs.shapes)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 400, (n,), generator=gen).tolist() for n in (3, 20, 9, 12, 1)]
    params = SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True)
    results = engine.generate(prompts, params)
    assert set(engine.graphs.shapes) == prepared and engine.stats.graph_steps > 0
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == infer.generate(model, None, prompt, params).token_ids
    with pytest.raises(ValueError, match="max_seq_len must be an int >= 1"):
        engine.capture_decode_graphs(0)
    assert Engine(model, None, num_blocks=8).capture_decode_graphs() == 0, "no graphs, nothing to capture"
