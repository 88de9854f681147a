"""Prefix reuse must not change a single log-prob beyond float tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from evals.mmlu import load_mmlu
from evals.scoring import Request, Scorer, letter_block, letter_prefix, score, score_naive, shared_length
from quantize.model.sources import load_model, load_tokenizer, resolve_model


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


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return load_tokenizer(resolve_model("smollm2-135m"))


@pytest.fixture(scope="module")
def tiny_on_smollm2_vocab(smollm2_tokenizer):
    """A 1-layer Llama over SmolLM2's real 49k-token vocabulary: real BPE merges at every prompt boundary."""
    from tests.conftest import tiny_model

    return tiny_model(
        vocab_size=len(smollm2_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        max_position_embeddings=4096,
    )


def test_real_tokenizer_merges_differently_at_the_prefix_boundary(smollm2_tokenizer, mmlu_dir: Path) -> None:
    """The bug this scoring fixes: prefix ids + question ids are not the whole prompt's ids."""
    data = load_mmlu(mmlu_dir, subjects="global_facts", limit=3)
    prefix = letter_prefix("global_facts", data.dev["global_facts"][:5])
    for item in data.test:
        block = letter_block(item, False)
        apart = smollm2_tokenizer(prefix)["input_ids"] + smollm2_tokenizer(block)["input_ids"]
        assert apart != smollm2_tokenizer(prefix + block)["input_ids"]


@pytest.mark.parametrize("fmt", ["letter", "cloze"])
def test_scores_equal_whole_string_scoring_on_a_real_tokenizer(
    tiny_on_smollm2_vocab, smollm2_tokenizer, mmlu_dir: Path, fmt: str
) -> None:
    data = load_mmlu(mmlu_dir, subjects="global_facts,marketing", limit=3, seed=1)
    fast = score(
        tiny_on_smollm2_vocab, smollm2_tokenizer, fmt, data.by_subject(), data.dev, 5, token_budget=2048
    )
    slow = score_naive(tiny_on_smollm2_vocab, smollm2_tokenizer, fmt, data.by_subject(), data.dev, 5)
    assert fast.keys() == slow.keys() and len(fast) == 6
    for key in fast:
        torch.testing.assert_close(fast[key], slow[key], rtol=1e-4, atol=1e-5)


def test_shared_prefix_is_the_longest_common_token_run(smollm2_tokenizer, mmlu_dir: Path) -> None:
    data = load_mmlu(mmlu_dir, subjects="global_facts", limit=4)
    prefix_text = letter_prefix("global_facts", data.dev["global_facts"][:5])
    contexts = [smollm2_tokenizer(prefix_text + letter_block(i, False))["input_ids"] for i in data.test]
    shared = shared_length(contexts)
    assert all(c[:shared] == contexts[0][:shared] for c in contexts)
    assert len({c[shared] for c in contexts if len(c) > shared}) > 1 or any(
        len(c) == shared + 1 for c in contexts
    )
    assert shared_length([[1, 2, 3], [1, 2, 4], [1, 5]]) == 1
    assert shared_length([[7, 8, 9]]) == 2
    assert shared_length([[1, 2], [3, 4]]) == 0


def test_no_shared_prefix_scores_the_same_as_a_split_one(tiny) -> None:
    model, tokenizer = tiny
    scorer = Scorer(model, tokenizer, token_budget=1024)
    sequences = [[5, 9, 17, 33, 40, 41], [5, 9, 17, 60, 61, 62, 63]]
    whole = [Request(str(i), s, [s[-1]], [len(s) - 2]) for i, s in enumerate(sequences)]
    split = [Request(str(i), s[2:], [s[-1]], [len(s) - 4]) for i, s in enumerate(sequences)]
    alone = scorer.run([], whole)
    shared = scorer.run(sequences[0][:2], split)
    for index in alone:
        torch.testing.assert_close(alone[index], shared[index], rtol=1e-4, atol=1e-5)
