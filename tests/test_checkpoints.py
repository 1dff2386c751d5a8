"""Test checkpoints: deterministic, both config formats alike in transformers, safe to build in parallel."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from reference import Oracle, build_checkpoint
from reference.checkpoints import (
    ARCHS,
    BENCH_CONFIGS,
    CONFIG_CLASSES,
    _cached_build,
    _config_kwargs,
    to_legacy_config,
)
from reference.tiny_tokenizer import TokenIds

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def read_config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("arch", ARCHS)
def test_same_seed_gives_identical_files(arch: str, tmp_path: Path) -> None:
    first = build_checkpoint(arch, seed=3, root=tmp_path / "a")
    second = build_checkpoint(arch, seed=3, root=tmp_path / "b")
    assert sorted(p.name for p in first.iterdir()) == sorted(FILES)
    for name in FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes(), f"{arch}: {name} differs"


@pytest.mark.parametrize("arch", ARCHS)
def test_different_seed_gives_different_weights(arch: str, tmp_path: Path) -> None:
    a = load_file(build_checkpoint(arch, seed=0, root=tmp_path) / "model.safetensors")
    b = load_file(build_checkpoint(arch, seed=1, root=tmp_path) / "model.safetensors")
    assert a.keys() == b.keys()
    same = [name for name in a if torch.equal(a[name], b[name])]
    assert not same, f"{arch}: tensors identical across seeds: {same}"


@pytest.mark.parametrize("arch", ARCHS)
def test_v5_and_legacy_formats_load_to_the_same_model(arch: str) -> None:
    v5_dir, legacy_dir = build_checkpoint(arch), build_checkpoint(arch, config_format="legacy")
    v5_raw, legacy_raw = read_config(v5_dir), read_config(legacy_dir)
    assert "rope_parameters" in v5_raw and "rope_theta" not in v5_raw
    assert "rope_parameters" not in legacy_raw and "layer_types" not in legacy_raw
    assert "rope_theta" in legacy_raw and "rope_scaling" in legacy_raw and "torch_dtype" in legacy_raw

    v5, legacy = AutoConfig.from_pretrained(v5_dir), AutoConfig.from_pretrained(legacy_dir)
    assert v5.rope_parameters == legacy.rope_parameters
    assert getattr(v5, "layer_types", None) == getattr(legacy, "layer_types", None)
    ids = torch.randint(0, v5.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    assert torch.equal(Oracle(v5_dir).logits(ids), Oracle(legacy_dir).logits(ids))


def test_gemma3_legacy_keys_match_the_hub_layout() -> None:
    raw = read_config(build_checkpoint("gemma3_text", config_format="legacy"))
    assert raw["sliding_window_pattern"] == 2 and "_sliding_window_pattern" not in raw
    assert raw["rope_theta"] == 1e6 and raw["rope_local_base_freq"] == 1e4
    assert raw["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    no_scaling = read_config(build_checkpoint("gemma3_text", config_format="legacy", rope_scaling=None))
    assert no_scaling["rope_scaling"] is None


def test_tiny_defaults_exercise_each_architecture() -> None:
    llama = AutoConfig.from_pretrained(build_checkpoint("llama"))
    assert llama.rope_parameters["rope_type"] == "llama3"
    assert llama.rope_parameters["original_max_position_embeddings"] < 2048
    assert not llama.tie_word_embeddings

    qwen2 = AutoConfig.from_pretrained(build_checkpoint("qwen2"))
    assert not qwen2.tie_word_embeddings and qwen2.num_attention_heads == 4 * qwen2.num_key_value_heads
    assert qwen2.head_dim * qwen2.num_attention_heads != qwen2.hidden_size
    assert set(qwen2.layer_types) == {"full_attention"} and qwen2.sliding_window is None  # as released

    qwen3 = AutoConfig.from_pretrained(build_checkpoint("qwen3"))
    assert qwen3.tie_word_embeddings and qwen3.rope_parameters["rope_theta"] == 1e6
    assert qwen3.head_dim * qwen3.num_attention_heads != qwen3.hidden_size

    gemma3 = AutoConfig.from_pretrained(build_checkpoint("gemma3_text"))
    assert set(gemma3.layer_types) == {"sliding_attention", "full_attention"}
    assert gemma3.query_pre_attn_scalar != gemma3.head_dim
    assert gemma3.head_dim * gemma3.num_attention_heads != gemma3.hidden_size
    assert gemma3.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert gemma3.rope_parameters["full_attention"]["rope_type"] == "linear"


def test_overrides_reach_the_config_and_the_cache_key() -> None:
    base = build_checkpoint("gemma3_text")
    path = build_checkpoint("gemma3_text", num_hidden_layers=6, sliding_window_pattern=3, num_key_value_heads=1,
                            head_dim=40)
    assert path != base
    config = AutoConfig.from_pretrained(path)
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (6, 1, 40)
    assert config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    legacy = read_config(
        build_checkpoint("gemma3_text", config_format="legacy", num_hidden_layers=6, sliding_window_pattern=3)
    )
    assert legacy["sliding_window_pattern"] == 3


@pytest.mark.parametrize(("arch", "overrides"), [("qwen2", {}), ("llama", {"attention_bias": True, "mlp_bias": True})])
def test_biases_are_drawn_not_zero(arch: str, overrides: dict[str, Any]) -> None:
    """Every bias is random, or the oracle could not see one dropped; Qwen 2 has q/k/v biases and no other."""
    weights = load_file(build_checkpoint(arch, **overrides) / "model.safetensors")
    biases = {name: t for name, t in weights.items() if name.endswith(".bias")}
    assert biases and all(t.std() > 0.05 for t in biases.values()), {n: t.std().item() for n, t in biases.items()}
    if arch == "qwen2":
        assert {n.split(".")[-2] for n in biases} == {"q_proj", "k_proj", "v_proj"}


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_are_peaked_and_finite_over_2k_tokens(arch: str) -> None:
    oracle = Oracle(build_checkpoint(arch))
    ids = torch.randint(0, oracle.vocab_size, (1, 2048), generator=torch.Generator().manual_seed(0))
    logits = oracle.logits(ids)[0]
    assert torch.isfinite(logits).all()
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.3, "logits too flat: greedy would hinge on rounding"
    assert (logits.argmax(-1) != ids[0]).float().mean() > 0.5, "the model mostly copies its input"


@pytest.mark.parametrize("arch", ARCHS)
def test_earlier_tokens_change_later_predictions(arch: str) -> None:
    oracle = Oracle(build_checkpoint(arch))
    ids = torch.randint(0, oracle.vocab_size, (1, 96), generator=torch.Generator().manual_seed(1))
    changed = ids.clone()
    changed[0, 80] = (changed[0, 80] + 1) % oracle.vocab_size
    before, after = oracle.logits(ids)[0], oracle.logits(changed)[0]
    assert torch.equal(before[:80], after[:80]), "causality: earlier positions must not see a later token"
    moved = (after[81:] - before[81:]).abs().amax(dim=-1)
    assert moved.min() > 1e-3, f"a changed token barely moves later logits: {moved}"
    assert (after[81:].argmax(-1) != before[81:].argmax(-1)).any(), "no later prediction changed"


def test_cached_build_uses_the_winner_of_a_race(tmp_path: Path) -> None:
    def write_while_another_process_wins(directory: Path) -> None:
        (directory / "mine").write_text("loser")
        (tmp_path / "ckpt").mkdir()
        (tmp_path / "ckpt" / "theirs").write_text("winner")

    path = _cached_build(tmp_path, "ckpt", write_while_another_process_wins)
    assert path == tmp_path / "ckpt" and sorted(p.name for p in path.iterdir()) == ["theirs"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"], "the losing temp dir was left behind"


def test_failed_build_leaves_nothing_behind(tmp_path: Path) -> None:
    def broken(directory: Path) -> None:
        (directory / "half").write_text("written")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        _cached_build(tmp_path, "ckpt", broken)
    assert list(tmp_path.iterdir()) == []


def _build_in_subprocess(root: str, barrier: Any, results: Any) -> None:
    barrier.wait()  # start the builds together so they really race
    results.put(str(build_checkpoint("qwen3", seed=11, root=Path(root))))


def test_concurrent_builds_produce_one_valid_directory(tmp_path: Path) -> None:
    # forkserver: children fork from a clean server that imported this module once (fork from a process
    # whose torch has started threads can hang; spawn would re-import transformers in every child).
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    num_procs = 2
    barrier, results = ctx.Barrier(num_procs), ctx.Queue()
    procs = [ctx.Process(target=_build_in_subprocess, args=(str(tmp_path), barrier, results)) for _ in range(num_procs)]
    for p in procs:
        p.start()
    paths = {results.get(timeout=120) for _ in procs}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(paths) == 1
    path = Path(paths.pop())
    assert [p.name for p in tmp_path.iterdir()] == [path.name], "temp dirs left behind"
    assert sorted(p.name for p in path.iterdir()) == sorted(FILES)
    reference = build_checkpoint("qwen3", seed=11, root=tmp_path / "serial")
    assert (path / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()


def test_bad_arguments_give_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown arch 'mistral'"):
        build_checkpoint("mistral")
    with pytest.raises(ValueError, match="unknown config_format"):
        build_checkpoint("llama", config_format="v4")
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        build_checkpoint("llama", vocab_size=100)
    with pytest.raises(ValueError, match=r"unknown llama config field\(s\) \['num_kv_heads'\]"):
        build_checkpoint("llama", num_kv_heads=1)
    with pytest.raises(TypeError, match="JSON"):
        build_checkpoint("llama", rope_scaling={"rope_type": "linear", "factor": torch.tensor(2.0)})


def test_legacy_format_refuses_layer_types_without_a_pattern() -> None:
    v5 = read_config(build_checkpoint("gemma3_text"))
    irregular = {
        **v5,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    }
    with pytest.raises(ValueError, match="no sliding_window_pattern"):
        to_legacy_config(irregular)


@pytest.mark.parametrize(
    ("arch", "num_params"),
    [("llama", 1_235_814_400), ("qwen2", 494_032_768), ("qwen3", 1_720_574_976), ("gemma3_text", 999_885_952)],
)
def test_bench_configs_have_the_real_model_sizes(arch: str, num_params: int) -> None:
    """Llama-3.2-1B, Qwen2.5-0.5B-Instruct and Qwen3-1.7B (tied heads counted once), gemma-3-1b; on the meta
    device (no memory)."""
    ids = TokenIds(vocab_size=512, bos_token_id=1, eos_token_ids=[2], pad_token_id=None)
    config = CONFIG_CLASSES[arch](**_config_kwargs(arch, BENCH_CONFIGS[arch], ids, {}))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == num_params
