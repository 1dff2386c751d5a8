"""Loader: sharded checkpoints, and every bad input gets an error naming the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import infer
from infer.errors import CheckpointError
from infer.families import ARCHITECTURES
from reference import build_checkpoint


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A private copy of the tiny Llama checkpoint that a test may damage."""
    target = tmp_path / "ckpt"
    shutil.copytree(build_checkpoint("llama"), target)
    return target


def test_sharded_checkpoint_loads_identically(ckpt: Path, tmp_path: Path) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    sharded = tmp_path / "sharded"
    shutil.copytree(ckpt, sharded)
    (sharded / "model.safetensors").unlink()
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, sharded / file)
        weight_map.update({n: file for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ids = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(infer.load_model(sharded)(ids), infer.load_model(ckpt)(ids))


def test_missing_directory() -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        infer.load_model("/nonexistent/checkpoint")


def test_missing_config(ckpt: Path) -> None:
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        infer.load_model(ckpt)


def test_missing_weights(ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        infer.load_model(ckpt)


def test_missing_shard(ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors"):
        infer.load_model(ckpt)


def test_unsupported_model_type_lists_supported(ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    config["model_type"] = "mistral"
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"'mistral'.*" + ", ".join(ARCHITECTURES)):
        infer.load_model(ckpt)


def test_missing_tensor_is_named(ckpt: Path) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.up_proj\.weight"):
        infer.load_model(ckpt)


def test_misshaped_tensor_names_both_shapes(ckpt: Path) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    good = tuple(tensors["model.norm.weight"].shape)
    tensors["model.norm.weight"] = torch.ones(good[0] + 1)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"norm\.weight.*\({good[0] + 1},\).*\({good[0]},\)"):
        infer.load_model(ckpt)


def test_corrupt_safetensors(ckpt: Path) -> None:
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        infer.load_model(ckpt)


def test_invalid_config_json(ckpt: Path) -> None:
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        infer.load_model(ckpt)


def test_unknown_dtype(ckpt: Path) -> None:
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        infer.load_model(ckpt, dtype="float8")


def test_checkpoint_files_are_not_modified(ckpt: Path) -> None:
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    infer.load_model(ckpt, dtype="bfloat16")
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before


def test_weights_are_read_into_their_own_memory_not_a_map_of_the_file() -> None:
    """The loader reads tensors straight into the model's memory: no map of the checkpoint stays behind (a
    map's touched pages count in the process's memory beside the copies, doubling the peak)."""
    from pathlib import Path

    import infer
    from reference import build_checkpoint

    path = build_checkpoint("llama")
    model = infer.load_model(path)
    maps = Path("/proc/self/maps")
    if maps.exists():
        assert str(path / "model.safetensors") not in maps.read_text()
    assert all(p.is_contiguous() for p in model.parameters())


def test_the_finite_check_reaches_every_chunk() -> None:
    import torch

    from infer.loader import _all_finite

    big = torch.zeros(3 * 1000 + 7, dtype=torch.bfloat16)
    assert _all_finite(big, chunk=1000)
    for bad in (float("nan"), float("inf")):
        flawed = big.clone()
        flawed[-1] = bad
        assert not _all_finite(flawed, chunk=1000), f"{bad} in the last, short chunk"


def test_loading_and_generating_do_not_import_torch_compile() -> None:
    """A process that loads a model and generates never imports torch._dynamo: its import is ~2 s, a third of a small
    `infer generate`'s wall time (nn.Embedding's random init, replaced by the checkpoint's weights anyway, was what
    pulled it in)."""
    import subprocess
    import sys

    script = ("import sys, infer; m = infer.load_model(sys.argv[1]); "
              "infer.generate(m, None, [1, 2, 3], infer.SamplingParams(max_new_tokens=2, temperature=0.0)); "
              "print(sorted(n for n in sys.modules if n.startswith('torch._dynamo')))")
    run = subprocess.run([sys.executable, "-c", script, str(build_checkpoint("llama"))], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]", run.stdout
