"""A request as the scheduler and runner see it: tokens, progress through them, its KV blocks, its sampling."""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field

import torch

from serve.block_pool import PrefixKey, chain_root, prefix_keys


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
        return self.temperature == 0.0

    def replace(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


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
    first_token_time: float | None = None
    last_token_time: float | None = None
    cached_prompt_tokens: int = 0
    generator: torch.Generator | None = None
    seed: int = 0  # the request's seed (drawn at random when it gave none)
    sample_offset: int = (
        0  # output tokens that came before this engine's (a fleet worker continuing an answer)
    )
    cache_salt: bytes = b""  # tenants with different salts never share prefix-cache blocks
    session: tuple[str, str] | None = None  # (user, session id) its stored blocks are recorded under
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

    def keys(self, block_size: int) -> list[PrefixKey]:
        """Prefix-cache keys of the request's full blocks, extended as blocks fill (tokens never change once
        appended, so earlier keys are computed once)."""
        full = self.num_tokens // block_size
        done = len(self._keys)
        if done < full:
            parent = self._keys[-1] if self._keys else chain_root(self.cache_salt)
            self._keys += prefix_keys(self.all_ids[done * block_size : full * block_size], block_size, parent)
        return self._keys[:full]

    def sort_key(self) -> tuple[int, int]:
        """FCFS within priority classes: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_index)
