from __future__ import annotations

from calibrate.clean import CleaningCounts, Sample, clean_samples, extract_samples, normalize
from calibrate.sources import Message

U, A, S = "user", "assistant", "system"


def conv(*pairs: tuple[str, str]) -> tuple[Message, ...]:
    return tuple(Message(role, text) for role, text in pairs)


def test_first_turn_needs_a_leading_user_turn() -> None:
    counts = CleaningCounts()
    conversations = [
        conv((S, "sys"), (U, "q1"), (A, "a1"), (U, "q2")),
        conv((A, "greeting"), (U, "late question")),
        conv(),
    ]
    samples = extract_samples(conversations, "first", "f", counts)
    assert [s.messages for s in samples] == [conv((S, "sys"), (U, "q1"))]
    assert counts.conversations == 3 and counts.no_user_turn == 2


def test_all_turns_keep_their_context() -> None:
    counts = CleaningCounts()
    samples = extract_samples([conv((U, "q1"), (A, "a1"), (U, "q2"))], "all", "f", counts)
    assert [s.messages for s in samples] == [conv((U, "q1")), conv((U, "q1"), (A, "a1"), (U, "q2"))]
    assert samples[1].query == "q2"


def test_cleaning_rules_in_order_with_counts() -> None:
    texts = [
        "  Hello world  ",
        "Hello world",
        "hello   WORLD!",
        "",
        "   ",
        "mail bob@example.com",
        "mail alice@example.com",
        "unique",
    ]
    samples = [Sample(conv((U, t)), f"s{i}") for i, t in enumerate(texts)]
    counts = CleaningCounts()
    cleaned = clean_samples(samples, counts)
    assert [s.query for s in cleaned] == ["Hello world", "mail <EMAIL>", "mail <EMAIL>", "unique"]
    assert counts.samples == 8
    assert counts.stripped == 2
    assert counts.empty == 2
    assert counts.exact_duplicates == 1
    assert counts.normalized_duplicates == 1
    assert counts.pii_samples == 2 and counts.pii["email"] == 2


def test_pii_in_context_messages_is_scrubbed_too() -> None:
    counts = CleaningCounts()
    sample = Sample(conv((U, "my ip is 10.1.2.3"), (A, "noted"), (U, "and now?")), "s")
    (cleaned,) = clean_samples([sample], counts)
    assert cleaned.messages[0].content == "my ip is <IP_ADDRESS>"
    assert counts.pii["ip"] == 1


def test_normalize() -> None:
    assert normalize("  Ｈello,\tWORLD!! ") == "hello, world"
