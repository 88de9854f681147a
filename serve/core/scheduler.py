"""Iteration-level (continuous) batching over the paged KV pool.

Every step the scheduler builds one batch under a token budget:
1. Decodes first: every running request that needs one token, highest tier first, oldest first within a
   tier. They are cheap, so a long prompt arriving never stalls the streams already running.
2. Then prompt chunks, by tier: the running requests still in prefill get their next chunk (chunked prefill:
   a long prompt is spread over several steps), and waiting requests are admitted in order of tier (its
   tenant's, from the API key), then, between the tenants of a tier, the one that has had the fewest tokens
   for its weight (`serve.core.fair_queue`), then the request's own `priority` among its tenant's requests (lower
   first), then arrival, while the budget and `max_num_seqs` allow, after reusing any cached prefix blocks; a
   waiting request of a higher tier (or of a peer tenant further behind its share) takes its chunk before a
   running one, so a top-tier prompt is never left for the next step behind the chunks of lower tiers' prompts.
3. A top-tier prompt may take the step past the budget, up to `top_tier_tokens` (a controller sets it when it
   caps the steps so that a top-tier arrival never waits long for the step in flight): it then goes in the
   fewest steps it can, and lower tiers' chunks get what the usual budget leaves after it.
When the pool cannot give a running request its next block, a running request of the *lowest* tier present is
preempted, the newest of them: its blocks are freed and it goes back to the queue, to be recomputed later
(cheaply, if its prefix blocks are still cached). A waiting request never preempts one of its own tier or a
higher one; but when the batch is full, or the pool short of the blocks its first chunk needs, it takes the
place of running requests of a *lower* tier (lowest first, newest first) before the step is built, or of a peer
tenant of its tier holding more than its share of that tier's seats while its own tenant holds less. So no
request is ever preempted, or kept waiting for a seat, while a lower tier holds one, and no tenant holds its
tier's seats while a peer waits below its share.

The waiting queue is bounded (`max_queue`); `add` returns False when it is full, which the API turns into a
429 with Retry-After, unless the newcomer outranks the lowest tier waiting: then the newest request of that tier
leaves the queue instead (`shed`, answered 429 too), so a higher tier is never refused while a lower one waits;
and a tenant under its share of its tier's places displaces the last request of the peer furthest over its own,
so one tenant's backlog never turns another's requests into 429s.
The knobs a controller turns between steps are `StepLimits` (`serve.core.config`, the one place they are
declared): the batch cap, the step's token budget, the prompt tokens one request may prefill per step
(`prefill_chunk`), how far a top-tier prompt may take a step (`top_tier_tokens`), and how long an arriving request
may be held so that it is batched with later ones (`admission_wait`, the static batching-window rules). The
scheduler decides who runs and never touches tensors; which blocks each request holds, and where a prefix's blocks
come from (the pool's cache, the KV offload), is the KV cache manager's business (`serve.core.kv_cache_manager`).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from serve.core.block_pool import BlockPool
from serve.core.config import SchedulerConfig
from serve.core.fair_queue import FairQueue, Lane, lane
from serve.core.kv_cache_manager import KVCacheManager
from serve.core.request import Request, Status


@dataclass
class Scheduled:
    request: Request
    start: int  # tokens already in the KV cache before this step
    num_new: int  # tokens computed this step
    # speculative tokens verified after a decode's token (their KV is written, kept only where accepted: `settle`)
    proposal: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last token, so a next token is sampled (the proposal's rows
        go past it, or, for a draft model catching up, are its last tokens)."""
        return self.start + self.num_new + len(self.proposal) >= self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[Scheduled] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
    ) -> None:
        self.config = config
        self.kv = kv
        self.waiting = FairQueue()
        self.running: list[Request] = []
        self.shed: list[Request] = []  # left the queue for a higher tier's request; the engine answers them
        self._arrivals = 0
        self.num_preemptions = 0

    @property
    def pool(self) -> BlockPool:
        return self.kv.pool

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> bool:
        """Queue a request; False when the waiting queue is full (back-pressure) of requests of its tier or
        higher, and its tenant already holds its share of its tier's places. Otherwise a full queue makes room:
        the last request of the lowest tier waiting leaves (`shed`) when that tier is lower than the newcomer's,
        or else the last of the tenant of its tier furthest over its share."""
        if len(self.waiting) >= self.config.max_queue:
            victim = self._displaced(request)
            if victim is None:
                return False
            self.finish(victim, "shed")
            self.shed.append(victim)
        request.arrival_index = self._arrivals
        self._arrivals += 1
        request.status = Status.WAITING
        self.waiting.push(request)
        return True

    def _displaced(self, newcomer: Request) -> Request | None:
        """The waiting request a newcomer to a full queue displaces, if any."""
        queue = self.waiting
        if self.config.max_queue == 0:
            return None
        lowest = max(rank for rank, _tenant in queue.lanes())
        if lowest < newcomer.tier_rank:
            return None
        mine, peers = lane(newcomer), queue.lanes(lowest)
        same = lowest == newcomer.tier_rank
        present = [*peers, mine] if same else peers
        total = sum(queue.waiting(p) for p in peers)
        if same and queue.waiting(mine) + 1 > queue.share(mine, total, present):
            return None
        over = max(
            (p for p in peers if p != mine),
            key=lambda p: queue.waiting(p) / queue.share(p, total, present),
            default=None,
        )
        if over is None or (same and queue.waiting(over) - 1 < queue.share(over, total, present)):
            return None
        return queue.last(over)

    def preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.release(request)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(request)

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished and free its blocks now (also for aborts and timeouts)."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        self.kv.release(request)
        request.status = Status.FINISHED
        request.finish_reason = reason

    def _victim(self, scheduled_ids: set[int]) -> Request | None:
        """The running request to preempt: of the lowest tier present, the newest; never one already in this
        step's batch."""
        candidates = [s for s in self.running if id(s) not in scheduled_ids]
        if not candidates:
            return None
        lowest = max(s.tier_rank for s in candidates)
        return next(s for s in reversed(candidates) if s.tier_rank == lowest)

    def _seat_higher_tier(self, out: SchedulerOutput) -> None:
        """Before the step is built: while the best waiting request cannot get in (the batch is full, or the free
        blocks cannot hold its first chunk), preempt the newest of the lowest running tier when that tier is lower
        than its own, or else the newest of a peer tenant holding more than its share of its tier's seats while
        its own tenant holds less."""
        while self.waiting and self.running:
            head = self.waiting.head()
            assert head is not None
            chunk = self._chunk(head, self.config.max_num_batched_tokens)
            full = len(self.running) >= self.config.max_num_seqs
            if not full and self.kv.can_hold(chunk):
                return
            victim = self._victim(set())
            if victim is not None and victim.tier_rank <= head.tier_rank:
                victim = self._over_share(head)
            if victim is None:
                return
            self.preempt(victim)
            out.preempted.append(victim)

    def _over_share(self, head: Request) -> Request | None:
        """The newest seated request of the peer tenant furthest over its share of the seats of `head`'s tier, when
        `head`'s tenant is under its own and taking one seat leaves that peer at its share or above."""
        seats: Counter[Lane] = Counter(lane(r) for r in self.running if r.tier_rank == head.tier_rank)
        mine, total = lane(head), self.config.max_num_seqs
        present = {*seats, *self.waiting.lanes(head.tier_rank)}
        if seats[mine] + 1 > self.waiting.share(mine, total, present):
            return None
        over = max(
            (p for p in seats if p != mine),
            key=lambda p: seats[p] / self.waiting.share(p, total, present),
            default=None,
        )
        if over is None or seats[over] - 1 < self.waiting.share(over, total, present):
            return None
        return next(r for r in reversed(self.running) if lane(r) == over)

    def _chunk(self, request: Request, budget: int, whole: bool = False) -> int:
        """Tokens the request computes this step: one to decode, or the next chunk of its prompt (as much as the
        budget allows when `whole`)."""
        chunk = budget if whole else self.config.prefill_chunk or budget
        return min(request.num_uncomputed, budget, max(1, chunk))

    def _hold(self, now: float) -> bool:
        """A batching window: hold the waiting head until it has waited `admission_wait` or enough have come to
        fill the free seats."""
        if self.config.admission_wait <= 0 or not self.waiting:
            return False
        head = self.waiting.head()
        assert head is not None
        seats = self.config.max_num_seqs - len(self.running)
        return now - head.arrival_time < self.config.admission_wait and len(self.waiting) < seats

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled_ids: set[int] = set()
        self._seat_higher_tier(out)
        budget = self.config.max_num_batched_tokens
        top = max(budget, self.config.top_tier_tokens)  # what top-tier prompt chunks may bring the step to
        by_rank = sorted(self.running, key=lambda r: r.tier_rank)
        for request in [r for r in by_rank if r.num_uncomputed <= 1]:
            if budget <= 0:
                break
            used = self._continue(request, budget, out, scheduled_ids)
            budget, top = budget - used, top - used
        prefills = [r for r in by_rank if r.num_uncomputed > 1]
        admitting = not self._hold(time.monotonic() if now is None else now)
        urgency = self.waiting.urgency
        while True:
            prefills = sorted(
                (r for r in prefills if r in self.running and id(r) not in scheduled_ids), key=urgency
            )
            head = (
                self.waiting.head()
                if admitting and self.waiting and len(self.running) < self.config.max_num_seqs
                else None
            )
            admit = head is not None and (not prefills or urgency(head) < urgency(prefills[0]))
            upcoming = head if admit else (prefills[0] if prefills else None)
            if upcoming is None:
                break
            whole = upcoming.tier_rank == 0 and self.config.top_tier_tokens > 0
            room = top if whole else budget
            if room <= 0:
                break
            taken: int | None
            if admit:
                taken = self._admit(upcoming, room, out, scheduled_ids, whole=whole)
                admitting = taken is not None
            else:
                taken = self._continue(prefills.pop(0), room, out, scheduled_ids, whole=whole)
            budget, top = budget - (taken or 0), top - (taken or 0)
        return out

    def _continue(
        self,
        request: Request,
        budget: int,
        out: SchedulerOutput,
        scheduled_ids: set[int],
        whole: bool = False,
    ) -> int:
        """Schedule a running request's next token or prompt chunk (preempting the newest of the lowest tier, never
        a higher one than its own, while the pool is short); the tokens it takes (0: none this step)."""
        if request not in self.running:  # preempted earlier in this step
            return 0
        num_new = self._chunk(request, budget, whole)
        while not self.kv.grow(request, request.num_computed + num_new):
            victim = self._victim(scheduled_ids)
            if victim is None or victim.tier_rank < request.tier_rank:
                victim = request
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return 0
        out.scheduled.append(Scheduled(request, request.num_computed, num_new))
        scheduled_ids.add(id(request))
        self.waiting.charge(request, num_new)
        return num_new

    def _admit(
        self,
        request: Request,
        budget: int,
        out: SchedulerOutput,
        scheduled_ids: set[int],
        whole: bool = False,
    ) -> int | None:
        """Seat the waiting head, after reusing its cached (or fetched) prefix blocks, with its first chunk; the
        tokens it takes, or None when the pool cannot hold that chunk (admission stops for this step)."""
        self.kv.take_cached_prefix(request)
        num_new = self._chunk(request, budget, whole)
        if not self.kv.grow(request, request.num_computed + num_new):
            self.kv.release(request)
            return None
        self.waiting.remove(request, seated=True)
        if request.output_ids == [] and request.num_preemptions == 0:
            request.cached_prompt_tokens = request.num_computed
        request.status = Status.RUNNING
        self.running.append(request)
        out.scheduled.append(Scheduled(request, request.num_computed, num_new))
        scheduled_ids.add(id(request))
        self.waiting.charge(request, num_new)
        return num_new

    def commit(self, out: SchedulerOutput) -> None:
        """After the model ran: advance progress and publish newly full blocks to the prefix cache."""
        for item in out.scheduled:
            request = item.request
            if request.finished:
                continue
            request.num_computed = item.start + item.num_new
            self.kv.register_full(request)
