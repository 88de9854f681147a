"""Accepting proposed tokens against the target's distributions, exactly.

Pure functions on one request's verified rows: `greedy` keeps proposals while they equal the target's argmax and
then emits the target's own token; `sampled` is Leviathan et al.'s rejection sampler for a deterministic proposal
(the proposer's distribution is a point mass q = 1{x}): accept x with probability min(1, p(x)/q(x)) = p(x), else
draw from norm(max(0, p - q)), which is p with x removed. Either way the emitted tokens are distributed exactly
as the target's; and when all proposals pass, one more token comes from the last row for free.

Randomness: the draws for the request's i-th output token come from its generator seeded from (seed, i)
(`serve.core.sampler.token_seed`), as without speculation, so a given seed and the same proposals give the same
tokens on any engine, and a request that proposes nothing draws exactly what the plain sampler draws.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # what the request emits: the accepted proposals, then one token of the target's
    accepted: int  # how many proposals were kept


def greedy(target: Sequence[int], proposal: Sequence[int]) -> Verdict:
    """target: the argmax of each verified row (len(proposal) + 1 of them)."""
    assert len(target) == len(proposal) + 1, "one verified row per proposal, plus the row before them"
    accepted = 0
    while accepted < len(proposal) and proposal[accepted] == target[accepted]:
        accepted += 1
    return Verdict([*proposal[:accepted], int(target[accepted])], accepted)


def sampled(
    probs: torch.Tensor, proposal: Sequence[int], generator: Callable[[int], torch.Generator]
) -> Verdict:
    """probs [len(proposal) + 1, vocab]: the target's distribution at each verified row (after temperature,
    top-k, top-p); generator(i): the request's generator seeded for the i-th token this step emits."""
    assert probs.shape[0] == len(proposal) + 1, "one verified row per proposal, plus the row before them"
    for index, token in enumerate(proposal):
        draws = generator(index)
        chance = float(probs[index, token])
        if float(torch.rand(1, generator=draws)) < chance:
            continue
        residual = probs[index].clone()
        residual[token] = 0.0
        if float(residual.sum()) <= 0.0:  # p was (numerically) all on the proposal
            continue
        replacement = int(torch.multinomial(residual, 1, generator=draws))
        return Verdict([*proposal[:index], replacement], index)
    last = len(proposal)
    bonus = int(torch.multinomial(probs[last], 1, generator=generator(last)))
    return Verdict([*proposal, bonus], last)
