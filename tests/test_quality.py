"""The KV-cache quality report (`infer.quality`, `python -m infer quality`): its figures against their
definitions computed independently, exact kinds measured as exact, and the command's table and JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import infer
from infer.__main__ import main
from infer.cache import create_cache
from infer.families import ARCHITECTURES
from infer.model_store import default_model_path
from infer.quality import TEXTS, compare, load_text, measure, one_pass_logits, text_ids
from reference import Oracle, build_checkpoint
from tests.helpers import assert_close


def test_compare_matches_the_definitions() -> None:
    """top-1 agreement, mean KL(exact || lossy), max logit error and the perplexity ratio, from numpy."""
    gen = torch.Generator().manual_seed(0)
    exact = torch.randn(50, 30, generator=gen) * 3
    lossy = exact + torch.randn(50, 30, generator=gen) * 0.7
    targets = torch.randint(0, 30, (50,), generator=gen)
    got = compare("x", exact, lossy, targets, cache_bytes=30, exact_bytes=120)

    def log_softmax(a: np.ndarray) -> np.ndarray:
        a = a - a.max(-1, keepdims=True)
        return a - np.log(np.exp(a).sum(-1, keepdims=True))

    e, q = log_softmax(exact.double().numpy()), log_softmax(lossy.double().numpy())
    kl = (np.exp(e) * (e - q)).sum(-1).mean()
    t = targets.numpy()
    ppl_e = math.exp(-e[np.arange(50), t].mean())
    ppl_q = math.exp(-q[np.arange(50), t].mean())
    assert got.top1_agreement == pytest.approx((e.argmax(-1) == q.argmax(-1)).mean())
    assert got.mean_kl == pytest.approx(kl, rel=1e-4)
    assert got.max_logit_error == pytest.approx(np.abs(exact.numpy() - lossy.numpy()).max())
    assert got.perplexity == pytest.approx(ppl_q, rel=1e-5)
    assert got.perplexity_ratio == pytest.approx(ppl_q / ppl_e, rel=1e-5)
    assert got.bytes_ratio == 0.25 and got.steps == 50


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_one_pass_reads_the_text_as_the_oracle(arch: str) -> None:
    """The fp32 reference of the weight comparisons and of the real model's lossy-kind bounds: the logits predicting
    ids[prefill:] are transformers' over the whole text, row for row; the bytes are the exact cache's."""
    path = build_checkpoint(arch)
    model = infer.load_model(path)
    ids = torch.randint(0, model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    got, nbytes = one_pass_logits(model, ids, 5)
    want = Oracle(path).logits(torch.tensor([ids]))[0, 4:-1].float().cpu()
    assert got.shape == want.shape == (19, model.config.vocab_size)
    assert_close(got, want, 1e-5 * max(1.0, want.abs().max().item()), f"{arch}: one pass vs the oracle")
    assert nbytes == create_cache("contiguous", model.config, max_seq_len=24).memory_bytes
    with pytest.raises(ValueError, match=r"prefill must lie in \[1, 23\]"):
        one_pass_logits(model, ids, 24)


def test_exact_kinds_measure_exact_and_lossy_ones_do_not() -> None:
    model = infer.load_model(None, dtype="float32")  # the default model: the real SmolLM2
    ids = text_ids(infer.Tokenizer(default_model_path()), load_text("prose"), 64)
    rows = {r.kind: r for r in measure(model, ids, ["contiguous", "paged", "sliding", "int4"], prefill=8)}
    for kind in ("contiguous", "paged", "sliding"):
        assert rows[kind].top1_agreement == 1.0 and rows[kind].max_logit_error == 0.0, kind
        assert rows[kind].perplexity_ratio == 1.0, kind
    # At 64 tokens the exact sinks and the ring (16-46 newest tokens) are most of an int4 cache; at 4k they are not.
    assert rows["int4"].max_logit_error > 0 and rows["int4"].bytes_ratio < 0.9
    assert rows["int4"].steps == 64 - 8
    exact, int4 = (create_cache(kind, model.config, max_seq_len=4096, dtype=torch.bfloat16).memory_bytes
                   for kind in ("contiguous", "int4"))
    assert int4 / exact < 0.3


def test_shipped_texts_are_real_text() -> None:
    prose, code = load_text("prose"), load_text("code")
    assert prose.startswith("It is a truth universally acknowledged") and len(prose) > 10_000
    assert "def " in code and set(TEXTS) == {"prose", "code"}
    with pytest.raises(FileNotFoundError, match="neither one of prose, code nor a file"):
        load_text("poetry")


def test_quality_command_prints_the_table_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "q.json"
    assert main(["quality", "--kinds", "contiguous,int8", "--tokens", "40", "--prefill", "8", "--threads", "1",
                 "--text", "code", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "ppl ratio" in printed and "int8" in printed
    report = json.loads(out.read_text())
    assert [k["kind"] for k in report["kinds"]] == ["contiguous", "int8"] and report["tokens"] == 40


def test_quality_command_refuses_bad_arguments_before_loading(capsys: pytest.CaptureFixture) -> None:
    assert main(["quality", "--kinds", "int3"]) == 2
    assert "unknown cache kind(s) int3" in capsys.readouterr().err
    assert main(["quality", "--tokens", "10", "--prefill", "10"]) == 2
    assert "--prefill must lie in" in capsys.readouterr().err


def test_quality_command_compares_weight_storages(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--compare-weights: each storage of the default model (its Q4_1 file) against its dequantized weights."""
    out = tmp_path / "w.json"
    assert main(["quality", "--compare-weights", "stored,int8", "--tokens", "40", "--prefill", "8", "--threads", "1",
                 "--json", str(out)]) == 0
    assert "against the dense (dequantized) weights" in capsys.readouterr().out
    rows = {k["kind"]: k for k in json.loads(out.read_text())["kinds"]}
    assert set(rows) == {"stored weights", "int8 weights"}
    assert rows["stored weights"]["top1_agreement"] == 1.0  # the same weights, fp32 rounding apart
    assert rows["stored weights"]["bytes_ratio"] < 0.25 < rows["int8 weights"]["bytes_ratio"] < 0.4  # of fp32
    assert main(["quality", "--compare-weights", "int3"]) == 2
    assert "unknown weight storage(s) int3" in capsys.readouterr().err
