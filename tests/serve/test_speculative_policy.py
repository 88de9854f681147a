"""Speculative decoding's pure parts: prompt lookup, the acceptance rules (greedy, and a rejection sampler whose
output distribution is checked against the target's with a chi-squared test over thousands of seeded draws) and
the policy that picks k and the source from measured acceptance and costs."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch

from quantize.common.errors import QpackError
from serve.core.request import Request, SamplingParams
from serve.core.sampler import sample, seeded
from serve.speculative import verify
from serve.speculative.ngram import prompt_lookup
from serve.speculative.policy import Acceptance, Costs, SpeculationPolicy, best_k, expected_tokens

# chi-squared critical values at p = 0.001 by degrees of freedom: a correct sampler fails 1 run in 1000
CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52}


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of counts against probs over the cells with nonzero probability; (stat, dof)."""
    keep = probs > 0
    assert int(counts[~keep].sum()) == 0, "a token of probability 0 was drawn"
    expected = probs[keep] * counts.sum()
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    return stat, int(keep.sum()) - 1


def test_prompt_lookup_takes_the_longest_recurring_ngram_and_its_latest_occurrence() -> None:
    tokens = [7, 1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 8, 2, 3]
    assert prompt_lookup(tokens, 3, max_n=4, min_n=2) == [4, 5, 8]  # "2 3" latest at 7..8, followed by 4 5 8
    assert prompt_lookup(tokens, 2, max_n=4, min_n=3) == []  # "8 2 3" never recurs
    assert prompt_lookup([5, 1, 2, 6, 1, 2], 2, max_n=2, min_n=1) == [6, 1]
    assert prompt_lookup([1, 2, 3], 4) == []
    assert prompt_lookup([1, 2, 1, 2], 0) == []


def test_prompt_lookup_continues_a_repeating_pattern_past_the_context() -> None:
    assert prompt_lookup([4, 1, 2, 1, 2], 5, max_n=2, min_n=2) == [1, 2, 1, 2, 1]
    assert prompt_lookup([3, 3, 3], 4, max_n=2, min_n=1) == [3, 3, 3, 3]


def test_greedy_keeps_proposals_while_they_match_then_takes_the_targets_token() -> None:
    assert verify.greedy([5, 6, 7, 8], [5, 6, 9]) == verify.Verdict([5, 6, 7], 2)
    assert verify.greedy([5, 6, 7, 8], [5, 6, 7]) == verify.Verdict([5, 6, 7, 8], 3)  # all kept: one more
    assert verify.greedy([4, 6], [5]) == verify.Verdict([4], 0)
    assert verify.greedy([4], []) == verify.Verdict([4], 0)


def _generators(seed: int) -> Callable[[int], torch.Generator]:
    generator = torch.Generator()
    return lambda ahead: generator.manual_seed(seed * 100 + ahead)


def test_rejection_sampling_emits_the_targets_distribution() -> None:
    p0 = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1, 0.0])
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.0, 0.3])
    for proposal in ([1, 5], [4, 0], [5, 3]):  # likely, unlikely, and a token the target never draws
        probs = torch.stack([p0, p1, torch.full((6,), 1 / 6)])
        first = torch.zeros(6)
        second = torch.zeros(6)
        for seed in range(6000):
            verdict = verify.sampled(probs, proposal, _generators(seed))
            first[verdict.tokens[0]] += 1
            if verdict.tokens[0] == proposal[0] and len(verdict.tokens) > 1:
                second[verdict.tokens[1]] += 1
        stat, dof = _chi2(first, p0)
        assert stat < CHI2_999[dof], (proposal, first, stat)
        if p0[proposal[0]] > 0.05:
            stat, dof = _chi2(second, p1)  # after an accepted first token the second follows the next row
            assert stat < CHI2_999[dof], (proposal, second, stat)


def test_a_request_that_proposes_nothing_draws_what_the_plain_sampler_draws() -> None:
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=11)
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    from serve.core.sampler import distribution

    for emitted in range(5):
        request = Request("r", [1, 2, 3], params)
        request.output_ids = list(range(emitted))
        plain = sample(logits, [request])[0]
        probs = distribution(logits[0], params)[None]
        verdict = verify.sampled(probs, [], partial(seeded, request))
        assert verdict.tokens == [plain]


def test_the_same_seed_and_proposal_give_the_same_tokens() -> None:
    probs = torch.softmax(torch.randn(4, 30, generator=torch.Generator().manual_seed(1)), dim=-1)
    runs = {tuple(verify.sampled(probs, [3, 4, 5], _generators(7)).tokens) for _ in range(3)}
    assert len(runs) == 1


def test_expected_tokens_and_best_k_follow_acceptance_and_cost() -> None:
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12
    assert best_k(0.05, 0.3, 8) == (0, 1.0)  # nothing pays: decode plainly
    ks = [best_k(alpha, 0.1, 8)[0] for alpha in (0.3, 0.6, 0.8, 0.95)]
    assert ks == sorted(ks) and ks[-1] > ks[0]  # more acceptance, longer proposals
    assert best_k(0.95, 0.0, 8)[0] == 8  # free proposals: as many as allowed
    assert best_k(0.8, 0.5, 8)[0] < best_k(0.8, 0.05, 8)[0]  # a dearer proposer proposes fewer


def test_acceptance_decays_toward_recent_steps() -> None:
    seen = Acceptance.starting(0.5)
    for _ in range(30):
        seen.observe(4, 4)
    assert seen.rate > 0.95
    for _ in range(30):
        seen.observe(4, 0)
    assert seen.rate < 0.2


def test_a_source_below_break_even_is_probed_every_probe_every_steps() -> None:
    policy = SpeculationPolicy("ngram", k_max=8, probe_every=4)
    seen = {"ngram": Acceptance(0.0, 10.0)}
    ks = [policy.plan(seen, room=8)["ngram"] for _ in range(8)]
    assert ks == [0, 0, 0, 1, 0, 0, 0, 1]
    assert policy.plan({"ngram": Acceptance(10.0, 0.5)}, room=3)["ngram"] == 3  # never past the room


def test_auto_chooses_the_source_with_the_larger_expected_gain() -> None:
    policy = SpeculationPolicy("auto", costs=Costs(verify_row=0.05, propose={"ngram": 0.0, "draft": 0.4}))
    seen = {"ngram": Acceptance(9.0, 1.0), "draft": Acceptance(9.0, 1.0)}
    choice = policy.choose(seen, {"ngram": [1, 2, 3], "draft": [1, 2, 3]})
    assert choice.source == "ngram" and choice.k == 3  # as likely to be kept, and free
    seen["ngram"] = Acceptance(1.0, 9.0)
    assert policy.choose(seen, {"ngram": [1, 2, 3], "draft": [1, 2, 3]}).source == "draft"
    assert policy.choose(seen, {"ngram": [], "draft": []}).source is None


def test_speculation_stops_above_the_batch_threshold() -> None:
    policy = SpeculationPolicy("auto", max_batch=4)
    assert [policy.active(n) for n in (0, 1, 4, 5)] == [False, True, True, False]
    assert not SpeculationPolicy("off").active(1)


def test_costs_are_measured_in_plain_steps() -> None:
    costs = Costs(smoothing=1.0)
    costs.observe_proposal("draft", 4, 0.1)  # ignored until a plain step was measured
    assert costs.propose["draft"] == 0.35
    costs.observe_plain(0.01)
    costs.observe_verify(4, 0.014)
    costs.observe_proposal("draft", 4, 0.012)
    assert abs(costs.verify_row - 0.1) < 1e-9
    assert abs(costs.propose["draft"] - 0.3) < 1e-9


def test_a_draft_starts_only_when_the_tokens_left_repay_its_prefill() -> None:
    costs = Costs(
        verify_row=0.05, propose={"ngram": 0.0, "draft": 0.2}, prefill={"ngram": 0.0, "draft": 0.01}
    )
    policy = SpeculationPolicy("draft", costs=costs)
    seen = {"draft": Acceptance(9.0, 1.0)}
    assert policy.plan(seen, room=100, starting={"draft": 500})["draft"] > 0  # saves ~60 steps for 5
    assert policy.plan(seen, room=8, starting={"draft": 2000})["draft"] == 0  # saves ~5 steps for 20
    assert policy.plan(seen, room=8, starting={"draft": 0})["draft"] > 0  # already started: no one-off cost


def test_a_source_that_cannot_pay_even_when_always_accepted_is_never_probed() -> None:
    costs = Costs(verify_row=0.1, propose={"ngram": 0.0, "draft": 0.95})
    policy = SpeculationPolicy("draft", probe_every=2, costs=costs)
    seen = {"draft": Acceptance(10.0, 0.0)}
    assert [policy.plan(seen, room=8)["draft"] for _ in range(6)] == [0] * 6


def test_a_draft_that_cannot_be_is_refused_in_one_line(tmp_path: Path) -> None:
    from serve.loading import load_draft

    with pytest.raises(QpackError, match="group size must be one of 32, 64, 128"):
        load_draft("int4:48", None)  # type: ignore[arg-type]
    with pytest.raises(QpackError, match="neither int4"):
        load_draft(str(tmp_path / "missing"), None)  # type: ignore[arg-type]
