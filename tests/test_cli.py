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
from infer.sampling import SamplingParams
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
    (["generate", "Hi", "--decode-gemv", "gemm"], "invalid choice: 'gemm'"),
    (["generate", "Hi", "--weights", "int3"], "invalid choice: 'int3'"),
    (["generate", "Hi", "--weights", "int4", "--group-size", "48"], "invalid choice: 48"),
    (["bench", "--prompt-len", "0"], "--prompt-len must be >= 1"),
    (["bench", "--model", "org/model"], "only local checkpoint directories are read"),
    (["bench", "--batched", "--no-roofline", "--plot", "r.png"], "--plot draws the steps against the roofline"),
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
    """Raw text (--no-chat): the prompt, then its continuation."""
    code, out, err = run_main(["generate", "Once upon", "--max-new-tokens", "4", "--temperature", "0", "--no-chat"],
                              capsys)
    assert code == 0 and out.startswith("Once upon") and out.endswith("\n")
    assert "4 generated (length)" in err


@pytest.mark.parametrize("weights", ["auto", "int8", "dense"])
def test_the_default_model_answers_with_its_weights_stored_quantized_or_dense(
        weights: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--weights auto runs the Q4_1 file as stored; int8 requantizes it; dense dequantizes: each still answers."""
    code, out, err = run_main(["generate", "What is the capital of France?", "--temperature", "0",
                               "--weights", weights, "--max-new-tokens", "12"], capsys)
    assert code == 0 and "Paris" in out, (out, err)


def test_the_default_model_answers_a_question_as_a_chat_model(capsys: pytest.CaptureFixture[str]) -> None:
    """No --model: the real SmolLM2-135M-Instruct, through its chat template, stopping at its end of turn."""
    code, out, err = run_main(["generate", "What is the capital of France?", "--temperature", "0"], capsys)
    assert code == 0 and "Paris" in out and "(eos)" in err
    assert not out.startswith("What is the capital"), "a chat answer, not the prompt continued"


def cli(*args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # A run started in the background by a script (`cmd &`, no job control) ignores SIGINT, and a child
    # inherits the ignore (Python then installs no KeyboardInterrupt handler): give the CLI the default.
    return subprocess.Popen([sys.executable, "-m", "infer", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.fixture(scope="module")
def endless_dir() -> Path:
    """A tiny model with a long context, run with --ignore-eos: generation cannot end by itself (~20 s) before
    the test signals it (the default model's 512 tokens took 1.4 s, which a loaded machine can spend first)."""
    return build_checkpoint("llama", max_position_embeddings=32768)


def test_ctrl_c_exits_130_and_keeps_what_was_printed(endless_dir: Path) -> None:
    proc = cli("generate", "Once", "--model", str(endless_dir), "--max-new-tokens", "20000", "--temperature", "0",
               "--ignore-eos", "--threads", "1")
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.read(12)  # generation has started once text beyond the prompt arrives
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert (first + rest).startswith(b"Once") and len(first + rest) > len(b"Once")
    assert err.decode().strip().splitlines()[-1] == "interrupted" and b"Traceback" not in err


def test_a_closed_pipe_exits_141_without_a_traceback(endless_dir: Path) -> None:
    proc = cli("generate", "Once", "--model", str(endless_dir), "--max-new-tokens", "20000", "--temperature", "0",
               "--ignore-eos", "--threads", "1")
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(8)
    proc.stdout.close()
    err = proc.stderr.read()
    proc.wait(timeout=60)
    assert proc.returncode == 141
    assert b"Traceback" not in err and b"Exception ignored" not in err
    assert err.decode().strip().splitlines() == ["error: stdout was closed; stopped"]


def test_ignore_eos_generates_past_the_end_token(endless_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "Once", "--model", str(endless_dir), "--max-new-tokens", "600", "--temperature", "0"]
    code, _, err = run_main(argv, capsys)
    assert code == 0 and "generated (eos)" in err  # this model ends "Once" within 600 tokens (at 355)...
    code, _, err = run_main([*argv, "--ignore-eos"], capsys)
    assert code == 0 and "600 generated (length)" in err  # ...and --ignore-eos goes on to the limit


GENERATION_CONFIGS = [
    {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95},
    {"do_sample": False, "temperature": 0.7, "top_k": 5},
    {"do_sample": True},
    {"do_sample": True, "min_p": 0.1, "repetition_penalty": 1.3, "max_new_tokens": 7},
    {"repetition_penalty": 1.1},
    None,
]


@pytest.mark.parametrize("generation", GENERATION_CONFIGS, ids=lambda g: "no file" if g is None else str(g))
def test_generation_defaults_read_generation_config_as_transformers(tmp_path: Path, generation: dict | None) -> None:
    from transformers import GenerationConfig

    from infer.loader import generation_defaults

    target = tmp_path / "ckpt"
    shutil.copytree(build_checkpoint("llama"), target)
    (target / "generation_config.json").unlink()
    if generation is not None:
        (target / "generation_config.json").write_text(json.dumps(generation))
    ours = SamplingParams(**generation_defaults(target))
    config = GenerationConfig.from_pretrained(target) if generation is not None else GenerationConfig()
    # What generate() uses: the file's values, transformers' global defaults for the fields it leaves unset.
    defaults = config._get_default_generation_params()
    hf = {k: getattr(config, k) if getattr(config, k) is not None else defaults.get(k)
          for k in ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens")}
    assert ours.repetition_penalty == hf["repetition_penalty"]
    if not hf["do_sample"]:
        assert ours.is_greedy
    else:
        assert (ours.temperature, ours.top_k, ours.top_p, ours.min_p) == (
            hf["temperature"], hf["top_k"], hf["top_p"], hf["min_p"] or 0.0)
    if generation is not None and "max_new_tokens" in generation:
        assert ours.max_new_tokens == hf["max_new_tokens"]


@pytest.mark.parametrize(("field", "value"), [("do_sample", "yes"), ("temperature", "hot"), ("top_k", -1),
                                              ("top_p", float("nan"))])
def test_bad_generation_config_fields_are_named(tmp_path: Path, field: str, value: object,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "ckpt"
    shutil.copytree(build_checkpoint("llama"), target)
    (target / "generation_config.json").write_text(json.dumps({"do_sample": True, field: value}))
    code, out, err = run_main(["generate", "Hi", "--model", str(target)], capsys)
    assert (code, out) == (2, "") and "generation_config.json" in err and field in err


def test_cli_defaults_come_from_the_checkpoint_and_flags_win(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    import infer.generation

    seen: list[SamplingParams] = []
    real = infer.generation.generate

    def spy(model: object, tokenizer: object, prompt: object, params: SamplingParams, **kw: object) -> object:
        seen.append(params)
        return real(model, tokenizer, prompt, params, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(infer.generation, "generate", spy)
    path = str(build_checkpoint("qwen3"))  # generation_config.json: do_sample, temperature 0.6, top_k 20, top_p 0.95
    assert run_main(["generate", "Hi", "--model", path, "--max-new-tokens", "2"], capsys)[0] == 0
    assert (seen[-1].temperature, seen[-1].top_k, seen[-1].top_p) == (0.6, 20, 0.95)
    argv = ["generate", "Hi", "--model", path, "--max-new-tokens", "2", "--temperature", "0.9", "--top-k", "3",
            "--min-p", "0.05", "--repetition-penalty", "1.2", "--seed", "4"]
    assert run_main(argv, capsys)[0] == 0
    p = seen[-1]
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.seed) == (0.9, 3, 0.95, 0.05, 1.2, 4)


def test_system_message_stdin_and_prompt_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    import io

    from infer.tokenizer import Tokenizer

    path = build_checkpoint("llama")
    tok = Tokenizer(path)
    base = ["generate", "--model", str(path), "--max-new-tokens", "1", "--temperature", "0"]
    code, _, err = run_main([*base, "Hello there", "--system", "Be brief."], capsys)
    expected = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Hello there"}])
    assert code == 0 and f"[{len(expected)} prompt tokens" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin"))
    code, out, _ = run_main([*base, "-"], capsys)
    assert code == 0 and out.startswith("from stdin")
    (tmp_path / "prompt.txt").write_text("from a file", encoding="utf-8")
    code, out, _ = run_main([*base, "--prompt-file", str(tmp_path / "prompt.txt")], capsys)
    assert code == 0 and out.startswith("from a file")
    code, out, err = run_main([*base, "--prompt-file", str(tmp_path / "missing.txt")], capsys)
    assert (code, out) == (2, "") and "--prompt-file" in err
    code, out, err = run_main(base, capsys)
    assert (code, out) == (2, "") and "no prompt" in err


def test_help_shows_defaults_and_shared_names(capsys: pytest.CaptureFixture[str]) -> None:
    helps = {}
    for command in ("generate", "bench"):
        code, out, _ = run_main([command, "--help"], capsys)
        assert code == 0
        helps[command] = out
    assert "(default: contiguous)" in helps["generate"] and "(default: bfloat16)" in helps["bench"]
    for shared in ("--model", "--dtype", "--device", "--compute-dtype", "--threads", "--seed", "--cache",
                   "--max-new-tokens", "--decode-gemv", "--no-huge-pages", "--no-native-ops"):
        assert shared in helps["generate"] and shared in helps["bench"], shared


def test_forced_speed_choices_reach_the_model(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                                              ) -> None:
    """--decode-gemv, --no-huge-pages, --no-native-ops and --no-native-step load the model as asked; a native form
    this machine cannot build is refused in one line before the model loads."""
    import infer.__main__
    from infer.kernels import native

    loaded = []
    real = infer.__main__.load_with_args

    def spy(path: Path, args: object) -> object:
        model = real(path, args)  # type: ignore[arg-type]
        loaded.append((model.decode_gemv, model.huge_pages, model.native_ops, model.native_step))
        return model

    monkeypatch.setattr(infer.__main__, "load_with_args", spy)
    argv = ["generate", "Hi", "--max-new-tokens", "2", "--decode-gemv", "mv", "--no-huge-pages", "--no-native-ops",
            "--no-native-step"]
    assert run_main(argv, capsys)[0] == 0
    assert loaded == [("mv", False, False, False)]
    monkeypatch.setattr(native, "native_kernels", lambda flavour="native": None)
    monkeypatch.setattr(native, "unavailable_reason", lambda flavour="native": "no C compiler on PATH")
    code, out, err = run_main(["generate", "Hi", "--decode-gemv", "native"], capsys)
    assert (code, out) == (2, "") and err.strip().endswith("--decode-gemv native is unavailable here: no C compiler "
                                                          "on PATH; use auto"), err
    assert len(loaded) == 1, "refused before the model loads"
