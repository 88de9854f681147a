"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the context's last n-gram.

Answers that quote, summarize or edit a given text repeat long runs of it; the proposals cost a scan of the
context (no model), so even a modest acceptance pays for the extra rows of the verifying step.
"""

from __future__ import annotations

from collections.abc import Sequence


def prompt_lookup(tokens: Sequence[int], k: int, max_n: int = 4, min_n: int = 2) -> list[int]:
    """`k` tokens that followed the most recent earlier occurrence of the last n tokens of `tokens`, trying the
    longest n first (`max_n` down to `min_n`); [] when no n-gram recurs. A continuation that reaches the end of
    the context goes on with the proposed tokens themselves (a repeating pattern proposes its next period)."""
    length = len(tokens)
    if k <= 0 or length < min_n + 1:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = list(tokens[length - n :])
        last = pattern[-1]
        for end in range(length - 2, n - 2, -1):  # end: index of an earlier occurrence's last token
            if tokens[end] == last and list(tokens[end - n + 1 : end + 1]) == pattern:
                return _continue(tokens, end + 1, k)
    return []


def _continue(tokens: Sequence[int], start: int, k: int) -> list[int]:
    proposal: list[int] = []
    for source in range(start, start + k):
        proposal.append(tokens[source] if source < len(tokens) else proposal[source - len(tokens)])
    return proposal
