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

Decode at small batch is dominated by per-op overhead and weight reads, so the layer loop is lean: q/k/v and
gate/up projections that share an input are fused into one kernel call each (when they have the same scheme),
and norms use the fused `rms_norm` op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from serve.scheduler import Scheduled


def kv_bytes_per_token(config: object, dtype: torch.dtype = torch.float32) -> int:
    heads = int(config.num_attention_heads)  # type: ignore[attr-defined]
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)  # type: ignore[attr-defined]
    layers = int(config.num_hidden_layers)  # type: ignore[attr-defined]
    return 2 * layers * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class _LayerPlan:
    """A decoder layer's modules, with q/k/v and gate/up fused where their schemes allow."""

    def __init__(self, layer: nn.Module) -> None:
        from quantize.modules import fuse_linears

        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        self.q, self.k, self.v, self.o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.qkv = fuse_linears([self.q, self.k, self.v])
        self.split_qkv = [int(self.q.out_features), int(self.k.out_features), int(self.v.out_features)]
        self.gate, self.up, self.down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.gate_up = fuse_linears([self.gate, self.up])
        self.intermediate = int(self.gate.out_features)
        self.act = mlp.act_fn

    @staticmethod
    def norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        weight = module.weight  # type: ignore[union-attr]
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv is not None:
            q, k, v = torch.split(self.qkv(x), self.split_qkv, dim=-1)
            return q, k, v
        return self.q(x), self.k(x), self.v(x)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = torch.split(self.gate_up(x), self.intermediate, dim=-1)
        else:
            gate, up = self.gate(x), self.up(x)
        return self.down(self.act(gate) * up)


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] slot of each new token
    num_decode: int  # the first num_decode tokens are single-token decodes
    decode_slots: torch.Tensor  # [D, L] context slots of each decode (padded with 0)
    decode_mask: torch.Tensor  # [D, 1, 1, L] bool, True where the slot holds context
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # (row start, row end, context slots, mask)
    sample_rows: torch.Tensor  # [S] rows whose output is sampled


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        config = model.config  # type: ignore[attr-defined]
        self.model = model
        self.device = torch.device(device)
        self.apply_rope = apply_rotary_pos_emb
        self.embed = model.model.embed_tokens  # type: ignore[union-attr]
        self.layers = list(model.model.layers)  # type: ignore[union-attr]
        self.norm = model.model.norm  # type: ignore[union-attr]
        self.rotary = model.model.rotary_emb  # type: ignore[union-attr]
        self.lm_head = model.lm_head  # type: ignore[union-attr]
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        self.scale = self.head_dim**-0.5
        window = getattr(config, "sliding_window", None)
        self.sliding_window = int(window) if window and getattr(config, "use_sliding_window", True) else None
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_dtype = kv_dtype
        slots = num_blocks * block_size
        self.plans = [_LayerPlan(layer) for layer in self.layers]
        self.k_cache = [
            torch.zeros(slots, self.num_kv_heads, self.head_dim, dtype=kv_dtype, device=self.device)
            for _ in self.layers
        ]
        self.v_cache = [
            torch.zeros(slots, self.num_kv_heads, self.head_dim, dtype=kv_dtype, device=self.device)
            for _ in self.layers
        ]

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
        decodes = [i for i in items if i.num_new == 1]
        prefills = [i for i in items if i.num_new > 1]
        ordered = decodes + prefills
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        sample_rows: list[int] = []
        row = 0
        for item in ordered:
            tokens = item.seq.all_ids[item.start : item.start + item.num_new]
            ids.extend(tokens)
            positions.append(torch.arange(item.start, item.start + item.num_new))
            slots.append(self._slots(item.seq.block_ids, item.start, item.start + item.num_new))
            row += item.num_new
            if item.samples:
                sample_rows.append(row - 1)
        num_decode = len(decodes)
        width = max((i.start + 1 for i in decodes), default=0)
        decode_slots = torch.zeros(num_decode, width, dtype=torch.int64)
        decode_mask = torch.zeros(num_decode, 1, 1, width, dtype=torch.bool)
        for index, item in enumerate(decodes):
            length = item.start + 1
            decode_slots[index, :length] = self._slots(item.seq.block_ids, 0, length)
            keys = torch.arange(length)
            decode_mask[index, 0, 0, :length] = self._window_mask(torch.tensor([item.start]), keys)[0]
        prefill_meta = []
        start = num_decode
        for item in prefills:
            end = start + item.num_new
            context = item.start + item.num_new
            mask = self._window_mask(torch.arange(item.start, context), torch.arange(context))
            prefill_meta.append((start, end, self._slots(item.seq.block_ids, 0, context), mask[None, None]))
            start = end
        return StepBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.cat(positions) if positions else torch.zeros(0, dtype=torch.int64),
            slots=torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64),
            num_decode=num_decode,
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            prefills=prefill_meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64),
        )

    def _attention(self, index: int, q: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        # q: [T, heads, d] -> [T, heads * d]
        k_cache, v_cache = self.k_cache[index], self.v_cache[index]
        out = torch.empty_like(q)
        d = batch.num_decode
        if d:
            keys = k_cache[batch.decode_slots].transpose(1, 2).to(q.dtype)  # [D, kv, L, d]
            values = v_cache[batch.decode_slots].transpose(1, 2).to(q.dtype)
            attended = F.scaled_dot_product_attention(
                q[:d].unsqueeze(2),
                keys,
                values,
                attn_mask=batch.decode_mask,
                scale=self.scale,
                enable_gqa=True,
            )  # [D, heads, 1, d]
            out[:d] = attended[:, :, 0, :]
        for start, end, slots, mask in batch.prefills:
            keys = k_cache[slots].transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, kv, ctx, d]
            values = v_cache[slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
            query = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
            attended = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
            )
            out[start:end] = attended[0].transpose(0, 1)
        return out.reshape(q.shape[0], -1)

    @torch.inference_mode()
    def execute(self, items: list[Scheduled]) -> torch.Tensor:
        """Run one scheduled step; returns logits [S, vocab] for the items that sample, in schedule order
        (decodes first, then prefills)."""
        batch = self.prepare(items)
        hidden = self.embed(batch.input_ids.to(self.device))  # [T, H]
        cos, sin = self.rotary(hidden[None], batch.positions.to(self.device)[None])
        cos, sin = cos[0], sin[0]
        tokens = hidden.shape[0]
        slots = batch.slots.to(self.device)
        for index, plan in enumerate(self.plans):
            q, k, v = plan.project_qkv(plan.norm(plan.input_norm, hidden))
            q, k = self.apply_rope(
                q.reshape(tokens, self.num_heads, self.head_dim),
                k.reshape(tokens, self.num_kv_heads, self.head_dim),
                cos,
                sin,
                unsqueeze_dim=1,
            )
            self.k_cache[index].index_copy_(0, slots, k.to(self.kv_dtype))
            self.v_cache[index].index_copy_(
                0, slots, v.reshape(tokens, self.num_kv_heads, self.head_dim).to(self.kv_dtype)
            )
            hidden = hidden + plan.o(self._attention(index, q, batch))
            hidden = hidden + plan.mlp(plan.norm(plan.post_norm, hidden))
        last = self.norm(hidden[batch.sample_rows.to(self.device)])
        return self.lm_head(last).to(torch.float32)

    def ordered(self, items: list[Scheduled]) -> list[Scheduled]:
        """The items that sample, in the order `execute` returns their logits."""
        return [i for i in items if i.num_new == 1 and i.samples] + [
            i for i in items if i.num_new > 1 and i.samples
        ]
