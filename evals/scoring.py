"""MMLU scoring with a shared few-shot prefix computed once per subject.

Every question of a subject starts with the same k-shot prefix (the instruction line and the dev examples),
which is most of the tokens of a 5-shot prompt. The prefix is run once per subject and its key/value cache is
reused for every question of that subject, batched; only the question-specific suffix is computed per
question, and the vocabulary projection runs only at the positions that are scored. Each prompt is tokenized
as one string, like lm-evaluation-harness, and the shared prefix is the longest run of tokens the subject's
prompts have in common, so the scores are the standard MMLU ones; the per-question implementation
(`score_naive`, lm-eval's tokenization, no reuse) must give the same log-probs up to float tolerance
(tests/evals/test_scoring.py).

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
from typing import Any, cast

import torch
from torch import nn

from evals.config import FORMATS
from evals.mmlu import LETTERS, Item
from quantize.common.errors import QpackError
from quantize.common.progress import NULL_PROGRESS, Progress


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
        self.decoder = cast(nn.Module, model.model)  # the transformer under the LM head
        self.lm_head = cast(nn.Module, model.lm_head)
        self.config: Any = model.config  # a transformers config (torch types module attributes as tensors)
        self.tokenizer = tokenizer
        self.token_budget = token_budget
        self.letter_ids = [self.encode(f" {letter}") for letter in LETTERS]
        self.single_token_letters = all(len(ids) == 1 for ids in self.letter_ids)
        forward = inspect.signature(self.decoder.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward else "past_key_values"

    def encode(self, text: str, first: bool = False) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=first)["input_ids"])

    @torch.inference_mode()
    def _prefix(self, prefix: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not prefix:
            return []
        out = self.decoder(input_ids=torch.tensor([prefix]), use_cache=True)
        cache = out.past_key_values
        return [(layer.keys, layer.values) for layer in cache.layers]

    @torch.inference_mode()
    def _batch(
        self, prefix_kv: list[tuple[torch.Tensor, torch.Tensor]], prefix_len: int, batch: list[Request]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
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
        cached: dict[str, Any] = {}
        if prefix_kv:
            cache = DynamicCache(config=self.config)
            for index, (keys, values) in enumerate(prefix_kv):
                cache.update(
                    keys.expand(size, -1, -1, -1).contiguous(),
                    values.expand(size, -1, -1, -1).contiguous(),
                    index,
                )
            cached = {"use_cache": True, self._cache_kwarg: cache}
        hidden = self.decoder(input_ids=input_ids, attention_mask=mask, **cached).last_hidden_state
        rows = torch.tensor([row for row, r in enumerate(batch) for _ in r.positions])
        cols = torch.tensor([p for r in batch for p in r.positions])
        logp = torch.log_softmax(self.lm_head(hidden[rows, cols]).to(torch.float32), dim=-1)
        targets = torch.tensor([t for r in batch for t in r.targets])
        picked = logp.gather(1, targets[:, None])[:, 0]
        greedy = logp.argmax(dim=-1) == targets
        out, start = [], 0
        for request in batch:
            stop = start + len(request.positions)
            out.append((picked[start:stop], greedy[start:stop]))
            start = stop
        return out

    def run(self, prefix: list[int], requests: list[Request]) -> dict[int, torch.Tensor]:
        """Log-probs of each request's targets (by request index), batching by length under the token budget."""
        return {index: values for index, (values, _greedy) in self.run_detailed(prefix, requests).items()}

    def run_detailed(
        self, prefix: list[int], requests: list[Request]
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Per request index: its targets' log-probs and whether each target is the argmax token there."""
        prefix_kv = self._prefix(prefix)
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i].tokens))  # widest first
        batches: list[list[int]] = []
        for index in order:
            width = len(requests[batches[-1][0]].tokens) if batches else 0
            if batches and (len(batches[-1]) + 1) * (len(prefix) + width) <= self.token_budget:
                batches[-1].append(index)
            else:
                batches.append([index])
        results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for batch in batches:
            outputs = self._batch(prefix_kv, len(prefix), [requests[j] for j in batch])
            results.update(zip(batch, outputs, strict=True))
        return results


def _encode_batch(scorer: Scorer, texts: list[str], first: bool) -> list[list[int]]:
    if not texts:
        return []
    return [list(ids) for ids in scorer.tokenizer(texts, add_special_tokens=first)["input_ids"]]


def continuation_ids(context: list[int], whole: list[int]) -> list[int]:
    """lm-eval's split of `context + continuation`: the whole string tokenized, minus the context's length.

    The context is tokenized on its own and the continuation is what the whole string has after that many
    tokens, so a boundary merge shows up in the continuation rather than shifting the context."""
    return whole[len(context) :]


def shared_length(contexts: list[list[int]]) -> int:
    """The longest token prefix all contexts share, leaving each at least one token of its own."""
    if not contexts:
        return 0
    first = contexts[0]
    length = min(len(c) for c in contexts) - 1
    for context in contexts[1:]:
        if context[:length] == first[:length]:
            continue
        low, high = 0, length
        while low < high:
            middle = (low + high + 1) // 2
            if context[:middle] == first[:middle]:
                low = middle
            else:
                high = middle - 1
        length = low
    return max(length, 0)


def _letter_prompts(
    scorer: Scorer, subject: str, items: list[Item], shots: list[Item]
) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each question's whole-string context ids and its four letter continuations (lm-eval's split)."""
    prefix = letter_prefix(subject, shots)
    texts = [prefix + letter_block(item, False) for item in items]
    contexts = _encode_batch(scorer, texts, True)
    probe = _encode_batch(scorer, [texts[0] + f" {letter}" for letter in LETTERS], True) if texts else []
    if all(
        continuation_ids(contexts[0], whole) == ids
        for whole, ids in zip(probe, scorer.letter_ids, strict=False)
    ):
        return contexts, [scorer.letter_ids] * len(items)
    wholes = _encode_batch(scorer, [text + f" {letter}" for text in texts for letter in LETTERS], True)
    letters = [
        [continuation_ids(context, wholes[4 * index + choice]) for choice in range(4)]
        for index, context in enumerate(contexts)
    ]
    return contexts, letters


def _cloze_prompts(
    scorer: Scorer, subject: str, items: list[Item], shots: list[Item]
) -> tuple[list[list[int]], list[list[list[int]]]]:
    prefix = cloze_prefix(subject, shots)
    texts = [prefix + cloze_context(item) for item in items]
    contexts = _encode_batch(scorer, texts, True)
    wholes = _encode_batch(
        scorer,
        [text + f" {choice}" for text, item in zip(texts, items, strict=True) for choice in item.choices],
        True,
    )
    answers = []
    for index, context in enumerate(contexts):
        row = []
        for choice in range(4):
            ids = continuation_ids(context, wholes[4 * index + choice])
            row.append(ids or scorer.encode(" "))
        answers.append(row)
    return contexts, answers


def build_requests(
    scorer: Scorer, fmt: str, subject: str, items: list[Item], shots: list[Item]
) -> tuple[list[int], list[Request], list[tuple[str, int, int]]]:
    """Shared prefix ids, requests, and for each request (item key, choice index or -1 for letter, answer bytes).

    Every prompt is tokenized as one string, as lm-eval does (tokenizing the few-shot prefix and the question
    apart merges differently at the boundary: SmolLM2 makes one "\\n\\n" token where the whole string has two).
    The prefix whose key/value cache is shared is then the longest token prefix the subject's prompts have in
    common, so reusing it changes no token."""
    if fmt == "letter":
        contexts, continuations = _letter_prompts(scorer, subject, items, shots)
    else:
        contexts, continuations = _cloze_prompts(scorer, subject, items, shots)
    shared = shared_length(contexts)
    prefix = contexts[0][:shared] if contexts else []
    requests, meta = [], []
    for item, context, answers in zip(items, contexts, continuations, strict=True):
        own = context[shared:]
        last = len(own) - 1
        if fmt == "letter" and answers == scorer.letter_ids and scorer.single_token_letters:
            requests.append(Request(item.key, own, [ids[0] for ids in answers], [last] * 4))
            meta.append((item.key, -1, 0))
            continue
        for choice_index, ids in enumerate(answers):
            positions = list(range(last, last + len(ids)))
            requests.append(Request(item.key, own + ids, ids, positions))
            size = 1 if fmt == "letter" else max(len(f" {item.choices[choice_index]}".encode()), 1)
            meta.append((item.key, choice_index, size))
    return prefix, requests, meta


def _collect(
    items: list[Item],
    meta: list[tuple[str, int, int]],
    values: dict[int, torch.Tensor],
) -> dict[str, torch.Tensor]:
    scores = {item.key: torch.zeros(4, dtype=torch.float64) for item in items}
    for index, (key, choice, size) in enumerate(meta):
        if choice == -1:
            scores[key] = values[index].to(torch.float64)
        else:
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
        raise QpackError(f"`formats` must be one of {', '.join(FORMATS)} (got {fmt!r})")
    scorer = Scorer(model, tokenizer, token_budget)
    scores: dict[str, torch.Tensor] = {}
    total = sum(len(v) for v in by_subject.values())
    with progress.task(f"MMLU {fmt} {shots}-shot: {label}", total=total) as task:
        for subject, items in by_subject.items():
            prefix, requests, meta = build_requests(scorer, fmt, subject, items, dev[subject][:shots])
            values = scorer.run(prefix, requests)
            scores.update(_collect(items, meta, values))
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
    """The straightforward reference, lm-eval's way: per question and choice, the whole prompt string and the
    whole prompt + continuation string tokenized separately, one full forward each, no cache reuse."""
    scores: dict[str, torch.Tensor] = {}

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])

    for subject, items in by_subject.items():
        for item in items:
            if fmt == "letter":
                context = letter_prefix(subject, dev[subject][:shots]) + letter_block(item, False)
                continuations = [f" {letter}" for letter in LETTERS]
            else:
                context = cloze_prefix(subject, dev[subject][:shots]) + cloze_context(item)
                continuations = [f" {choice}" for choice in item.choices]
            context_ids = encode(context)
            row = torch.zeros(4, dtype=torch.float64)
            for choice, continuation in enumerate(continuations):
                answer = encode(context + continuation)[len(context_ids) :]
                ids = torch.tensor([context_ids + answer])
                logp = torch.log_softmax(model(input_ids=ids).logits[0].to(torch.float32), dim=-1)
                picked = logp[torch.arange(len(context_ids) - 1, ids.shape[1] - 1), torch.tensor(answer)]
                size = 1 if fmt == "letter" else max(len(continuation.encode()), 1)
                row[choice] = float(picked.to(torch.float64).sum()) / size
            scores[item.key] = row
    return scores


ScoreFn = Callable[..., dict[str, torch.Tensor]]
