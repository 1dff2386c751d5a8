"""The bench's report: a person can trust it — ratios worded the right way round, the machine, the commit,
the choices made, units and every contender's raw trials in the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
            "--trials", "2", "--warmup", "0", "--positions", "1", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "choices (threads" in printed and "prefill matmul dtype" in printed and "decode GEMV form" in printed
    report = json.loads(out.read_text())
    machine = report["machine"]
    assert {"torch", "threads", "cpu_count"} <= machine.keys() and isinstance(machine["threads"], int)
    assert {c["name"] for c in report["choices"]} >= {"prefill matmul dtype", "decode GEMV form"}
    assert report["units"]["decode_tok_s"] == "tokens/s"
    assert report["bandwidth_bytes_s"] > 0 and report["copy_bandwidth_bytes_s"] > 0
    assert report["units"]["roofline_fraction"] == "fraction of read bandwidth"
    trials = report["contenders"]["infer[contiguous]"]
    assert len(trials) == 2 and all(len(t["step_times_s"]) == 3 for t in trials), trials[0].keys()
