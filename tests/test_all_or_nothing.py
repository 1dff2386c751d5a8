"""All or nothing: a cache operation that fails changes nothing, a forward stopped between layers leaves
every cache kind as it was, and a model call never changes the model.

The state of a cache is read through its own snapshot (tensors and offset) and, for the paged kind, the
pool's allocator; "unchanged" means equal to the state before the failing call, bit for bit.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import infer
from infer.cache import CACHE_KINDS
from infer.cache.base import CacheSnapshot
from infer.cache.paged import PagedCache
from infer.cache.snapshot import load_snapshot, save_snapshot
from infer.families import ARCHITECTURES
from reference import build_checkpoint
from tests.helpers import TEST_DEVICE

KINDS = sorted(CACHE_KINDS)


@functools.cache
def model_of(arch: str) -> infer.Transformer:
    return infer.load_model(build_checkpoint(arch))


def ids_for(model: infer.Transformer, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


def state(cache: infer.KVCache) -> tuple[Any, ...]:
    """Everything a later call can observe: the offset, the snapshot's tensors, and for a paged cache
    the pool's allocator."""
    snap = cache.snapshot()
    tensors = tuple((name, t.clone()) for name, t in sorted(snap.tensors.items()))
    pool: tuple[Any, ...] = ()
    if isinstance(cache, PagedCache):
        manager = cache.pool.manager
        pool = (manager.free_block_ids(), tuple(manager.ref_count(b) for b in range(manager.num_blocks)),
                cache.token_ids)
    return cache.offset, snap.token_ids, tensors, pool


def same_state(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    (offset_a, ids_a, tensors_a, pool_a), (offset_b, ids_b, tensors_b, pool_b) = a, b
    return (
        (offset_a, ids_a, pool_a) == (offset_b, ids_b, pool_b)
        and [n for n, _ in tensors_a] == [n for n, _ in tensors_b]
        and all(torch.equal(x, y) for (_, x), (_, y) in zip(tensors_a, tensors_b, strict=True))
    )


class Interrupt(Exception):
    pass


def stop_at_layer(model: infer.Transformer, index: int, monkeypatch: pytest.MonkeyPatch,
                  error: type[BaseException] = Interrupt) -> None:
    """Make `model.layers[index]` raise once, as Ctrl-C or an error inside a layer would."""
    layer = model.layers[index]
    original = layer.forward

    def raising(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(layer, "forward", original)
        raise error("stopped between layers")

    monkeypatch.setattr(layer, "forward", raising)


@pytest.mark.parametrize("error", [Interrupt, KeyboardInterrupt])
@pytest.mark.parametrize("step", [1, 6])  # a decode step and a chunk, both wrapping the ring (window 8)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_forward_stopped_between_layers_changes_no_cache(arch: str, kind: str, step: int,
                                                         error: type[BaseException],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    model = model_of(arch)
    ids = ids_for(model, 40, seed=11)
    options: dict[str, Any] = {"residual_window": 4} if kind in ("int8", "int4", "fp4") else {}
    with torch.no_grad():
        cache = infer.create_cache(kind, model.config, max_seq_len=40, **options)
        twin = infer.create_cache(kind, model.config, max_seq_len=40, **options)
        for c in (cache, twin):
            model(ids[:, :13], c)
            model(ids[:, 13:14], c)
        before = state(cache)
        stop_at_layer(model, model.config.num_hidden_layers - 1, monkeypatch, error)
        with pytest.raises(error):
            model(ids[:, 14 : 14 + step], cache)
        assert same_state(state(cache), before), f"{kind}/{arch}: a stopped forward left its writes"
        retried = model(ids[:, 14 : 14 + step], cache, all_logits=True)
        expected = model(ids[:, 14 : 14 + step], twin, all_logits=True)
        assert torch.equal(retried, expected), f"{kind}/{arch}: retrying the stopped step gives other logits"
        assert torch.equal(model(ids[:, 14 + step : 20 + step], cache), model(ids[:, 14 + step : 20 + step], twin))


def filled(kind: str, arch: str = "gemma3_text", length: int = 13) -> infer.KVCache:
    model = model_of(arch)
    options: dict[str, Any] = {"residual_window": 4} if kind in ("int8", "int4", "fp4") else {}
    cache = infer.create_cache(kind, model.config, max_seq_len=32, **options)
    with torch.no_grad():
        model(ids_for(model, length, seed=3), cache)
    return cache


def broken_snapshots(good: CacheSnapshot) -> dict[str, CacheSnapshot]:
    """A valid snapshot of another cache's content, broken one way at a time."""
    last = sorted(n for n, t in good.tensors.items() if t.numel())[-1]  # an empty tensor cannot be misshaped

    def with_tensors(**changes: torch.Tensor | None) -> CacheSnapshot:
        tensors = {n: t for n, t in good.tensors.items() if changes.get(n, t) is not None}
        tensors.update({n: t for n, t in changes.items() if t is not None})
        return CacheSnapshot(good.kind, good.offset, tensors, good.token_ids, dict(good.meta))

    t = good.tensors[last]
    floats = sorted(n for n, x in good.tensors.items() if x.numel() and x.dtype.is_floating_point)
    scales = [n for n in floats if n.endswith("_scale")]
    poisoned = {f"{n} holding a NaN": with_tensors(**{n: good.tensors[n].clone().view(-1).index_fill(
        0, torch.tensor([0], device=t.device), float("nan")).view(good.tensors[n].shape)}) for n in floats}
    poisoned |= {f"{n} holding an inf": with_tensors(**{n: good.tensors[n].clone().fill_(float("inf"))})
                 for n in floats[:1]}
    poisoned |= {f"{n} negative": with_tensors(**{n: -good.tensors[n].abs() - 1}) for n in scales}
    return {
        **poisoned,
        "last tensor missing": with_tensors(**{last: None}),
        "last tensor misshaped": with_tensors(**{last: t[..., :-1]}),
        "last tensor one token short": with_tensors(**{last: t.narrow(3, 0, t.shape[3] - 1)}),
        "last tensor relabelled int32": with_tensors(**{last: t.view(-1)[: t.numel()].to(torch.int32).view(t.shape)}),
        "an extra tensor": with_tensors(extra=torch.zeros(1)),
        "negative offset": CacheSnapshot(good.kind, -3, dict(good.tensors), None, dict(good.meta)),
        "offset not an int": CacheSnapshot(good.kind, 2.5, dict(good.tensors), None, dict(good.meta)),  # type: ignore[arg-type]
        "another kind": CacheSnapshot("nonsense", good.offset, dict(good.tensors), None, dict(good.meta)),
    }


@pytest.mark.parametrize("kind", KINDS)
def test_failed_restore_changes_nothing(kind: str) -> None:
    cache = filled(kind)
    good = filled(kind, length=7).snapshot()
    for how, snapshot in broken_snapshots(good).items():
        before = state(cache)
        with pytest.raises((ValueError, TypeError)) as caught:
            cache.restore(snapshot)
        assert "snapshot" in str(caught.value) or "restore" in str(caught.value), f"{kind}, {how}: {caught.value}"
        assert same_state(state(cache), before), f"{kind}: a failed restore ({how}) changed the cache"
    cache.restore(good)  # and the cache still works
    assert cache.offset == 7


@pytest.mark.parametrize("kind", KINDS)
def test_bad_update_and_advance_change_nothing(kind: str) -> None:
    cache = filled(kind)
    layers = model_of("gemma3_text").config.num_hidden_layers
    kv_heads, head_dim = model_of("gemma3_text").config.num_key_value_heads, model_of("gemma3_text").config.head_dim
    k = torch.randn(1, kv_heads, 2, head_dim, device=TEST_DEVICE)
    before = state(cache)
    cases: list[tuple[Any, type[Exception], str]] = [
        (lambda: cache.update(-1, k, k), ValueError, "layer"),
        (lambda: cache.update(layers, k, k), ValueError, "layer"),
        (lambda: cache.update(True, k, k), TypeError, "layer"),
        (lambda: cache.update(0, k.to(torch.complex64), k.to(torch.complex64)), TypeError, "floating"),
        (lambda: cache.update(0, k.long(), k.long()), TypeError, "floating"),
        (lambda: cache.update(0, k, k.double()), TypeError, "dtype"),
        (lambda: cache.update(0, k[:, :, :, :-1], k[:, :, :, :-1]), ValueError, "head_dim"),
        (lambda: cache.update(0, k.to("meta"), k.to("meta")), ValueError, "device"),  # not a deep error mid-write
        (lambda: cache.advance(1.5), TypeError, "int"),
        (lambda: cache.advance(-1), infer.CacheFullError, "advance"),
        (lambda: cache.advance(10**6), infer.CacheFullError, "max_seq_len"),
    ]
    for call, error, word in cases:
        with pytest.raises(error, match=word):
            call()
        assert same_state(state(cache), before), f"{kind}: a rejected call changed the cache ({word})"


def test_paged_misuse_changes_nothing() -> None:
    model = model_of("llama")
    cache = infer.create_cache("paged", model.config, max_seq_len=24, block_size=4)
    assert isinstance(cache, PagedCache)
    prompt = ids_for(model, 9, seed=2)
    with torch.no_grad():
        model(prompt, cache)
    cache.extend_token_ids(prompt[0].tolist())
    before = state(cache)
    for bad in ([1.5], [-1], ["7"], [True]):
        with pytest.raises(TypeError, match="token_ids"):
            cache.extend_token_ids(bad)  # type: ignore[arg-type]
        assert same_state(state(cache), before)
    free = cache.pool.manager.num_free
    cache.release()
    with pytest.raises(ValueError, match="released"):
        cache.extend_token_ids([1, 2])
    assert cache.pool.manager.num_free == free + cache.pool.manager.blocks_for(9)


@pytest.mark.parametrize("kind", KINDS)
def test_tampered_snapshot_files_are_refused(kind: str, tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    cache = filled(kind)
    path = tmp_path / "snap.safetensors"
    save_snapshot(cache.snapshot(), path)
    with safe_open(str(path), framework="pt") as f:
        header = dict(f.metadata())
        tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    for field, value in (("offset", "-4"), ("offset", "lots"), ("token_ids", "{oops"), ("meta", "[1]"),
                         ("token_ids", "[-1]")):
        save_file(tensors, str(path), metadata={**header, field: value})
        with pytest.raises(infer.CheckpointError, match=field):
            load_snapshot(path)
    # A header that relabels a float tensor as int32 loads (it is a valid file) but never restores.
    name = sorted(n for n, t in tensors.items() if t.dtype.is_floating_point)[0]
    relabelled = {**tensors, name: tensors[name].float().view(torch.int32)}
    save_file(relabelled, str(path), metadata=header)
    before = state(cache)
    with pytest.raises(ValueError, match=name):
        cache.restore(load_snapshot(path))
    assert same_state(state(cache), before)


def test_a_call_on_another_device_leaves_the_model_working() -> None:
    model = model_of("gemma3_text")
    ids = ids_for(model, 5, seed=1)
    with torch.no_grad():
        expected = model(ids)
        with pytest.raises(ValueError, match="move them"):
            model(ids.to("meta"))
        assert torch.equal(model(ids), expected)


def test_a_stopped_step_after_a_whole_block_prefix_hit_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt made only of cached whole blocks starts one token short of them (its last token must be
    computed); a step stopped there leaves the cache as it was (the offset, the tokens and values it
    holds; a copy-on-write copy the step made stays, as discard_step documents) and can be run again."""
    from infer.cache.paged import PagedKVPool

    model = model_of("llama")
    pool = PagedKVPool(model.config, num_blocks=8, block_size=4)
    prompt = ids_for(model, 8, seed=21)[0].tolist()
    first = pool.new_sequence(prompt)
    with torch.no_grad():
        model(torch.tensor([prompt]), first)  # caches and registers both blocks
    second = pool.new_sequence(prompt)
    assert second.offset == 7, "the last prompt token is left to compute"
    offset, token_ids, tensors, _ = state(second)
    stop_at_layer(model, 1, monkeypatch)
    with pytest.raises(Interrupt), torch.no_grad():
        model(torch.tensor([prompt[7:]]), second)
    after = state(second)
    assert (after[0], after[1]) == (offset, token_ids)
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(after[2], tensors, strict=True))
    with torch.no_grad():  # and the step then runs
        model(torch.tensor([prompt[7:]]), second)
    assert second.offset == 8


@pytest.mark.parametrize("kind", ["int8", "int4", "fp4"])
def test_a_quantized_snapshot_with_negative_or_poisoned_scales_is_refused(kind: str) -> None:
    """Scales are absmax / qmax: a negative one (or a NaN) can only come from an edited file, and would flip or
    poison the keys it scales. Blocks of 4 tokens, so a short sequence already holds quantized blocks."""
    model = model_of("llama")
    cache = infer.create_cache(kind, model.config, max_seq_len=32, residual_block=4, residual_window=0)
    with torch.no_grad():
        model(ids_for(model, 13, seed=3), cache)
    good = cache.snapshot()
    assert good.tensors["k_scale"].numel() and good.tensors["v_scale"].numel()
    # The 4-bit kinds' key offsets may be negative (a channel's midpoint), never NaN.
    offsets = [("k_offset", float("nan"))] if good.tensors["k_offset"].numel() else []
    for name, value in [(n, v) for n in ("k_scale", "v_scale") for v in (-1.0, float("nan"))] + offsets:
        tensors = {**good.tensors, name: good.tensors[name].clone().view(-1).index_fill(
            0, torch.tensor([0], device=good.tensors[name].device), value).view(good.tensors[name].shape)}
        before = state(cache)
        with pytest.raises(ValueError, match=name):
            cache.restore(CacheSnapshot(good.kind, good.offset, tensors, good.token_ids, dict(good.meta)))
        assert same_state(state(cache), before)
