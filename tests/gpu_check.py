"""The whole harness on a CUDA machine in one command (`make gpu-check`), and one report of what it found.

Stages, each in its own process and time limit, so one that fails or hangs still leaves the others' results:

- kernels: tests/test_gpu.py, the Triton kernels compiled (not interpreted) against their formulas, graph
  capture and replay (tests/test_graphs.py);
- oracle: the property, conformance, engine, sampling, stopping, chat and real-model suites with every model,
  cache and oracle on CUDA (INFER_TEST_DEVICE=cuda; fp32 with TF32 off);
- bench-*: batch-1 decode against Hugging Face (eager dynamic, static, static + torch.compile) at the
  Llama-3.2-1B and Qwen3-1.7B shapes with the fraction of measured read bandwidth; where the batch-1 step's
  time goes (tests/gpu_decode_profile.py: kernels, graph replay, one-row products); the batched engine on the
  mixed workload at 64 and 256 requests against HF static batching, and with quantized pools (where their steps'
  time goes: tests/gpu_pool_profile.py); quantized KV against bf16 at 8k and 32k.

The report (markdown and JSON: device, driver, versions, every figure, every failure with its test id) goes to
--out. Without CUDA it says so in one line and exits 2.

    python tests/gpu_check.py [--out DIR] [--only kernels,oracle,...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

KERNEL_TESTS = ["tests/test_gpu.py", "tests/test_triton_kernels.py", "tests/test_graphs.py",
                "tests/test_tensor_parallel.py::test_two_ranks_on_one_gpu_equal_one_process"]
# The suites that hold the CPU path to the oracle, run again with models on CUDA.
ORACLE_TESTS = ["tests/property", "tests/test_cache_conformance.py", "tests/test_engine.py",
                "tests/test_sampling_oracle.py", "tests/test_stopping.py", "tests/test_chat.py",
                "tests/test_generate.py", "tests/test_models.py", "tests/test_paged.py", "tests/test_sliding.py",
                "tests/test_prompt_cache.py", "tests/test_real_model.py", "tests/test_all_or_nothing.py"]

BENCH = ["-m", "infer", "bench", "--device", "cuda", "--no-memory"]
SINGLE = ["--prompt-len", "512", "--max-new-tokens", "128", "--against-hf", "--trials", "3"]
# In the order they run: the batch-1 figures first, the ones a short lease is most likely to leave out last (the
# quantized pools before the KV table: on the H200 of 2026-11-27 the table had run twice, the pools never; building
# their 1.24B checkpoint alone took most of the 110 s they were given); 256 requests (the batched engine's
# issue) before the Qwen3 shapes' batch-1 figures, which ran once already.
BENCHES: dict[str, list[str]] = {
    "bench-llama-1b": [*BENCH, "--arch", "llama", *SINGLE],
    # Where the batch-1 step goes: top kernels, graph replay with the attention kernel and masked, one-row products.
    "profile-decode": ["tests/gpu_decode_profile.py"],
    "bench-batched-64": [*BENCH, "--arch", "llama", "--batched", "--requests", "64", "--against-hf",
                         "--batch-size", "32", "--no-one-by-one", "--trials", "2"],
    # The quantized pool read in place by the Triton paged kernel, against the bf16 pool at the same memory.
    "bench-batched-kv": [*BENCH, "--arch", "llama", "--batched", "--requests", "64", "--kv-cache-dtype",
                         "int8,int4,fp4", "--cache-memory", "2048", "--no-one-by-one", "--trials", "1"],
    "bench-kv": [*BENCH, "--arch", "llama", "--cache-table", "contiguous,int8,int4,fp4", "--contexts",
                 "8192,32768", "--max-new-tokens", "64"],
    # Quantized weights (issue 26): the Triton dequantizing kernel in decode steps, against the bf16 run above.
    "bench-llama-1b-int4": [*BENCH, "--arch", "llama", "--weights", "int4", "--prompt-len", "512",
                            "--max-new-tokens", "128", "--trials", "3"],
    "bench-batched-256": [*BENCH, "--arch", "llama", "--batched", "--requests", "256", "--against-hf",
                          "--batch-size", "32", "--no-one-by-one", "--trials", "1"],
    # The same workload with its mixed steps (63 decode rows and an arriving prompt) run eagerly, as before they
    # replayed from graphs by default (the H200 of 2026-12-04: 5084 tok/s eager against 8376 replayed).
    "bench-batched-256-eager-mixed": [*BENCH, "--arch", "llama", "--batched", "--requests", "256", "--no-mixed-graphs",
                                       "--no-one-by-one", "--trials", "1"],
    "bench-qwen3-1.7b": [*BENCH, "--arch", "qwen3", *SINGLE],
    # Why the quantized pools lag the bf16 pool in the batched engine: step times by phase, torch.profiler's tops.
    "profile-pool": ["tests/gpu_pool_profile.py", "--kinds", "bf16,int8,int4"],
}
# The oracle stage ran its 486 tests in 207 s on the H200 of 2026-11-27 and reached 100% in the next lease
# only to be cut at 240 s before its summary; that evening, ~99% of ~500 at 270 s beside the kernels stage: 330.
# The two run side by side, so the kernels stage may take as long as the oracle's for nothing: on a fresh H200 on
# 2026-12-04 it had 157 of its ~165 tests done when cut at 240 s.
TIME_LIMITS = {"kernels": 330, "oracle": 330, "bench-llama-1b": 150, "profile-decode": 90, "bench-qwen3-1.7b": 150,
               "bench-batched-64": 90, "bench-batched-256": 120,
               "bench-batched-256-eager-mixed": 120, "bench-kv": 90, "bench-llama-1b-int4": 60,
               "bench-batched-kv": 200, "profile-pool": 150}


@dataclass
class Stage:
    """One stage's outcome: its command, exit status, time, and what it measured or found."""

    name: str
    command: list[str]
    returncode: int | None = None  # None: ran past its time limit
    seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    failures: list[dict[str, str]] = field(default_factory=list)
    figures: Any = None
    log_tail: str = ""


def environment() -> dict[str, Any]:
    """Device, driver and the versions every figure depends on."""
    import torch

    env: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "python": platform.python_version(),
                           "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "transformers", "hypothesis"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    env["device"] = torch.cuda.get_device_name(0)
    props = torch.cuda.get_device_properties(0)
    env["memory_gib"] = round(props.total_memory / 2**30, 1)
    env["multiprocessors"] = props.multi_processor_count
    try:
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        env["driver"] = None
    from infer.model_store import stored_path

    model = stored_path()
    env["real_model"] = str(model) if model.is_file() else None  # None: not in the store, its tests left out
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        env["commit"] = None
    return env


def run_stages(stages: list[tuple[Stage, float]], env: dict[str, dict[str, str]], out: Path) -> None:
    """Run stages side by side, each with its own time limit; each one's whole output goes to out/<name>.log."""
    running = []
    for stage, limit in stages:
        print(f"[gpu-check] {stage.name} (limit {limit:.0f} s): {' '.join(stage.command[1:])}", flush=True)
        log = (out / f"{stage.name}.log").open("w")
        proc = subprocess.Popen(stage.command, cwd=ROOT, env=env[stage.name], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        running.append((stage, limit, proc, log, time.perf_counter()))
    for stage, limit, proc, log, start in running:
        try:
            stage.returncode = proc.wait(timeout=max(1.0, start + limit - time.perf_counter()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the stage and its pytest workers
            proc.wait()
            stage.returncode = None
        stage.seconds = time.perf_counter() - start
        log.close()
        stage.log_tail = (out / f"{stage.name}.log").read_text(errors="replace")[-3000:]
        status = "timed out" if stage.returncode is None else f"exit {stage.returncode}"
        print(f"[gpu-check] {stage.name}: {status} after {stage.seconds:.0f} s", flush=True)


def read_junit(path: Path, stage: Stage) -> None:
    """Counts and every failure (test id and the first lines of its message) from pytest's JUnit XML."""
    if not path.exists():
        return
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "errors"
                message = (child.get("message") or child.text or "").strip().splitlines()
                stage.failures.append({"test": test_id, "kind": child.tag, "message": " ".join(message[:3])[:400]})
            elif child.tag == "skipped":
                outcome = "skipped"
        counts[outcome] += 1
    stage.counts = counts


# pytest -v's line for each test as it ends (with xdist: "[gw3] [ 42%] PASSED tests/test_a.py::test_b[x]").
_OUTCOME_LINE = re.compile(r"^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (tests/\S+::\S+)"
                           r"|^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_OUTCOMES = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped",
             "XFAIL": "skipped"}


def read_outcome_lines(log: str, stage: Stage) -> None:
    """Counts and failing test ids from the stage's log, one line per test (`-v`): what a stage cut by its time
    limit leaves, having written neither its JUnit XML nor its summary."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for line in log.splitlines():
        match = _OUTCOME_LINE.match(line)
        if match is None:
            continue
        outcome, test_id = (match.group(1), match.group(2)) if match.group(1) else (match.group(4), match.group(3))
        counts[_OUTCOMES[outcome]] += 1
        if outcome in ("FAILED", "ERROR"):
            stage.failures.append({"test": test_id, "kind": "failure" if outcome == "FAILED" else "error",
                                   "message": "(the stage was cut before its summary: see its log)"})
    stage.counts = counts


def bench_figures(name: str, report: Any) -> Any:
    """The figures a person reads from one bench JSON."""
    if name == "bench-kv":
        return report
    keep = ("name", "decode_tok_s", "step_p50_ms", "roofline_fraction", "ttft_ms", "tok_s", "req_s", "wall_s",
            "ttft_p50_ms", "latency_p50_ms", "context", "eager_ms", "graph_ms", "graph_masked_ms", "kernel_ms",
            "launches")
    rows = [{k: r[k] for k in keep if k in r} for r in report.get("results", [])]
    extra = {k: report[k] for k in ("bandwidth_bytes_s", "bytes_per_decode_step", "ratios", "model")
             if k in report}
    roofline = report.get("roofline") or {}  # a batched bench's: its fraction of the limits per phase, its profile
    if roofline:
        extra["roofline"] = [{k: p[k] for k in ROOFLINE_KEYS} for p in roofline["phases"]]
        extra["profile"] = roofline["profile"]
    return {"rows": rows, **extra}


ROOFLINE_KEYS = ("phase", "steps", "seconds", "gflop_s", "gb_s", "fraction", "fraction_p50", "fraction_at_shape",
                 "step_p50_ms")


def table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines of a table with `rows[0]`'s keys as columns (floats to 4 significant digits)."""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return lines + ["| " + " | ".join(f"{r.get(k):.4g}" if isinstance(r.get(k), float) else str(r.get(k))
                                      for k in keys) + " |" for r in rows]


def outcome(stage: Stage) -> str:
    """ok, exit N, timed out, or not run (the budget ran out before it)."""
    if stage.returncode is None:
        return "timed out" if stage.seconds else "not run"
    return "ok" if stage.returncode == 0 else f"exit {stage.returncode}"


def markdown(env: dict[str, Any], stages: list[Stage]) -> str:
    """The report a person reads."""
    lines = ["# GPU check", "", " | ".join(f"{k}: {v}" for k, v in env.items()), "",
             "| stage | result | seconds | passed | failed | errors | skipped |", "|---|---|---:|---:|---:|---:|---:|"]
    for s in stages:
        result = outcome(s)
        c = s.counts
        lines.append(f"| {s.name} | {result} | {s.seconds:.0f} | {c.get('passed', '')} | {c.get('failed', '')} | "
                     f"{c.get('errors', '')} | {c.get('skipped', '')} |")
    for s in stages:
        if s.failures:
            lines += ["", f"## Failures in {s.name}", ""]
            lines += [f"- `{f['test']}` ({f['kind']}): {f['message']}" for f in s.failures]
    for s in stages:
        if not s.figures:
            continue
        lines += ["", f"## {s.name}", ""]
        rows = s.figures if isinstance(s.figures, list) else s.figures["rows"]
        if rows:
            lines += table(rows)
        if isinstance(s.figures, dict):
            for k in ("bandwidth_bytes_s", "bytes_per_decode_step"):
                if k in s.figures:
                    lines.append(f"\n{k}: {s.figures[k]:.4g}")
            lines += [f"\n{r}" for r in s.figures.get("ratios", [])]
            for k, title in (("roofline", "The engine's fraction of the measured roofline, per phase"),
                             ("profile", "Where a step's time goes (a further run under timing hooks)")):
                if s.figures.get(k):
                    lines += ["", f"{title}:", "", *table(s.figures[k])]
    for s in stages:
        if s.returncode != 0 and s.seconds:
            lines += ["", f"## Log tail of {s.name}", "", "```", s.log_tail[-1500:], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "bench_results" / "gpu"), help="folder of the report")
    parser.add_argument("--only", default=None, help="comma-separated stages (default: all): kernels, oracle, "
                        + ", ".join(BENCHES))
    parser.add_argument("--workers", type=int, default=10,
                        help="pytest-xdist workers of the oracle stage (the kernel stage gets half as many)")
    parser.add_argument("--budget", type=float, default=540,
                        help="seconds for the whole check: a bench that would start with under 30 s left is not run")
    parser.add_argument("--limit", action="append", default=[], metavar="STAGE=SECONDS",
                        help="another time limit for a stage (repeatable)")
    args = parser.parse_args(argv)
    limits = dict(TIME_LIMITS)
    for item in args.limit:
        stage_name, _, seconds = item.partition("=")
        if stage_name not in limits or not seconds.isdigit():
            parser.error(f"--limit {item!r}: expected STAGE=SECONDS with STAGE one of {list(limits)}")
        limits[stage_name] = int(seconds)
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False); run it on a machine with one")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = ["kernels", "oracle", *BENCHES]
    chosen = names if args.only is None else args.only.split(",")
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        parser.error(f"--only: unknown stage(s) {unknown}; choose from {names}")
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
    base_env.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter
    env = environment()
    deadline = time.perf_counter() + args.budget
    stages: list[Stage] = []

    def save() -> None:
        (out / "gpu_report.json").write_text(json.dumps({"environment": env, "stages": [asdict(s) for s in stages]},
                                                        indent=1))
        (out / "gpu_report.md").write_text(markdown(env, stages))

    # The two test stages share the GPU side by side (tiny models: the device is far from busy); the benches
    # then run one at a time on a quiet device, in the order of BENCHES, as long as the budget lasts.
    tests: list[tuple[Stage, float]] = []
    test_env: dict[str, dict[str, str]] = {}
    for name, paths in (("kernels", KERNEL_TESTS), ("oracle", ORACLE_TESTS)):
        if name not in chosen:
            continue
        # The real model cannot be fetched on a machine without a network: its tests are left out, and the
        # report says so, unless the file is in the store already.
        deselect = [] if env["real_model"] else ["-m", "not real_model"]
        workers = args.workers if name == "oracle" else max(1, args.workers // 2)
        # -v: a line per test as it ends, so a stage cut by its limit still names its failures (read_outcome_lines)
        tests.append((Stage(name, [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n",
                                   str(workers), "-rfE", f"--junitxml={out / f'{name}.xml'}", *deselect, *paths]),
                      min(limits[name], args.budget)))
        # Derandomized, no example database: a rerun on another lent machine draws the same examples.
        test_env[name] = base_env | {"INFER_HYPOTHESIS_PROFILE": "ci"} | (
            {"INFER_TEST_DEVICE": "cuda"} if name == "oracle" else {})
    if tests:
        run_stages(tests, test_env, out)
        for stage, _ in tests:
            if (out / f"{stage.name}.xml").exists():
                read_junit(out / f"{stage.name}.xml", stage)
            else:  # cut by its limit: what its per-test lines say
                read_outcome_lines((out / f"{stage.name}.log").read_text(errors="replace"), stage)
            stages.append(stage)
        save()
    for name in BENCHES:
        if name not in chosen:
            continue
        stage = Stage(name, [sys.executable, *BENCHES[name], "--json", str(out / f"{name}.json")])
        left = deadline - time.perf_counter()
        if left < 30:
            stage.log_tail = f"not run: {left:.0f} s of the --budget left"
            print(f"[gpu-check] {name}: {stage.log_tail}", flush=True)
        else:
            run_stages([(stage, min(limits[name], left))], {name: base_env}, out)
            if (out / f"{name}.json").exists():
                stage.figures = bench_figures(name, json.loads((out / f"{name}.json").read_text()))
        stages.append(stage)
        save()
    print(markdown(env, stages))
    return 0 if all(s.returncode == 0 for s in stages) else 1


if __name__ == "__main__":
    sys.exit(main())
