"""The scheduler with a mock model that always emits token 7 (no tensors)."""

from __future__ import annotations

from serve.block_pool import BlockPool
from serve.request import Request, SamplingParams, Status
from serve.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def make(num_blocks: int = 20, **kwargs) -> Scheduler:
    config = SchedulerConfig(
        **{"block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 4, "max_queue": 8, **kwargs}
    )
    return Scheduler(config, BlockPool(num_blocks))


def request(name: str, length: int, priority: int = 0, max_tokens: int = 4) -> Request:
    return Request(
        name, list(range(100, 100 + length)), GREEDY.replace(max_tokens=max_tokens), priority=priority
    )


def mock_step(scheduler: Scheduler) -> SchedulerOutput:
    """Run the 'model': every sequence that reaches its last token samples token 7; finish at max_tokens."""
    out = scheduler.schedule()
    scheduler.commit(out)
    for item in out.scheduled:
        if item.samples and not item.request.finished:
            item.request.output_ids.append(7)
            if len(item.request.output_ids) >= item.request.params.max_tokens:
                scheduler.finish(item.request, "length")
    return out


def test_admission_budget_and_chunked_prefill() -> None:
    s = make()
    long, short = request("long", 30), request("short", 3)
    assert s.add(long) and s.add(short)
    first = s.schedule()
    assert [(i.request.request_id, i.num_new) for i in first.scheduled] == [
        ("long", 16)
    ]  # budget 16: a chunk
    assert not first.scheduled[0].samples
    s.commit(first)
    second = s.schedule()
    assert [(i.request.request_id, i.start, i.num_new) for i in second.scheduled] == [
        ("long", 16, 14),
        ("short", 0, 2),
    ]
    s.commit(second)
    long.output_ids.append(7)  # long finished its prompt this step and sampled
    third = s.schedule()
    # decode of `long` (1 token) goes first; `short` continues its prefill with the last prompt token
    assert [(i.request.request_id, i.num_new, i.samples) for i in third.scheduled] == [
        ("long", 1, True),
        ("short", 1, True),
    ]


def test_max_num_seqs_and_queue_bound() -> None:
    s = make(max_num_seqs=2, max_queue=3)
    requests = [request(f"r{i}", 3) for i in range(3)]
    assert all(s.add(x) for x in requests)
    assert not s.add(request("overflow", 3))  # bounded queue: caller answers 429
    out = s.schedule()
    assert [i.request.request_id for i in out.scheduled] == ["r0", "r1"] and s.num_waiting == 1


def test_priority_classes_are_fcfs_within() -> None:
    s = make(max_num_seqs=1)
    for name, priority in (("low-a", 5), ("high-a", 0), ("low-b", 5), ("high-b", 0)):
        s.add(request(name, 2, priority=priority, max_tokens=1))
    order = []
    for _ in range(10):
        out = mock_step(s)
        order += [i.request.request_id for i in out.scheduled if i.request.finished]
    assert order == ["high-a", "high-b", "low-a", "low-b"]


def test_preemption_frees_the_newest_and_recomputes_later() -> None:
    s = make(num_blocks=6, max_num_batched_tokens=64)
    old, new = request("old", 8, max_tokens=12), request("new", 8, max_tokens=12)
    s.add(old)
    s.add(new)
    mock_step(s)  # both prefilled: 2 blocks each, 2 free
    preempted = []
    for _ in range(12):
        out = mock_step(s)
        preempted += [p.request_id for p in out.preempted]
        if old.finished:
            break
    assert preempted and set(preempted) == {"new"}  # the newest one gives way
    assert old.finished and old.output_ids == [7] * 12
    while s.has_work():
        mock_step(s)
    assert new.finished and new.output_ids == [7] * 12 and new.num_preemptions >= 1
    assert s.pool.num_free == 6


def test_prefix_cache_hit_skips_computed_blocks() -> None:
    s = make(max_num_batched_tokens=64)
    a = request("a", 10)
    s.add(a)
    mock_step(s)
    b = Request("b", [*list(range(100, 108)), 1, 2, 3], GREEDY)
    s.add(b)
    out = s.schedule()
    (item,) = [i for i in out.scheduled if i.request is b]
    assert item.start == 8 and item.num_new == 3 and b.cached_prompt_tokens == 8
    assert b.block_ids[:2] == a.block_ids[:2] and s.pool.blocks[a.block_ids[0]].ref_cnt == 2


def test_abort_frees_blocks_at_once() -> None:
    s = make()
    x = request("x", 9)
    s.add(x)
    s.schedule()
    assert s.pool.num_used == 3
    s.finish(x, "abort")
    assert s.pool.num_used == 0 and x.status is Status.FINISHED and not s.has_work()
    waiting = request("w", 3)
    s.add(waiting)
    s.finish(waiting, "abort")
    assert s.num_waiting == 0


def test_kv_waste_counts_only_the_last_partial_block() -> None:
    s = make(max_num_batched_tokens=64)
    s.add(request("a", 9))
    mock_step(s)
    allocated, unused = s.kv_waste()
    assert allocated == 12 and unused == 2  # 10 tokens (9 prompt + 1 sampled) in 3 blocks of 4
