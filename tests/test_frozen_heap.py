"""The collector kept off the process's old objects while generating (`infer.memory.frozen_heap`): what is frozen,
what is still collected, that it always ends, that a caller's own freeze stays theirs, and that the generation loops
(the batched engine's and one request's) run inside it and leave the heap as they found it."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

import infer
from infer.engine import Engine
from infer.memory import frozen_heap
from infer.sampling import SamplingParams
from tests.helpers import random_model, tiny_config

MODEL = random_model(tiny_config("llama", num_layers=2), seed=3)


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    """Each test starts and ends on an unfrozen heap (whatever it did)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


class Node:
    """A reference cycle's member (a cycle is what only the collector frees)."""

    def __init__(self) -> None:
        self.me = self


def is_scanned(obj: object) -> bool:
    """Whether the collector's generations hold `obj` (a frozen object is in none of them). (The freeze count is no
    measure of what stays frozen: frozen objects that die leave it.)"""
    return any(o is obj for o in gc.get_objects())


def cycle_collected(make_inside: bool) -> tuple[bool, bool]:
    """A cycle made before the block (or inside it) and dropped inside: (collected by a full collection inside,
    collected by one after)."""
    gc.collect()
    node = None if make_inside else Node()
    with frozen_heap():
        if make_inside:
            node = Node()
        ref = weakref.ref(node)
        node = None
        gc.collect()
        inside = ref() is None
    gc.collect()
    return inside, ref() is None


def test_old_objects_wait_for_the_block_end_and_new_ones_are_collected_inside() -> None:
    assert cycle_collected(make_inside=True) == (True, True), "garbage made inside is collected inside"
    assert cycle_collected(make_inside=False) == (False, True), "old garbage is collected only after the block"
    assert gc.get_freeze_count() == 0


def test_the_block_freezes_what_exists_and_always_gives_it_back() -> None:
    old = [0]  # a tracked object made before the block
    with frozen_heap():
        assert not is_scanned(old) and gc.get_freeze_count() > 0, "every old object frozen"
        new = [1]
        assert is_scanned(new), "an object made inside is the collector's as before"
    assert gc.get_freeze_count() == 0 and is_scanned(old)
    with pytest.raises(KeyError), frozen_heap():
        raise KeyError("a failure inside")
    assert gc.get_freeze_count() == 0, "unfrozen after an error too"


def test_a_callers_freeze_stays_theirs_and_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    theirs = [0]
    gc.freeze()
    with frozen_heap():
        pass
    assert not is_scanned(theirs) and gc.get_freeze_count() > 0, "the caller's frozen heap is not thawed by the block"
    gc.unfreeze()
    monkeypatch.setenv("INFER_GC_FREEZE", "0")
    with frozen_heap():
        assert gc.get_freeze_count() == 0, "INFER_GC_FREEZE=0: the collector as Python runs it"


def test_the_engine_and_one_request_generate_on_a_frozen_heap_and_thaw_it(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    step = Engine.step

    def watched(self: Engine) -> list:
        seen.append(gc.get_freeze_count())
        return step(self)

    monkeypatch.setattr(Engine, "step", watched)
    engine = Engine(MODEL, None, num_blocks=32, block_size=4)
    engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert seen and all(seen), "every engine step on the frozen heap"
    assert gc.get_freeze_count() == 0
    engine.add_request([6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))
    stream = engine.stream()
    next(stream)
    assert gc.get_freeze_count() > 0
    stream.close()  # type: ignore[attr-defined]  # (a stream abandoned part way)
    assert gc.get_freeze_count() == 0, "a closed stream thaws the heap"

    steps = infer.generation._token_steps
    during: list[int] = []

    def watched_steps(*args: object, **kwargs: object) -> Iterator[object]:
        for token_step in steps(*args, **kwargs):  # type: ignore[arg-type]
            during.append(gc.get_freeze_count())
            yield token_step

    monkeypatch.setattr(infer.generation, "_token_steps", watched_steps)
    result = infer.generate(MODEL, None, [1, 2, 3], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(result.token_ids) == 3 and len(during) == 3 and all(during), "one request's steps on the frozen heap"
    assert gc.get_freeze_count() == 0
