"""A validated request's prompt as token ids: the tokenizer for completions, the model's chat template (or a
plain role-prefixed transcript for models without one) for chat.

Tokenizing is the one step whose cost a client controls before any limit applies, so it is bounded first: a
token of this vocabulary stands for at most `longest_token_chars` characters (its longest token string: byte-level
BPE and SentencePiece tokens cover no more text than their own string), so a prompt longer than
`max_model_len` times that cannot fit the context whatever it tokenizes to, and is refused without tokenizing.
"""

from __future__ import annotations

from typing import Any

from serve.openai.protocol import ApiError, GenerationRequest


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the longest token string in the vocabulary (added tokens included)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(t) for t in tokens if t), default=1)


def check_text_size(request: GenerationRequest, max_chars: int, max_model_len: int) -> None:
    """400 at once for a prompt that cannot fit the context at the most characters a token can cover."""
    chars = request.text_chars
    if chars > max_chars:
        raise ApiError(
            400,
            f"the prompt is {chars:,} characters; it cannot fit the model context of {max_model_len:,} tokens "
            f"(at most {max_chars:,} characters); shorten it",
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


def _chat_ids(messages: list[dict[str, str]], tokenizer: Any) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:
            raise ApiError(400, f"the chat template rejected these messages: {exc}", "messages") from None
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])
