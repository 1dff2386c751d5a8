"""tests/gpu_check.py where no GPU is: one line and a non-zero exit, and its report from pytest's JUnit XML."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import gpu_check

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_it_says_so_in_one_line_and_exits_non_zero(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "no CUDA device" in out[0]
    assert not any(tmp_path.iterdir()), "nothing is written when nothing ran"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_the_cuda_test_switch_refuses_a_machine_without_cuda() -> None:
    env = {**os.environ, "INFER_TEST_DEVICE": "cuda"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                          "tests/test_gpu_check.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "INFER_TEST_DEVICE=cuda" in run.stdout + run.stderr


def test_the_report_counts_every_outcome_and_names_each_failure(tmp_path: Path) -> None:
    junit = tmp_path / "oracle.xml"
    junit.write_text(
        '<?xml version="1.0"?><testsuites><testsuite>'
        '<testcase classname="tests.test_a" name="test_ok"/>'
        '<testcase classname="tests.test_a" name="test_bad[llama]"><failure message="assert 1 == 2">tb</failure>'
        '</testcase>'
        '<testcase classname="tests.test_b" name="test_broken"><error message="fixture failed">tb</error></testcase>'
        '<testcase classname="tests.test_b" name="test_gpu"><skipped message="needs CUDA"/></testcase>'
        '</testsuite></testsuites>')
    stage = gpu_check.Stage("oracle", ["pytest"], returncode=1, seconds=3.0)
    gpu_check.read_junit(junit, stage)
    assert stage.counts == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1}
    assert [f["test"] for f in stage.failures] == ["tests.test_a::test_bad[llama]", "tests.test_b::test_broken"]
    report = gpu_check.markdown({"device": "test"}, [stage])
    assert "| oracle | exit 1 | 3 | 1 | 1 | 1 | 1 |" in report
    assert "`tests.test_a::test_bad[llama]` (failure): assert 1 == 2" in report


def test_a_stage_cut_by_its_limit_still_counts_and_names_its_failures() -> None:
    """A test stage killed at its limit writes no JUnit XML and no summary: its per-test lines (`-v`, with and
    without xdist) give the counts and the failing ids."""
    log = ("bringing up nodes...\n"
           "[gw1] [ 25%] PASSED tests/test_a.py::test_ok \n"
           "[gw0] [ 50%] FAILED tests/property/test_b.py::test_bad[int8-llama] \n"
           "[gw1] [ 75%] SKIPPED tests/test_a.py::test_gpu \n"
           "tests/test_c.py::test_fixture ERROR                                   [ 90%]\n"
           "[gw2] [ 99%] XFAIL tests/test_a.py::test_known \n"
           "E   assert PASSED tests/not_a_test_line is only text\n")
    stage = gpu_check.Stage("oracle", ["pytest"], returncode=None, seconds=330.0)
    gpu_check.read_outcome_lines(log, stage)
    assert stage.counts == {"passed": 1, "failed": 1, "errors": 1, "skipped": 2}
    assert [(f["test"], f["kind"]) for f in stage.failures] == [
        ("tests/property/test_b.py::test_bad[int8-llama]", "failure"), ("tests/test_c.py::test_fixture", "error")]
    assert "| oracle | timed out | 330 | 1 | 1 | 1 | 2 |" in gpu_check.markdown({"device": "test"}, [stage])


def test_a_batched_bench_reports_its_roofline_per_phase_and_its_profile() -> None:
    """A batched bench's JSON (`bench --batched --json`) gives the report its fraction of the measured roofline per
    phase and where a step's time goes, as tables; one run without the roofline (`--no-roofline`) gives neither."""
    phases = [{"phase": phase, "steps": steps, "seconds": 0.5, "gflop": 1.0, "gb": 2.0, "gflop_s": 3.0, "gb_s": 4.0,
               "roofline_s": 0.1, "fraction": fraction, "fraction_p50": 0.21, "fraction_at_shape": 0.25,
               "step_p50_ms": 4.5}
              for phase, steps, fraction in (("mixed", 137, 0.07), ("decode", 128, 0.19))]
    profile = [{"part": "attention", "seconds": 1.97, "share": 0.32}]
    report = {"results": [{"name": "infer engine", "tok_s": 3082.0}], "ratios": ["x"],
              "roofline": {"phases": phases, "profile": profile, "read_bandwidth": 3.2e12}}
    stage = gpu_check.Stage("bench-batched-256", ["python"], returncode=0, seconds=54.0)
    stage.figures = gpu_check.bench_figures("bench-batched-256", report)
    text = gpu_check.markdown({"device": "test"}, [stage])
    assert "| decode | 128 | 0.5 | 3 | 4 | 0.19 | 0.21 | 0.25 | 4.5 |" in text
    assert "| mixed | 137 |" in text and "| attention | 1.97 | 0.32 |" in text
    stage.figures = gpu_check.bench_figures("bench-batched-256", report | {"roofline": None})
    text = gpu_check.markdown({"device": "test"}, [stage])
    assert "| decode |" not in text and "attention" not in text and "| infer engine | 3082 |" in text
