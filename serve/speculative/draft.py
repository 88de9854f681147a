"""A draft model: a cheaper copy of the served model that proposes tokens greedily, with its own KV pool.

The draft is either another artifact of the same model (`--draft DIR`: say, its int4 build beside the served
int8 one; its FP32 LM head is re-quantized to int4 at load) or built at load time from the served model itself
(`--draft int4`): every linear that can say its weight (`QuantLinear.dense_weight`), the LM head included,
re-quantized to int4 with RTN. The draft only proposes,
so its quality costs acceptance, never correctness; embeddings, norms and anything it doesn't re-quantize are the
served model's own tensors, shared, not copied.

Its KV lives in a pool of its own (a different model computes different keys). Each request it drafts for keeps
a sequence here: the tokens whose KV the draft holds, so after a verification only the tokens the target rejected
are recomputed (the draft's KV of accepted proposals stays valid). Sequences are dropped when their request
leaves the batch or when the pool needs their blocks for requests drafting now (least recently used first).
Everything runs on the engine's thread.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from quantize.formats.schemes import Int4
from quantize.runtime.handlers import handler_for
from quantize.runtime.modules import QuantLinear
from serve.core.block_pool import BlockPool
from serve.core.kv_cache import KVLayout
from serve.core.request import Request, SamplingParams
from serve.core.runner import ModelRunner
from serve.core.scheduler import Scheduled

_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


def _dense(module: nn.Module) -> torch.Tensor | None:
    if isinstance(module, QuantLinear):
        return module.dense_weight()
    if type(module) is nn.Linear:
        return module.weight.detach().to(torch.float32)
    return None


def quantized_copy(model: nn.Module, scheme: Int4) -> tuple[nn.Module, int]:
    """The model with every linear whose weight is readable re-quantized to `scheme` (RTN), the LM head included;
    every other tensor shared with `model`. Returns (draft, linears re-quantized)."""
    handler = handler_for(scheme)
    memo: dict[int, object] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    replaced = 0
    for _name, module in model.named_modules():
        weight = _dense(module)
        if weight is None or scheme.problems(weight.shape[1], weight.shape[0]):
            continue
        bias = getattr(module, "bias", None)
        tensors = handler.quantize(scheme, weight)
        memo[id(module)] = handler.build(scheme, tensors, bias, weight.device)
        replaced += 1
    return copy.deepcopy(model, memo), replaced


def quantize_head(model: nn.Module, scheme: Int4) -> bool:
    """Replace the model's LM head (a draft's: an artifact keeps it FP32, the product rule for what is served)
    with `scheme` RTN: at SmolLM2's widths the FP32 head is half of what a decode step reads. False where its
    weight can't be read or doesn't fit the scheme."""
    head = model.get_submodule("lm_head")
    weight = _dense(head)
    if weight is None or scheme.problems(weight.shape[1], weight.shape[0]):
        return False
    handler = handler_for(scheme)
    quantized = handler.build(
        scheme, handler.quantize(scheme, weight), getattr(head, "bias", None), weight.device
    )
    model.set_submodule("lm_head", quantized)
    return True


@dataclass(eq=False)
class _Sequence:
    request: Request  # its prompt_ids: the tokens the draft has seen (computed: the first `computed` of them)
    computed: int = 0


class DraftModel:
    """Greedy proposals from a draft model for several requests at once, one batched draft step per token."""

    def __init__(
        self, model: nn.Module, kv_bytes: int, block_size: int, kv_dtype: torch.dtype = torch.float32
    ) -> None:
        layout = KVLayout.of(model.config, kv_dtype)
        num_blocks = layout.blocks_within(kv_bytes, block_size)
        if num_blocks < 2:
            raise ValueError(
                f"the draft's KV memory ({kv_bytes} bytes) holds {num_blocks} blocks of {block_size} tokens; "
                "give it more"
            )
        self.model = model
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self.runner = ModelRunner(model, layout, num_blocks, block_size)
        self.sequences: OrderedDict[str, _Sequence] = OrderedDict()
        self.kv_bytes = layout.memory_for(num_blocks, block_size)
        self.catch_up_rows = 16
        self.step_seconds, self.steps = 0.0, 0  # the last `propose`'s decode-row steps (prefills excluded)
        self.prefill_seconds, self.prefill_tokens = 0.0, 0  # and its prefills

    def retain(self, request_ids: set[str]) -> None:
        """Drop the sequences of requests no longer decoding."""
        for request_id in [r for r in self.sequences if r not in request_ids]:
            self._drop(request_id)

    def uncomputed(self, request_id: str, tokens: int) -> int:
        """Context tokens the draft must read before proposing for this request (all of them if it holds none)."""
        sequence = self.sequences.get(request_id)
        return tokens if sequence is None else 0

    def _drop(self, request_id: str) -> None:
        sequence = self.sequences.pop(request_id)
        if sequence.request.block_ids:
            self.pool.free(sequence.request.block_ids)
        sequence.request.block_ids = []

    def _sequence(self, request_id: str, tokens: list[int]) -> _Sequence:
        """The request's sequence, its tokens set to `tokens` and its KV kept only for their common prefix."""
        sequence = self.sequences.pop(request_id, None)
        if sequence is None:
            sequence = _Sequence(Request(f"draft-{request_id}", list(tokens), _GREEDY))
        else:
            seen = sequence.request.prompt_ids
            common = 0
            limit = min(sequence.computed, len(tokens))
            while common < limit and seen[common] == tokens[common]:
                common += 1
            sequence.computed = min(
                common, len(tokens) - 1
            )  # the last token's logits are what it proposes from
            sequence.request.prompt_ids = list(tokens)
        self.sequences[request_id] = sequence  # most recently used last
        return sequence

    def _reserve(self, sequence: _Sequence, tokens: int, keep: set[str]) -> bool:
        """Blocks for `tokens` positions, taking them from sequences not drafting now (LRU) if the pool is short."""
        request = sequence.request
        need = -(-tokens // self.block_size) - len(request.block_ids)
        if need <= 0:
            return True
        while self.pool.num_free < need:
            victim = next((r for r in self.sequences if r not in keep), None)
            if victim is None:
                return False
            self._drop(victim)
        blocks = self.pool.allocate(need)
        assert blocks is not None
        request.block_ids.extend(blocks)
        return True

    def propose(self, wanted: dict[str, tuple[list[int], int]]) -> dict[str, list[int]]:
        """wanted: request id -> (its tokens so far, k); returns up to k greedy draft tokens each (none for a
        request the draft's pool can't hold)."""
        keep = set(wanted)
        active: list[tuple[str, _Sequence, int]] = []
        for request_id, (tokens, k) in wanted.items():
            if k <= 0:
                continue
            sequence = self._sequence(request_id, tokens)
            if self._reserve(sequence, len(tokens) + k - 1, keep):
                active.append((request_id, sequence, k))
            else:
                self._drop(request_id)
        proposals: dict[str, list[int]] = {request_id: [] for request_id, _s, _k in active}
        self.step_seconds, self.steps = 0.0, 0
        self.prefill_seconds, self.prefill_tokens = 0.0, 0
        while active:
            items = [self._item(s) for _r, s, _k in active]
            started = time.perf_counter()
            logits = self.runner.run(self.runner.prepare(items))
            seconds = time.perf_counter() - started
            if all(
                item.num_new == 1 for item in items
            ):  # a prompt's prefill is a one-off, not a per-token cost
                self.step_seconds += seconds
                self.steps += 1
            else:
                self.prefill_seconds += seconds
                self.prefill_tokens += sum(item.num_new for item in items)
            last: dict[int, int] = {}
            row = 0
            for item in self.runner.ordered(items):
                row += 1 + len(item.proposal)
                last[id(item.request)] = row - 1
            nexts = logits[list(last.values())].argmax(dim=-1).tolist()
            by_request = dict(zip(last, nexts, strict=True))
            still: list[tuple[str, _Sequence, int]] = []
            for request_id, sequence, k in active:
                token = int(by_request[id(sequence.request)])
                sequence.computed = len(sequence.request.prompt_ids)
                proposals[request_id].append(token)
                if len(proposals[request_id]) < k:
                    sequence.request.prompt_ids.append(token)
                    still.append((request_id, sequence, k))
            active = still
        return proposals

    def _item(self, sequence: _Sequence) -> Scheduled:
        """The draft step computing a sequence's uncomputed tokens: a few (the tokens the target emitted since
        the last proposal) as decode rows of the fused native step, a prompt as a prefill."""
        tokens = sequence.request.prompt_ids
        start, count = sequence.computed, len(tokens) - sequence.computed
        if count <= self.catch_up_rows:
            return Scheduled(sequence.request, start, 1, tokens[start + 1 :])
        return Scheduled(sequence.request, start, count)
