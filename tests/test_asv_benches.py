"""The asv benchmarks run: every benchmark body once at its smallest parameters (no timing asserted; one whose
setup raises NotImplementedError, as asv skips it, is skipped)."""

from __future__ import annotations

import itertools

import pytest

from asv_benches import benchmarks as b

SMALL = {"context": [128], "prompt_len": [128]}
# Whole generations are the slow bodies; every cache kind is already driven by DecodeStep.
SMALL_BY_CLASS = {"Generation": {"cache": ["contiguous", "paged"]}, "BatchedEngine": {"architecture": ["gemma3_text"]}}


def small_params(cls: type) -> list[tuple]:
    names = cls.param_names  # type: ignore[attr-defined]
    small = {**SMALL, **SMALL_BY_CLASS.get(cls.__name__, {})}
    grids = [small.get(name, values) for name, values in zip(names, cls.params, strict=True)]  # type: ignore[attr-defined]
    return list(itertools.product(*grids))


CASES = [
    (cls, method, params)
    for cls in (b.DecodeStep, b.Prefill, b.Generation, b.CacheMemory, b.BatchedEngine, b.PackedProducts)
    for method in [m for m in dir(cls) if m.startswith(("time_", "peakmem_", "track_"))]
    for params in small_params(cls)
]


@pytest.mark.parametrize(("cls", "method", "params"), CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_benchmark_body_runs(cls: type, method: str, params: tuple) -> None:
    bench = cls()
    if hasattr(bench, "setup"):
        try:
            bench.setup(*params)
        except NotImplementedError as e:  # (asv's own rule: a setup that raises it skips the benchmark here)
            pytest.skip(str(e))
    result = getattr(bench, method)(*params)
    if method.startswith("track_"):
        assert result > 0


def test_offline_dashboard_points_every_cdn_tag_at_its_local_copy() -> None:
    from asv_benches.publish_offline import VENDORED, point_at_local

    url = "https://cdnjs.cloudflare.com/ajax/libs/flot/0.8.3/jquery.flot.min.js"
    other = "https://code.jquery.com/jquery-3.3.1.min.js"
    html = (f'<script src="{other}" integrity="sha256-A" crossorigin="anonymous"></script>\n'
            f'<script src="{url}" integrity="sha512-B" onerror="js_load_failure()"></script>')
    out = point_at_local(html, url, "vendor/jquery.flot.min.js")
    assert '<script src="vendor/jquery.flot.min.js" onerror="js_load_failure()"></script>' in out
    assert f'<script src="{other}" integrity="sha256-A"' in out  # other tags untouched
    assert url in VENDORED and other in VENDORED
