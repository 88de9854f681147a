"""From conversations to clean calibration samples: turn selection, then the cleaning rules, in order.

A sample is what the model would see when a user sends that turn: the user turn plus the conversation before
it. The rules run in a fixed order (strip, drop empty, exact dedupe, normalised dedupe, PII scrub) and each
one counts what it did, because "512 samples" means little unless the user can see that 3,000 duplicates and
40 e-mail addresses were removed on the way. Dedupe runs before the scrub so two queries that differ only in a
scrubbed e-mail address are still both kept; the token-length filter runs later, once samples are tokenized.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from calibrate.pii import scrub
from calibrate.sources import Conversation, Message

TURNS: tuple[str, ...] = ("first", "all")
_SPACE = re.compile(r"\s+")
_PUNCT_EDGES = re.compile(r"^[\W_]+|[\W_]+$")


@dataclass(frozen=True)
class Sample:
    """A calibration query: its context messages and the final user turn (the last message)."""

    messages: tuple[Message, ...]
    source: str

    @property
    def query(self) -> str:
        return self.messages[-1].content


@dataclass
class CleaningCounts:
    conversations: int = 0
    no_user_turn: int = 0
    samples: int = 0
    stripped: int = 0
    empty: int = 0
    exact_duplicates: int = 0
    normalized_duplicates: int = 0
    pii_samples: int = 0
    pii: Counter[str] = field(default_factory=Counter)
    too_short: int = 0
    too_long: int = 0
    kept: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "conversations": self.conversations,
            "no_user_turn": self.no_user_turn,
            "samples": self.samples,
            "stripped": self.stripped,
            "empty": self.empty,
            "exact_duplicates": self.exact_duplicates,
            "normalized_duplicates": self.normalized_duplicates,
            "pii_samples": self.pii_samples,
            "pii": dict(sorted(self.pii.items())),
            "too_short": self.too_short,
            "too_long": self.too_long,
            "kept": self.kept,
        }


def extract_samples(
    conversations: list[Conversation], turns: str, source: str, counts: CleaningCounts
) -> list[Sample]:
    """`first`: the opening user turn (after system messages); `all`: every user turn with its context.

    With `first`, a conversation that opens with an assistant turn has no first user query and is counted in
    `no_user_turn` rather than guessed at.
    """
    samples: list[Sample] = []
    for index, conversation in enumerate(conversations):
        counts.conversations += 1
        before = len(samples)
        if turns == "first":
            position = next((i for i, m in enumerate(conversation) if m.role != "system"), None)
            if position is not None and conversation[position].role == "user":
                samples.append(Sample(conversation[: position + 1], f"{source}#{index}"))
        else:
            for position, message in enumerate(conversation):
                if message.role == "user":
                    samples.append(Sample(conversation[: position + 1], f"{source}#{index}.{position}"))
        if len(samples) == before:
            counts.no_user_turn += 1
    return samples


def normalize(text: str) -> str:
    """Key for near-duplicate detection: NFKC, case-folded, whitespace collapsed, edge punctuation dropped."""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = _SPACE.sub(" ", text).strip()
    return _PUNCT_EDGES.sub("", text)


def clean_samples(samples: list[Sample], counts: CleaningCounts) -> list[Sample]:
    counts.samples += len(samples)
    stripped: list[Sample] = []
    for sample in samples:
        messages = tuple(Message(m.role, m.content.strip()) for m in sample.messages)
        if messages != sample.messages:
            counts.stripped += 1
        stripped.append(Sample(messages, sample.source))

    non_empty = [s for s in stripped if s.query]
    counts.empty += len(stripped) - len(non_empty)

    exact_seen: set[tuple[tuple[str, str], ...]] = set()
    exact_unique: list[Sample] = []
    for sample in non_empty:
        key = tuple((m.role, m.content) for m in sample.messages)
        if key in exact_seen:
            counts.exact_duplicates += 1
            continue
        exact_seen.add(key)
        exact_unique.append(sample)

    normalized_seen: set[tuple[tuple[str, str], ...]] = set()
    unique: list[Sample] = []
    for sample in exact_unique:
        key = tuple((m.role, normalize(m.content)) for m in sample.messages)
        if key in normalized_seen:
            counts.normalized_duplicates += 1
            continue
        normalized_seen.add(key)
        unique.append(sample)

    scrubbed: list[Sample] = []
    for sample in unique:
        total: Counter[str] = Counter()
        scrubbed_messages: list[Message] = []
        for message in sample.messages:
            text, found = scrub(message.content)
            total.update(found)
            scrubbed_messages.append(Message(message.role, text))
        if total:
            counts.pii_samples += 1
            counts.pii.update(total)
        scrubbed.append(Sample(tuple(scrubbed_messages), sample.source))
    return scrubbed
