"""A validated request's prompt as token ids: the tokenizer for completions, the model's chat template (or a
plain role-prefixed transcript for models without one) for chat.

Tokenizing is the one step whose cost a client controls before any limit applies, so it is bounded first: a
token of this vocabulary stands for at most `longest_token_chars` characters (its longest token string: byte-level
BPE and SentencePiece tokens cover no more text than their own string), so a prompt longer than
`max_model_len` times that cannot fit the context whatever it tokenizes to, and is refused without tokenizing.
A chat request's messages count too (each at least one token), and there are at most `MAX_MESSAGES` of them.
"""

from __future__ import annotations

from typing import Any

from serve.openai.protocol import ApiError, GenerationRequest
from serve.tenancy.tenants import SharedPrefix


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the longest token string in the vocabulary (added tokens included)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(t) for t in tokens if t), default=1)


def check_text_size(request: GenerationRequest, max_chars: int, max_model_len: int) -> None:
    """400 at once for a prompt that cannot fit the context at the most characters a token can cover. Each chat
    message also counts as one token's worth of characters: a chat template gives every message at least one
    token of its own (its role marker), so a flood of empty messages is as costly as the text it stands for."""
    per_message = max(1, max_chars // max(1, max_model_len))
    chars = request.text_chars + request.message_count * per_message
    if chars > max_chars:
        counted = (
            f" ({request.message_count:,} messages at {per_message:,} each included)"
            if request.message_count
            else ""
        )
        raise ApiError(
            400,
            f"the prompt is {chars:,} characters{counted}; it cannot fit the model context of "
            f"{max_model_len:,} tokens (at most {max_chars:,} characters); shorten it",
            "messages" if request.chat else "prompt",
            "context_length_exceeded",
        )


def prompt_ids(request: GenerationRequest, tokenizer: Any, vocab_size: int) -> list[int]:
    if request.chat:
        assert request.messages is not None
        return _chat_ids(request.messages, tokenizer)
    prompt = request.prompt
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    assert prompt is not None
    if any(not 0 <= t < vocab_size for t in prompt):
        raise ApiError(400, f"'prompt' token ids must be in [0, {vocab_size})", "prompt")
    return list(prompt)


def _chat_ids(messages: list[dict[str, str]], tokenizer: Any, generation_prompt: bool = True) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as exc:
            raise ApiError(400, f"the chat template rejected these messages: {exc}", "messages") from None
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + (
        "assistant:" if generation_prompt else ""
    )
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def shared_tokens(
    request: GenerationRequest, ids: list[int], prefixes: tuple[SharedPrefix, ...], tokenizer: Any
) -> tuple[str, int] | None:
    """(name, tokens) of the shared prefix this prompt starts with, if its tenant may share one: a chat whose first
    message is a system message of exactly the shared text, or a completion prompt that starts with it. The tokens
    are those the prompt and the shared text alone have in common (a boundary that tokenizes differently is not
    shared)."""
    if not prefixes:
        return None
    if request.messages is not None:
        first = request.messages[0]
        prefix = next(
            (
                p
                for p in prefixes
                if first["role"] == "system"
                and len(first["content"]) == p.chars
                and p.matches(first["content"])
            ),
            None,
        )
        if prefix is None:
            return None
        try:
            alone = _chat_ids([first], tokenizer, generation_prompt=False)
        except ApiError:  # a template that wants more than a system message: nothing is shared
            return None
    elif isinstance(request.prompt, str):
        prefix = next((p for p in prefixes if p.matches(request.prompt)), None)
        if prefix is None:
            return None
        alone = list(tokenizer(request.prompt[: prefix.chars], add_special_tokens=True)["input_ids"])
    else:
        return None
    common = 0
    for mine, theirs in zip(ids, alone, strict=False):
        if mine != theirs:
            break
        common += 1
    return (prefix.name, common) if common else None
