"""Each bench contender's memory is measured alone, in a fresh process: its peak, and what it added to a
process that had only imported torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infer.__main__ import main
from infer.bench_memory import MemorySpec, measure
from reference import build_checkpoint


def spec(path: Path, **kwargs: object) -> MemorySpec:
    fields = {"name": "infer[contiguous]", "plugin": None, "path": str(path), "dtype": "float32", "device": "cpu",
              "prompt_ids": [1, 2, 3, 4], "new_tokens": 3, **kwargs}
    return MemorySpec(**fields)  # type: ignore[arg-type]


def test_a_bigger_model_adds_more_memory_in_its_own_process() -> None:
    small = measure(spec(build_checkpoint("llama")))
    big = measure(spec(build_checkpoint("llama", intermediate_size=16384)))  # ~25 MB more fp32 weights
    assert 0 < small.baseline_bytes < small.peak_bytes
    assert big.own_bytes - small.own_bytes > 15 * 2**20, (small, big)


def test_the_hf_contender_is_measured_through_its_plugin() -> None:
    figures = measure(spec(build_checkpoint("llama"), name="hf[dynamic]", plugin="hf"))
    assert figures.own_bytes > 0


def test_a_failing_child_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match=r"memory of hf\[nope\] failed: .*no contender 'hf\[nope\]'"):
        measure(spec(build_checkpoint("llama"), name="hf[nope]", plugin="hf"))


@pytest.mark.parametrize("no_memory", [False, True])
def test_bench_reports_per_contender_memory_unless_told_not_to(tmp_path: Path, no_memory: bool,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", str(build_checkpoint("llama")), "--prompt-len", "4", "--max-new-tokens", "3",
            "--trials", "1", "--warmup", "0", "--positions", "1", "--compare", "--no-roofline", "--json", str(out),
            *(["--no-memory"] if no_memory else [])]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert [row["name"] for row in report["results"]] == ["infer[contiguous]", "infer[no cache]"]
    for row in report["results"]:
        if no_memory:
            assert "own_mib" not in row and "peak_mib" not in row
        else:
            assert row["peak_mib"] > row["own_mib"] > 0 and row["peak_mib"] > report["baseline_mib"]
    assert ("own_mib" in capsys.readouterr().out) is not no_memory
