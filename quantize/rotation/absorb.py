"""Folding a residual-stream rotation into a model's weights: the surgery behind `qpack quantize --rotate`.

With Q orthogonal ([hidden, hidden]) and every RMSNorm's scale folded into the linears that read its output
(the norms keep their FP32 weights, now ones), RMSNorm(x Q) = RMSNorm(x) Q, so the model computes the same logits
with its residual stream rotated by Q:
- the embedding's rows become E Q, so the stream starts rotated;
- the linears that read the stream (q, k, v, gate, up; the LM head) take W Q on their input side;
- the linears that write it (o, down) take Qᵀ W on their output side (a bias b becomes b Q).
Per head, a second rotation R ([head_dim, head_dim]) turns v's output and o's matching input: attention mixes
positions, never the dims of a head, so the product is unchanged while each head's values are spread too.

A tied head cannot stay tied: it reads the final norm's output, whose scale g is folded into it (E diag(g) Q),
while the embedding is E Q. The head is written as its own FP32 tensor (the manifest says so, with its bytes);
keeping the tie would need an extra FP32 op on the final norm's output at run time. Everything else keeps the
architecture, so the rotated artifact loads and serves with the existing kernels and exports as-is.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import nn

from quantize.rotation.hadamard import hadamard_order, hadamard_rows, random_hadamard, random_signs

_ROWS = 4096  # rows rotated at a time: a 128k-row embedding never needs a float64 copy of itself
# RMSNorm pre-norm decoders with the module names below; Gemma (norm offsets, scaled embeddings) and others refused
ROTATABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class Rotation:
    """A randomized Hadamard rotation of the residual stream (`hidden`) and of each attention head
    (`head_dim`), drawn from `seed`."""

    kind: str
    seed: int
    hidden: int
    head_dim: int

    @cached_property
    def signs(self) -> torch.Tensor:
        return random_signs(self.hidden, self.seed)

    @cached_property
    def per_head(self) -> torch.Tensor:
        return random_hadamard(self.head_dim, self.seed + 1)

    def rotate(
        self, rows: torch.Tensor, scale: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """rows diag(scale) Q in `dtype`, Q = diag(signs) H / √hidden: computed in float64 by the fast transform, a
        block of rows at a time, so no float64 copy of a whole matrix is ever held."""
        out = torch.empty(rows.shape, dtype=dtype)
        signs = self.signs if scale is None else self.signs * scale.to(torch.float64)
        for start in range(0, rows.shape[0], _ROWS):
            block = rows[start : start + _ROWS].to(torch.float64) * signs
            out[start : start + _ROWS] = hadamard_rows(block) / self.hidden**0.5
        return out

    @property
    def residual(self) -> torch.Tensor:
        """Q itself, [hidden, hidden] float64 (for tests and small models)."""
        return self.rotate(torch.eye(self.hidden, dtype=torch.float64), dtype=torch.float64)

    def to_json(self) -> dict[str, Any]:
        residual, head = hadamard_order(self.hidden), hadamard_order(self.head_dim)
        assert residual is not None and head is not None
        return {
            "kind": self.kind,
            "seed": self.seed,
            "residual": {"size": self.hidden, "hadamard": residual.describe()},
            "per_head": {"size": self.head_dim, "hadamard": head.describe()},
            "online": None,
            "untied_head": False,
        }


def head_dim_of(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def rotation_problems(config: Any) -> list[str]:
    """Why a model with this config cannot be rotated here (empty: it can)."""
    problems = []
    model_type = getattr(config, "model_type", None)
    if model_type not in ROTATABLE_MODEL_TYPES:
        problems.append(
            f"model type {model_type!r} is not one rotations are absorbed into here "
            f"({', '.join(ROTATABLE_MODEL_TYPES)})"
        )
    for what, size in (("hidden size", int(config.hidden_size)), ("head dim", head_dim_of(config))):
        if hadamard_order(size) is None:
            problems.append(
                f"its {what} {size} has no Hadamard matrix here (2^a, or 2^a times q + 1 for a prime q = 3 mod 4)"
            )
    return problems


def rotation_for(config: Any, kind: str, seed: int) -> Rotation:
    """The rotation of a model with this config; ValueError naming every problem when it has none."""
    problems = rotation_problems(config)
    if problems:
        raise ValueError("; ".join(problems))
    return Rotation(kind, seed, int(config.hidden_size), head_dim_of(config))


def _set(module: Any, name: str, value: torch.Tensor) -> None:
    module._parameters[name] = nn.Parameter(value.to(torch.float32).contiguous(), requires_grad=False)


def _input_side(linear: Any, rotation: Rotation, scale: torch.Tensor | None = None) -> None:
    """W ← W diag(scale) Q: the linear reads the rotated stream."""
    _set(linear, "weight", rotation.rotate(linear.weight.detach(), scale))


def _output_side(linear: Any, rotation: Rotation) -> None:
    """W ← Qᵀ W (= (Wᵀ Q)ᵀ), b ← b Q: the linear writes the rotated stream."""
    _set(linear, "weight", rotation.rotate(linear.weight.detach().T).T)
    if getattr(linear, "bias", None) is not None:
        _set(linear, "bias", rotation.rotate(linear.bias.detach()[None])[0])


def _norm_scale(norm: Any) -> torch.Tensor:
    """The norm's scale, taken out of it (its weight set to ones)."""
    scale = norm.weight.detach().to(torch.float64).clone()
    _set(norm, "weight", torch.ones_like(scale))
    return scale


def rotate_block(layer: Any, rotation: Rotation) -> None:
    """Fold the block's norms into the linears after them and rotate its linears (in place, FP32 kept)."""
    r = rotation.per_head
    attention, mlp = layer.self_attn, layer.mlp
    attention_scale = _norm_scale(layer.input_layernorm)
    for linear in (attention.q_proj, attention.k_proj, attention.v_proj):
        _input_side(linear, rotation, attention_scale)
    mlp_scale = _norm_scale(layer.post_attention_layernorm)
    for linear in (mlp.gate_proj, mlp.up_proj):
        _input_side(linear, rotation, mlp_scale)
    _output_side(attention.o_proj, rotation)
    _output_side(mlp.down_proj, rotation)
    head_dim = rotation.head_dim
    v, o = attention.v_proj, attention.o_proj
    v_weight = v.weight.detach().to(torch.float64)
    heads = v_weight.reshape(-1, head_dim, v_weight.shape[-1])
    _set(v, "weight", (r.T[None] @ heads).reshape(v_weight.shape))
    if getattr(v, "bias", None) is not None:
        _set(v, "bias", (v.bias.detach().to(torch.float64).reshape(-1, head_dim) @ r).reshape(-1))
    o_weight = o.weight.detach().to(torch.float64)
    columns = o_weight.reshape(o_weight.shape[0], -1, head_dim)
    _set(o, "weight", (columns @ r).reshape(o_weight.shape))


def rotate_outside(model: nn.Module, rotation: Rotation) -> None:
    """The embedding rotated, the final norm's scale folded into the LM head and the head rotated; a tied head is
    untied (its own tensor) and the config says so."""
    base: Any = model.model
    head: Any = model.lm_head
    final_scale = _norm_scale(base.norm)
    embedding = base.embed_tokens.weight.detach()
    _input_side(head, rotation, final_scale)
    _set(base.embed_tokens, "weight", rotation.rotate(embedding))
    config: Any = model.config
    config.tie_word_embeddings = False


def rotate_model(model: nn.Module, rotation: Rotation) -> None:
    """A whole in-memory model rotated (the streamed pass rotates block by block instead)."""
    rotate_outside(model, rotation)
    for layer in model.model.layers:  # type: ignore[union-attr]
        rotate_block(layer, rotation)
