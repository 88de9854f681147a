"""Incremental detokenization gives exactly a full decode's text, on the real tokenizers qpack serves:
stories260k's sentencepiece BPE with byte fallback and SmolLM2's GPT-2 byte-level BPE. Random ids and crafted
texts: multi-byte UTF-8 split across tokens, byte-fallback runs, leading spaces, special ids in the middle; the
text streamed so far is always a prefix of the final text, and the decode work grows linearly."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from quantize.model.sources import load_model, load_tokenizer, resolve_model
from serve.engine.config import CacheConfig
from serve.engine.detokenizer import IncrementalDetokenizer, Vocabulary

TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "  two leading spaces,  double  spaces and a trailing one ",
    "你好，世界！ 日本語のテキスト 한국어",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷 and ∑∫ math",
    "mixed: café naïve Ωmega 🐍 snake\nnew line\ttab",
    "😀",
    " ",
]


@pytest.fixture(scope="module")
def stories_tokenizer(stories_dir: Path) -> Any:
    return load_tokenizer(resolve_model(str(stories_dir)))


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Any:
    return load_tokenizer(resolve_model("smollm2-135m"))


@pytest.fixture(params=["stories", "smollm2"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_tokenizer")


def _stream(tokenizer: Any, ids: list[int], chunk: int = 1) -> tuple[list[str], IncrementalDetokenizer]:
    """The pieces an incremental detokenizer emits for `ids` fed `chunk` at a time, then its flush; checks that
    the text emitted so far is always a prefix of the full decode."""
    detokenizer = IncrementalDetokenizer(tokenizer, Vocabulary.of(tokenizer))
    full = tokenizer.decode(ids, skip_special_tokens=True)
    pieces = []
    for start in range(0, len(ids), chunk):
        pieces.append(detokenizer.add(ids[start : start + chunk]))
        assert full.startswith("".join(pieces)), (ids[: start + chunk], pieces)
    pieces.append(detokenizer.flush())
    return pieces, detokenizer


def _check(tokenizer: Any, ids: list[int], chunk: int = 1) -> None:
    pieces, _ = _stream(tokenizer, ids, chunk)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_the_vocabulary_knows_byte_tokens_and_skipped_ids(stories_tokenizer, smollm2_tokenizer) -> None:
    stories = Vocabulary.of(stories_tokenizer)
    assert len(stories.byte_tokens) == 256 and {0, 1, 2} <= stories.skipped
    smollm2 = Vocabulary.of(smollm2_tokenizer)
    assert not smollm2.byte_tokens and smollm2_tokenizer.eos_token_id in smollm2.skipped


@pytest.mark.parametrize("text", TEXTS)
def test_crafted_texts_decode_as_a_whole(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    _check(tokenizer, ids)
    _check(tokenizer, ids, chunk=3)  # a verifying step emits several tokens at once
    special = sorted(Vocabulary.of(tokenizer).skipped)
    rng = random.Random(text)
    mixed = list(ids)
    for _ in range(3):  # special ids (EOS with ignore_eos, BOS) anywhere, even inside a character
        mixed.insert(rng.randrange(len(mixed) + 1), rng.choice(special))
    _check(tokenizer, mixed)


def test_a_character_split_over_byte_fallback_tokens_waits_for_its_last_byte(stories_tokenizer) -> None:
    ids = stories_tokenizer.encode("a😀b", add_special_tokens=False)
    tokens = stories_tokenizer.convert_ids_to_tokens(ids)
    assert tokens[-5:-1] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]  # the emoji is four byte tokens
    pieces, _ = _stream(stories_tokenizer, ids)
    assert pieces[-6:-2] == ["", "", "", ""] and "".join(pieces) == "a😀b"


def test_a_character_split_over_byte_level_tokens_waits_for_its_last_byte(smollm2_tokenizer) -> None:
    ids = smollm2_tokenizer.encode("你好 😀", add_special_tokens=False)
    assert any("\ufffd" in smollm2_tokenizer.decode([i]) for i in ids)  # some token holds a partial character
    pieces, _ = _stream(smollm2_tokenizer, ids)
    assert "".join(pieces) == "你好 😀" and not any("\ufffd" in piece for piece in pieces)


def test_leading_spaces_are_kept_after_the_first_token(stories_tokenizer) -> None:
    ids = stories_tokenizer.encode("Hello world  again", add_special_tokens=False)
    pieces, _ = _stream(stories_tokenizer, ids)
    assert pieces[0] == "Hello"[: len(pieces[0])] and "".join(pieces) == "Hello world  again"


@pytest.mark.parametrize("seed", range(6))
def test_random_ids_decode_as_a_whole(tokenizer: Any, seed: int) -> None:
    rng = random.Random(seed)
    size = len(tokenizer)
    vocabulary = Vocabulary.of(tokenizer)
    bytes_ = sorted(vocabulary.byte_tokens) or list(range(size))
    for _ in range(20):
        # byte tokens weighted up, so that valid and invalid byte runs both come up on stories
        ids = [
            rng.choice(bytes_) if rng.random() < 0.4 else rng.randrange(size)
            for _ in range(rng.randrange(1, 40))
        ]
        _check(tokenizer, ids, chunk=rng.choice([1, 1, 2, 5]))


def test_decode_work_grows_linearly(tokenizer: Any) -> None:
    text = " ".join(TEXTS) * 20
    ids = tokenizer.encode(text, add_special_tokens=False)[:500]
    assert len(ids) == 500
    pieces, detokenizer = _stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    # a full decode per token would pass 125,250 ids; the windows pass a few per token
    assert detokenizer.decoded_ids < 12 * len(ids)


@pytest.fixture(scope="module")
def stories_engine(stories_dir: Path) -> Any:
    import torch

    from serve.engine.config import EngineConfig
    from serve.engine.core import Engine

    source = resolve_model(str(stories_dir))
    model = load_model(source, dtype=torch.float32)
    return lambda: Engine(model, load_tokenizer(source), EngineConfig(cache=CacheConfig(memory="8MB")))


def _generate(engine: Any, prompt: str, params: Any) -> tuple[list[str], list[int], str | None]:
    pieces: list[str] = []
    ids: list[int] = []
    reasons: list[str | None] = []

    def collect(output: Any) -> None:
        pieces.append(output.text)
        ids.extend(output.token_ids)
        reasons.append(output.finish_reason)

    engine.add("r", engine.tokenizer.encode(prompt), params, collect)
    while engine.has_work():
        engine.step()
    return pieces, ids, reasons[-1]


def test_the_engine_streams_a_full_decode_and_stops_across_tokens(stories_engine) -> None:
    from serve.core.request import SamplingParams

    engine = stories_engine()
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    pieces, ids, reason = _generate(engine, TEXTS[0], params)
    full = engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert reason == "length" and "".join(pieces) == full and len(ids) == 60
    # a stop string across a token boundary: the end of one token's text and the start of the next's
    cut = len(engine.tokenizer.decode(ids[:20], skip_special_tokens=True))
    stop = full[cut - 2 : cut + 3]
    assert len(engine.tokenizer.decode(ids[19:20], skip_special_tokens=True).strip()) >= 1
    pieces, _, reason = _generate(stories_engine(), TEXTS[0], params.replace(stop=("no such", stop)))
    assert reason == "stop" and "".join(pieces) == full[: full.find(stop)]
    assert all(stop not in piece for piece in pieces)


def test_the_engines_decode_work_grows_linearly(stories_engine) -> None:
    """500 tokens through the engine: every id it hands the tokenizer counted (a full decode per token would
    hand it 125,250)."""
    from serve.core.request import SamplingParams

    engine = stories_engine()
    real = engine.tokenizer
    passed = {"ids": 0}

    class Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            passed["ids"] += len(ids)
            return real.decode(ids, skip_special_tokens=skip_special_tokens)

    engine.tokenizer = Counting()
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    pieces, ids, reason = _generate(engine, "Once", params)
    assert reason == "length" and len(ids) == 500
    assert "".join(pieces) == real.decode(ids, skip_special_tokens=True)
    assert passed["ids"] < 12 * 500
