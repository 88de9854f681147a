"""Model surgery, in one place: finding linears, swapping modules, folding scales into the Llama block.

Everything that knows the Llama-family module layout (`model.layers.N.self_attn.q_proj`, the norms in front
of each input group, GQA) lives here, so algorithms stay pure tensor math and the artifact loader and the
quantizer swap modules the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from quantize.formats.schemes import Scheme
from quantize.runtime.handlers import handler_for
from quantize.runtime.modules import QuantLinear


@dataclass
class QuantizedWeight:
    """The stored form of one quantized linear (what the artifact holds for it)."""

    scheme: Scheme
    algorithm: str
    tensors: dict[str, torch.Tensor]
    bias: torch.Tensor | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def nbytes(self) -> int:
        total = handler_for(self.scheme).storage_bytes(self.tensors)
        return total + (0 if self.bias is None else self.bias.numel() * 4)


@dataclass(frozen=True)
class InputGroup:
    """Linears of one block that read the same input, and the module whose output can absorb a scale."""

    block: int
    name: str
    members: tuple[str, ...]
    predecessor: str | None


def get_module(model: nn.Module, fqn: str) -> nn.Module:
    return model.get_submodule(fqn)


def get_linear(model: nn.Module, fqn: str) -> nn.Linear:
    """The float linear at `fqn` (an internal invariant: the planner only plans linears)."""
    module = model.get_submodule(fqn)
    assert isinstance(module, nn.Linear), f"{fqn} is {type(module).__name__}, not a float linear"
    return module


def set_module(model: nn.Module, fqn: str, module: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def linear_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """{fqn: (in_features, out_features)} of every linear, quantized or not, in module order."""
    shapes: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear | QuantLinear):
            shapes[name] = (int(module.in_features), int(module.out_features))
    return shapes


def kept_module_names(model: nn.Module) -> list[str]:
    """Short names of the non-linear weights that always stay FP32 (embeddings, norms)."""
    names: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            names.append(name.rsplit(".", 1)[-1])
        elif "norm" in type(module).__name__.lower() and "norms" not in names:
            names.append("norms")
    return names


def input_groups(model: nn.Module) -> list[InputGroup]:
    """The input groups of every decoder block of a Llama-family model (its modules reached by name)."""
    tree: Any = model
    config = tree.config
    mha = config.num_attention_heads == getattr(config, "num_key_value_heads", config.num_attention_heads)
    groups: list[InputGroup] = []
    for index in range(len(tree.model.layers)):
        p = f"model.layers.{index}"
        groups += [
            InputGroup(
                index,
                "attn_in",
                (f"{p}.self_attn.q_proj", f"{p}.self_attn.k_proj", f"{p}.self_attn.v_proj"),
                f"{p}.input_layernorm",
            ),
            InputGroup(
                index, "attn_out", (f"{p}.self_attn.o_proj",), f"{p}.self_attn.v_proj" if mha else None
            ),
            InputGroup(
                index, "mlp_in", (f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"), f"{p}.post_attention_layernorm"
            ),
            InputGroup(index, "mlp_out", (f"{p}.mlp.down_proj",), f"{p}.mlp.up_proj"),
        ]
    return groups


@torch.no_grad()
def fold_input_scale(model: nn.Module, group: InputGroup, scale: torch.Tensor) -> None:
    """Make the group's input x / s and its weights W * s: the product is unchanged, exactly.

    The predecessor (a norm, or the linear producing the input) absorbs 1/s on its output channels.
    """
    assert group.predecessor is not None, group
    predecessor = get_module(model, group.predecessor)
    s = scale.to(torch.float32)
    if isinstance(predecessor, nn.Linear):
        predecessor.weight.div_(s[:, None].to(predecessor.weight.dtype))
        if predecessor.bias is not None:
            predecessor.bias.div_(s.to(predecessor.bias.dtype))
    else:
        weight = predecessor.weight
        assert isinstance(weight, torch.Tensor) and weight.shape == s.shape, (group, weight.shape)
        weight.div_(s.to(weight.dtype))
    for fqn in group.members:
        linear = get_linear(model, fqn)
        linear.weight.mul_(s[None, :].to(linear.weight.dtype))


def install(
    model: nn.Module, fqn: str, record: QuantizedWeight, device: torch.device | str = "cpu"
) -> nn.Module:
    """Replace the linear at `fqn` with the runtime module for `record`."""
    module = handler_for(record.scheme).build(
        record.scheme, record.tensors, record.bias, torch.device(device)
    )
    set_module(model, fqn, module)
    return module
