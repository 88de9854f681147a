"""When to speculate, from which source, and how many tokens: decided from measured acceptance and costs.

Pure and clock-free (the engine feeds it what it measured), so simulated acceptance traces test it.

Costs are in units of a plain batch-1 step, measured: the engine runs one plain step first and then one every
`calibrate_every` batch-1 steps, and times verifying steps and the draft model's decode-row steps against it.

The model: proposals are accepted one after another with probability `alpha` each (the request's measured
acceptance, a decayed count of accepted and rejected proposals), so k proposals yield
E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens per verifying step (the last row always gives one). The step costs
1 + k * (verify_row + propose) target-step units: `verify_row` is what one more row adds to the target's step
(measured: the step's time by row count), `propose` what one proposed token costs the proposer (~0 for prompt
lookup; a draft model's step time over the target's). The policy picks the k in 0..k_max that maximizes
E(k) / cost(k); k = 0 is plain decoding (ratio 1). A source whose acceptance fell so low that k = 0 wins is probed
again with one token every `probe_every` steps, so it can recover when the text changes (a quoted passage).
A source that must first read the context (the draft model's prefill of the prompt) starts on a request only
when the plain steps it is expected to save over the tokens left outweigh that one-off cost (measured per context
token). `auto` takes, per step, the source with the larger expected speed-up among those that have a proposal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SOURCES = ("ngram", "draft")
MODES = ("off", "ngram", "draft", "auto")


@dataclass
class Acceptance:
    """A source's acceptance for one request: proposals kept and rejected, decayed so that recent steps count
    most (a prior of `prior` acceptance worth `weight` proposals to start from)."""

    accepted: float
    rejected: float
    decay: float = 0.9
    idle_steps: int = 0  # steps since this source last proposed for the request

    @classmethod
    def starting(cls, prior: float, weight: float = 4.0) -> Acceptance:
        return cls(prior * weight, (1.0 - prior) * weight)

    @property
    def rate(self) -> float:
        total = self.accepted + self.rejected
        return self.accepted / total if total > 0 else 0.0

    def observe(self, proposed: int, accepted: int) -> None:
        """One verifying step: `accepted` of `proposed` kept (a rejection, if any, right after them)."""
        self.accepted = self.accepted * self.decay + accepted
        self.rejected = self.rejected * self.decay + (1.0 if accepted < proposed else 0.0)
        self.idle_steps = 0


@dataclass
class Costs:
    """Measured costs in units of one plain target step (batch-1 decode): `verify_row`, what each extra verified
    row adds; `propose[source]`, what one proposed token costs. Exponentially averaged as the engine reports."""

    verify_row: float = 0.08
    propose: dict[str, float] = field(default_factory=lambda: {"ngram": 0.0, "draft": 0.35})
    # a source's one-off cost per context token when it starts on a request (the draft's prompt prefill)
    prefill: dict[str, float] = field(default_factory=lambda: {"ngram": 0.0, "draft": 0.05})
    smoothing: float = 0.1
    step_seconds: float = 0.0  # the plain step's time, the unit (0: not measured yet)

    def observe_plain(self, seconds: float) -> None:
        self.step_seconds = seconds if self.step_seconds <= 0 else self._mix(self.step_seconds, seconds)

    def observe_verify(self, extra_rows: int, seconds: float) -> None:
        if self.step_seconds > 0 and extra_rows > 0:
            row = max(0.0, (seconds / self.step_seconds - 1.0) / extra_rows)
            self.verify_row = self._mix(self.verify_row, row)

    def observe_proposal(self, source: str, tokens: int, seconds: float) -> None:
        if self.step_seconds > 0 and tokens > 0:
            self.propose[source] = self._mix(self.propose[source], seconds / tokens / self.step_seconds)

    def observe_prefill(self, source: str, tokens: int, seconds: float) -> None:
        if self.step_seconds > 0 and tokens > 0:
            self.prefill[source] = self._mix(self.prefill[source], seconds / tokens / self.step_seconds)

    def _mix(self, old: float, new: float) -> float:
        return (1.0 - self.smoothing) * old + self.smoothing * new


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verifying step of k proposals yields at per-token acceptance alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_k(alpha: float, per_token_cost: float, k_max: int) -> tuple[int, float]:
    """(k, expected speed-up over plain decoding) maximizing E(k) / (1 + k * per_token_cost); (0, 1.0) when no
    k pays."""
    best, gain = 0, 1.0
    for k in range(1, k_max + 1):
        ratio = expected_tokens(alpha, k) / (1.0 + k * per_token_cost)
        if ratio > gain + 1e-9:
            best, gain = k, ratio
    return best, gain


@dataclass(frozen=True)
class Choice:
    source: str | None  # None: decode plainly this step
    k: int
    gain: float


@dataclass
class SpeculationPolicy:
    mode: str = "off"
    k_max: int = 8
    max_batch: int = 4  # sequences decoding in a step above which speculation is off
    probe_every: int = 16
    calibrate_every: int = 32  # batch-1 steps between plain ones, which measure the cost unit
    priors: dict[str, float] = field(default_factory=lambda: {"ngram": 0.5, "draft": 0.7})
    costs: Costs = field(default_factory=Costs)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"speculative mode {self.mode!r} is not one of {', '.join(MODES)}")

    @property
    def sources(self) -> tuple[str, ...]:
        return SOURCES if self.mode == "auto" else (() if self.mode == "off" else (self.mode,))

    def active(self, decoding: int) -> bool:
        """Whether a step with `decoding` sequences speculates at all (verification stops being nearly free once
        the batch already fills the step's compute)."""
        return self.mode != "off" and 0 < decoding <= self.max_batch

    def start(self) -> dict[str, Acceptance]:
        """A new request's acceptance per source (from the priors)."""
        return {source: Acceptance.starting(self.priors[source]) for source in self.sources}

    def plan(
        self, acceptance: dict[str, Acceptance], room: int, starting: dict[str, int] | None = None
    ) -> dict[str, int]:
        """How many tokens each source should propose for a request this step (at most `room`: what its
        max_tokens and context leave). A source whose k is 0 is probed with 1 every `probe_every` steps, unless
        even certain acceptance could not pay for it (its measured cost per token). `starting[source]`: context
        tokens the source must first read for this request (the draft model's prompt prefill): it starts only
        when the steps it is expected to save over the `room` left outweigh that one-off cost."""
        ks: dict[str, int] = {}
        for source, seen in acceptance.items():
            per_token = self._per_token(source)
            k, gain = best_k(seen.rate, per_token, min(self.k_max, room))
            context = (starting or {}).get(source, 0)
            if k > 0 and context > 0:
                saved = room * (1.0 - 1.0 / gain)  # plain steps saved over what is left, at the expected gain
                if saved <= context * self.costs.prefill[source]:
                    k = 0
            if k == 0 and room > 0 and not context and best_k(1.0, per_token, self.k_max)[0] > 0:
                seen.idle_steps += 1
                if seen.idle_steps >= self.probe_every:
                    k, seen.idle_steps = 1, 0
            ks[source] = k
        return ks

    def choose(self, acceptance: dict[str, Acceptance], proposals: dict[str, list[int]]) -> Choice:
        """Which source's proposal to verify: the one with the larger expected speed-up (a probe, k = 1 below
        break-even, counts as a gain of 1.0); None when no source proposed anything."""
        best = Choice(None, 0, 1.0)
        for source, tokens in proposals.items():
            if not tokens:
                continue
            gain = self.gain(acceptance[source], source, len(tokens))
            if best.source is None or gain > best.gain:
                best = Choice(source, len(tokens), gain)
        return best

    def gain(self, seen: Acceptance, source: str, k: int) -> float:
        """The expected speed-up over plain decoding of verifying k tokens from `source`."""
        return expected_tokens(seen.rate, k) / (1.0 + k * self._per_token(source))

    def _per_token(self, source: str) -> float:
        return self.costs.verify_row + self.costs.propose[source]
