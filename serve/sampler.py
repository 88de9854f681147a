"""Next-token sampling: greedy, temperature, top-k, top-p, each request with its own seeded generator.

A request's random stream depends only on its own seed, never on which other requests share its batch, so
the same request gives the same output alone or among 16 concurrent ones.
"""

from __future__ import annotations

import torch

from serve.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits [S, vocab] float32, one row per sequence -> next token ids."""
    if all(s.params.greedy for s in seqs):
        return logits.argmax(dim=-1).tolist()
    tokens = []
    for row, seq in enumerate(seqs):
        params = seq.params
        if params.greedy:
            tokens.append(int(logits[row].argmax()))
            continue
        scores = logits[row] / params.temperature
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
        probs = torch.softmax(scores, dim=-1)
        tokens.append(int(torch.multinomial(probs, 1, generator=seq.generator)))
    return tokens
