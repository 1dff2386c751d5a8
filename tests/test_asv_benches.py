"""The asv benchmarks run: every benchmark body once at its smallest parameters (no timing asserted)."""

from __future__ import annotations

import itertools

import pytest

from asv_benches import benchmarks as b

SMALL = {"context": [128], "prompt_len": [128]}
# Whole generations are the slow bodies; every cache kind is already driven by DecodeStep.
SMALL_BY_CLASS = {"Generation": {"cache": ["contiguous", "paged"]}}


def small_params(cls: type) -> list[tuple]:
    names = cls.param_names  # type: ignore[attr-defined]
    small = {**SMALL, **SMALL_BY_CLASS.get(cls.__name__, {})}
    grids = [small.get(name, values) for name, values in zip(names, cls.params, strict=True)]  # type: ignore[attr-defined]
    return list(itertools.product(*grids))


CASES = [
    (cls, method, params)
    for cls in (b.DecodeStep, b.Prefill, b.Generation, b.CacheMemory)
    for method in [m for m in dir(cls) if m.startswith(("time_", "peakmem_", "track_"))]
    for params in small_params(cls)
]


@pytest.mark.parametrize(("cls", "method", "params"), CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_benchmark_body_runs(cls: type, method: str, params: tuple) -> None:
    bench = cls()
    if hasattr(bench, "setup"):
        bench.setup(*params)
    result = getattr(bench, method)(*params)
    if method.startswith("track_"):
        assert result > 0
