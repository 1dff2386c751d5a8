"""Speed choices by capability: the prefill dtype follows the CPU's half-precision units, can be forced, and
is reported with its reason."""

from __future__ import annotations

import pytest
import torch

from infer.tuning import CHOICES, choose_prefill_dtype, cpu_flags

CPU = torch.device("cpu")
AMX_XEON = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"})
AVX2_EPYC = frozenset({"avx2", "fma", "f16c"})


@pytest.mark.parametrize(("weights", "flags", "value", "reason"), [
    (torch.bfloat16, AMX_XEON, "exact", "native here (amx_bf16, avx512_bf16)"),
    (torch.bfloat16, AVX2_EPYC, "float32", "no amx_bf16 or avx512_bf16"),
    (torch.float16, AMX_XEON, "float32", "no amx_fp16 or avx512_fp16"),
    (torch.float16, AVX2_EPYC | {"avx512_fp16"}, "exact", "native here (avx512_fp16)"),
    (torch.float32, AVX2_EPYC, "exact", "nothing to choose"),
])
def test_prefill_dtype_follows_the_cpus_units(weights: torch.dtype, flags: frozenset[str], value: str,
                                              reason: str) -> None:
    choice = choose_prefill_dtype(weights, CPU, flags=flags)
    assert (choice.value, reason in choice.reason) == (value, True), choice
    assert CHOICES["prefill matmul dtype"] == choice, "the latest choice is what reports print"


def test_unreadable_flags_fall_back_to_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    import infer.tuning

    monkeypatch.setattr(infer.tuning, "_time_prefill_matmul", lambda dtype: (2.0, 1.0))
    monkeypatch.setattr(infer.tuning, "cpu_flags", lambda: None)
    choice = choose_prefill_dtype(torch.bfloat16, CPU)
    assert choice.value == "float32" and "measured" in choice.reason
    monkeypatch.setattr(infer.tuning, "_time_prefill_matmul", lambda dtype: (1.0, 2.0))
    assert choose_prefill_dtype(torch.bfloat16, CPU).value == "exact"


def test_gpu_and_fp32_have_nothing_to_choose() -> None:
    assert choose_prefill_dtype(torch.bfloat16, torch.device("cuda")).value == "exact"


def test_cpu_flags_parse_proc_cpuinfo(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "cpuinfo"
    path.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\nbogomips\t: 1\n")
    assert cpu_flags(str(path)) == frozenset({"fpu", "avx2", "amx_bf16"})
    assert cpu_flags(str(path) + ".missing") is None
