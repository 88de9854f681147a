"""The waiting queue: strict order between tiers, a fair share of tokens between the tenants of one tier, and the
body's `priority` only among the caller's own requests.

Two tenants on one tier are peers: neither may reorder, starve or crowd out the other. A single heap ordered by
(tier, body priority, arrival) let one tenant's `"priority": -1000000` jump every other tenant of its tier, and a
tenant with a deep backlog hold the queue. So the queue keeps one heap per (tier, tenant), ordered by the
request's own (priority, arrival), and picks between the tenants of a tier by start-time fair queueing over
tokens: each tenant has a virtual time, the tokens the engine computed for it (prompt chunks and decodes, charged
when scheduled) divided by its `weight` (tenants file), and the tenant with the least goes next.

Invariants (tensor-free, tested with a handful of requests):
- a higher tier's request always goes before a lower tier's (rank 0 first), as before;
- inside a tier, the head is the first request, by (priority, arrival), of the tenant with the least virtual time
  (ties: the older head);
- a tenant that comes back after waiting for nothing starts no earlier than the tier's virtual clock (the virtual
  time of the last tenant whose head was taken): idle time banks no credit, so a returning tenant can't hold the
  tier for the tokens it didn't use;
- `share(tier, tenant, total)` is a tenant's part of `total` (seats, queue places) in proportion to the weights of
  the tenants of that tier that have requests here or running: what the scheduler uses to shed a full queue's
  over-share tenant instead of refusing an under-share one, and to give a seat to a tenant below its share.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

from serve.core.request import Request

Lane = tuple[int, str]  # (tier rank, tenant)


def lane(request: Request) -> Lane:
    return (request.owner.tier_rank, request.owner.tenant)


class FairQueue:
    def __init__(self) -> None:
        self._heaps: dict[Lane, list[tuple[int, int, Request]]] = {}
        self._size = 0
        self.virtual: dict[Lane, float] = {}  # tokens charged / weight, per tenant and tier
        self.weights: dict[Lane, float] = {}
        self._clock: dict[int, float] = {}  # per tier: the virtual time of the last head taken

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Request]:
        for heap in self._heaps.values():
            for _priority, _arrival, request in heap:
                yield request

    def push(self, request: Request) -> None:
        key = lane(request)
        heap = self._heaps.get(key)
        if heap is None:
            heap = self._heaps[key] = []
            self.virtual[key] = max(self.virtual.get(key, 0.0), self._clock.get(key[0], 0.0))
        self.weights[key] = request.owner.weight
        heapq.heappush(heap, (request.priority, request.arrival_index, request))
        self._size += 1

    def head(self) -> Request | None:
        """The next request to seat."""
        best: tuple[int, float, int] | None = None
        found: Request | None = None
        for key, heap in self._heaps.items():
            first = heap[0]
            rank = (key[0], self.virtual[key], first[1])
            if best is None or rank < best:
                best, found = rank, first[2]
        return found

    def remove(self, request: Request, seated: bool = False) -> bool:
        """Take `request` out (finished, shed, or `seated`: then its tier's virtual clock reaches its tenant's
        virtual time); False when it was not waiting here."""
        key = lane(request)
        heap = self._heaps.get(key)
        if heap is None:
            return False
        if seated:
            self._clock[key[0]] = max(self._clock.get(key[0], 0.0), self.virtual[key])
        if heap[0][2] is request:
            heapq.heappop(heap)
        else:
            kept = [entry for entry in heap if entry[2] is not request]
            if len(kept) == len(heap):
                return False
            heap[:] = kept
            heapq.heapify(heap)
        self._size -= 1
        if not heap:
            del self._heaps[key]
        return True

    def charge(self, request: Request, tokens: int) -> None:
        """`tokens` computed for `request`: its tenant's virtual time moves on by tokens / weight."""
        key = lane(request)
        self.virtual[key] = self.virtual.get(key, 0.0) + tokens / request.owner.weight
        self.weights[key] = request.owner.weight

    def urgency(self, request: Request) -> tuple[int, float]:
        """(tier rank, the tenant's virtual time): lower goes first, for waiting and running prompts alike."""
        key = lane(request)
        return (key[0], self.virtual.get(key, 0.0))

    def waiting(self, key: Lane) -> int:
        heap = self._heaps.get(key)
        return len(heap) if heap is not None else 0

    def lanes(self, tier_rank: int | None = None) -> list[Lane]:
        """The lanes with requests waiting (of one tier)."""
        return [key for key in self._heaps if tier_rank is None or key[0] == tier_rank]

    def last(self, key: Lane) -> Request:
        """The request of this lane that would be seated last (the one to let go first)."""
        return max(self._heaps[key], key=lambda entry: entry[:2])[2]

    def share(self, key: Lane, total: int, present: Iterable[Lane]) -> float:
        """`key`'s part of `total` among the lanes of its tier in `present` (and itself), by weight."""
        peers = {other for other in present if other[0] == key[0]} | {key}
        weight = sum(self.weights.get(other, 1.0) for other in peers)
        return total * self.weights.get(key, 1.0) / weight
