"""A Llama-family causal LM as weights only: the module tree the serving runner reads, no transformers modeling.

The serving runner (`serve/core/runner.py`) has its own forward over a paged KV cache: of the model it needs only the
modules and their weights (embeddings, norms, the q/k/v/o and MLP projections, the rotary embedding, the LM head)
under the Hugging Face names, and the config. Building the Hugging Face model for that costs more than the model:
in transformers 5, importing `modeling_llama`, or even instantiating `LlamaConfig`, pulls in torch._dynamo,
torch.distributed.tensor and (where installed) torchao, ~130 MB of resident memory in every server process. This
module builds the same tree from the artifact's config.json (which the artifact writer fills with every default
transformers applies) using only `transformers.modeling_rope_utils` for the RoPE variants, so the frequencies are
transformers' own.

The skeleton has no `forward` of its own: running it is the serving runner's job. `quantize.load_artifact(...,
skeleton=True)` installs the artifact's quantized modules into it exactly as into the Hugging Face model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from transformers.modeling_rope_utils import (
    ROPE_INIT_FUNCTIONS,
    RotaryEmbeddingConfigMixin,
    dynamic_rope_update,
)

from quantize.common.errors import QpackError

REQUIRED_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "rms_norm_eps",
    "rope_parameters",
    "max_position_embeddings",
    "hidden_act",
)

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "silu": nn.SiLU,
    "swish": nn.SiLU,
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "gelu_new": lambda: nn.GELU(approximate="tanh"),
}


class SkeletonConfig(SimpleNamespace, RotaryEmbeddingConfigMixin):
    """config.json as attributes (what the runner and the RoPE functions read), validated at load; RoPE
    parameters standardized by transformers' own mixin, as its config classes do."""

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> SkeletonConfig:
        problems = [f"{key} missing" for key in REQUIRED_KEYS if key not in data]
        rope = data.get("rope_parameters")
        if "rope_parameters" in data and not (isinstance(rope, dict) and "rope_type" in rope):
            problems.append(
                "rope_parameters is not a {rope_type, ...} object (per-layer RoPE is not supported)"
            )
        if str(data.get("hidden_act")) not in ACTIVATIONS and "hidden_act" in data:
            problems.append(f"hidden_act {data['hidden_act']!r} is not one of {', '.join(ACTIVATIONS)}")
        if problems:
            raise QpackError(f"config {where} cannot be served: {'; '.join(problems)}; rebuild the artifact")
        config = cls(**data)
        config.standardize_rope_params()  # type: ignore[misc]  # the mixin needs only the attributes it reads
        if getattr(config, "num_key_value_heads", None) is None:
            config.num_key_value_heads = config.num_attention_heads
        if getattr(config, "head_dim", None) is None:
            config.head_dim = config.hidden_size // config.num_attention_heads
        return config


def _meta(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = _meta(hidden_size)
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE cos/sin for positions, every `rope_type` transformers knows (default, linear, dynamic, yarn, longrope,
    llama3), with the same attributes as transformers' `LlamaRotaryEmbedding` so that its `dynamic_rope_update`
    applies unchanged."""

    def __init__(self, config: SkeletonConfig) -> None:
        super().__init__()
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.config = config
        self.rope_type = config.rope_parameters["rope_type"]
        if self.rope_type == "default":
            inv_freq, self.attention_scaling = _default_inv_freq(config)
        elif self.rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](config)
        else:
            raise QpackError(f"rope_type {self.rope_type!r} is not supported; rebuild the artifact")
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, ...] (its dtype and device), position_ids [B, T] -> cos, sin [B, T, head_dim]."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(
            x.dtype
        )


def _default_inv_freq(config: SkeletonConfig) -> tuple[torch.Tensor, float]:
    base, dim = config.rope_parameters["rope_theta"], config.head_dim
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def _linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    """An nn.Linear with meta weights, built without running its initializer: initializing meta tensors goes
    through torch's Python reference ops, which import torch._dynamo (~70 MB resident)."""
    linear = nn.Linear(1, 1, bias=bias)
    linear.in_features, linear.out_features = in_features, out_features
    linear.weight = _meta(out_features, in_features)
    if bias:
        linear.bias = _meta(out_features)
    return linear


class Attention(nn.Module):
    def __init__(self, config: SkeletonConfig, prefix: str, biased: Callable[[str], bool]) -> None:
        super().__init__()
        heads, kv_heads, d, hidden = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.hidden_size,
        )
        self.q_proj = _linear(hidden, heads * d, biased(f"{prefix}.q_proj"))
        self.k_proj = _linear(hidden, kv_heads * d, biased(f"{prefix}.k_proj"))
        self.v_proj = _linear(hidden, kv_heads * d, biased(f"{prefix}.v_proj"))
        self.o_proj = _linear(heads * d, hidden, biased(f"{prefix}.o_proj"))


class MLP(nn.Module):
    def __init__(self, config: SkeletonConfig, prefix: str, biased: Callable[[str], bool]) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = _linear(hidden, inter, biased(f"{prefix}.gate_proj"))
        self.up_proj = _linear(hidden, inter, biased(f"{prefix}.up_proj"))
        self.down_proj = _linear(inter, hidden, biased(f"{prefix}.down_proj"))
        self.act_fn = ACTIVATIONS[str(config.hidden_act)]()


class DecoderLayer(nn.Module):
    def __init__(self, config: SkeletonConfig, index: int, biased: Callable[[str], bool]) -> None:
        super().__init__()
        prefix = f"model.layers.{index}"
        self.self_attn = Attention(config, f"{prefix}.self_attn", biased)
        self.mlp = MLP(config, f"{prefix}.mlp", biased)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, config: SkeletonConfig, biased: Callable[[str], bool]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=_meta(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i, biased) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class CausalLMSkeleton(nn.Module):
    """`model.embed_tokens / layers / norm / rotary_emb` and `lm_head`, named as in transformers; no forward."""

    def __init__(self, config: SkeletonConfig, biased: Callable[[str], bool]) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config, biased)
        self.lm_head = _linear(config.hidden_size, config.vocab_size, biased("lm_head"))
        eos = getattr(config, "eos_token_id", None)
        self.generation_config = SimpleNamespace(eos_token_id=eos)


def build_skeleton(config: SkeletonConfig, names: Iterable[str]) -> CausalLMSkeleton:
    """The skeleton on the meta device (no memory; the loader assigns the weights and rebuilds the rotary
    embedding's computed buffers) for a state whose tensor names are `names`: a linear has a bias exactly when
    the state holds `{fqn}.bias` (Qwen2's q/k/v, Llama's attention_bias/mlp_bias)."""
    with_bias = {name.removesuffix(".bias") for name in names if name.endswith(".bias")}
    return CausalLMSkeleton(config, lambda fqn: fqn in with_bias)
