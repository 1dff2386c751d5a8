"""The engine on a CUDA device against Hugging Face on the same device: logits, greedy tokens per cache kind,
seeded sampling, half precision. Skipped where no CUDA device is present (as in CI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import infer
from infer.__main__ import main
from infer.families import ARCHITECTURES
from infer.generation import generate
from infer.sampling import SamplingParams
from reference import Oracle, build_checkpoint
from tests.helpers import assert_close, solo_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

EXACT_KINDS = ["contiguous", "sliding", "paged"]


def random_ids(vocab: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def no_tf32() -> None:
    # fp32 comparisons at 1e-5 need true fp32 matmuls on both sides.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_fp32_logits_equal_oracle_on_cuda(arch: str) -> None:
    path = build_checkpoint(arch)
    model = infer.load_model(path, device="cuda")
    ids = random_ids(model.config.vocab_size, 40, seed=1)
    with torch.no_grad():
        ours = model(ids.cuda())
    assert ours.device.type == "cuda"
    expected = Oracle(path, device="cuda").logits(ids)
    assert_close(ours.float().cpu(), expected, 1e-5 * max(1.0, expected.abs().max().item()), f"{arch} on cuda")


@pytest.mark.parametrize("kind", EXACT_KINDS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_tokens_equal_oracle_on_cuda(arch: str, kind: str) -> None:
    path = build_checkpoint(arch)
    model = infer.load_model(path, device="cuda")
    prompt = random_ids(model.config.vocab_size, 13, seed=2)[0].tolist()
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ours = generate(model, None, prompt, params, cache=kind)
    assert ours.token_ids == Oracle(path, device="cuda").greedy(prompt, 24), f"{arch}/{kind} on cuda"


@pytest.mark.parametrize("kind", ["int8", "int4", "fp4"])
def test_lossy_kinds_run_on_cuda(kind: str) -> None:
    model = infer.load_model(build_checkpoint("llama"), device="cuda")
    prompt = random_ids(model.config.vocab_size, 9, seed=3)[0].tolist()
    result = generate(model, None, prompt, SamplingParams(max_new_tokens=12, ignore_eos=True), cache=kind)
    assert len(result.token_ids) == 12
    assert all(0 <= t < model.config.vocab_size for t in result.token_ids)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_seeded_sampling_cached_equals_uncached_on_cuda(arch: str) -> None:
    model = infer.load_model(build_checkpoint(arch), device="cuda")
    prompt = random_ids(model.config.vocab_size, 7, seed=4)[0].tolist()
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_k=40, top_p=0.95, seed=11, ignore_eos=True)
    cached = generate(model, None, prompt, params)
    assert cached.token_ids == generate(model, None, prompt, params).token_ids
    assert cached.token_ids == generate(model, None, prompt, params, use_kv_cache=False).token_ids


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_half_precision_on_cuda(arch: str, dtype: torch.dtype) -> None:
    """Stated bound on CUDA: the error against fp32 is at most 2x HF's own half-precision error (the CPU bound is
    1.5x; CUDA's fused SDPA kernels accumulate in a different order from HF's eager matmul + softmax)."""
    path = build_checkpoint(arch)
    model = infer.load_model(path, dtype=dtype, device="cuda")
    ids = random_ids(model.config.vocab_size, 24, seed=5)
    hf_half = Oracle(path, dtype=dtype, device="cuda").logits(ids)
    fp32 = Oracle(path, device="cuda").logits(ids)
    with torch.no_grad():
        ours = model(ids.cuda()).float().cpu()
    hf_error = (hf_half - fp32).abs().max().item()
    our_error = (ours - fp32).abs().max().item()
    assert our_error <= 2.0 * max(hf_error, 1e-3), f"{arch} {dtype}: error {our_error:.4f}, HF's {hf_error:.4f}"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_graph_replay_equals_the_eager_static_and_ordinary_steps(arch: str) -> None:
    """One-token steps replayed from a captured CUDA graph: bit for bit the same static step run eagerly, and
    the ordinary step's fp32 logits within 1e-5, over 12 steps (Gemma past its window)."""
    from infer.graphs import GraphedDecoder

    model = infer.load_model(build_checkpoint(arch), device="cuda")
    ids = random_ids(model.config.vocab_size, 10, seed=5).cuda()
    caches = [infer.create_cache("contiguous", model.config, max_seq_len=32, device="cuda") for _ in range(3)]
    with torch.no_grad():
        token = [model(ids, c) for c in caches][0][:, -1].argmax(-1, keepdim=True)
        graphed, eager = GraphedDecoder(model, caches[0], capture=True), GraphedDecoder(model, caches[1], capture=False)
        for step in range(12):
            replayed = graphed.step(token).clone()
            assert graphed.graph is not None
            assert torch.equal(replayed, eager.step(token)), f"step {step}: replay differs from the eager step"
            ordinary = model(token, caches[2])
            assert_close(replayed, ordinary, 1e-5 * max(1.0, ordinary.abs().max().item()), f"step {step}")
            token = ordinary.argmax(-1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_generate_with_graphs_gives_the_eager_tokens(arch: str, dtype: str) -> None:
    """Greedy runs with replayed steps and with eager ones: the same tokens in fp32. In bf16 the replayed step
    attends with the Triton kernel and the eager one with SDPA, whose roundings differ, so the runs may part, but
    only where the fp32 model's top two logits (fed the shared tokens) lie within twice the eager bf16 run's own
    error: a replayed step that attends wrongly parts where the choice is clear."""
    path = build_checkpoint(arch)
    model = infer.load_model(path, device="cuda", dtype=dtype)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompt = list(range(3, 13))
    runs = {}
    for graphs in (False, True):
        model.decode_graphs = graphs
        runs[graphs] = generate(model, None, prompt, params).token_ids
    if dtype == "float32" or runs[True] == runs[False]:
        assert runs[True] == runs[False]
        return
    parted = next(i for i, (a, b) in enumerate(zip(runs[True], runs[False], strict=True)) if a != b)
    model.decode_graphs = False
    shared = runs[False][:parted + 1]
    exact = solo_logits(infer.load_model(path, device="cuda"), prompt, shared).float()
    rounded = solo_logits(model, prompt, shared).float()
    error = (rounded - exact).abs().max().item()
    top2 = exact[parted].topk(2).values
    margin = (top2[0] - top2[1]).item()
    assert margin <= 2 * error, (f"{arch}: the replayed run parted from the eager one at token {parted}, where "
                                 f"fp32's top-2 margin {margin:.4f} exceeds twice bf16's error {error:.4f}")


def _engine_runs(arch: str, dtype: str, modes: dict[str, bool | None], mixed: bool = False) -> dict[str, tuple]:
    """Six requests of different lengths through the engine on CUDA, once per mode: decode_graphs=True with
    capture ("replay"), the same padded steps run eagerly ("static"), or decode_graphs=False ("eager"). `mixed`:
    a budget of 16 tokens a step, the prompts' tokens rows of the Triton kernel, and with graphs every step padded
    (`mixed_graphs`)."""
    from infer.engine import Engine

    model = infer.load_model(build_checkpoint(arch), device="cuda", dtype=dtype)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 400, (n,), generator=gen).tolist() for n in (3, 9, 17, 5, 2, 30)]
    params = [SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True) for new in (20, 6, 14, 9, 3, 11)]
    runs = {}
    for name, capture in modes.items():
        rows = {"max_num_batched_tokens": 16, "chunk_attention": "triton"} if mixed else {}
        engine = Engine(model, None, num_blocks=128, block_size=4, keep_logits=True, decode_graphs=capture is not None,
                        mixed_graphs=mixed and capture is not None, **rows)
        if engine.graphs is not None:
            engine.graphs.capture = bool(capture)
        prepared = engine.capture_decode_graphs(48) if capture else 0  # the longest request ends at 41 tokens
        results = engine.generate(prompts, params)
        if capture:
            assert engine.graphs is not None and len(engine.graphs.shapes) == prepared > 3
            assert all(s.graph is not None for s in engine.graphs.shapes.values())
            assert engine.stats.graph_steps == engine.stats.steps - (not mixed)
            assert (engine.stats.graph_prompt_steps > 0) == mixed
        runs[name] = (results, model, prompts, params)
    return runs


def test_mixed_graphs_are_on_by_default_on_cuda_wherever_they_can_run() -> None:
    """Timed on an H200 (2026-12-04: the mixed workload at 256 requests 1.65x with them): by default the steps
    carrying prompt chunks replay from graphs wherever their tokens are rows of the in-place kernel and the pool is
    exact; a quantized pool (whose staging pads one write a row) or SDPA chunks keep them eager, without an error."""
    from infer.engine import Engine
    from infer.ragged import IN_PLACE_KERNELS

    model = infer.load_model(build_checkpoint("llama"), device="cuda")
    engine = Engine(model, None, num_blocks=32, block_size=4)
    assert engine.graphs is not None
    assert engine.mixed_graphs == (engine.chunk_attention in IN_PLACE_KERNELS)
    assert Engine(model, None, num_blocks=32, block_size=4, chunk_attention="triton").mixed_graphs
    assert not Engine(model, None, num_blocks=32, block_size=4, chunk_attention="sdpa").mixed_graphs
    assert not Engine(model, None, num_blocks=32, block_size=4, kv_cache_dtype="int8").mixed_graphs
    assert not Engine(model, None, num_blocks=32, block_size=4, mixed_graphs=False).mixed_graphs


@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "mixed"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_engine_decode_graphs_give_the_eager_engine_and_solo_tokens(arch: str, mixed: bool) -> None:
    """The batched engine on CUDA (the Triton paged kernel, pure-decode steps replayed from graphs at padded batch
    and table-width buckets; `mixed`: with `mixed_graphs`, steps carrying prompt chunks too, 16 tokens a step beside
    the decode rows, every token a row of the Triton kernel) against the engine stepping eagerly and each request's
    solo run, in fp32: the same greedy tokens, logits within 1e-5 of the eager engine's."""
    runs = _engine_runs(arch, "float32", {"replay": True, "eager": None}, mixed)
    (replayed, model, prompts, params), (eager, *_) = runs["replay"], runs["eager"]
    for prompt, p, r, e in zip(prompts, params, replayed, eager, strict=True):
        assert r.token_ids == e.token_ids == generate(model, None, prompt, p).token_ids
        assert r.logits is not None and e.logits is not None
        assert_close(r.logits, e.logits, 1e-5 * max(1.0, e.logits.abs().max().item()), "logits")


@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "mixed"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_engine_graph_replay_equals_its_eager_static_steps_in_bf16(arch: str, mixed: bool) -> None:
    """In bf16 a padded batch may round otherwise than the unpadded one, but the replayed graph runs the very
    kernels of the same static step run eagerly (prompt tokens among its rows too, `mixed`): identical tokens and
    logits."""
    runs = _engine_runs(arch, "bfloat16", {"replay": True, "static": False}, mixed)
    for r, s in zip(runs["replay"][0], runs["static"][0], strict=True):
        assert r.token_ids == s.token_ids
        assert torch.equal(r.logits, s.logits)


@pytest.mark.parametrize("scheme", ["int8", "int4", "fp4"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_quantized_pool_graph_replay_equals_its_static_steps_and_the_eager_engine(arch: str, scheme: str) -> None:
    """A quantized pool's pure-decode steps replayed from CUDA graphs (the step's staging plan padded into the
    graph's static buffers; blocks filling and quantized inside the replay; the Triton kernel over codes and
    staging; Gemma 3's sliding layers in their exact rings, a second table set) in fp32: identical tokens and logits
    to the same padded steps run eagerly; against the engine stepping eagerly, logits within fp32 rounding plus 5%
    of what quantizing did (a key on a rounding boundary may take the next code in another batch shape) and the
    same tokens unless parted at a near-tie; Llama's requests against their quantized solo runs (the oracle)."""
    from infer.engine import Engine
    from tests.property.test_quantized_pool_properties import check_against_solo

    model = infer.load_model(build_checkpoint(arch), device="cuda")
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 400, (n,), generator=gen).tolist() for n in (3, 9, 17, 5, 2, 30)]
    params = [SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True) for new in (20, 6, 14, 9, 3, 11)]
    runs = {}
    for mode in ("replay", "static", "eager"):
        engine = Engine(model, None, num_blocks=128, block_size=4, keep_logits=True, kv_cache_dtype=scheme,
                        decode_graphs=mode != "eager", max_num_batched_tokens=256)
        assert engine.decode_attention == "triton"
        prepared = 0
        if engine.graphs is not None:
            engine.graphs.capture = mode == "replay"
            prepared = engine.capture_decode_graphs(48) if mode == "replay" else 0
        ids = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
        while engine.has_unfinished():
            engine.step()
        assert engine.stats.graph_steps == (0 if mode == "eager" else engine.stats.steps - 1)
        if mode == "replay":
            assert engine.graphs is not None and len(engine.graphs.shapes) == prepared
            assert all(s.graph is not None for s in engine.graphs.shapes.values())
            if arch == "llama":
                for prompt, rid in zip(prompts, ids, strict=True):
                    check_against_solo(engine, model, scheme, 4, [prompt], [rid], chunks=[len(prompt)])
        runs[mode] = [engine.result(rid) for rid in ids]
    for prompt, replayed, static, eager in zip(prompts, runs["replay"], runs["static"], runs["eager"], strict=True):
        assert replayed.token_ids == static.token_ids
        assert torch.equal(replayed.logits, static.logits)
        exact = solo_logits(model, prompt, eager.token_ids).float().cpu()
        lossy = (eager.logits - exact).abs().max().item()
        tol = 1e-5 * max(1.0, exact.abs().max().item()) + 0.05 * lossy
        same = next((i for i, (a, b) in enumerate(zip(replayed.token_ids, eager.token_ids, strict=True)) if a != b),
                    len(eager.token_ids))
        assert_close(replayed.logits[: same + 1], eager.logits[: same + 1], tol, f"{arch} {scheme} logits")
        if same < len(eager.token_ids):  # parted: only where the eager run's top two were within the tolerance
            top2 = eager.logits[same].topk(2).values
            assert (top2[0] - top2[1]).item() <= 2 * tol, f"parted at token {same} with a clear margin"


def test_prompt_chunks_join_the_triton_kernel_where_measured_faster_on_cuda() -> None:
    """On CUDA "auto" times the prompt chunks' tokens as rows of the Triton kernel against SDPA per chunk (32 prompts
    of 128 tokens) and names both times; the engine's requests equal their solo runs either way (the oracle suites
    run the engine on CUDA)."""
    from infer.config import ModelConfig
    from infer.tuning import choose_chunk_attention

    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=2048, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8, head_dim=64)
    auto = choose_chunk_attention(config, torch.bfloat16, torch.device("cuda"), "triton")
    assert auto.value in ("triton", "sdpa") and "triton " in auto.reason and "sdpa " in auto.reason, auto.reason


def test_hf_compiled_static_contender_runs_on_cuda() -> None:
    """The bench's `hf[static+compile:reduce-overhead]` contender compiles and steps (twice, on one cache)."""
    from transformers import AutoModelForCausalLM

    from reference.hf_bench import hf_compiled_contender

    model = AutoModelForCausalLM.from_pretrained(build_checkpoint("llama")).cuda().eval()
    contender = hf_compiled_contender(model, list(range(3, 13)), 8)
    for _ in range(2):
        trial = contender.run()
        assert len(trial.step_times_s) == 7


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_attention_off_cudnn_gives_the_cudnn_tokens_and_logits(arch: str) -> None:
    """The forward keeps SDPA off cuDNN on CUDA (a plan per new shape); PyTorch's own choice is the check: in bf16
    both are as far from the fp32 model's logits as bf16 allows, and neither further than the other by much (an
    absolute bound on bf16 logits was too tight for Gemma 3's large activations on an H200, 2026-11-26)."""
    exact = infer.load_model(build_checkpoint(arch), device="cuda")
    ids = random_ids(exact.config.vocab_size, 24, seed=3).cuda()

    def run(model: infer.Transformer, dtype: torch.dtype) -> torch.Tensor:
        cache = infer.create_cache("contiguous", model.config, max_seq_len=28, dtype=dtype, device="cuda")
        with torch.no_grad():
            prefill = model(ids[:, :20], cache, all_logits=True)
            steps = [model(ids[:, t : t + 1], cache) for t in range(20, 24)]
        return torch.cat([prefill, *steps], 1).float().cpu()

    reference = run(exact, torch.float32)
    model = infer.load_model(build_checkpoint(arch), dtype="bfloat16", device="cuda")
    error = {}
    for cudnn in (False, True):
        model.cudnn_attention = cudnn
        error[cudnn] = ((run(model, torch.bfloat16) - reference).norm() / reference.norm()).item()
    assert error[False] < 5e-2, f"{arch}: bf16 logits off cuDNN are {error[False]:.2e} from fp32 (relative)"
    assert error[False] <= 1.5 * error[True] + 1e-3, (
        f"{arch}: bf16 logits off cuDNN {error[False]:.2e} from fp32, PyTorch's choice {error[True]:.2e}")


def test_batched_bench_with_graphs_and_its_profile_on_cuda(tmp_path: Path) -> None:
    """`bench --batched` on CUDA: the engine replays decode graphs, and the roofline's profiled run (its hooks
    synchronise around every op, which a graph capture forbids) still completes (it failed on an H200,
    2026-11-26)."""
    out = tmp_path / "batched.json"
    argv = ["bench", "--batched", "--device", "cuda", "--model", str(build_checkpoint("llama")), "--requests", "6",
            "--batched-prompt-lens", "3-12", "--batched-new-tokens", "4-9", "--no-one-by-one", "--trials", "1",
            "--no-memory", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["engine_stats"]["graph_steps"] > 0
    assert {p["part"] for p in report["roofline"]["profile"]} >= {"projections (matmuls)", "attention"}
