"""The reference-score cache: a hit only under the exact same key, damage never trusted."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from evals.refcache import HeldoutCache, ReferenceCache, ReferenceKey, head_sha256, tokenizer_sha256

KEY = ReferenceKey("a" * 64, "b" * 64, "c" * 64, "letter", 5)
SCORES = {"anatomy/0": torch.tensor([-1.0, -2.0, -0.5, float("-inf")], dtype=torch.float64)}


def test_round_trip_and_merge(tmp_path: Path) -> None:
    cache = ReferenceCache(tmp_path, KEY)
    assert cache.load() == {}
    cache.store(SCORES)
    cache.store({"anatomy/1": torch.tensor([-3.0, -1.0, -1.0, -1.0])})
    loaded = ReferenceCache(tmp_path, KEY).load()
    assert set(loaded) == {"anatomy/0", "anatomy/1"}
    torch.testing.assert_close(loaded["anatomy/0"][:3], SCORES["anatomy/0"][:3])
    assert loaded["anatomy/0"][3] < -1e299 and int(torch.argmax(loaded["anatomy/0"])) == 2
    assert not list(cache.path.parent.glob("*.tmp"))


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(ReferenceKey)])
def test_every_key_part_invalidates(tmp_path: Path, field: str) -> None:
    ReferenceCache(tmp_path, KEY).store(SCORES)
    value = getattr(KEY, field)
    changed = dataclasses.replace(KEY, **{field: value + 1 if isinstance(value, int) else value + "x"})
    assert changed.digest != KEY.digest
    assert ReferenceCache(tmp_path, changed).load() == {}
    assert set(ReferenceCache(tmp_path, KEY).load()) == {"anatomy/0"}


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text[: len(text) // 2],
        lambda text: text.replace('"letter"', '"cloze"'),
        lambda text: json.dumps({"key": json.loads(text)["key"], "scores": {"anatomy/0": [1.0, 2.0]}}),
    ],
)
def test_damaged_files_are_ignored_with_a_warning(tmp_path: Path, damage) -> None:
    cache = ReferenceCache(tmp_path, KEY)
    cache.store(SCORES)
    cache.path.write_text(damage(cache.path.read_text()))
    with pytest.warns(UserWarning, match="damaged reference cache"):
        assert cache.load() == {}


def test_tokenizer_hash_follows_the_files(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    first = tokenizer_sha256(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    second = tokenizer_sha256(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{ }")
    assert len({first, second, tokenizer_sha256(tmp_path)}) == 3


def test_heldout_hidden_states_round_trip_and_refuse_damage(tmp_path: Path) -> None:
    cache = HeldoutCache(tmp_path, "r" * 64)
    hidden = [torch.randn(5, 8), torch.randn(3, 8)]
    head = torch.nn.Linear(8, 11, bias=False)
    assert cache.load("c" * 64, 2048, 0) is None
    cache.store("c" * 64, 2048, 0, hidden, head_sha256(head))
    stored = cache.load("c" * 64, 2048, 0)
    assert stored is not None and stored.head_sha256 == head_sha256(head)
    for got, want in zip(stored.hidden, hidden, strict=True):
        assert torch.equal(got, want)
    assert (
        cache.load("c" * 64, 2048, 1) is None
        and HeldoutCache(tmp_path, "s" * 64).load("c" * 64, 2048, 0) is None
    )
    other = torch.nn.Linear(8, 11, bias=False)
    assert head_sha256(other) != head_sha256(head)
    path = cache.path("c" * 64, 2048, 0)
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.warns(UserWarning, match="damaged held-out reference cache"):
        assert cache.load("c" * 64, 2048, 0) is None
