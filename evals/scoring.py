"""MMLU scoring with a shared few-shot prefix computed once per subject.

Every question of a subject starts with the same k-shot prefix (the instruction line and the dev examples),
which is most of the tokens of a 5-shot prompt. The prefix is run once per subject and its key/value cache is
reused for every question of that subject, batched; only the question-specific suffix is computed per
question, and the vocabulary projection runs only at the positions that are scored. The prompt is always
tokenized as `prefix ids + suffix ids`, so the reference per-question implementation (`score_naive`) sees the
same tokens and must give the same log-probs up to float tolerance (tests/evals/test_scoring.py).

Formats:
- `letter` (default): the standard MMLU prompt ("The following are multiple choice questions (with answers)
  about {subject}." + dev examples + question, choices A-D, "Answer:"), scored by the next-token log-probs of
  " A", " B", " C", " D" (for a tokenizer that splits a letter into several tokens, the log-likelihood of
  each letter's tokens, which is the same quantity).
- `cloze`: the log-likelihood of each answer's text after "Question: ...\\nAnswer:", normalised by the
  answer's length in bytes (lm-eval's acc_norm) — how small models are evaluated, since they sit at chance on
  letters.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from evals.mmlu import LETTERS, Item
from quantize.errors import QpackError
from quantize.progress import NULL_PROGRESS, Progress

FORMATS = ("letter", "cloze")


def _title(subject: str) -> str:
    return subject.replace("_", " ")


def letter_block(item: Item, with_answer: bool) -> str:
    text = item.question.strip() + "\n"
    text += "".join(f"{letter}. {choice}\n" for letter, choice in zip(LETTERS, item.choices, strict=True))
    text += "Answer:"
    return text + (f" {LETTERS[item.answer]}\n\n" if with_answer else "")


def letter_prefix(subject: str, shots: list[Item]) -> str:
    header = f"The following are multiple choice questions (with answers) about {_title(subject)}.\n\n"
    return header + "".join(letter_block(shot, True) for shot in shots)


def cloze_prefix(subject: str, shots: list[Item]) -> str:
    header = f"The following are questions (with answers) about {_title(subject)}.\n\n"
    return header + "".join(
        f"Question: {shot.question.strip()}\nAnswer: {shot.choices[shot.answer]}\n\n" for shot in shots
    )


def cloze_context(item: Item) -> str:
    return f"Question: {item.question.strip()}\nAnswer:"


@dataclass
class Request:
    """One sequence to score after the prefix: its tokens and which of its positions to read out."""

    key: str
    tokens: list[int]
    targets: list[int]  # token ids whose log-prob is read at positions[i]
    positions: list[int]  # index into `tokens` whose output predicts targets[i]


class Scorer:
    """Log-probs of requests after a shared prefix, for any `*ForCausalLM` (FP32 or qpack-quantized)."""

    def __init__(self, model: nn.Module, tokenizer: Any, token_budget: int = 4096) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.token_budget = token_budget
        self.letter_ids = [self.encode(f" {letter}") for letter in LETTERS]
        self.single_token_letters = all(len(ids) == 1 for ids in self.letter_ids)
        forward = inspect.signature(model.model.forward).parameters  # type: ignore[union-attr]
        self._cache_kwarg = "cache" if "cache" in forward else "past_key_values"

    def encode(self, text: str, first: bool = False) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=first)["input_ids"])

    @torch.inference_mode()
    def _prefix(self, prefix: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = self.model.model(input_ids=torch.tensor([prefix]), use_cache=True)  # type: ignore[union-attr]
        cache = out.past_key_values
        return [(layer.keys, layer.values) for layer in cache.layers]

    @torch.inference_mode()
    def _batch(
        self, prefix_kv: list[tuple[torch.Tensor, torch.Tensor]], prefix_len: int, batch: list[Request]
    ) -> list[torch.Tensor]:
        from transformers import DynamicCache

        width = max(len(r.tokens) for r in batch)
        size = len(batch)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids = torch.full((size, width), pad, dtype=torch.long)
        mask = torch.zeros((size, prefix_len + width), dtype=torch.long)
        mask[:, :prefix_len] = 1
        for row, request in enumerate(batch):
            input_ids[row, : len(request.tokens)] = torch.tensor(request.tokens)
            mask[row, prefix_len : prefix_len + len(request.tokens)] = 1
        cache = DynamicCache(config=self.model.config)  # type: ignore[union-attr]
        for index, (keys, values) in enumerate(prefix_kv):
            cache.update(
                keys.expand(size, -1, -1, -1).contiguous(),
                values.expand(size, -1, -1, -1).contiguous(),
                index,
            )
        hidden = self.model.model(  # type: ignore[union-attr]
            input_ids=input_ids, attention_mask=mask, use_cache=True, **{self._cache_kwarg: cache}
        ).last_hidden_state
        rows = torch.tensor([row for row, r in enumerate(batch) for _ in r.positions])
        cols = torch.tensor([p for r in batch for p in r.positions])
        logp = torch.log_softmax(self.model.lm_head(hidden[rows, cols]).to(torch.float32), dim=-1)  # type: ignore[union-attr]
        targets = torch.tensor([t for r in batch for t in r.targets])
        picked = logp.gather(1, targets[:, None])[:, 0]
        out, start = [], 0
        for request in batch:
            out.append(picked[start : start + len(request.positions)])
            start += len(request.positions)
        return out

    def run(self, prefix: list[int], requests: list[Request]) -> dict[int, torch.Tensor]:
        """Log-probs of each request's targets (by request index), batching by length under the token budget."""
        prefix_kv = self._prefix(prefix)
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i].tokens))
        results: dict[int, torch.Tensor] = {}
        batch: list[int] = []
        for index in order:
            width = len(requests[batch[0]].tokens) if batch else len(requests[index].tokens)
            if batch and (len(batch) + 1) * (len(prefix) + width) > self.token_budget:
                for i, value in zip(
                    batch, self._batch(prefix_kv, len(prefix), [requests[j] for j in batch]), strict=True
                ):
                    results[i] = value
                batch = []
            batch.append(index)
        if batch:
            for i, value in zip(
                batch, self._batch(prefix_kv, len(prefix), [requests[j] for j in batch]), strict=True
            ):
                results[i] = value
        return results


def build_requests(
    scorer: Scorer, fmt: str, subject: str, items: list[Item], shots: list[Item]
) -> tuple[list[int], list[Request], list[tuple[str, int, int]]]:
    """Prefix ids, requests, and for each request (item key, choice index or -1 for letter, answer bytes)."""
    if fmt == "letter":
        prefix = scorer.encode(letter_prefix(subject, shots), first=True)
        requests, meta = [], []
        for item in items:
            tokens = scorer.encode(letter_block(item, False))
            last = len(tokens) - 1
            if scorer.single_token_letters:
                requests.append(Request(item.key, tokens, [ids[0] for ids in scorer.letter_ids], [last] * 4))
                meta.append((item.key, -1, 0))
                continue
            for choice_index, letter_ids in enumerate(scorer.letter_ids):
                positions = list(range(last, last + len(letter_ids)))
                requests.append(Request(item.key, tokens + letter_ids, letter_ids, positions))
                meta.append((item.key, choice_index, 1))
        return prefix, requests, meta
    prefix = scorer.encode(cloze_prefix(subject, shots), first=True)
    requests, meta = [], []
    for item in items:
        context = scorer.encode(cloze_context(item))
        for choice_index, choice in enumerate(item.choices):
            continuation = scorer.encode(f" {choice}") or scorer.encode(" ")
            tokens = context + continuation
            positions = list(range(len(context) - 1, len(tokens) - 1))
            requests.append(Request(item.key, tokens, continuation, positions))
            meta.append((item.key, choice_index, max(len(f" {choice}".encode()), 1)))
    return prefix, requests, meta


def _collect(
    fmt: str,
    items: list[Item],
    requests: list[Request],
    meta: list[tuple[str, int, int]],
    values: dict[int, torch.Tensor],
) -> dict[str, torch.Tensor]:
    scores: dict[str, torch.Tensor] = {}
    if all(choice == -1 for _key, choice, _size in meta):
        for index, (key, _choice, _size) in enumerate(meta):
            scores[key] = values[index].to(torch.float64)
        return scores
    for item in items:
        scores[item.key] = torch.zeros(4, dtype=torch.float64)
    for index, (key, choice, size) in enumerate(meta):
        scores[key][choice] = float(values[index].to(torch.float64).sum()) / size
    return scores


def score(
    model: nn.Module,
    tokenizer: Any,
    fmt: str,
    by_subject: dict[str, list[Item]],
    dev: dict[str, list[Item]],
    shots: int,
    token_budget: int = 4096,
    progress: Progress = NULL_PROGRESS,
    label: str = "model",
) -> dict[str, torch.Tensor]:
    """{item key: 4 scores} (letter: log-probs of A-D; cloze: length-normalised log-likelihoods)."""
    if fmt not in FORMATS:
        raise QpackError(f"--format must be one of {', '.join(FORMATS)} (got {fmt!r})")
    scorer = Scorer(model, tokenizer, token_budget)
    scores: dict[str, torch.Tensor] = {}
    total = sum(len(v) for v in by_subject.values())
    with progress.task(f"MMLU {fmt} {shots}-shot: {label}", total=total) as task:
        for subject, items in by_subject.items():
            prefix, requests, meta = build_requests(scorer, fmt, subject, items, dev[subject][:shots])
            values = scorer.run(prefix, requests)
            scores.update(_collect(fmt, items, requests, meta, values))
            task.advance(len(items))
    return scores


@torch.inference_mode()
def score_naive(
    model: nn.Module,
    tokenizer: Any,
    fmt: str,
    by_subject: dict[str, list[Item]],
    dev: dict[str, list[Item]],
    shots: int,
) -> dict[str, torch.Tensor]:
    """The straightforward reference: one full forward per request (prefix + suffix), no cache reuse."""
    scorer = Scorer(model, tokenizer)
    scores: dict[str, torch.Tensor] = {}
    for subject, items in by_subject.items():
        prefix, requests, meta = build_requests(scorer, fmt, subject, items, dev[subject][:shots])
        values: dict[int, torch.Tensor] = {}
        for index, request in enumerate(requests):
            ids = torch.tensor([prefix + request.tokens])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].to(torch.float32), dim=-1)  # type: ignore[operator]
            positions = torch.tensor([len(prefix) + p for p in request.positions])
            values[index] = logp[positions, torch.tensor(request.targets)]
        scores.update(_collect(fmt, items, requests, meta, values))
    return scores


ScoreFn = Callable[..., dict[str, torch.Tensor]]
