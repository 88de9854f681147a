"""Prefix reuse must not change a single log-prob beyond float tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from evals.mmlu import load_mmlu
from evals.scoring import Scorer, letter_prefix, score, score_naive
from quantize.models import load_model, load_tokenizer, resolve_model


@pytest.fixture(scope="module")
def tiny(tiny_qwen2: Path):
    source = resolve_model(str(tiny_qwen2))
    return load_model(source), load_tokenizer(source)


@pytest.fixture(scope="module")
def tiny_split_letters(tiny_llama: Path, stories_dir: Path):
    """The original stories260k tokenizer splits " A" into two tokens: the multi-token letter path."""
    return load_model(resolve_model(str(tiny_llama))), load_tokenizer(stories_dir)


@pytest.mark.parametrize("fmt", ["letter", "cloze"])
@pytest.mark.parametrize("shots", [0, 2])
@pytest.mark.parametrize("which", ["tiny", "tiny_split_letters"])
def test_prefix_reuse_equals_naive(mmlu_dir: Path, fmt: str, shots: int, which: str, request) -> None:
    model, tokenizer = request.getfixturevalue(which)
    assert Scorer(model, tokenizer).single_token_letters == (which == "tiny")
    data = load_mmlu(mmlu_dir, subjects="anatomy,college_physics", limit=4, seed=3)
    fast = score(model, tokenizer, fmt, data.by_subject(), data.dev, shots, token_budget=1024)
    slow = score_naive(model, tokenizer, fmt, data.by_subject(), data.dev, shots)
    assert fast.keys() == slow.keys() and len(fast) == 8
    for key in fast:
        torch.testing.assert_close(fast[key], slow[key], rtol=1e-4, atol=1e-5)


def test_batching_does_not_change_scores(tiny, mmlu_dir: Path) -> None:
    model, tokenizer = tiny
    data = load_mmlu(mmlu_dir, subjects="marketing", limit=6)
    one = score(model, tokenizer, "letter", data.by_subject(), data.dev, 1, token_budget=256)
    many = score(model, tokenizer, "letter", data.by_subject(), data.dev, 1, token_budget=100_000)
    for key in one:
        torch.testing.assert_close(one[key], many[key], rtol=1e-4, atol=1e-5)


def test_prompt_format(tiny, mmlu_dir: Path) -> None:
    _model, _tokenizer = tiny
    data = load_mmlu(mmlu_dir, subjects="anatomy", limit=1)
    text = letter_prefix("anatomy", data.dev["anatomy"][:1])
    assert text.startswith("The following are multiple choice questions (with answers) about anatomy.\n\n")
    assert "\nA. " in text and text.endswith(f"Answer: {'ABCD'[data.dev['anatomy'][0].answer]}\n\n")
