"""Render samples the way the server will see them, then tokenize.

Calibration must match serving: an instruct model is queried through its chat template (system prompt,
role markers, generation prompt), so by default samples are rendered with the model's own template, the same
one `qpack serve` applies to chat requests. `--no-chat-template` renders raw text for base models.
"""

from __future__ import annotations

from typing import Any

from calibrate.clean import Sample


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render(sample: Sample, tokenizer: Any, use_template: bool) -> str:
    if use_template:
        messages = [{"role": m.role, "content": m.content} for m in sample.messages]
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return "\n\n".join(m.content for m in sample.messages)


def tokenize_samples(
    samples: list[Sample], tokenizer: Any, use_template: bool
) -> tuple[list[Sample], list[list[int]], int]:
    """Token ids per sample; samples the chat template rejects are dropped and counted (third value)."""
    kept: list[Sample] = []
    texts: list[str] = []
    rejected = 0
    for sample in samples:
        try:
            texts.append(render(sample, tokenizer, use_template))
        except Exception:
            rejected += 1
            continue
        kept.append(sample)
    if not texts:
        return kept, [], rejected
    encoded = tokenizer(texts, add_special_tokens=not use_template)["input_ids"]
    return kept, [list(ids) for ids in encoded], rejected


def content_token_ids(samples: list[Sample], tokenizer: Any) -> list[list[int]]:
    """Tokens of the query text alone (no template), for comparing what users ask about."""
    texts = ["\n\n".join(m.content for m in s.messages) for s in samples]
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
