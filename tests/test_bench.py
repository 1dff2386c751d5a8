"""The bench's report: a person can trust it — ratios worded the right way round, the machine, the commit,
the choices made, units and every contender's raw trials in the JSON."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from infer.__main__ import main
from infer.bench import speed_ratio
from reference import build_checkpoint


@pytest.mark.parametrize(("ratio", "words"), [(1.25, "1.25x faster"), (1.0, "1.00x faster"), (0.8, "1.25x slower"),
                                              (0.5, "2.00x slower")])
def test_ratio_wording(ratio: float, words: str) -> None:
    assert speed_ratio(ratio) == words


def test_json_report_names_machine_choices_units_and_raw_trials(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", str(build_checkpoint("llama")), "--prompt-len", "6", "--max-new-tokens", "4",
            "--trials", "2", "--warmup", "0", "--positions", "1", "--no-memory", "--json", str(out), "--plot",
            str(tmp_path / "steps.png")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"wrote {tmp_path / 'steps.png'}" in printed, "--plot: the per-step latency chart"
    assert (tmp_path / "steps.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert "choices (threads" in printed and "prefill matmul dtype" in printed and "decode GEMV form" in printed
    report = json.loads(out.read_text())
    machine = report["machine"]
    assert {"torch", "threads", "cpu_count"} <= machine.keys() and isinstance(machine["threads"], int)
    assert {c["name"] for c in report["choices"]} >= {"prefill matmul dtype", "decode GEMV form"}
    assert report["units"]["decode_tok_s"] == "tokens/s"
    assert report["bandwidth_bytes_s"] > 0 and report["copy_bandwidth_bytes_s"] > 0
    rates = report["read_bandwidth_by_method_bytes_s"]
    assert "torch.sum" in rates and report["bandwidth_bytes_s"] == max(rates.values()), "the best read is the bound"
    assert report["units"]["roofline_fraction"] == "fraction of read bandwidth"
    trials = report["contenders"]["infer[contiguous]"]
    assert len(trials) == 2 and all(len(t["step_times_s"]) == 3 for t in trials), trials[0].keys()


def test_batched_workload_report(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench --batched`: the engine, one by one and HF static batches over the same requests; every contender
    produces the workload's tokens; the pool figures and the per-request times are reported. The threads stay
    PyTorch's default (the one-token timing once took one thread for a run of hundred-row steps)."""
    import infer.bench

    def no_timing(model: object, forced: int = 0) -> None:
        raise AssertionError("bench --batched timed the one-token thread choice")
    monkeypatch.setattr(infer.bench, "choose_threads", no_timing)
    threads = torch.get_num_threads()
    out = tmp_path / "batched.json"
    argv = ["bench", "--batched", "--model", str(build_checkpoint("llama")), "--requests", "5",
            "--batched-prompt-lens", "3-12", "--batched-new-tokens", "2-6", "--batch-size", "2", "--shared-prefix",
            "20", "--max-num-batched-tokens", "24", "--against-hf", "--trials", "1", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "throughput" in printed and "prefix hit rate" in printed and "batched decode attention" in printed
    assert f"CPU threads: {threads};" in printed and torch.get_num_threads() == threads
    report = json.loads(out.read_text())
    wanted = sum(r["max_new_tokens"] for r in report["workload"])
    names = {row["name"] for row in report["results"]}
    assert names == {"infer engine", "infer one by one[contiguous]", "hf static batches[2]"}
    for runs in report["runs"].values():
        (run,) = runs
        assert run["new_tokens"] == wanted
        assert len(run["ttft_s"]) == len(run["latency_s"]) == 5
        assert all(0 < t <= lat <= run["wall_s"] * 1.001 for t, lat in
                   zip(run["ttft_s"], run["latency_s"], strict=True))
    stats = report["engine_stats"]
    assert stats["prefix_hit_rate"] > 0, "prompts sharing a full block (20 tokens) must hit the prefix cache"
    roofline = report["roofline"]  # the machine's limits measured in the run, the engine's steps against them
    phases = {row["phase"]: row for row in roofline["phases"]}
    assert phases["all"]["steps"] == stats["steps"]
    assert sum(row["steps"] for p, row in phases.items() if p != "all") == stats["steps"]
    assert all(0 < row["fraction"] <= row["fraction_at_shape"] for row in phases.values())
    assert all(row["fraction_p50"] > 0 for row in phases.values()), "the median step's fraction, beside the mean's"
    assert roofline["read_bandwidth"] > 0 and all(r > 0 for r in roofline["matmul_flops_by_rows"].values())
    assert stats["token_budget"] == 24 and {"24", "512"} <= set(roofline["matmul_flops_by_rows"]), \
        "the matmul rate at the engine's budget, and the peak past a small budget's rows"
    assert {p["part"] for p in roofline["profile"]} >= {"projections (matmuls)", "attention", "scheduling"}
    assert stats["max_waste_slots_per_running_seq"] < stats["block_size"]


def test_the_batched_bench_times_the_limits_before_between_and_after_its_runs(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine's limits are timed after the warm-ups and before the timed runs, between the trials and after
    them, and the report reads the runs against their median at every row count (a shared host's speed moves
    between minutes: one timing, or the best of several, measures that noise as much as the engine), the best
    timing kept beside it."""
    import infer.bench_batched as bench_batched
    from infer.roofline import Limits

    events: list[str] = []
    engine = bench_batched.run_engine
    timings = iter([(7.0, 3.5e9), (2.0, 1e9), (4.0, 2e9)])  # the best 7/4 of the median, both limits

    def logged_engine(*args: object, **kwargs: object) -> bench_batched.BatchedRun:
        events.append("run")
        return engine(*args, **kwargs)  # type: ignore[arg-type]

    def fake_limits(model: object, max_rows: int) -> Limits:
        events.append("limits")
        rate, bandwidth = next(timings)
        return Limits({r: rate * r for r in sorted({1, 16, 512, max_rows})}, bandwidth)

    monkeypatch.setattr(bench_batched, "run_engine", logged_engine)
    monkeypatch.setattr(bench_batched, "machine_limits", fake_limits)
    out = tmp_path / "limits.json"
    argv = ["bench", "--batched", "--model", str(build_checkpoint("llama")), "--requests", "3",
            "--batched-prompt-lens", "3-8", "--batched-new-tokens", "2-4", "--max-num-batched-tokens", "24",
            "--no-one-by-one", "--trials", "2", "--json", str(out)]
    assert main(argv) == 0
    assert events == ["run", "limits", "run", "limits", "run", "limits", "run"], \
        "warm-up, limits, trial, limits, trial, limits, profile"
    roofline = json.loads(out.read_text())["roofline"]
    assert {int(r): v for r, v in roofline["matmul_flops_by_rows"].items()} == {1: 4.0, 16: 64.0, 24: 96.0,
                                                                                512: 2048.0}, \
        "each row count the median of the three timings, the engine's token budget (24) timed every time"
    assert roofline["read_bandwidth"] == 2e9
    assert [t["read_bandwidth"] for t in roofline["timings"]] == [3.5e9, 1e9, 2e9]
    for phase in roofline["phases"]:  # every step's bound 4/7 of the median's against the best timing
        assert phase["p50_vs_best"] == pytest.approx(phase["fraction_p50"] * 4 / 7, rel=1e-9)


def test_each_quantized_pool_is_read_against_its_own_roofline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`bench --batched --kv-cache-dtype int8,int4` with the roofline: each quantized pool's run per phase against a
    roofline whose K/V bytes are its blocks' (the pool's layout: a code a K or V element, 1 byte for int8 and half for
    int4, a bf16 scale per key channel of a block (and for 4-bit codes an offset), a bf16 scale per value row), so it
    reads fewer bytes than the exact pool over the same steps, and its fraction is its roofline over its own time.
    Each run's steps are in the JSON, one by one, adding up to its phases' rows, and `--plot` draws them."""
    import infer.bench_batched as bench_batched
    from infer.roofline import Limits

    monkeypatch.setattr(bench_batched, "machine_limits",
                        lambda model, max_rows: Limits({r: 1e9 * r for r in (1, 16, max_rows)}, 1e9))
    out = tmp_path / "pool_roofline.json"
    argv = ["bench", "--batched", "--model", str(build_checkpoint("llama")), "--requests", "3",
            "--batched-prompt-lens", "3-20", "--batched-new-tokens", "2-5", "--kv-cache-dtype", "int8,int4",
            "--cache-memory", "4", "--no-one-by-one", "--trials", "1", "--json", str(out), "--plot",
            str(tmp_path / "roofline.png")]
    assert main(argv) == 0
    assert f"wrote {tmp_path / 'roofline.png'}" in capsys.readouterr().out
    assert (tmp_path / "roofline.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    report = json.loads(out.read_text())
    roofline, config = report["roofline"], json.loads((build_checkpoint("llama") / "config.json").read_text())
    d = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    bs = int(report["engine_stats"]["block_size"])
    per_element = {"infer engine[int8]": (2 * bs * d * 1 + (d + bs) * 2) / (2 * bs * d),
                   "infer engine[int4]": (2 * bs * d // 2 + (2 * d + bs) * 2) / (2 * bs * d)}
    exact = {row["phase"]: row for row in roofline["phases"]}
    assert {row["name"] for row in roofline["pools"]} == set(per_element)
    for row in roofline["pools"]:
        assert row["kv_bytes_per_element"] == pytest.approx(per_element[row["name"]], rel=1e-12)
        same = exact[row["phase"]]
        assert row["steps"] == same["steps"], "the pools in the same memory and limits ran the same steps"
        assert row["gb"] < same["gb"], "a quantized pool reads fewer K/V bytes than the exact one over the same steps"
        assert row["fraction"] == pytest.approx(row["roofline_s"] / row["seconds"], rel=1e-9)
    phases = {(row.get("name", "infer engine"), row["phase"]): row for row in [*roofline["phases"], *roofline["pools"]]}
    assert set(roofline["steps"]) == {"infer engine", *per_element}
    for name, steps in roofline["steps"].items():
        assert len(steps) == phases[name, "all"]["steps"]
        for phase in ("prefill", "mixed", "decode", "all"):
            mine = [s for s in steps if phase in (s["phase"], "all")]
            if mine:
                row = phases[name, phase]
                assert len(mine) == row["steps"] and sum(s["seconds"] for s in mine) == pytest.approx(row["seconds"])
                assert sum(s["bytes"] for s in mine) / 1e9 == pytest.approx(row["gb"])
                assert sum(s["roofline_s"] for s in mine) == pytest.approx(row["roofline_s"])
    engine_steps = roofline["steps"]["infer engine"]
    medians = {p: statistics.median(s["seconds"] for s in engine_steps if s["phase"] == p)
               for p in {s["phase"] for s in engine_steps}}
    slow = [s["seconds"] - medians[s["phase"]] for s in engine_steps if s["seconds"] > 2 * medians[s["phase"]]]
    assert roofline["slow_steps"]["count"] == len(slow), "the engine run's steps over twice their phase's median"
    assert roofline["slow_steps"]["excess_s"] == pytest.approx(sum(slow))
    faulted = [s["faults"] for s in engine_steps if s["seconds"] > 2 * medians[s["phase"]]]
    usual = 2 * statistics.median(s["faults"] for s in engine_steps) + 2
    assert roofline["slow_steps"]["faults"] == sum(faulted) and roofline["slow_steps"]["faulting"] == sum(
        f > usual for f in faulted), "the page faults the host took in the slow steps, from each step's own count"
    assert roofline["slow_steps"]["run_faults"] == sum(s["faults"] for s in engine_steps)


def test_the_pool_kinds_report_requests_per_gib_and_the_latency_they_served_at() -> None:
    """`pool_row`: the requests of the workload's mean length a pool holds (whole blocks each), per GiB of pool, and
    the median request's time per output token after its first; requests of one token have no such time."""
    from infer.bench_batched import BatchedRun, BatchRequest, pool_row

    work = [BatchRequest([1] * 10, 5), BatchRequest([1] * 20, 3), BatchRequest([1] * 30, 1)]  # mean 23 tokens
    run = BatchedRun("engine", 2.0, ttft_s=[0.1, 0.2, 0.3], latency_s=[0.5, 0.8, 0.3], new_tokens=9,
                     stats={"kv_memory_bytes": 2**29, "pool_blocks": 100, "block_size": 16, "preemptions": 0})
    row = pool_row(run, work)
    assert row["requests_fit"] == 50, "23 tokens take 2 blocks of 16"
    assert row["requests_per_gib"] == 100, "half a GiB of pool holds 50"
    assert row["tpot_p50_ms"] == pytest.approx(200.0), "0.4 s over 4 tokens and 0.6 s over 2: 100 and 300 ms"
    assert row["tok_s"] == 4.5


def test_the_batched_bench_sets_pool_kinds_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`bench --batched --kv-cache-dtype int8`: the exact and the int8 pool in the same memory, int8 holding more
    requests per GiB, each with the latency it served at, in the table and the JSON."""
    out = tmp_path / "pools.json"
    argv = ["bench", "--batched", "--model", str(build_checkpoint("llama")), "--requests", "4",
            "--batched-prompt-lens", "3-12", "--batched-new-tokens", "2-6", "--kv-cache-dtype", "int8",
            "--cache-memory", "4", "--no-one-by-one", "--no-roofline", "--trials", "1", "--json", str(out)]
    assert main(argv) == 0
    assert "requests_per_gib" in capsys.readouterr().out
    pools = {row["name"]: row for row in json.loads(out.read_text())["pools"]}
    assert set(pools) == {"infer engine", "infer engine[int8]"}
    assert pools["infer engine[int8]"]["requests_per_gib"] > pools["infer engine"]["requests_per_gib"] > 0
    assert all(row["tpot_p50_ms"] > 0 for row in pools.values())


def test_the_batched_bench_samples_as_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`bench --batched --temperature 0.8 --top-p 0.9`: every request samples with those settings and its own seed,
    in the engine, one by one and HF's static batches (its processors and multinomial), each the workload's
    tokens; the header says how they pick."""
    from infer.bench_batched import BatchRequest, Sampling, batched_workload, request_params

    out = tmp_path / "sampled.json"
    argv = ["bench", "--batched", "--model", str(build_checkpoint("llama")), "--requests", "4",
            "--batched-prompt-lens", "3-12", "--batched-new-tokens", "2-6", "--batch-size", "2", "--temperature",
            "0.8", "--top-p", "0.9", "--against-hf", "--no-roofline", "--trials", "1", "--json", str(out)]
    assert main(argv) == 0
    assert "shared prefix 0, temperature 0.8, top_p 0.9)" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert {json.dumps(r["sampling"], sort_keys=True) for r in report["workload"]} == {
        json.dumps({"temperature": 0.8, "top_k": 0, "top_p": 0.9, "min_p": 0.0}, sort_keys=True)}
    wanted = sum(r["max_new_tokens"] for r in report["workload"])
    assert len(report["runs"]) == 3 and all(run["new_tokens"] == wanted for (run,) in report["runs"].values())
    work = batched_workload(100, num_requests=3, sampling=Sampling(0.8, 5, 0.9, 0.1), seed=7)
    params = [request_params(r) for r in work]
    assert [p.seed for p in params] == [7, 8, 9] and all(p.ignore_eos for p in params)
    assert {(p.temperature, p.top_k, p.top_p, p.min_p) for p in params} == {(0.8, 5, 0.9, 0.1)}
    assert str(BatchRequest([1], 1).sampling) == "greedy" and request_params(BatchRequest([1], 2)).seed == 0


@pytest.mark.parametrize("bad", [["--requests", "0"], ["--batch-size", "0"], ["--shared-prefix", "-1"],
                                 ["--max-num-seqs", "0"], ["--top-p", "1.5"], ["--temperature", "-1"],
                                 ["--top-k", "-2"], ["--min-p", "2"]])
def test_batched_arguments_fail_before_any_model_loads(bad: list[str], capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import infer.loader

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(infer.loader, "load_model", no_load)
    assert main(["bench", "--batched", "--model", str(build_checkpoint("llama")), *bad]) != 0
    err = capsys.readouterr().err
    assert bad[0] in err and "Traceback" not in err


def test_hf_trial_runs_its_steps_through_a_given_decode_and_reused_cache() -> None:
    """The compiled HF contender's plumbing (the compilation itself is CUDA-only: tests/test_gpu.py): every
    one-token step goes through `decode` at the next cache position, and one static cache serves every trial."""
    from transformers import AutoModelForCausalLM, StaticCache

    from reference.hf_bench import hf_greedy_trial

    model = AutoModelForCausalLM.from_pretrained(build_checkpoint("llama"))
    positions: list[int] = []

    def step(**kwargs: object) -> object:
        positions.append(int(kwargs["cache_position"].item()))  # type: ignore[attr-defined]
        return model(**kwargs)

    cache = StaticCache(config=model.config, max_cache_len=10)
    for _ in range(2):
        trial = hf_greedy_trial(model, "static", [1, 2, 3, 4, 5, 6], 4, cache=cache, decode=step)
        assert len(trial.step_times_s) == 3 and trial.prompt_tokens == 6
    assert positions == [6, 7, 8] * 2
