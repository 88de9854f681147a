"""A validated request's prompt as token ids: the tokenizer for completions, the model's chat template (or a
plain role-prefixed transcript for models without one) for chat."""

from __future__ import annotations

from typing import Any

from serve.openai.protocol import ApiError, GenerationRequest


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
