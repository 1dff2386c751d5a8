"""The scheduler on its own: pure bookkeeping, driven by a simulated forward (no model, no tensors).

Hypothesis draws request sets (prompt lengths with shared prefixes, output lengths, arrival steps, aborts),
pool sizes small enough to force preemption, block sizes, caps and token budgets; after every step the
plan and the allocator must satisfy the scheduler's promises."""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from infer.cache.block_manager import BlockManager
from infer.scheduler import PoolTooSmall, Request, Scheduler, SchedulerOutput, Status
from tests.helpers import check_pool_invariants


@st.composite
def workloads(draw: st.DrawFn) -> dict:
    block_size = draw(st.integers(1, 6))
    n = draw(st.integers(1, 8))
    shared = draw(st.lists(st.integers(0, 9), max_size=12))  # a common prefix some prompts start with
    requests = []
    for _ in range(n):
        own = draw(st.lists(st.integers(0, 9), min_size=1, max_size=20))
        prompt = (shared if draw(st.booleans()) else []) + own
        if requests and draw(st.integers(0, 3)) == 0:  # the same prompt again: all of it cached, copy-on-write
            prompt = list(draw(st.sampled_from(requests))["prompt"])
        requests.append({
            "prompt": prompt,
            "outputs": draw(st.integers(1, 12)),
            "arrival": draw(st.integers(0, 6)),
            "abort_at": draw(st.none() | st.integers(0, 30)),
        })
    longest = max(len(r["prompt"]) + r["outputs"] for r in requests)
    # From "the longest request barely fits alone" to roomy: small pools force preemption.
    min_blocks = -(-longest // block_size) + 1
    return {
        "block_size": block_size,
        "num_blocks": draw(st.integers(min_blocks, min_blocks + 6)),
        "max_num_seqs": draw(st.integers(1, 6)),
        "budget": draw(st.integers(1, 24)),
        "prefix_caching": draw(st.booleans()),
        "requests": requests,
        "fail_every": draw(st.sampled_from([0, 0, 3, 5])),  # some steps' forwards raise (discarded)
    }


def simulate(w: dict) -> tuple[Scheduler, dict[int, Request], list[int], int, int]:
    """Run the workload to the end; check every step. Returns the scheduler, requests, order of first
    scheduling, number of preemptions and number of block copies."""
    manager = BlockManager(w["num_blocks"], w["block_size"])
    sched = Scheduler(manager, max_num_seqs=w["max_num_seqs"], max_num_batched_tokens=w["budget"],
                      enable_prefix_caching=w["prefix_caching"])
    reqs = {i: Request(i, list(r["prompt"]), max_tokens=len(r["prompt"]) + r["outputs"])
            for i, r in enumerate(w["requests"])}
    first_scheduled: list[int] = []
    arrival: dict[int, int] = {}  # request -> its place in the order of arrival
    preemptions = copies = 0
    times_preempted: dict[int, int] = {}
    admitted_tokens = hit_tokens = 0  # the prefix-cache figures, summed from the admissions seen
    pool: dict[int, dict[int, int]] = {}  # the pool's contents as a forward would leave them: block -> slot -> token
    step = 0
    while step < 10_000:
        for i, r in enumerate(w["requests"]):
            if r["arrival"] == step:
                sched.add(reqs[i])
                assert reqs[i].status is Status.WAITING
                arrival[i] = len(arrival)
            if r["abort_at"] == step and r["arrival"] <= step:
                sched.finish(i)
                assert reqs[i].status is Status.FINISHED and i not in sched.requests
        if step > max(r["arrival"] for r in w["requests"]) and not sched.has_unfinished():
            break
        waiting_before = [r.request_id for r in sched.waiting]
        known_before = {i: reqs[i].num_tokens for i in reqs}
        plan = sched.schedule()
        check_policy(plan, waiting_before, known_before, arrival, sched)
        for c in plan.chunks:
            if c.request_id in waiting_before:  # admitted: its first chunk starts where its cached prefix ends
                assert reqs[c.request_id].num_prefix_hit_tokens == c.start
                assert c.start == 0 or w["prefix_caching"], "a prefix hit with prefix caching off"
                admitted_tokens += known_before[c.request_id]
                hit_tokens += c.start
        assert (sched.prompt_tokens_admitted, sched.prefix_hit_tokens) == (admitted_tokens, hit_tokens)
        assert sched.prefix_hit_rate == (hit_tokens / admitted_tokens if admitted_tokens else 0.0)
        assert all(r.status is Status.WAITING for r in sched.waiting)
        assert all(r.status is Status.RUNNING for r in sched.running)
        preemptions += len(plan.preempted)
        for rid in plan.preempted:
            times_preempted[rid] = times_preempted.get(rid, 0) + 1
            assert reqs[rid].num_preemptions == times_preempted[rid], "a request's preemption count"
        assert not plan.failed, "every request fits the pool alone"
        assert plan.num_batched_tokens <= w["budget"]
        assert len(sched.running) <= w["max_num_seqs"]
        assert len({c.request_id for c in plan.chunks}) == len(plan.chunks), "a request twice in one step"
        for c in plan.chunks:
            req = reqs[c.request_id]
            assert req.status is Status.RUNNING and c.num_tokens >= 1
            assert c.start == req.num_computed, "a chunk must continue where the computed tokens end"
            assert c.start + c.num_tokens <= req.num_tokens
            assert manager.num_tokens(c.request_id) == c.start + c.num_tokens, "slots not reserved"
            if c.request_id not in first_scheduled:
                first_scheduled.append(c.request_id)
        if sched.has_unfinished():
            assert plan.chunks or plan.preempted, f"step {step}: requests wait but nothing runs (deadlock)"
        copies += len(plan.copies)
        copy_blocks(pool, plan)  # copy-on-write, done before the forward as the engine does
        if w.get("fail_every") and step % w["fail_every"] == 1:  # the forward raised: its slots come back
            sched.discard(plan.chunks)
            for c in plan.chunks:
                if c.request_id in sched.requests:
                    assert manager.num_tokens(c.request_id) == reqs[c.request_id].num_computed, "slots kept"
            check_pool_invariants(manager, {i: reqs[i].token_ids for i in manager.seq_ids})
            step += 1
            continue
        write_chunks(pool, manager, plan, reqs)
        sched.computed(plan.chunks)
        for r in sched.running:  # every running request reads back its own tokens (copies done, none lost)
            assert read_back(pool, manager, r.request_id, r.num_computed) == r.token_ids[: r.num_computed]
        for c in plan.chunks:
            req = reqs[c.request_id]
            if c.sample and c.request_id in sched.requests:
                sched.append_token(c.request_id, 100 + len(req.output_ids))
                if req.num_tokens >= req.max_tokens:
                    sched.finish(c.request_id)
                    assert req.status is Status.FINISHED
        check_pool_invariants(manager, {i: reqs[i].token_ids for i in manager.seq_ids})
        step += 1
    assert not sched.has_unfinished(), "the workload did not finish"
    return sched, reqs, first_scheduled, preemptions, copies


def copy_blocks(pool: dict[int, dict[int, int]], plan: SchedulerOutput) -> None:
    """What the engine does with the plan's copies before the forward: each destination block gets the source's
    contents."""
    for copy in plan.copies:
        pool[copy.dst] = dict(pool.get(copy.src, {}))


def write_chunks(pool: dict[int, dict[int, int]], manager: BlockManager, plan: SchedulerOutput,
                 reqs: dict[int, Request]) -> None:
    """What the forward does to the pool: each chunk's tokens into the slots its request's block table names."""
    bs = manager.block_size
    for c in plan.chunks:
        table = manager.block_table(c.request_id)
        for pos in range(c.start, c.start + c.num_tokens):
            pool.setdefault(table[pos // bs], {})[pos % bs] = reqs[c.request_id].token_ids[pos]


def read_back(pool: dict[int, dict[int, int]], manager: BlockManager, seq_id: int, n: int) -> list[int | None]:
    """The first `n` tokens a sequence's block table points at in the simulated pool."""
    bs, table = manager.block_size, manager.block_table(seq_id)
    return [pool.get(table[pos // bs], {}).get(pos % bs) for pos in range(n)]


def check_policy(plan: SchedulerOutput, waiting_before: list[int], known: dict[int, int], arrival: dict[int, int],
                 sched: Scheduler) -> None:
    """The policy beyond each request's own correctness, from the scheduler's contract (module docstring):
    a chunk samples exactly when it reaches the request's last known token (a request recomputed after preemption
    samples nowhere before); admission is first come, first served from the head of the queue, and none in a
    step that had to preempt; the preempted are the youngest, younger than every request the step runs, and wait
    in the queue in arrival order, ahead of anything that came after them."""
    for c in plan.chunks:
        assert c.sample == (c.start + c.num_tokens == known[c.request_id]), f"request {c.request_id} samples wrongly"
    admitted = [c.request_id for c in plan.chunks if c.request_id in waiting_before]
    if plan.preempted:
        assert not admitted, "a request was admitted in a step that had to preempt"
    assert admitted == waiting_before[: len(admitted)], "admission skipped the head of the queue"
    ran = [arrival[c.request_id] for c in plan.chunks]
    for rid in plan.preempted:
        assert all(arrival[rid] > a for a in ran), f"request {rid} was preempted before a younger one"
    queue = [arrival[r.request_id] for r in sched.waiting]
    assert queue == sorted(queue), "the queue left arrival order (preempted requests resume first come, first served)"
    if plan.num_batched_tokens < sched.max_num_batched_tokens:  # budget left: every running request ran
        assert {r.request_id for r in sched.running} <= {c.request_id for c in plan.chunks}, "a running request idled"
    running = [arrival[r.request_id] for r in sched.running]
    assert running == sorted(running), "running requests out of arrival order (a resumed one must not count as young)"
    resumed = [arrival[c.request_id] for c in plan.chunks if c.request_id not in waiting_before]
    assert resumed == sorted(resumed), "running requests scheduled out of arrival order"


@settings(max_examples=300)  # pure Python, milliseconds each: enough draws to reach preemption then resumption
@given(workloads())
def test_every_request_finishes_within_the_rules(w: dict) -> None:
    sched, reqs, first_scheduled, preemptions, copies = simulate(w)
    event(f"preempted: {preemptions > 0}")
    event(f"copy-on-write: {copies > 0}")
    manager = sched.blocks
    assert manager.num_free == manager.num_blocks, "blocks still held after every request ended"
    for i, r in enumerate(w["requests"]):
        aborted = r["abort_at"] is not None and r["abort_at"] >= r["arrival"]
        if not aborted:
            assert len(reqs[i].output_ids) == r["outputs"], f"request {i} stopped early"
    # First come, first served: among requests that arrived at different steps, the earlier starts first.
    for a, b in zip(first_scheduled, first_scheduled[1:], strict=False):
        assert w["requests"][a]["arrival"] <= w["requests"][b]["arrival"] or reqs[a].num_preemptions


def test_preemption_frees_the_youngest_and_recomputes_it() -> None:
    manager = BlockManager(num_blocks=6, block_size=2)
    sched = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    old, young = Request(0, [1, 2, 3, 4, 5], max_tokens=12), Request(1, [6, 7, 8, 9, 10], max_tokens=12)
    sched.add(old)
    sched.add(young)
    preempted = []
    for _ in range(6):
        plan = sched.schedule()
        preempted += plan.preempted
        sched.computed(plan.chunks)
        for c in plan.chunks:
            if c.sample:
                sched.append_token(c.request_id, 0)
    assert preempted and preempted[0] == 1, "the younger request must be the one preempted"
    assert young.num_preemptions >= 1 and old.num_preemptions == 0
    assert young.status is Status.WAITING and young.num_computed == 0, "a preempted request is recomputed"
    assert 1 not in manager.seq_ids, "a preempted request's blocks go back to the pool"
    check_pool_invariants(manager)


def test_shared_prompt_prefix_is_computed_once() -> None:
    manager = BlockManager(num_blocks=32, block_size=4)
    sched = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=256)
    system = list(range(40, 56))  # 16 tokens: four full blocks
    sched.add(Request(0, system + [1, 2], max_tokens=20))
    plan = sched.schedule()
    sched.computed(plan.chunks)
    sched.add(Request(1, system + [3], max_tokens=20))
    plan = sched.schedule()
    (chunk,) = [c for c in plan.chunks if c.request_id == 1]
    assert chunk.start == 16 and chunk.num_tokens == 1, "the second request recomputed the shared prefix"
    assert sched.prefix_hit_tokens == 16 and sched.prefix_hit_rate == 16 / (18 + 17)
    sched.computed(plan.chunks)
    sched.add(Request(2, system + [4, 5], max_tokens=20))
    sched.schedule()
    assert sched.prefix_hit_tokens == 32 and sched.prefix_hit_rate == 32 / (18 + 17 + 18), "hits are summed"


@given(prompt=st.lists(st.integers(0, 9), min_size=1, max_size=8), outputs=st.lists(st.integers(0, 9), max_size=8))
def test_a_requests_token_range_is_the_slice_of_its_tokens(prompt: list[int], outputs: list[int]) -> None:
    """`Request.tokens(start, stop)` (what a step's chunks feed the forward) is `token_ids[start:stop]` wherever the
    range lies, every range: in the prompt, in the outputs, or across the prompt's end (a recomputed request's
    chunk)."""
    request = Request(0, prompt, max_tokens=64, output_ids=list(outputs))
    total = len(prompt) + len(outputs)
    for start in range(total + 1):
        for stop in range(start, total + 1):
            assert request.tokens(start, stop) == (prompt + outputs)[start:stop], (start, stop)


@given(block_size=st.integers(1, 6), prompt_len=st.integers(1, 14), outputs=st.integers(1, 14),
       budget=st.integers(1, 9))
def test_blocks_filled_by_any_chunk_serve_later_prompts(block_size: int, prompt_len: int, outputs: int,
                                                        budget: int) -> None:
    """Every block a request's computed tokens fill is registered, whichever chunk filled it (a prompt chunk the
    budget cut, or a decode step's one token): a later prompt extending the conversation (the prompt, the outputs,
    one more token) finds all of them once the first has finished, as many as its own length leaves cached."""
    manager = BlockManager(num_blocks=64, block_size=block_size)
    sched = Scheduler(manager, max_num_seqs=2, max_num_batched_tokens=budget)
    first = Request(0, list(range(100, 100 + prompt_len)), max_tokens=64)
    sched.add(first)
    while len(first.output_ids) < outputs:
        plan = sched.schedule()
        sched.computed(plan.chunks)
        for c in plan.chunks:
            if c.sample:
                sched.append_token(c.request_id, 200 + len(first.output_ids))
    computed = first.num_computed  # the last output is not computed yet
    assert computed == prompt_len + outputs - 1
    later = first.token_ids + [7]
    sched.finish(0)  # (its blocks stay cached; the budget is the next request's)
    sched.add(Request(1, later, max_tokens=64))
    sched.schedule()
    assert sched.requests[1].num_prefix_hit_tokens == min(computed // block_size * block_size, len(later) - 1)


def test_every_copy_on_write_of_a_step_is_returned() -> None:
    """A prompt cached whole recomputes its last token into a private copy of the shared last block; the copy
    must reach the plan even when another request is admitted after it in the same step."""
    manager = BlockManager(num_blocks=16, block_size=2)
    sched = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    first = Request(0, [1, 2, 3, 4], max_tokens=5)
    sched.add(first)
    pool: dict[int, dict[int, int]] = {}
    plan = sched.schedule()
    write_chunks(pool, manager, plan, {0: first})
    sched.computed(plan.chunks)
    sched.append_token(0, 5)  # still running: its blocks are shared, not revived
    again, other = Request(1, [1, 2, 3, 4], max_tokens=6), Request(2, [7, 8, 9], max_tokens=6)
    sched.add(again)
    sched.add(other)
    plan = sched.schedule()
    assert len(plan.copies) == 1, "the shared last block of the cached prompt needs exactly one copy"
    copy_blocks(pool, plan)
    write_chunks(pool, manager, plan, {0: first, 1: again, 2: other})
    sched.computed(plan.chunks)
    assert read_back(pool, manager, 1, 4) == [1, 2, 3, 4] and read_back(pool, manager, 2, 3) == [7, 8, 9]
    assert read_back(pool, manager, 0, 5) == [1, 2, 3, 4, 5]


def test_long_prompt_is_chunked_beside_decode_steps() -> None:
    manager = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=8)
    sched.add(Request(0, [1, 2, 3], max_tokens=20))
    plan = sched.schedule()
    sched.computed(plan.chunks)
    sched.append_token(0, 9)
    sched.add(Request(1, list(range(30)), max_tokens=40))
    plan = sched.schedule()
    assert [(c.request_id, c.start, c.num_tokens, c.sample) for c in plan.chunks] == [(0, 3, 1, True),
                                                                                      (1, 0, 7, False)]


def test_a_prompt_the_pool_cannot_hold_is_refused_alone() -> None:
    sched = Scheduler(BlockManager(num_blocks=4, block_size=4), max_num_seqs=4, max_num_batched_tokens=64)
    sched.add(Request(0, [1] * 8, max_tokens=10))
    with pytest.raises(PoolTooSmall, match="shorten the prompt or give the engine more blocks"):
        sched.add(Request(1, [1] * 17, max_tokens=20))
    assert list(sched.requests) == [0]


def test_a_request_that_outgrows_the_pool_fails_instead_of_waiting_forever() -> None:
    manager = BlockManager(num_blocks=2, block_size=2)
    sched = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    sched.add(Request(0, [1, 2, 3], max_tokens=50))
    failed = []
    for _ in range(5):
        plan = sched.schedule()
        failed += plan.failed
        sched.computed(plan.chunks)
        for c in plan.chunks:
            if c.sample:
                sched.append_token(c.request_id, 0)
    assert [rid for rid, _ in failed] == [0] and "more than the pool's 2 KV blocks" in failed[0][1]
    assert not sched.has_unfinished() and manager.num_free == 2


@pytest.mark.parametrize(("name", "value"), [("max_num_seqs", 0), ("max_num_batched_tokens", -1),
                                             ("max_num_seqs", 1.5), ("max_num_batched_tokens", True)])
def test_bad_limits_are_refused(name: str, value: object) -> None:
    kwargs = {"max_num_seqs": 4, "max_num_batched_tokens": 16, name: value}
    with pytest.raises(ValueError, match=name):
        Scheduler(BlockManager(4, 4), **kwargs)  # type: ignore[arg-type]
