"""The model runner: a Llama-family forward that reads and writes the paged KV pool.

It reuses the model's own modules (embeddings, norms, the rotary embedding with whatever RoPE variant the
config asks for, the MLPs, and q/k/v/o projections, which may be qpack's quantized modules or plain FP32/BF16
linears), but replaces the attention plumbing: tokens of all scheduled sequences are flattened into one
`[tokens, hidden]` batch, so every linear layer sees exactly the real tokens, never padding. New keys and
values are written to their slots in the pool (slot = block id * block_size + offset); attention then reads
each sequence's context through its block table:
- decoding sequences (one new token each) are attended in one batched call, reading the context slots of
  each sequence (shorter contexts are masked);
- prefill chunks are attended per sequence with a causal mask offset by the tokens already cached, which is
  what makes chunked prefill and prefix-cache hits exact.
Only the last position of sequences that sample this step goes through the final norm and LM head.

Decode at small batch is dominated by per-op overhead and weight reads. A step of decodes only (up to
`kernels.max_rows()` sequences) runs each run of consecutive layers whose projections are int8/int4/bf16/FP32 as
one `kernels.decode_layers` call; other layers (float16, bitsandbytes), prefill steps, and machines without the
native kernels take the per-layer loop, where q/k/v and gate/up projections that share an input are fused into one
kernel call each (when they have the same scheme) and norms use the fused `rms_norm` op.

Batch-invariant mode (`batch_invariant=True`, `qpack serve --batch-invariant`): by default a token's KV and
logits depend slightly on how it was computed: a long prefill takes SDPA attention and, for float, bf16 and int4
layers, dense GEMMs, a decode or short prefill the native kernels, and the two sum in different orders (up to
5e-3 apart in FP32; int8 layers compute the same exact sums either way). Blocks reused from
the prefix cache or the KV offload then differ from the ones a fresh prefill would compute, and a near-tie in
greedy decoding can go the other way. In this mode every token, prefill or decode, runs through the fused
native step, `INVARIANT_ROWS` rows a call, each prefill token as a row attending to its own causal prefix in the
pool, and the LM head through the native kernel, whose per-row sums don't depend on the other rows. A token's KV
and logits are then a function of the tokens before it alone: reused and recomputed blocks are the same bits, and
outputs are the same with or without the KV offload, whatever the batch. Prefill is slower (row-by-row attention
instead of SDPA, and float/bf16/int4 layers on the row kernels: a 512-token prompt of the int8 SmolLM2 on a
2-core AMX Xeon, 0.9-1.2 s against 0.65 s); decode is unchanged.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from quantize.runtime.kernels import ops as kernels
from quantize.runtime.modules import decode_part, fuse_linears
from serve.core.kv_cache import KVLayout
from serve.core.scheduler import Scheduled


class _Projection:
    """Linears sharing one input, computed in as few kernel calls as their schemes allow: q/k/v is one call
    when all three share a scheme, two when (say) v_proj was kept at 16 bit."""

    def __init__(self, modules: list[nn.Module]) -> None:
        groups: list[list[nn.Module]] = []
        for module in modules:
            if groups and type(groups[-1][-1]) is type(module):
                groups[-1].append(module)
            else:
                groups.append([module])
        self.calls: list[nn.Module] = []
        for group in groups:
            fused = fuse_linears(group) if len(group) > 1 else None
            self.calls.extend([fused] if fused is not None else group)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.calls) == 1:
            return self.calls[0](x)
        return torch.cat([call(x) for call in self.calls], dim=-1)


class _LayerPlan:
    """A decoder layer's modules, with q/k/v and gate/up fused where their schemes allow."""

    def __init__(self, layer: nn.Module) -> None:
        part = layer.get_submodule
        input_norm, post_norm = part("input_layernorm"), part("post_attention_layernorm")
        self.input_weight, self.post_weight = _weight(input_norm), _weight(post_norm)
        self.input_eps, self.post_eps = _eps(input_norm), _eps(post_norm)
        self.qkv = _Projection([part("self_attn.q_proj"), part("self_attn.k_proj"), part("self_attn.v_proj")])
        self.o = part("self_attn.o_proj")
        self.gate_up = _Projection([part("mlp.gate_proj"), part("mlp.up_proj")])
        self.down = part("mlp.down_proj")
        self.act = part("mlp.act_fn")

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)

    def native_projections(self) -> list[list[kernels.Part]] | None:
        """The layer's q/k/v, o, gate/up and down as `kernels.decode_layers` parts, or None when the fused
        native step can't run it (a linear that is not int8/int4/bf16/FP32, an activation other than SiLU)."""
        if type(self.act).__name__ not in ("SiLU", "SiLUActivation"):
            return None
        if any(weight.dtype != torch.float32 for weight in (self.input_weight, self.post_weight)):
            return None
        parts: list[list[kernels.Part]] = []
        for calls in (self.qkv.calls, [self.o], self.gate_up.calls, [self.down]):
            found = [decode_part(module) for module in calls]
            if any(part is None for part in found):
                return None
            parts.append([part for part in found if part is not None])
        return parts


def _weight(module: nn.Module) -> torch.Tensor:
    weight = module.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.weight is not a tensor")
    return weight


def _eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [-x[d/2:], x[:d/2]] (Hugging Face's RoPE convention)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and kernels.ready()
        and not torch.compiler.is_compiling()
    ):
        return kernels.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


_NO_MASK = torch.zeros(0, dtype=torch.bool)

# Rows per fused native call in batch-invariant mode: a 512-token prompt of the int8 SmolLM2 took 2.16 s at 32 rows
# a call and 1.7-1.8 s at 256 or 512 (one GEMM instead of many weight passes; 2-core Xeon, before AMX), and the
# call's scratch grows with its rows (per thread, for 8B widths ~0.3 GB at 1024 rows).
INVARIANT_ROWS = 256


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] slot of each new token
    num_decode: int  # the first num_decode tokens are single-token decodes
    decode_slots: torch.Tensor  # [D, L] context slots of each decode (padded with 0)
    decode_bounds: torch.Tensor  # [2, D] first attended key (sliding window) and context length
    # (row start, row end, context slots, mask [1, 1, n, context]; empty in batch-invariant mode)
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor]]
    sample_rows: torch.Tensor  # [S] rows whose output is sampled


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        layout: KVLayout,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        compile_decode: bool = False,
        batch_invariant: bool = False,
    ) -> None:
        config = model.config
        self.model = model
        self.device = torch.device(device)
        self.embed = model.get_submodule("model.embed_tokens")
        self.layers = list(model.get_submodule("model.layers").children())
        norm = model.get_submodule("model.norm")
        self.norm_weight, self.final_eps = _weight(norm), _eps(norm)
        self.rotary = model.get_submodule("model.rotary_emb")
        self.lm_head = model.get_submodule("lm_head")
        self.num_heads, self.num_kv_heads, self.head_dim = (
            layout.num_heads,
            layout.num_kv_heads,
            layout.head_dim,
        )
        self.scale = self.head_dim**-0.5
        window = getattr(config, "sliding_window", None)
        self.sliding_window = int(window) if window and getattr(config, "use_sliding_window", True) else None
        if self.device.type == "cpu":
            kernels.enable()  # builds once per machine (~1 min) so that no request waits for it
        self._native_attention = (
            self.device.type == "cpu" and kernels.ready() and layout.dtype in (torch.float32, torch.bfloat16)
        )
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_dtype = layout.dtype
        self.plans = [_LayerPlan(layer) for layer in self.layers]
        self.segments = self._segments() if self._native_attention else [(0, len(self.plans), None)]
        self._decode_fn: Callable[[StepBatch], torch.Tensor] | None = None
        if compile_decode:
            self._decode_fn = torch.compile(self._forward, dynamic=True)
        self.k_cache, self.v_cache = layout.allocate(num_blocks, block_size, self.device)
        self.batch_invariant = batch_invariant
        if batch_invariant:
            self._check_invariant()

    def _check_invariant(self) -> None:
        """Batch-invariant mode runs every layer in the fused native step: say at once why it can't."""
        problems = []
        if not self._native_attention:
            reason = kernels.unavailable_reason() or f"device {self.device.type}, KV {self.kv_dtype}"
            problems.append(f"the native kernels can't run here ({reason})")
        elif any(run is None for _start, _end, run in self.segments):
            layers = [str(i) for start, end, run in self.segments if run is None for i in range(start, end)]
            problems.append(
                f"the fused step can't run layers {', '.join(layers)} "
                "(it runs int8, int4, bf16 and FP32 linears with a SiLU MLP and FP32 norms)"
            )
        if decode_part(self.lm_head) is None or _weight(self.embed).dtype != torch.float32:
            problems.append("the embeddings and LM head must be FP32 (load with --dtype float32)")
        if problems:
            raise ValueError(
                "--batch-invariant: " + "; ".join(problems) + "; serve without --batch-invariant"
            )

    def _segments(self) -> list[tuple[int, int, kernels.DecodeLayers | None]]:
        """Runs of consecutive layers: (start, end, tensors) for a run the fused native step executes, (start,
        end, None) for one the per-layer loop runs (say, float16 or bitsandbytes projections)."""
        segments: list[tuple[int, int, kernels.DecodeLayers | None]] = []
        for index, plan in enumerate(self.plans):
            projections = plan.native_projections()
            if segments and (segments[-1][2] is not None) == (projections is not None):
                start, _end, run = segments.pop()
            else:
                start, run = index, kernels.DecodeLayers() if projections is not None else None
            if run is not None and projections is not None:
                run.add(plan.input_weight, plan.post_weight, (plan.input_eps, plan.post_eps), projections)
            segments.append((start, index + 1, run))
        return segments

    def read_block(self, block_id: int) -> torch.Tensor:
        """A copy of one block's KV: [2 * layers, block_size, kv_heads, head_dim], K of every layer, then V."""
        rows = slice(block_id * self.block_size, (block_id + 1) * self.block_size)
        return torch.stack([cache[rows] for cache in (*self.k_cache, *self.v_cache)])

    def write_block(self, block_id: int, block: torch.Tensor) -> None:
        """Fill one pool block from `read_block`'s layout."""
        rows = slice(block_id * self.block_size, (block_id + 1) * self.block_size)
        for cache, part in zip((*self.k_cache, *self.v_cache), block, strict=True):
            cache[rows].copy_(part)

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        blocks = torch.tensor(block_ids, dtype=torch.int64)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def _window_mask(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        mask = key_pos[None, :] <= query_pos[:, None]
        if self.sliding_window is not None:
            mask &= key_pos[None, :] > query_pos[:, None] - self.sliding_window
        return mask

    def prepare(self, items: list[Scheduled]) -> StepBatch:
        """The step's tensors. A decode with a `proposal` (speculative tokens) takes one decode row per token,
        each attending to its own causal prefix in the pool, and all its rows are sampled: a row's result is what a
        one-token decode at that position computes, bit for bit, when the step runs fused (decodes only, at most
        `kernels.max_rows()` rows) or batch-invariant."""
        decodes = [i for i in items if i.num_new == 1]
        prefills = [i for i in items if i.num_new > 1]
        ordered = decodes + prefills
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        sample_rows: list[int] = []
        row = 0
        for item in ordered:
            tokens = [*item.request.all_ids[item.start : item.start + item.num_new], *item.proposal]
            end = item.start + len(tokens)
            ids.extend(tokens)
            positions.append(torch.arange(item.start, end))
            slots.append(self._slots(item.request.block_ids, item.start, end))
            row += len(tokens)
            if item.samples:
                sample_rows.extend(range(row - 1 - len(item.proposal), row))
        lengths = [p for i in decodes for p in range(i.start + 1, i.start + 2 + len(i.proposal))]
        num_decode = len(lengths)
        width = max(lengths, default=0)
        decode_slots = torch.zeros(num_decode, width, dtype=torch.int64)
        bounds: list[list[int]] = [[], []]
        index = 0
        for item in decodes:
            context_slots = self._slots(item.request.block_ids, 0, item.start + 1 + len(item.proposal))
            for length in range(item.start + 1, item.start + 2 + len(item.proposal)):
                decode_slots[index, :length] = context_slots[:length]
                first = max(0, length - self.sliding_window) if self.sliding_window is not None else 0
                bounds[0].append(first)
                bounds[1].append(length)
                index += 1
        prefill_meta = []
        start = num_decode
        for item in prefills:
            end = start + item.num_new
            context = item.start + item.num_new
            mask = (
                _NO_MASK  # batch-invariant steps bound each row's keys instead
                if self.batch_invariant
                else self._window_mask(torch.arange(item.start, context), torch.arange(context))[None, None]
            )
            prefill_meta.append((start, end, self._slots(item.request.block_ids, 0, context), mask))
            start = end
        return StepBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.cat(positions) if positions else torch.zeros(0, dtype=torch.int64),
            slots=torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64),
            num_decode=num_decode,
            decode_slots=decode_slots,
            decode_bounds=torch.tensor(bounds, dtype=torch.int64).reshape(2, num_decode),
            prefills=prefill_meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64),
        )

    def _attention(
        self, index: int, batch: StepBatch, q: torch.Tensor, decode_mask: torch.Tensor | None
    ) -> torch.Tensor:
        # q: [T, heads, d] -> [T, heads * d]; decode_mask None: decodes read the pool in place (native kernel)
        k_cache, v_cache = self.k_cache[index], self.v_cache[index]
        num_decode, decode_slots = batch.num_decode, batch.decode_slots
        parts: list[torch.Tensor] = []
        if num_decode and decode_mask is None:
            parts.append(
                kernels.decode_attention(
                    q[:num_decode],
                    k_cache,
                    v_cache,
                    decode_slots,
                    batch.decode_bounds[0],
                    batch.decode_bounds[1],
                    self.scale,
                )
            )
        elif num_decode:
            rows, width = decode_slots.shape
            flat = decode_slots.reshape(-1)
            keys = k_cache.index_select(0, flat).view(rows, width, self.num_kv_heads, self.head_dim)
            values = v_cache.index_select(0, flat).view(rows, width, self.num_kv_heads, self.head_dim)
            if keys.dtype != q.dtype:
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            attended = F.scaled_dot_product_attention(
                q[:num_decode].unsqueeze(2),
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=decode_mask,
                scale=self.scale,
                enable_gqa=True,
            )  # [D, heads, 1, d]
            parts.append(attended.reshape(num_decode, -1))
        for start, end, slots, mask in batch.prefills:
            keys = k_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)  # [1, kv, ctx, d]
            values = v_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)
            if keys.dtype != q.dtype:
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            query = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
            attended = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
            )
            parts.append(attended[0].transpose(0, 1).reshape(end - start, -1))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _decode_mask(self, batch: StepBatch) -> torch.Tensor | None:
        """[D, 1, 1, L] keys each decode attends to, for SDPA; None where the native kernel reads the pool."""
        if not batch.num_decode or (self._native_attention and not torch.compiler.is_compiling()):
            return None
        keys = torch.arange(batch.decode_slots.shape[1], device=batch.decode_slots.device)
        first, length = batch.decode_bounds[0, :, None], batch.decode_bounds[1, :, None]
        return ((keys >= first) & (keys < length))[:, None, None, :]

    def _forward(self, batch: StepBatch) -> torch.Tensor:
        hidden = self.embed(batch.input_ids)  # [T, H]
        cos, sin = self.rotary(hidden[None], batch.positions[None])
        cos, sin = cos[0], sin[0]  # [T, d]
        if self.batch_invariant:
            hidden = self._rows_forward(batch, hidden, cos, sin)
            last = _rms_norm(hidden.index_select(0, batch.sample_rows), self.norm_weight, self.final_eps)
            return self._rows_head(last)
        decode_mask = self._decode_mask(batch)
        fused = self._fuses(hidden.shape[0], bool(batch.prefills)) and hidden.dtype == torch.float32
        for start, end, native_run in self.segments:
            if fused and native_run is not None:
                hidden = self._native_layers(
                    slice(start, end),
                    native_run,
                    hidden,
                    cos,
                    sin,
                    batch.slots,
                    batch.decode_slots,
                    batch.decode_bounds[0],
                    batch.decode_bounds[1],
                )
                continue
            for index in range(start, end):
                hidden = self._layer(index, batch, hidden, cos, sin, decode_mask)
        last = _rms_norm(hidden.index_select(0, batch.sample_rows), self.norm_weight, self.final_eps)
        return self._head(last)

    def _native_layers(
        self,
        layers: slice,
        run: kernels.DecodeLayers,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        context: torch.Tensor,
        starts: torch.Tensor,
        lengths: torch.Tensor,
    ) -> torch.Tensor:
        """LAYERS in one fused native call: rows [R, H] with their RoPE, the slots their new KV goes to, and the
        context slots [R, L] each row attends to, keys starts..lengths-1."""
        return kernels.decode_layers(
            hidden,
            cos,
            sin,
            run,
            self.k_cache[layers],
            self.v_cache[layers],
            slots,
            context,
            starts,
            lengths,
            self.num_heads,
            self.num_kv_heads,
            self.scale,
        )

    def _layer(
        self,
        index: int,
        batch: StepBatch,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        decode_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        plan = self.plans[index]
        tokens = hidden.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        rotated = heads + kv_heads
        qkv = plan.qkv(_rms_norm(hidden, plan.input_weight, plan.input_eps))
        qk = qkv[:, : rotated * head_dim].reshape(tokens, rotated, head_dim)
        qk = qk * cos[:, None] + rotate_half(qk) * sin[:, None]  # RoPE on q and k heads in one pass
        k = qk[:, heads:]
        v = qkv[:, rotated * head_dim :].reshape(tokens, kv_heads, head_dim)
        if k.dtype != self.kv_dtype:
            k, v = k.to(self.kv_dtype), v.to(self.kv_dtype)
        self.k_cache[index].index_copy_(0, batch.slots, k)
        self.v_cache[index].index_copy_(0, batch.slots, v)
        attended = self._attention(index, batch, qk[:, :heads], decode_mask)
        hidden = hidden + plan.o(attended)
        return hidden + plan.mlp(_rms_norm(hidden, plan.post_weight, plan.post_eps))

    def _rows_forward(
        self, batch: StepBatch, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """All layers for every row of the step (batch-invariant mode), `INVARIANT_ROWS` rows per fused native
        call (a row's result doesn't depend on the rows beside it, so this bounds the call's scratch memory only;
        a prompt's int8 layers then run as a GEMM, on AMX tiles where the CPU has them). A row attends to keys
        0..its position (the window's start with a sliding window) of its request, which earlier calls, or
        earlier rows of the same call, have written to the pool.
        hidden [T, H], cos/sin [T, d] -> hidden [T, H] after the last layer."""
        run = self.segments[0][2]
        assert run is not None and len(self.segments) == 1, "checked by _check_invariant"
        lengths = batch.positions + 1  # [T]
        starts = (
            (lengths - self.sliding_window).clamp(min=0)
            if self.sliding_window is not None
            else torch.zeros_like(lengths)
        )
        step = INVARIANT_ROWS
        out: list[torch.Tensor] = []
        for first in range(0, hidden.shape[0], step):
            rows = slice(first, min(first + step, hidden.shape[0]))
            context = _row_context(batch, rows, int(lengths[rows].max()))
            out.append(
                self._native_layers(
                    slice(None),
                    run,
                    hidden[rows],
                    cos[rows],
                    sin[rows],
                    batch.slots[rows],
                    context,
                    starts[rows],
                    lengths[rows],
                )
            )
        return torch.cat(out) if len(out) > 1 else out[0]

    def _rows_head(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head through the native kernel, `kernels.max_rows()` rows at a time: a row's logits don't
        depend on the other rows (batch-invariant mode)."""
        if x.shape[0] == 0:
            return self._head(x)
        head = decode_part(self.lm_head)
        assert head is not None, "checked by _check_invariant"
        weight, scale, bias, zero_point = head
        rows = x.split(kernels.max_rows())
        return torch.cat([kernels.linear(r, weight, scale, bias, zero_point) for r in rows])

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """The FP32 LM head: up to `kernels.max_rows()` rows on CPU through the weight-streaming kernel (one
        pass over the 113 MB matrix at near bandwidth, ~2x MKL's GEMV). Beyond, [vocab, H] @ [H, rows] runs
        2-5x faster than the [rows, H] @ [H, vocab] that `F.linear` issues (measured on this project's 2-core
        reference machine)."""
        head = self.lm_head
        if type(head) is nn.Linear and head.weight.dtype == torch.float32 and kernels.takes(x):
            return kernels.linear(x, head.weight, None, head.bias)
        if x.shape[0] < 2 or x.device.type != "cpu" or type(head) is not nn.Linear:
            return head(x)
        logits = torch.mm(head.weight, x.t()).t()
        return logits + head.bias if head.bias is not None else logits

    def _fuses(self, num_rows: int, has_prefills: bool) -> bool:
        """Whether a step's native segments run as fused decode steps: decodes only, at most
        `kernels.max_rows()` of them, native kernels loaded, not being traced by torch.compile."""
        return (
            not has_prefills
            and num_rows <= kernels.max_rows()
            and self._native_attention
            and not torch.compiler.is_compiling()
        )

    def exact_rows(self) -> int:
        """How many decode rows (speculative ones included) a step may hold so that each row computes what a
        one-token decode computes, bit for bit: any number in batch-invariant mode, up to `kernels.max_rows()`
        when every layer runs in the fused native step, else 0 (speculation then can't keep greedy output)."""
        if not self._native_attention or any(run is None for _start, _end, run in self.segments):
            return 0
        if self.batch_invariant:
            return 1 << 30
        head = self.lm_head
        plain_head = type(head) is nn.Linear and head.weight.dtype == torch.float32
        return kernels.max_rows() if plain_head or decode_part(head) is not None else 0

    def fused_covers(self, batch: StepBatch) -> bool:
        """Whether every layer of this step runs in the fused native decode step (then a compiled step has
        nothing left to speed up)."""
        return self._fuses(batch.num_decode, bool(batch.prefills)) and all(
            run is not None for _start, _end, run in self.segments
        )

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> torch.Tensor:
        """Run a prepared step; returns logits [S, vocab] for the items that sample, in schedule order (decodes
        first, then prefills). `prepare` reads the requests' block tables, so the engine calls it under its
        lock (a concurrent abort frees blocks); `run` only touches tensors and can run without it."""
        device = self.device
        if device.type != "cpu":
            batch = _to_device(batch, device)
        if (
            self._decode_fn is not None
            and not self.batch_invariant
            and not batch.prefills
            and not self.fused_covers(batch)
        ):
            try:
                return self._decode_fn(batch).to(torch.float32)
            except Exception as error:  # a compiler failure must not take serving down
                warnings.warn(
                    f"torch.compile of the decode step failed, decoding eagerly: {error}", stacklevel=2
                )
                self._decode_fn = None
        return self._forward(batch).to(torch.float32)

    def ordered(self, items: list[Scheduled]) -> list[Scheduled]:
        """The items that sample, in the order `run` returns their logits (a decode with a proposal has one row
        of logits per token it verified: 1 + len(proposal))."""
        return [i for i in items if i.num_new == 1 and i.samples] + [
            i for i in items if i.num_new > 1 and i.samples
        ]


def _row_context(batch: StepBatch, rows: slice, width: int) -> torch.Tensor:
    """Context slots [rows, width] of a batch-invariant step's ROWS: a decode's own, or its prefill's."""
    first, last = rows.start, rows.stop
    context = torch.zeros(last - first, width, dtype=torch.int64)
    if first < batch.num_decode:
        decodes = batch.decode_slots[first : min(last, batch.num_decode)]
        used = min(width, decodes.shape[1])
        context[: decodes.shape[0], :used] = decodes[:, :used]
    for start, end, slots, _mask in batch.prefills:
        lo, hi = max(start, first), min(end, last)
        if lo < hi:
            used = min(width, slots.shape[0])
            context[lo - first : hi - first, :used] = slots[:used]
    return context


def _to_device(batch: StepBatch, device: torch.device) -> StepBatch:
    return StepBatch(
        input_ids=batch.input_ids.to(device),
        positions=batch.positions.to(device),
        slots=batch.slots.to(device),
        num_decode=batch.num_decode,
        decode_slots=batch.decode_slots.to(device),
        decode_bounds=batch.decode_bounds.to(device),
        prefills=[(a, b, slots.to(device), mask.to(device)) for a, b, slots, mask in batch.prefills],
        sample_rows=batch.sample_rows.to(device),
    )
