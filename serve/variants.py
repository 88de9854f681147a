"""The variants of the served model: artifacts built from one reference model (its int8 and int4 builds, say), each
with its engine, and how far its answers are from the reference (the next-token KL its manifest measured).

A server (or a fleet) answers to the model's name with whichever variant its controller routes a request to, the
most accurate one unless the load says otherwise (`serve.control`); a request may pin a variant by naming it in
`model`. The answer says which variant it came from: the `x-qpack-variant` header and `system_fingerprint`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from serve.engine.controls import EngineControls
from serve.engine.core import Engine
from serve.engine.protocol import ControlledEngine
from serve.refusal import Refusal

if TYPE_CHECKING:
    from serve.tenancy.tenants import Tier


@dataclass(frozen=True)
class Served:
    name: str
    version: str
    kl: float  # measured next-token KL against the reference model (0: the reference itself)
    content_hash: str
    engine: Engine

    @property
    def fingerprint(self) -> str:
        """OpenAI's `system_fingerprint`: which variant answered."""
        return f"qpack-{self.name}-{self.version}-{self.content_hash[:12]}"


class Variants:
    """The variants a server holds, most accurate first, answering to `model` (the reference's name)."""

    def __init__(self, model: str, version: str, served: list[Served]) -> None:
        if not served:
            raise ValueError("a server needs at least one variant")
        self.model, self.version = model, version
        self.served = sorted(served, key=lambda s: s.kl)
        self._by_name = {s.name: s for s in self.served}

    @classmethod
    def single(cls, engine: Engine, name: str, version: str, content_hash: str = "") -> Variants:
        return cls(
            name, version, [Served(name, version, 0.0, content_hash or engine.config.model_hash, engine)]
        )

    @property
    def primary(self) -> Served:
        return self.served[0]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.served]

    def controlled(self) -> dict[str, ControlledEngine]:
        """Each variant's engine as a controller sees it (knobs in, load out), by name."""
        return {s.name: EngineControls(s.engine) for s in self.served}

    def __getitem__(self, name: str) -> Served:
        return self._by_name[name]

    def __iter__(self) -> Iterator[Served]:
        return iter(self.served)

    def __len__(self) -> int:
        return len(self.served)

    @property
    def model_names(self) -> list[str]:
        """Every `model` a request may name here: the model's and each variant's, bare or with its version."""
        names = [self.model, f"{self.model}:{self.version}"]
        for served in self.served:
            names += [served.name, f"{served.name}:{served.version}"]
        return list(dict.fromkeys(names))

    def pinned(self, model: object) -> str | None:
        """The variant a request's `model` pins (None: the model's name, or no `model`: the router decides);
        404 for a name served nowhere here."""
        if model is None or model in (self.model, f"{self.model}:{self.version}"):
            return None
        for served in self.served:
            if model in (served.name, f"{served.name}:{served.version}"):
                return None if len(self.served) == 1 else served.name
        names = ", ".join(dict.fromkeys([self.model, *self.names]))
        raise Refusal(
            "not_found", f"model {model!r} is not served here; use {names}", "model", "model_not_found"
        )


def prioritize(variants: Variants, patience: float | Callable[[], float] = 0.0) -> None:
    """The cheaper variants of one machine start no step while the most accurate one holds a top-tier request
    that has waited `patience` seconds or more for its first token: side by side their steps slow each other,
    and the top tier, which always runs on the most accurate variant, would miss its first-token target
    (measured on two cores: 95% of the top tier's requests met it with the int4 engine stepping freely beside
    the int8 one, 98.8% with one engine). Giving way as soon as any top-tier prompt waits cost a eighth of the
    goodput routing had gained; a patience of a quarter of its target gives way only to the late ones."""
    engines = variants.controlled()
    primary = engines[variants.primary.name]

    def waited() -> float:
        return patience() if callable(patience) else patience

    for served in variants.served[1:]:
        engines[served.name].defer_to = lambda: primary.top_tier_pending(waited())


def top_tier_patience(tiers: Iterable[Tier]) -> float:
    """The `patience` of `prioritize`: a quarter of the top tier's first-token target (0 without one)."""
    top = min(tiers, key=lambda t: t.rank)
    return 0.25 * top.ttft_ms / 1000 if top.ttft_ms else 0.0
