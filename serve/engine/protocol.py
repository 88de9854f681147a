"""What the surge controller and the engine say to each other, and nothing else: the knobs it sets, the load it
reads, and the engine interface those travel through.

Declared below the controller (`serve.control`) and the fleet, which both import it, and implemented by
`serve.engine.core.Engine`; a fleet worker relays the same two types over Redis (`serve.fleet.wire`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from serve.core.config import StepLimits


@dataclass(frozen=True)
class Knobs(StepLimits):
    """What the controller sets on an engine: the scheduler's step limits, and whether to speculate."""

    # speculative decoding where the server offers it (serve/speculative): off in throughput mode, where the batch
    # is large enough that verification rows are no longer nearly free
    speculate: bool = True


@dataclass(frozen=True)
class Load:
    """One variant's engine (or fleet workers) at a tick."""

    waiting: dict[str, int] = field(default_factory=dict)  # per service tier: without their first token yet
    running: int = 0
    finished: int = 0  # requests finished since the last tick
    oldest: dict[str, float] = field(default_factory=dict)  # per service tier: how long its oldest one waited
    tokens: int = 0  # tokens computed since the last tick
    served: int = 0  # requests that ran and finished since the last tick
    served_tokens: int = 0  # their prompt and output tokens
    engines: int = 1  # the engines whose counts these are (a fleet's workers of one variant, summed)
    queued: int = 0  # of those waiting, the ones not yet seated (every tier): the engine is saturated


class ControlledEngine(Protocol):
    """The engine as a controller drives it."""

    defer_to: Callable[[], bool] | None  # while it returns True no step starts (another variant goes first)

    def configure(self, knobs: Knobs) -> None:
        """Apply a decision's knobs from the next step on."""

    def load(self) -> Load:
        """What the controller reads at a tick (counts since the engine started; the controller differences them)."""

    def top_tier_pending(self, waited: float = 0.0) -> bool:
        """Whether a top-tier request has waited `waited` seconds or more for its first token."""
