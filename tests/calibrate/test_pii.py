from __future__ import annotations

import pytest

from calibrate.pii import luhn_valid, scrub


@pytest.mark.parametrize(
    ("text", "expected", "kind"),
    [
        ("write to jane.doe+tag@mail.example.co.uk today", "write to <EMAIL> today", "email"),
        ("call +1 (555) 123-4567 now", "call <PHONE> now", "phone"),
        ("call 555-123-4567 now", "call <PHONE> now", "phone"),
        ("call (555) 123-4567", "call <PHONE>", "phone"),
        ("ring +44 20 7946 0958", "ring <PHONE>", "phone"),
        ("card 4111 1111 1111 1111 ok", "card <CREDIT_CARD> ok", "credit_card"),
        ("card 5500-0000-0000-0004", "card <CREDIT_CARD>", "credit_card"),
        ("amex 378282246310005", "amex <CREDIT_CARD>", "credit_card"),
        ("host 192.168.1.20 up", "host <IP_ADDRESS> up", "ip"),
        ("v6 2001:db8:85a3::8a2e:370:7334 up", "v6 <IP_ADDRESS> up", "ip"),
        ("key sk-proj-abcdefghijklmnopqrstuvwx1234", "key <SECRET>", "secret"),
        ("aws AKIAIOSFODNN7EXAMPLE", "aws <SECRET>", "secret"),
        ("token ghp_0123456789abcdefghijklmnopqrstuvwxyz", "token <SECRET>", "secret"),
        ("api_key = 'abcd1234efgh'", "api_key = '<SECRET>'", "secret"),
        ("password: hunter22", "password: <SECRET>", "secret"),
        ("Authorization: Bearer abcdefghijklmnop1234", "Authorization: Bearer <SECRET>", "secret"),
    ],
)
def test_scrub_finds_pii(text: str, expected: str, kind: str) -> None:
    scrubbed, counts = scrub(text)
    assert scrubbed == expected
    assert counts[kind] == 1 and sum(counts.values()) == 1


@pytest.mark.parametrize(
    "text",
    [
        "released on 2023-01-15 at 12:30:45",
        "version 1.2.3 and 10.4.1, pi is 3.14159",
        "unix time 1678901234 and order 1234567812345678",
        "std::vector<int> x; a::b",
        "bind to 127.0.0.1 or 0.0.0.0, subnet 255.255.255.0, section 1.1.2.1",
        "const token = localStorage.getItem('t'); password = process.env.PASSWORD",
        "the password reset link",
        "matrix [ 12 34 56 78 ]",
    ],
)
def test_scrub_leaves_ordinary_text(text: str) -> None:
    assert scrub(text) == (text, {})


def test_luhn() -> None:
    assert luhn_valid("4111111111111111")
    assert not luhn_valid("4111111111111112")
