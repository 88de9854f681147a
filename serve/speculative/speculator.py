"""The engine's side of speculation: which decodes of a step get proposals, from where, and what they yield.

A step speculates only when the scheduler built it of decodes alone (no prompt chunk beside them), at most
`max_batch` of them, and when the runner computes each verified row exactly as a one-token decode (`exact_rows`);
rows past that limit, or blocks the pool can't spare, shrink or drop proposals, never preempt anyone. Per step:
`plan` (under the engine's lock: the policy's k per request, prompt-lookup proposals, the tokens the draft model
needs), `draft` (outside the lock: the draft model's batched steps), `attach` (under the lock again: the chosen
proposal per request and the blocks its rows write to), then after the target's step `verify` per request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from serve.core.request import Request
from serve.core.sampler import distribution, seeded
from serve.core.scheduler import Scheduled, Scheduler, SchedulerOutput
from serve.metrics import Metrics
from serve.speculative import verify as rules
from serve.speculative.draft import DraftModel
from serve.speculative.ngram import prompt_lookup
from serve.speculative.policy import Acceptance, SpeculationPolicy


@dataclass
class _Wanted:
    item: Scheduled
    ks: dict[str, int]
    proposals: dict[str, list[int]] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)  # the request's tokens, for the draft model


@dataclass(frozen=True)
class Summary:
    """Speculation so far: tokens proposed and accepted per source, verifying steps and the tokens they emitted."""

    proposed: dict[str, int]
    accepted: dict[str, int]
    verify_steps: int
    emitted: int

    @property
    def acceptance(self) -> float:
        total = sum(self.proposed.values())
        return sum(self.accepted.values()) / total if total else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.verify_steps if self.verify_steps else 0.0

    def since(self, before: Summary) -> Summary:
        return Summary(
            {k: v - before.proposed.get(k, 0) for k, v in self.proposed.items()},
            {k: v - before.accepted.get(k, 0) for k, v in self.accepted.items()},
            self.verify_steps - before.verify_steps,
            self.emitted - before.emitted,
        )


@dataclass
class Plan:
    wanted: list[_Wanted] = field(default_factory=list)
    draft_seconds: float = 0.0


class Speculator:
    def __init__(
        self,
        policy: SpeculationPolicy,
        draft: DraftModel | None,
        exact_rows: int,
        max_model_len: int,
        metrics: Metrics,
    ) -> None:
        if policy.mode in ("draft", "auto") and draft is None:
            raise ValueError(f"--speculative {policy.mode} needs a draft model (--draft DIR or --draft int4)")
        if policy.mode != "off" and exact_rows < 2:
            raise ValueError(
                "--speculative needs every layer in the fused native step (CPU, native kernels, int8/int4/bf16/"
                "FP32 linears, an FP32 LM head), or --batch-invariant; serve without --speculative"
            )
        self.policy = policy
        self.draft_model = draft
        self.exact_rows = exact_rows
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.enabled = policy.mode != "off"  # a controller may switch it off under load
        self.acceptance: dict[str, dict[str, Acceptance]] = {}
        self.proposed: dict[str, int] = {}
        self.accepted: dict[str, int] = {}
        self.steps = 0
        self.emitted = 0
        self._source: dict[int, str] = {}  # id(item) -> the source of the proposal it carries this step
        self._since_plain = 0  # batch-1 steps since the last plain one

    def plan(self, out: SchedulerOutput, running: list[Request]) -> Plan:
        """Under the engine's lock: the step's decodes that will speculate, with their prompt-lookup proposals
        and what the draft model must propose."""
        self._source.clear()  # a proposal never verified (its request ended mid-step) leaves nothing behind
        live = {r.request_id for r in running}
        for request_id in [r for r in self.acceptance if r not in live]:
            del self.acceptance[request_id]
        if self.draft_model is not None:
            self.draft_model.retain(live)
        items = out.scheduled
        plan = Plan()
        if not self.enabled or any(i.num_new != 1 for i in items) or not self.policy.active(len(items)):
            return plan
        if len(items) == 1:
            self._since_plain += 1
            if self.policy.costs.step_seconds <= 0 or self._since_plain > self.policy.calibrate_every:
                self._since_plain = 0  # a plain batch-1 step now and then: the unit every cost is measured in
                return plan
        spare = self.exact_rows - len(items)
        for item in items:
            request = item.request
            params = request.params
            room = min(
                params.max_tokens - len(request.output_ids) - 1,
                self.max_model_len - request.num_tokens,
                spare,
            )
            if room <= 0:
                continue
            seen = self.acceptance.setdefault(request.request_id, self.policy.start())
            starting = (
                {"draft": self.draft_model.uncomputed(request.request_id, request.num_tokens)}
                if self.draft_model is not None
                else None
            )
            ks = self.policy.plan(seen, room, starting)
            if not any(ks.values()):
                continue
            wanted = _Wanted(item, ks)
            if ks.get("ngram"):
                wanted.proposals["ngram"] = prompt_lookup(request.all_ids, ks["ngram"])
            if ks.get("draft") and self._needs_draft(seen, wanted):
                wanted.tokens = list(request.all_ids)
            spare -= max(ks.values())
            plan.wanted.append(wanted)
        return plan

    def _needs_draft(self, seen: dict[str, Acceptance], wanted: _Wanted) -> bool:
        """Whether the draft model should run for this request: its expected gain beats prompt lookup's."""
        lookup = wanted.proposals.get("ngram")
        if not lookup:
            return True
        policy = self.policy
        return policy.gain(seen["draft"], "draft", wanted.ks["draft"]) > policy.gain(
            seen["ngram"], "ngram", len(lookup)
        )

    def draft(self, plan: Plan) -> None:
        """Outside the lock: run the draft model for the requests that need it (batched, one step per token)."""
        asked = {w.item.request.request_id: (w.tokens, w.ks["draft"]) for w in plan.wanted if w.tokens}
        if not asked or self.draft_model is None:
            return
        started = time.perf_counter()
        draft = self.draft_model
        proposals = draft.propose(asked)
        plan.draft_seconds = time.perf_counter() - started
        for wanted in plan.wanted:
            found = proposals.get(wanted.item.request.request_id)
            if found is not None:
                wanted.proposals["draft"] = found
        if len(asked) == 1 and draft.steps:
            self.policy.costs.observe_proposal("draft", draft.steps, draft.step_seconds)
        if draft.prefill_tokens:
            self.policy.costs.observe_prefill("draft", draft.prefill_tokens, draft.prefill_seconds)

    def attach(self, plan: Plan, scheduler: Scheduler) -> int:
        """Under the lock again: each request's chosen proposal, with blocks for its rows; the rows added."""
        added = 0
        for wanted in plan.wanted:
            item, request = wanted.item, wanted.item.request
            if request.finished:
                continue
            seen = self.acceptance.get(request.request_id)
            if seen is None:
                continue
            choice = self.policy.choose(seen, wanted.proposals)
            if choice.source is None:
                continue
            proposal = wanted.proposals[choice.source]
            if not scheduler.kv.reserve(request, item.start + 1 + len(proposal)):
                continue
            item.proposal = proposal
            self._source[id(item)] = choice.source
            added += len(proposal)
        return added

    def verify(self, item: Scheduled, logits: torch.Tensor) -> rules.Verdict:
        """The tokens a verifying request emits, from its rows' logits [1 + len(proposal), vocab]."""
        request = item.request
        if request.params.greedy:
            verdict = rules.greedy(logits.argmax(dim=-1).tolist(), item.proposal)
        else:
            probs = torch.stack([distribution(row, request.params) for row in logits])
            verdict = rules.sampled(probs, item.proposal, lambda ahead: seeded(request, ahead))
        source = self._source.pop(id(item), "ngram")
        seen = self.acceptance.get(request.request_id)
        if seen is not None and source in seen:
            seen[source].observe(len(item.proposal), verdict.accepted)
        self._count(source, len(item.proposal), verdict)
        return verdict

    def _count(self, source: str, proposed: int, verdict: rules.Verdict) -> None:
        self.proposed[source] = self.proposed.get(source, 0) + proposed
        self.accepted[source] = self.accepted.get(source, 0) + verdict.accepted
        self.steps += 1
        self.emitted += len(verdict.tokens)
        metrics = self.metrics.speculation
        metrics.proposed.labels(source=source).inc(proposed)
        metrics.accepted.labels(source=source).inc(verdict.accepted)
        metrics.steps.inc()
        metrics.emitted.inc(len(verdict.tokens))
        total = sum(self.proposed.values())
        metrics.acceptance.set(sum(self.accepted.values()) / total if total else 0.0)
        metrics.tokens_per_step.set(self.emitted / self.steps)

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """A batch-1 decode step's time: the unit of the policy's costs (plain), or a verifying step's."""
        items = out.scheduled
        if len(items) != 1 or items[0].num_new != 1:
            return
        extra = len(items[0].proposal)
        if extra:
            self.policy.costs.observe_verify(extra, seconds)
        else:
            self.policy.costs.observe_plain(seconds)

    def summary(self) -> Summary:
        return Summary(dict(self.proposed), dict(self.accepted), self.steps, self.emitted)
