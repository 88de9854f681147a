"""A request as the scheduler and runner see it: tokens, progress through them, its KV blocks, its sampling."""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field

import torch

from serve.core.block_pool import PrefixKey, chain_root, prefix_keys, rejoin

SessionName = tuple[
    str, str, str
]  # (tenant, user, session id): a stored conversation, always inside a tenant


# Temperatures below this are greedy (vLLM's cut-off too): dividing logits by a smaller one overflows float32 to
# inf/NaN, which no sampler can draw from.
GREEDY_TEMPERATURE = 1e-5


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        """Argmax sampling: temperature 0, or any under GREEDY_TEMPERATURE."""
        return self.temperature < GREEDY_TEMPERATURE

    def replace(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Owner:
    """Whose a request is: the tenant its API key belongs to and the tier it runs at (resolved by the server,
    never read from the body), and the `user` and `session_id` names the client gave, which mean something only
    inside that tenant."""

    tenant: str = "default"
    tier: str = "standard"
    tier_rank: int = 1  # 0 is the highest tier: admitted first, preempted last
    user: str | None = None
    session_id: str | None = None
    session_ttl: float | None = None  # the tenant's, when it sets one
    weight: float = (
        1.0  # the tenant's share of its tier's tokens against the other tenants' (`serve.core.fair_queue`)
    )
    max_sessions: int | None = None  # the tenant's cap on sessions indexed (None: the KV offload's default)

    @property
    def session(self) -> SessionName | None:
        """The stored conversation this request's blocks are recorded under (None: it named neither)."""
        if not self.user and not self.session_id:
            return None
        return (self.tenant, self.user or "", self.session_id or "")


@dataclass(frozen=True)
class SharedChain:
    """The leading `tokens` of a prompt that are a text several tenants share (tenants file): their blocks are
    keyed under `salt`, common to those tenants, and the chain rejoins the request's own salt after them."""

    salt: bytes
    tokens: int


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_index: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    output_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_registered: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    admitted_time: float | None = None  # when it first got a seat in the batch (queue time ends)
    first_token_time: float | None = None
    last_token_time: float | None = None
    cached_prompt_tokens: int = 0
    generator: torch.Generator | None = None
    seed: int = 0  # the request's seed (drawn at random when it gave none)
    sample_offset: int = (
        0  # output tokens that came before this engine's (a fleet worker continuing an answer)
    )
    cache_salt: bytes = b""  # tenants with different salts never share prefix-cache blocks
    owner: Owner = field(default_factory=Owner)
    shared: SharedChain | None = None
    _keys: list[PrefixKey] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self.params.greedy:
            self.generator = torch.Generator()
            self.seed = (
                self.params.seed if self.params.seed is not None else int(torch.randint(0, 2**62, (1,)))
            )

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def session(self) -> SessionName | None:
        return self.owner.session

    @property
    def tier_rank(self) -> int:
        return self.owner.tier_rank

    def keys(self, block_size: int) -> list[PrefixKey]:
        """Prefix-cache keys of the request's full blocks, extended as blocks fill (tokens never change once
        appended, so earlier keys are computed once). Blocks of a shared prefix chain from the shared salt; the
        first block after it rejoins the request's own salt."""
        full = self.num_tokens // block_size
        shared = self.shared.tokens // block_size if self.shared is not None else 0
        while len(self._keys) < full:
            done = len(self._keys)
            if done < shared:
                assert self.shared is not None
                end, parent = min(full, shared), self._keys[-1] if done else chain_root(self.shared.salt)
            else:
                end, parent = full, self._keys[-1] if done else chain_root(self.cache_salt)
                if done and done == shared:
                    parent = rejoin(parent, self.cache_salt)
            self._keys += prefix_keys(self.all_ids[done * block_size : end * block_size], block_size, parent)
        return self._keys[:full]
