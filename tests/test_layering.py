"""The engine stands alone: nothing under infer/ imports `reference` or `transformers`; the bench finds the
Hugging Face contender and its checkpoint builder as entry-point plugins."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import infer.bench
from infer.__main__ import main

ENGINE = Path(infer.bench.__file__).parent
FORBIDDEN = ("reference", "transformers")


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", sorted(ENGINE.rglob("*.py")), ids=lambda p: str(p.relative_to(ENGINE)))
def test_no_engine_module_imports_reference_or_transformers(path: Path) -> None:
    bad = {m for m in imported_modules(path) if m.split(".")[0] in FORBIDDEN}
    assert not bad, f"{path} imports {sorted(bad)}"


def test_importing_the_engine_and_its_cli_loads_neither() -> None:
    code = ("import sys, infer, infer.bench, infer.__main__\n"
            "from infer.__main__ import build_parser; build_parser()\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('reference', 'transformers'))\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bench_plugins_are_found_by_entry_point() -> None:
    from reference.checkpoints import build_bench_checkpoint
    from reference.hf_bench import hf_contenders

    assert infer.bench.plugin(infer.bench.CONTENDER_PLUGINS, "hf") is hf_contenders
    assert infer.bench.plugin(infer.bench.CHECKPOINT_PLUGINS, "random") is build_bench_checkpoint


def test_an_unknown_contender_fails_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--against", "vllm", "--model", "/nonexistent-but-checked-later"]) == 2
    err = capsys.readouterr().err
    assert "no such directory" in err or "no bench plugin 'vllm' is installed (in infer.bench.contenders: hf" in err
    assert main(["bench", "--against", "vllm", "--size", "150m", "--arch", "llama"]) == 2
    assert "no bench plugin 'vllm' is installed (in infer.bench.contenders: hf" in capsys.readouterr().err
