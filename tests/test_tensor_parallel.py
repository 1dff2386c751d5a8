"""Tensor parallelism (infer/tensor_parallel.py) held to one process: 2 and 3 ranks over gloo on the CPU, each
loading its shard of the same checkpoint; every architecture, every exact cache kind, greedy and sampled
generation, the batched engine (rank 0 schedules, the others follow), int8/int4 and a GGUF file's stored codes;
fp32 logits within 1e-5 (relative to the logits' scale: the partial sums are added in another order) of the model
in one process, tokens equal. Also the cuts themselves (they tile every weight), the refusals, and a rank that
dies: the others fail with an error instead of hanging."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given
from hypothesis import strategies as st

import infer
from infer.config import ModelConfig
from infer.families import ARCHITECTURES
from infer.kernels.native import native_kernels
from infer.sampling import SamplingParams
from infer.tensor_parallel import Shards, local_config, split, weight_cut
from reference import build_checkpoint
from tests.helpers import assert_close, solo_logits, tiny_config
from tests.tp_worker import ENGINE_PROMPTS, PREFILL, Case, fail_rank, run_rank, teacher_forced

# Three ranks need heads (and KV heads) divisible by 3; the MLP's 128 hidden units then split 64 / 32 / 32.
THREE_WAY = {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96}


def run_ranks(world: int, cases: list[Case]) -> list[dict[str, Any]]:
    """Every case on `world` gloo ranks; each rank's results."""
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(run_rank, args=(world, str(Path(out) / "init"), cases, out, 120.0), nprocs=world)
        return [torch.load(Path(out) / f"rank{r}.pt") for r in range(world)]


def bound(reference: torch.Tensor) -> float:
    return 1e-5 * max(1.0, reference.abs().max().item())


def check_case(case: Case, ranks: list[dict[str, Any]], world: int) -> None:
    """Rank 0's results against the same model in one process; every rank's equal to rank 0's."""
    one = infer.load_model(case.path, **case.options)
    got = ranks[0][case.name]
    for kind in case.kinds:
        expected = teacher_forced(one, kind)
        assert_close(got[kind], expected, bound(expected), f"{case.name} {kind} logits, {world} ranks")
        for r, other in enumerate(ranks[1:], 1):
            assert torch.equal(other[case.name][kind], got[kind]), f"{case.name}: rank {r}'s logits differ"
    greedy = infer.generate(one, None, PREFILL, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    assert got["greedy"] == greedy.token_ids, f"{case.name}: greedy tokens differ from one process"
    for r, other in enumerate(ranks):
        assert other[case.name]["greedy"] == got["greedy"], f"{case.name}: rank {r}'s greedy tokens"
        assert other[case.name]["sampled"] == got["sampled"], f"{case.name}: rank {r} sampled other tokens"
    if "engine" in got:
        for prompt, (tokens, logits) in zip(ENGINE_PROMPTS, got["engine"], strict=True):
            solo = infer.generate(one, None, prompt, SamplingParams(max_new_tokens=6, temperature=0.0,
                                                                     ignore_eos=True))
            assert tokens == solo.token_ids, f"{case.name}: an engine request's tokens differ from its solo run"
            expected = solo_logits(one, prompt, tokens).float().cpu()
            assert_close(logits.float(), expected, bound(expected), f"{case.name} engine logits")
        assert got["engine_preemptions"] > 0, "the engine test should preempt (pool of 7 blocks of 4)"
        for other in ranks[1:]:
            assert "calls Engine.follow()" in other[case.name]["follower_refused"]
            assert other[case.name]["follower_frozen"], "a follower's steps on a frozen heap, thawed after"


def check_memory(case: Case, ranks: list[dict[str, Any]], world: int, slack: float = 1.1) -> None:
    """Each rank holds about 1/N of the weights (norms are replicated; `slack` allows for them and for uneven
    cuts) and its share of the KV heads."""
    one = infer.load_model(case.path, **case.options)
    total = sum(t.nbytes for t in one.state_dict().values())
    config = one.config
    cache = infer.create_cache("contiguous", config, max_seq_len=32).memory_bytes
    for r, rank in enumerate(ranks):
        share = rank[case.name]["weight_bytes"] / total
        assert share <= slack / world, f"{case.name}: rank {r} holds {share:.2f} of the weights over {world} ranks"
        assert rank[case.name]["cache_bytes"] * world == cache, f"{case.name}: rank {r}'s KV cache"
    assert sum(rank[case.name]["weight_bytes"] for rank in ranks) >= total


def test_two_ranks_equal_one_process(tmp_path: Path) -> None:
    from reference.gguf_convert import hf_to_gguf

    cases = [Case(arch, build_checkpoint(arch)) for arch in ARCHITECTURES]
    llama = build_checkpoint("llama")
    # Gemma 3 1B's shape: one KV head, replicated on both ranks.
    cases.append(Case("gemma-one-kv-head", build_checkpoint("gemma3_text", num_key_value_heads=1),
                      kinds=("contiguous", "sliding")))
    cases += [Case(f"llama-{w}", llama, {"weights": w}, kinds=("contiguous",), engine=False) for w in ("int8", "int4")]
    cases.append(Case("llama-Q8_0", hf_to_gguf(llama, tmp_path / "llama-q8.gguf", "Q8_0"), kinds=("contiguous",),
                      engine=False))
    if native_kernels() is not None:
        cases.append(Case("llama-native", llama, {"decode_gemv": "native"}, kinds=("contiguous",), engine=False,
                          native_step=True))
    ranks = run_ranks(2, cases)
    for case in cases:
        check_case(case, ranks, 2)
    for case in cases[: len(ARCHITECTURES)]:
        check_memory(case, ranks, 2)


def test_three_ranks_with_uneven_splits_equal_one_process() -> None:
    cases = [Case(arch, build_checkpoint(arch, **THREE_WAY), kinds=("contiguous", "paged"))
             for arch in ("llama", "qwen3", "gemma3_text")]
    cases.append(Case("llama-int4", cases[0].path, {"weights": "int4"}, kinds=("contiguous",), engine=False))
    ranks = run_ranks(3, cases)
    for case in cases:
        check_case(case, ranks, 3)
    check_memory(cases[0], ranks, 3, slack=1.2)  # rank 0 holds 64 of the MLP's 128 hidden units


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_two_ranks_on_one_gpu_equal_one_process() -> None:
    """The model on CUDA (both ranks on device 0: gloo carries CUDA tensors, where NCCL needs a GPU per rank):
    the GPU kernels under the split, every architecture."""
    cases = [Case(arch, build_checkpoint(arch), {"device": "cuda"}, kinds=("contiguous", "paged"))
             for arch in ARCHITECTURES]
    ranks = run_ranks(2, cases)
    for case in cases:
        check_case(case, ranks, 2)


@pytest.mark.real_model
def test_the_real_model_over_three_ranks_equals_one_process() -> None:
    """SmolLM2-135M (9 query heads, 3 KV heads: 3 ranks) from its GGUF file, Q4_1 codes as stored: each rank reads
    its rows of every block-quantized tensor; greedy tokens and logits as in one process."""
    from infer.model_store import default_model_path

    path = default_model_path()
    case = Case("smollm2", path, kinds=("contiguous",), engine=False)
    ranks = run_ranks(3, [case])
    check_case(case, ranks, 3)
    one = infer.load_model(path)
    assert all(r["smollm2"]["weight_bytes"] < 0.36 * sum(t.nbytes for t in one.state_dict().values())
               for r in ranks)


def test_a_rank_that_dies_fails_the_others_instead_of_hanging() -> None:
    with tempfile.TemporaryDirectory() as out:
        context = mp.spawn(fail_rank, args=(2, str(Path(out) / "init"), str(build_checkpoint("llama")), out, 10.0),
                           nprocs=2, join=False)
        for process in context.processes:
            process.join(60)
            assert process.exitcode is not None, "a rank hung"
        result = torch.load(Path(out) / "rank0.pt")
    assert result["error"] is not None, "rank 0's step went on without rank 1"
    assert result["seconds"] < 40


# ---- the cuts, without processes ----

@given(total=st.integers(1, 300), parts=st.integers(1, 8), unit=st.sampled_from([1, 2, 4, 32]))
def test_split_tiles_the_range_in_units(total: int, parts: int, unit: int) -> None:
    total *= unit
    pieces = [split(total, parts, i, unit) for i in range(parts)]
    assert [i for p in pieces for i in range(total)[p]] == list(range(total))
    assert all(p.start % unit == 0 and p.stop % unit == 0 for p in pieces)
    sizes = [p.stop - p.start for p in pieces]
    assert max(sizes) - min(sizes) <= unit


def config_for(heads: int, kv: int) -> ModelConfig:
    return tiny_config("qwen3", num_heads=heads, num_kv_heads=kv, head_dim=4, hidden_size=8)


@pytest.mark.parametrize(("heads", "kv", "world"), [(4, 2, 2), (6, 3, 3), (4, 1, 2), (8, 2, 4), (8, 4, 2), (8, 2, 8)])
def test_each_ranks_query_heads_read_the_kv_heads_they_read_in_one_process(heads: int, kv: int, world: int) -> None:
    """The cuts of q/k/v/o/gate/up/down tile the weights (KV heads replicated where ranks outnumber them), and
    every local query head's group is the KV head its global head uses."""
    config = config_for(heads, kv)
    d, group = config.head_dim, heads // kv
    seen_q: list[int] = []
    for rank in range(world):
        shards = Shards(rank, world)
        local = local_config(config, shards)
        q = weight_cut("layers.0.self_attn.q_proj.weight", config, shards)
        k = weight_cut("layers.0.self_attn.k_proj.weight", config, shards)
        o = weight_cut("layers.0.self_attn.o_proj.weight", config, shards)
        assert q is not None and k is not None and o is not None and (q.dim, k.dim, o.dim) == (0, 0, 1)
        assert o.part == q.part
        q_heads = list(range(q.part.start // d, q.part.stop // d))
        kv_heads = list(range(k.part.start // d, k.part.stop // d))
        assert len(q_heads) == local.num_attention_heads and len(kv_heads) == local.num_key_value_heads
        local_group = local.num_attention_heads // local.num_key_value_heads
        for i, h in enumerate(q_heads):
            assert kv_heads[i // local_group] == h // group
        seen_q += q_heads
    assert seen_q == list(range(heads))
    rows = [weight_cut("layers.1.mlp.up_proj.weight", config, Shards(r, world)) for r in range(world)]
    cols = [weight_cut("layers.1.mlp.down_proj.weight", config, Shards(r, world)) for r in range(world)]
    assert [(c.dim, c.part) for c in cols if c] == [(1, c.part) for c in rows if c]
    assert [i for c in rows if c for i in range(config.intermediate_size)[c.part]] == \
        list(range(config.intermediate_size))
    biases = [weight_cut("layers.0.self_attn.o_proj.bias", config, Shards(r, world)) for r in range(world)]
    assert [b.zero for b in biases if b] == [r != 0 for r in range(world)]  # added once
    assert weight_cut("layers.0.input_layernorm.weight", config, Shards(0, world)) is None


def test_refusals_name_the_fix() -> None:
    with pytest.raises(ValueError, match="nproc-per-node among"):
        local_config(config_for(4, 2), Shards(0, 3))
    with pytest.raises(ValueError, match="nproc-per-node among"):
        weight_cut("layers.0.self_attn.k_proj.weight", config_for(6, 3), Shards(0, 2))
    with pytest.raises(ValueError, match="torchrun"):
        infer.load_model(build_checkpoint("llama"), tensor_parallel=True)


def test_torchrun_generate_prints_once_what_one_process_prints() -> None:
    """`torchrun --nproc-per-node 2 -m infer generate`: rank 0 prints the one-process run's text, rank 1 nothing;
    a model whose heads do not divide fails on each rank in one line naming the fix, no traceback."""
    import os
    import subprocess
    import sys

    llama = build_checkpoint("llama")
    args = ["-m", "infer", "generate", "--model", str(llama), "--max-new-tokens", "8", "--temperature", "0",
            "--threads", "1", "hello there"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=120)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    two = subprocess.run([*torchrun, *args], capture_output=True, text=True, env=env, timeout=120)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert two.stdout == one.stdout and one.stdout.startswith("hello there")
    assert two.stderr.count("prompt tokens") == 1, "more than one rank printed its summary"
    bad = subprocess.run([*torchrun, *args[:4], str(build_checkpoint("llama", **THREE_WAY)), *args[5:]],
                         capture_output=True, text=True, env=env, timeout=120)
    # (torchrun's own agent prints a traceback of its ChildFailedError; the ranks print one line each)
    assert bad.returncode != 0 and f'File "{Path(infer.__file__).parent}' not in bad.stderr
    # Whichever rank fails first ends the run (torchrun stops the other): one line naming the fix, prefixed with
    # the rank unless it is rank 0.
    lines = [line for line in bad.stderr.splitlines() if "error: tensor parallelism over 2 ranks" in line]
    assert lines and all(line.startswith(("error:", "rank 1: error:")) for line in lines), bad.stderr[-2000:]


def test_torchrun_bench_reports_once(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`torchrun --nproc-per-node 2 -m infer bench`: the single-request table printed by rank 0 alone; contenders
    that cannot run split (Hugging Face) refused before anything loads, naming the options to drop (checked in
    this process under torchrun's environment: the refusal comes before the process group, and a torchrun launch
    costs ~12 s of two interpreters' start)."""
    import os
    import subprocess
    import sys

    from infer.__main__ import _run

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    bench = ["bench", "--model", str(build_checkpoint("llama")), "--prompt-len", "8", "--new-tokens", "4",
             "--trials", "1", "--warmup", "0", "--threads", "1", "--no-memory", "--no-roofline"]
    run = subprocess.run([*torchrun, "-m", "infer", *bench], capture_output=True, text=True, env=env, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("infer[contiguous]") == 1 and "decode_tok_s" in run.stdout
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    assert _run([*bench, "--against-hf"]) != 0
    assert "drop --against / --against-hf" in capsys.readouterr().err
