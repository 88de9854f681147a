"""Incremental detokenization: each new token costs the decode of a few tokens, never of the whole output.

Decoding a request's whole output again on every token is quadratic in its length, and the engine does it under
its lock. Token texts can't simply be joined either: sentencepiece drops the space of the text's first "▁", a
UTF-8 character can be split over byte-fallback tokens ("<0xE4>") or byte-level BPE tokens, and a decoder may
merge neighbours. So, as vLLM and Hugging Face TGI do, each step decodes a window: the tokens from
`prefix_offset` on, where the tokens before `read_offset` were already emitted and serve as context. What the
window's text has beyond the text of that context is new. While it ends in U+FFFD (a character still
incomplete) nothing is emitted and the window grows. The pieces joined equal a full `decode(ids,
skip_special_tokens=True)` of the ids, and `flush` gives the rest at the end, an incomplete character included.

Two refinements keep that exact and the window short:
- ids that decoding with `skip_special_tokens` drops never enter the window (a run of them would grow it);
- while the last id is a byte-fallback token nothing is decoded: sentencepiece's ByteFallback decodes a run of
  byte tokens as one group, all of it U+FFFD if any byte is invalid, so a character complete inside a run is
  final only when the run ends.

A run of tokens that keeps the text ending in an incomplete character (invalid bytes, one after another) keeps
the window open: that request's decode grows with the run, bounded by its max_tokens.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_INCOMPLETE = "\ufffd"


class TokenDecoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True)
class Vocabulary:
    """What the detokenizer must know of a tokenizer's ids, found once per tokenizer: the ids a decode with
    `skip_special_tokens` drops, and the byte-fallback ids ("<0x41>" decoding to "A")."""

    skipped: frozenset[int]
    byte_tokens: frozenset[int]

    @classmethod
    def of(cls, tokenizer: Any) -> Vocabulary:
        decode = tokenizer.decode
        special = [int(i) for i in getattr(tokenizer, "all_special_ids", [])]
        skipped = frozenset(i for i in special if decode([i], skip_special_tokens=True) == "")
        vocab: dict[str, int] = getattr(tokenizer, "get_vocab", dict)()
        byte_tokens = frozenset(
            i
            for token, i in vocab.items()
            if _BYTE_TOKEN.fullmatch(token) and decode([i], skip_special_tokens=True) != token
        )
        return cls(skipped, byte_tokens)


class IncrementalDetokenizer:
    """One request's output text, token by token: `add` returns the text the new ids complete, `flush` the rest
    at the end. `decoded_ids` counts the ids passed to decode so far (the work done)."""

    def __init__(self, tokenizer: TokenDecoder, vocabulary: Vocabulary) -> None:
        self.tokenizer = tokenizer
        self.vocabulary = vocabulary
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.prefix_text = ""  # decode(ids[prefix_offset:read_offset])
        self.decoded_ids = 0

    def add(self, ids: Iterable[int]) -> str:
        kept = [i for i in ids if i not in self.vocabulary.skipped]
        if not kept:
            return ""
        self.ids += kept
        if self.ids[-1] in self.vocabulary.byte_tokens:
            return ""
        return self._read(final=False)

    def flush(self) -> str:
        if self.read_offset == len(self.ids):
            return ""
        return self._read(final=True)

    def _read(self, final: bool) -> str:
        text = self._decode(self.ids[self.prefix_offset :])
        if not final and (len(text) <= len(self.prefix_text) or text.endswith(_INCOMPLETE)):
            return ""
        new = text[len(self.prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        return new

    def _decode(self, ids: list[int]) -> str:
        self.decoded_ids += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)
