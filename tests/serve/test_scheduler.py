"""The scheduler with a mock model that always emits token 7 (no tensors)."""

from __future__ import annotations

from serve.core.block_pool import BlockPool
from serve.core.config import SchedulerConfig
from serve.core.kv_cache_manager import KVCacheManager
from serve.core.request import Owner, Request, SamplingParams, Status
from serve.core.scheduler import Scheduler, SchedulerOutput

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def make(num_blocks: int = 20, block_size: int = 4, **kwargs) -> Scheduler:
    config = SchedulerConfig(**{"max_num_batched_tokens": 16, "max_num_seqs": 4, "max_queue": 8, **kwargs})
    return Scheduler(config, KVCacheManager(BlockPool(num_blocks), block_size))


TIERS = {"priority": 0, "standard": 1, "free": 2}


def request(
    name: str,
    length: int,
    priority: int = 0,
    max_tokens: int = 4,
    tier: str = "standard",
    tenant: str | None = None,
    weight: float = 1.0,
) -> Request:
    owner = Owner(tenant=tenant or f"t-{tier}", tier=tier, tier_rank=TIERS[tier], weight=weight)
    return Request(
        name,
        list(range(100, 100 + length)),
        GREEDY.replace(max_tokens=max_tokens),
        priority=priority,
        owner=owner,
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
    allocated, unused = s.kv.waste(s.running)
    assert allocated == 12 and unused == 2  # 10 tokens (9 prompt + 1 sampled) in 3 blocks of 4


def finish_order(s: Scheduler, steps: int = 40) -> list[str]:
    order: list[str] = []
    for _ in range(steps):
        out = mock_step(s)
        order += [i.request.request_id for i in out.scheduled if i.request.finished]
    return order


def test_tier_comes_before_the_bodys_priority() -> None:
    """A free tenant sending priority -1000000 still waits behind every higher tier; priority orders it only among
    requests of its own tier."""
    s = make(max_num_seqs=1)
    s.add(request("free-pushy", 2, priority=-1_000_000, max_tokens=1, tier="free"))
    s.add(request("free-plain", 2, priority=0, max_tokens=1, tier="free"))
    s.add(request("standard", 2, priority=5, max_tokens=1, tier="standard"))
    s.add(request("priority", 2, priority=9, max_tokens=1, tier="priority"))
    assert finish_order(s) == ["priority", "standard", "free-pushy", "free-plain"]


def test_preemption_takes_the_lowest_tier_first_even_if_it_is_older() -> None:
    s = make(num_blocks=6, max_num_batched_tokens=64)
    old_free = request("old-free", 8, max_tokens=12, tier="free")
    new_priority = request("new-priority", 8, max_tokens=12, tier="priority")
    s.add(old_free)
    mock_step(s)
    s.add(new_priority)
    preempted = []
    for _ in range(40):
        out = mock_step(s)
        preempted += [p.request_id for p in out.preempted]
        if not s.has_work():
            break
    assert preempted and set(preempted) == {"old-free"}
    assert new_priority.num_preemptions == 0 and old_free.finished and new_priority.finished


def test_a_higher_tier_takes_a_lower_tiers_seat_and_never_the_reverse() -> None:
    s = make(max_num_seqs=2, max_num_batched_tokens=64)
    free = [request(f"free-{i}", 3, max_tokens=20, tier="free") for i in range(2)]
    for r in free:
        s.add(r)
    mock_step(s)
    assert {r.request_id for r in s.running} == {"free-0", "free-1"}
    urgent = request("urgent", 3, max_tokens=2, tier="priority")
    s.add(urgent)
    out = mock_step(s)
    assert [p.request_id for p in out.preempted] == ["free-1"]  # the newest of the lowest tier
    assert urgent in s.running and free[0] in s.running
    late_free = request("late-free", 3, max_tokens=2, tier="free")
    s.add(late_free)
    out = mock_step(s)
    assert not out.preempted and late_free not in s.running  # same tier: it waits its turn
    standard = request("standard", 3, max_tokens=2, tier="standard")
    s.add(standard)
    assert not [p for p in mock_step(s).preempted if p.tier_rank < standard.tier_rank]
    while s.has_work():
        out = mock_step(s)
        assert not [p for p in out.preempted if p.tier_rank < 2]  # only free requests ever give way
    assert all(r.finished for r in (*free, urgent, late_free, standard)) and s.pool.num_free == 20


def test_prefill_chunk_caps_a_prompts_tokens_per_step() -> None:
    s = make(max_num_batched_tokens=64, prefill_chunk=5)
    long, short = request("long", 12), request("short", 3)
    s.add(long)
    s.add(short)
    out = s.schedule()
    assert [(i.request.request_id, i.num_new) for i in out.scheduled] == [("long", 5), ("short", 3)]
    s.commit(out)
    assert [(i.start, i.num_new) for i in s.schedule().scheduled if i.request is long] == [(5, 5)]


def test_admission_wait_holds_the_head_for_a_fuller_batch() -> None:
    s = make(max_num_seqs=3, admission_wait=1.0)
    first = request("first", 3)
    first.arrival_time = 100.0
    s.add(first)
    assert not s.schedule(now=100.5).scheduled  # held: alone, and not yet waited its window
    assert [i.request for i in s.schedule(now=101.0).scheduled] == [first]  # waited long enough
    s = make(max_num_seqs=2, admission_wait=1.0)
    pair = [request(f"r{i}", 3) for i in range(2)]
    for r in pair:
        r.arrival_time = 100.0
        s.add(r)
    assert len(s.schedule(now=100.1).scheduled) == 2  # enough to fill the free seats: no need to wait


def test_a_full_queue_lets_the_newest_of_a_lower_tier_go_for_a_higher_one() -> None:
    s = make(max_num_seqs=1, max_queue=2)
    s.add(request("running", 3, tier="free"))
    s.schedule()
    old_free, new_free = request("old-free", 3, tier="free"), request("new-free", 3, tier="free")
    assert s.add(old_free) and s.add(new_free)
    assert not s.add(request("another-free", 3, tier="free"))  # full of its own tier: refused
    urgent = request("urgent", 3, tier="priority")
    assert s.add(urgent)
    assert s.shed == [new_free] and new_free.finish_reason == "shed" and s.num_waiting == 2
    assert s.add(request("standard", 3, tier="standard")) and s.shed[-1] is old_free
    assert not s.add(
        request("late-free", 3, tier="free")
    )  # only higher tiers wait now: the free one is refused
    assert sorted(r.request_id for r in s.waiting) == ["standard", "urgent"]


def test_decodes_first_then_prompt_chunks_by_tier_waiting_or_running() -> None:
    """A free prompt is half prefilled and a standard one decoding when a priority prompt arrives: the step is
    the standard decode, then the priority prompt's chunk, and the free prompt gets what budget is left."""
    s = make(max_num_batched_tokens=12, prefill_chunk=8)
    free, standard = request("free", 24, tier="free"), request("standard", 3)
    assert s.add(standard)
    mock_step(s)  # standard's prompt in one step: it decodes from now on
    assert s.add(free)
    first = mock_step(s)
    assert [(i.request.request_id, i.num_new) for i in first.scheduled] == [("standard", 1), ("free", 8)]
    top = Request(
        "priority", list(range(500, 520)), GREEDY, owner=Owner("t-p", "priority", 0)
    )  # no shared prefix
    assert s.add(top)
    second = s.schedule()
    assert [(i.request.request_id, i.start, i.num_new) for i in second.scheduled] == [
        ("standard", 4, 1),
        ("priority", 0, 8),
        ("free", 8, 3),
    ]


def test_a_top_tier_prompt_goes_past_the_budget_up_to_the_top_tier_tokens() -> None:
    """The same scene with `top_tier_tokens` set: the priority prompt's 20 tokens go in one step beside the
    standard decode (not chunks of 8), and the free prompt gets what the budget of 12 leaves: nothing. A short
    priority prompt leaves the free one the rest of the budget."""
    for length, expected in (
        (20, [("standard", 4, 1), ("priority", 0, 20)]),
        (5, [("standard", 4, 1), ("priority", 0, 5), ("free", 8, 6)]),
    ):
        s = make(max_num_batched_tokens=12, prefill_chunk=8, top_tier_tokens=24)
        free, standard = request("free", 24, tier="free"), request("standard", 3)
        assert s.add(standard)
        mock_step(s)
        assert s.add(free)
        mock_step(s)
        top = Request("priority", list(range(500, 500 + length)), GREEDY, owner=Owner("t-p", "priority", 0))
        assert s.add(top)
        step = mock_step(s)
        assert [(i.request.request_id, i.start, i.num_new) for i in step.scheduled] == expected


def seated_order(s: Scheduler, steps: int = 200) -> list[str]:
    order = []
    for _ in range(steps):
        out = mock_step(s)
        order += [i.request.request_id for i in out.scheduled if i.start == 0]
    return order


def test_a_tenants_body_priority_orders_only_its_own_requests() -> None:
    """B floods the tier with `priority` -1000000; A's one request, sent after, is seated as soon as B has had a
    turn, and B's own requests keep their priority order among themselves."""
    s = make(max_num_seqs=1, max_queue=16)
    for i in range(4):
        assert s.add(request(f"b{i}", 3, priority=-1_000_000 + (3 - i), tenant="b"))
    assert s.add(request("a", 3, priority=1000, tenant="a"))
    assert seated_order(s)[:3] == ["b3", "a", "b2"]


def test_tokens_are_shared_between_the_tenants_of_a_tier_by_weight() -> None:
    s = make(num_blocks=64, max_num_seqs=2, max_queue=64, max_num_batched_tokens=64)
    for i in range(20):
        s.add(request(f"light-{i}", 4, max_tokens=4, tenant="light"))
        s.add(request(f"heavy-{i}", 4, max_tokens=4, tenant="heavy", weight=3.0))
    served = {"light": 0, "heavy": 0}
    for _ in range(40):
        for item in mock_step(s).scheduled:
            served[item.request.owner.tenant] += item.num_new
    assert 2.5 <= served["heavy"] / served["light"] <= 3.5


def test_a_tenant_back_from_idle_banks_no_credit() -> None:
    """B ran alone for a long while; when A comes back the two alternate instead of A going first for all the
    tokens it didn't use."""
    s = make(max_num_seqs=1, max_queue=32)
    for i in range(10):
        s.add(request(f"early-b{i}", 3, tenant="b"))
    seated_order(s, 60)
    for i in range(4):
        s.add(request(f"a{i}", 3, tenant="a"))
        s.add(request(f"b{i}", 3, tenant="b"))
    order = seated_order(s, 60)
    assert sorted(order[:4]) == ["a0", "a1", "b0", "b1"]


def test_a_full_queue_makes_room_for_a_tenant_under_its_share() -> None:
    s = make(max_num_seqs=1, max_queue=4)
    hog = [request(f"b{i}", 3, tenant="b") for i in range(4)]
    assert all(s.add(r) for r in hog)
    assert not s.add(request("b-more", 3, tenant="b"))  # its own backlog: refused
    assert s.add(request("a0", 3, tenant="a")) and s.shed == [hog[3]]
    assert s.add(request("a1", 3, tenant="a")) and s.shed == [hog[3], hog[2]]
    assert not s.add(request("a2", 3, tenant="a"))  # A holds its share (2 of 4) now
    assert sorted(r.request_id for r in s.waiting) == ["a0", "a1", "b0", "b1"]


def test_a_tenant_under_its_share_of_seats_takes_one_from_a_peer_over_its_own() -> None:
    s = make(num_blocks=40, max_num_seqs=4, max_queue=16, max_num_batched_tokens=64)
    hog = [request(f"b{i}", 3, max_tokens=30, tenant="b") for i in range(6)]
    for r in hog:
        s.add(r)
    mock_step(s)
    assert [r.request_id for r in s.running] == ["b0", "b1", "b2", "b3"]
    s.add(request("a", 3, max_tokens=30, tenant="a"))
    out = mock_step(s)
    assert out.preempted == [hog[3]] and "a" in [r.request_id for r in s.running]
    for _ in range(5):  # no thrash: b holds 3 seats, over its share of 2, and waits
        assert not mock_step(s).preempted
