"""Next-token sampling: greedy, temperature, top-k, top-p, each request with its own seeded generator.

A request's random stream depends only on its own seed, never on which other requests share its batch, so
the same request gives the same output alone or among 16 concurrent ones. The generator is reseeded for every
token from (seed, token index), so the draw for token i does not depend on how many random numbers earlier
draws consumed: an engine that continues an answer after token i (a fleet worker taking over from a dead one)
samples exactly what the first engine would have.
"""

from __future__ import annotations

import hashlib

import torch

from serve.core.request import Request, SamplingParams


class RowError(Exception):
    """One request's own numbers could not be sampled (a distribution that is not finite, a draw refused)."""


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int | RowError]:
    """logits [S, vocab] float32, one row per request -> next token ids. A row that can't be sampled gets its
    RowError in place of a token, and the other rows their tokens: one request's numbers never fail the
    batch."""
    if all(s.params.greedy for s in requests):
        return logits.argmax(dim=-1).tolist()
    tokens: list[int | RowError] = []
    for row, request in enumerate(requests):
        if request.params.greedy:
            tokens.append(int(logits[row].argmax()))
            continue
        try:
            tokens.append(draw(logits[row], request))
        except Exception as error:
            tokens.append(RowError(f"{type(error).__name__}: {error}"))
    return tokens


def draw(logits: torch.Tensor, request: Request) -> int:
    """A sampled request's next token from its logits [vocab]; ValueError when its distribution is not finite."""
    probs = distribution(logits, request.params)
    if not bool(torch.isfinite(probs).all()):
        raise ValueError(f"no finite distribution at temperature {request.params.temperature}")
    return int(torch.multinomial(probs, 1, generator=seeded(request, 0)))


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: logits [vocab] after temperature, top-k and top-p ->
    probabilities [vocab]."""
    scores = logits / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[0]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        cumulative = torch.cumsum(probs, dim=-1)
        drop = cumulative - probs > params.top_p  # keep the smallest prefix whose mass reaches top_p
        ordered = ordered.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, ordered)
    return torch.softmax(scores, dim=-1)


def seeded(request: Request, ahead: int) -> torch.Generator:
    """The request's generator, seeded for its output token `ahead` places after the ones it has."""
    assert request.generator is not None
    index = request.sample_offset + len(request.output_ids) + ahead
    return request.generator.manual_seed(token_seed(request.seed, index))


def token_seed(seed: int, index: int) -> int:
    """The generator seed of a request's INDEX-th output token."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest(), "big") >> 1
