"""The engine core's settings, each declared once, torch-free.

The command line's options (`serve.options`), the surge controller's knobs (`serve.engine.protocol.Knobs`) and
the fleet's Redis messages take their names and defaults from these classes rather than repeating them, so a
default changed here changes everywhere. `StepLimits` are the settings a controller turns between steps;
`SchedulerConfig` adds what is fixed for a server's life.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

_Limits = TypeVar("_Limits", bound="StepLimits")


@dataclass(frozen=True)
class StepLimits:
    """What one step may hold: the batch cap, the step's token budget, the prompt tokens one request may
    prefill per step, how far a top-tier prompt may take a step, and how long an arriving request may be held so
    that it is batched with later ones."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024  # tokens per step (decodes and prefill chunks)
    prefill_chunk: int | None = None  # prompt tokens one request prefills per step (None: the step budget)
    admission_wait: float = 0.0  # seconds a waiting head may be held for a fuller batch
    top_tier_tokens: int = 0  # how many tokens a step with a top-tier prompt may reach (0: the budget)

    @property
    def chunk(self) -> int:
        """The prompt tokens one request may prefill per step, with None read as the step budget."""
        return self.prefill_chunk or self.max_num_batched_tokens

    def step_limits(self) -> dict[str, Any]:
        """The step limits alone, by name (what a controller sends and an engine applies)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(StepLimits)}

    def with_limits(self: _Limits, limits: StepLimits) -> _Limits:
        """This config with `limits`' step limits (a controller's decision applied)."""
        return dataclasses.replace(self, **limits.step_limits())


@dataclass(frozen=True)
class SchedulerConfig(StepLimits):
    max_queue: int = 256  # requests waiting for a seat before new ones are refused (429)


SCHEDULER_DEFAULTS = SchedulerConfig()
