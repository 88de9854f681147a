"""PII scrubbing of user queries before anything is stored.

Calibration sets are built from production traffic, so they carry what users paste: e-mail addresses, phone
numbers, IPs, card numbers, API keys. qpack stores only token ids (and text with --keep-text), but token ids
decode back to text, so every query is scrubbed before it is tokenized. Matches become placeholder tokens
(`<EMAIL>`, `<PHONE>`, ...) that keep the sentence shape, so activation statistics still see realistic text.

The patterns favour recall on the formats people paste (a missed secret is worse than a lost number) but
avoid the usual false positives: dates and version strings are not phone numbers (a phone needs a separator
style of phones or a leading `+`), and digit runs are only card numbers when they pass the Luhn check.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

PLACEHOLDERS: dict[str, str] = {
    "secret": "<SECRET>",
    "email": "<EMAIL>",
    "credit_card": "<CREDIT_CARD>",
    "ip": "<IP_ADDRESS>",
    "phone": "<PHONE>",
}

_SECRET_PATTERNS: tuple[str, ...] = (
    r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_\-]{20,}",
    r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",
    r"\bgh[pousr]_[A-Za-z0-9]{30,}\b",
    r"\bgithub_pat_[A-Za-z0-9_]{40,}\b",
    r"\bxox[abposr]-[A-Za-z0-9-]{10,}",
    r"\bAIza[0-9A-Za-z_\-]{35}\b",
    r"\bhf_[A-Za-z0-9]{30,}\b",
    r"\bglpat-[A-Za-z0-9_\-]{20,}\b",
    r"\b(?:sk|pk|rk)_(?:live|test)_[A-Za-z0-9]{16,}\b",
    r"\beyJ[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{10,}",
    r"-----BEGIN (?:[A-Z ]+ )?PRIVATE KEY-----[\s\S]*?(?:-----END (?:[A-Z ]+ )?PRIVATE KEY-----|$)",
)
_SECRET = re.compile("|".join(f"(?:{p})" for p in _SECRET_PATTERNS))
_ASSIGNED_SECRET = re.compile(
    r"(?i)\b((?:api[_-]?key|apikey|secret[_-]?key|secret|access[_-]?token|auth[_-]?token|token|password|passwd|"
    r"pwd|client[_-]?secret|private[_-]?key)[\"']?\s*[:=]\s*[\"']?)([^\s\"',;<>(){}\[\]]{4,})"
)
_BEARER = re.compile(r"(?i)\b(bearer\s+)([A-Za-z0-9._~+/\-]{16,}=*)")
_EMAIL = re.compile(r"\b[A-Za-z0-9._%+\-]+@[A-Za-z0-9\-]+(?:\.[A-Za-z0-9\-]+)*\.[A-Za-z]{2,}\b")
_CARD = re.compile(
    r"(?<![\w/=.:\-])(?:[2-6]\d{3}([ \-]?)\d{4}\1\d{4}\1\d{1,7}|3[47]\d{2}[ \-]?\d{6}[ \-]?\d{5})(?![\w\-]|\.\d)"
)
_IPV4 = re.compile(
    r"(?<![\w.\-])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?![\d.]\d)"
)
_IPV6 = re.compile(
    r"(?<![\w:])(?:(?:[0-9A-Fa-f]{1,4}:){7}[0-9A-Fa-f]{1,4}|(?:[0-9A-Fa-f]{1,4}:){1,7}:(?:[0-9A-Fa-f]{1,4}"
    r"(?::[0-9A-Fa-f]{1,4}){0,6})?|::(?:[0-9A-Fa-f]{1,4}:){0,6}[0-9A-Fa-f]{1,4})(?![\w:])"
)
_CODE_PATH = re.compile(r"^[A-Za-z_]\w*(?:(?:\.|::|->)[A-Za-z_]\w*)+$")
_NOT_PERSONAL_IPS = frozenset({"127.0.0.1", "0.0.0.0", "255.255.255.255"})
_PHONE = re.compile(
    r"(?<![\w+])(?:"
    r"\+\d{1,3}[\s.\-]?(?:\(\d{1,4}\)[\s.\-]?)?\d{1,4}(?:[\s.\-]?\d{2,4}){1,4}"
    r"|\(\d{3}\)\s?\d{3}[\s.\-]\d{4}"
    r"|\d{3}[.\-]\d{3}[.\-]\d{4}"
    r"|\d{3} \d{3} \d{4}"
    r")(?!\w)"
)


def luhn_valid(digits: str) -> bool:
    total = 0
    for index, char in enumerate(reversed(digits)):
        value = int(char)
        if index % 2 == 1:
            value *= 2
            if value > 9:
                value -= 9
        total += value
    return total % 10 == 0


def _card(match: re.Match[str]) -> str | None:
    digits = re.sub(r"\D", "", match.group(0))
    return PLACEHOLDERS["credit_card"] if 13 <= len(digits) <= 19 and luhn_valid(digits) else None


def _phone(match: re.Match[str]) -> str | None:
    digits = re.sub(r"\D", "", match.group(0))
    return PLACEHOLDERS["phone"] if 7 <= len(digits) <= 15 else None


def _ipv4(match: re.Match[str]) -> str | None:
    text = match.group(0)
    if text in _NOT_PERSONAL_IPS or text.startswith("255.255.") or all(len(o) == 1 for o in text.split(".")):
        return None
    return PLACEHOLDERS["ip"]


def _secret_value(match: re.Match[str]) -> str | None:
    """A value assigned to a secret-like key is redacted only when it looks like a literal credential."""
    value = match.group(2)
    if value.startswith(
        ("$", "%", "process.", "os.", "env", "ENV", "config", "settings", "self.", "this.", "request")
    ):
        return None
    if _CODE_PATH.match(value):
        return None
    has_digit = any(c.isdigit() for c in value)
    has_alpha = any(c.isalpha() for c in value)
    if (has_digit and has_alpha) or (len(value) >= 16 and not value.isidentifier()):
        return match.group(1) + PLACEHOLDERS["secret"]
    return None


def _ipv6(match: re.Match[str]) -> str | None:
    text = match.group(0)
    return PLACEHOLDERS["ip"] if text.count(":") >= 2 and any(c.isdigit() for c in text) else None


def _sub(
    pattern: re.Pattern[str],
    kind: str,
    text: str,
    counts: Counter[str],
    decide: Callable[[re.Match[str]], str | None],
) -> str:
    def replace(match: re.Match[str]) -> str:
        placeholder = decide(match)
        if placeholder is None:
            return match.group(0)
        counts[kind] += 1
        return placeholder

    return pattern.sub(replace, text)


def _fixed(kind: str) -> Callable[[re.Match[str]], str]:
    return lambda _match: PLACEHOLDERS[kind]


def _assigned(match: re.Match[str]) -> str:
    return match.group(1) + PLACEHOLDERS["secret"]


def scrub(text: str) -> tuple[str, Counter[str]]:
    """Replace PII in `text` with placeholders; returns the new text and counts per kind."""
    counts: Counter[str] = Counter()
    text = _sub(_SECRET, "secret", text, counts, _fixed("secret"))
    text = _sub(_ASSIGNED_SECRET, "secret", text, counts, _secret_value)
    text = _sub(_BEARER, "secret", text, counts, _assigned)
    text = _sub(_EMAIL, "email", text, counts, _fixed("email"))
    text = _sub(_CARD, "credit_card", text, counts, _card)
    text = _sub(_IPV4, "ip", text, counts, _ipv4)
    text = _sub(_IPV6, "ip", text, counts, _ipv6)
    text = _sub(_PHONE, "phone", text, counts, _phone)
    return text, counts
