"""The CLI: every error is one line on stderr and a non-zero exit, never a traceback, and arguments are
checked before the model loads or the prompt is echoed; Ctrl-C exits 130 keeping what was printed; a closed
pipe exits 141 quietly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import infer.loader
from infer.__main__ import main
from reference import build_checkpoint


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def broken_checkpoint(tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(build_checkpoint("llama"), target)
    config = json.loads((target / "config.json").read_text())
    config["rms_norm_eps"] = -1
    (target / "config.json").write_text(json.dumps(config))
    return target


BAD_ARGS = [
    (["generate", "Hi", "--model", "meta-llama/Llama-3.2-1B"], "only local checkpoint directories are read"),
    (["generate", "Hi", "--device", "tpu"], "unknown device 'tpu'"),
    (["generate", "Hi", "--dtype", "int8"], "unknown dtype 'int8'"),
    (["generate", "Hi", "--compute-dtype", "fp8"], "unknown dtype 'fp8'"),
    (["generate", "Hi", "--max-new-tokens", "x"], "invalid int value: 'x'"),
    (["generate", "Hi", "--temperature", "-1"], "temperature=-1.0 is invalid"),
    (["generate", "Hi", "--temperature", "inf"], "temperature=inf is invalid"),
    (["generate", "Hi", "--top-p", "2"], "top_p=2.0 is invalid"),
    (["generate", "Hi", "--threads", "-1"], "--threads must be >= 0"),
    (["generate", "Hi", "--cache", "huge"], "invalid choice: 'huge'"),
    (["bench", "--prompt-len", "0"], "--prompt-len must be >= 1"),
    (["bench", "--model", "org/model"], "only local checkpoint directories are read"),
    ([], "the following arguments are required"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_ARGS, ids=[" ".join(a) or "nothing" for a, _ in BAD_ARGS])
def test_bad_arguments_are_one_line_before_anything_runs(argv: list[str], message: str,
                                                         capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def no_loading(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(infer.loader, "load_model", no_loading)
    code, out, err = run_main(argv, capsys)
    assert code == 2
    assert out == "", "nothing may be echoed before the arguments are checked"
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_a_file_as_model_and_a_broken_checkpoint(tmp_path: Path, broken_checkpoint: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    for model, message in ((broken_checkpoint / "config.json", "is a file; pass the checkpoint directory"),
                           (broken_checkpoint, "rms_norm_eps=-1 is invalid")):
        code, out, err = run_main(["generate", "Hi", "--model", str(model)], capsys)
        assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1 and message in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(["generate", "Hi", "--device", "cuda"], capsys)
    assert (code, out) == (2, "") and "no CUDA device" in err


def test_success_prints_the_text_and_a_summary(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(["generate", "Once upon", "--max-new-tokens", "4", "--temperature", "0"], capsys)
    assert code == 0 and out.startswith("Once upon") and out.endswith("\n")
    assert "4 generated (length)" in err


def cli(*args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "infer", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env)


def test_ctrl_c_exits_130_and_keeps_what_was_printed() -> None:
    proc = cli("generate", "Once", "--max-new-tokens", "100000", "--temperature", "0")
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.read(12)  # generation has started once text beyond the prompt arrives
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert (first + rest).startswith(b"Once") and len(first + rest) > len(b"Once")
    assert err.decode().strip().splitlines()[-1] == "interrupted" and b"Traceback" not in err


def test_a_closed_pipe_exits_141_without_a_traceback() -> None:
    proc = cli("generate", "Once", "--max-new-tokens", "100000", "--temperature", "0")
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(8)
    proc.stdout.close()
    err = proc.stderr.read()
    proc.wait(timeout=60)
    assert proc.returncode == 141
    assert b"Traceback" not in err and b"Exception ignored" not in err
    assert err.decode().strip().splitlines() == ["error: stdout was closed; stopped"]
