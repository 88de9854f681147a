"""The quantized model as a student: built block by block from the artifact's own tensors, its int4/int8 scales
learnable, its gradient computed one block at a time.

The student is what the artifact holds, not the model the pass left behind: norms (which AWQ may have rescaled),
kept linears, biases and every quantized layer come from the tensors written for the artifact, so what is
trained is what will be stored. A block is rebuilt from those tensors whenever it is needed, unless the whole
student fits (`keep`): the memory bound is then the quantize pass's (one block in FP32, plus the artifact's
tensors and every block's input for one packed row).

The backward pass is block-wise gradient checkpointing by hand: the forward runs every block without a graph and
keeps each block's input; the loss's gradient at the last hidden state then walks back, each block run again
with a graph from its saved input and backpropagated at once. So at most one block's graph exists, whatever the
depth, and a streamed model reads each block twice per step (forward, then backward), as the Fisher pass does.

The teacher is the FP32 model's final normed hidden states (kept by the quantize pass) through the FP32 head;
the loss is the forward KL(teacher || student) of next-token distributions, weighted like the calibration
positions (a shared prefix counts once per sequence it stands for).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from quantize.distill.scales import LearnedScale, learnable, learned_scale, stored_with
from quantize.formats.schemes import Scheme
from quantize.model.surgery import set_module
from quantize.runtime.handlers import handler_for
from quantize.sequential.packing import Pack
from quantize.sequential.runner import BlockRunner
from quantize.sequential.streamed import assign_tensor

CHUNK = 128  # positions whose logits exist at once (a 49k vocabulary at 128 positions: 25 MB a copy)


class Student:
    """The quantized model's blocks from `tensors` (the artifact's tensors by name), its quantized layers'
    schemes from `schemes` ({fqn: scheme}) and their stored tensor names from `names`; `runner` supplies the
    embedding, the final norm and the block templates, `teacher_head` the FP32 head (the runner's by default)."""

    def __init__(
        self,
        runner: BlockRunner,
        tensors: Mapping[str, torch.Tensor],
        schemes: Mapping[str, Scheme],
        names: Mapping[str, list[str]],
        keep: bool = True,
        teacher_head: nn.Module | None = None,
    ) -> None:
        self.runner = runner
        self.teacher_head = teacher_head if teacher_head is not None else runner.lm_head
        self.tensors = tensors
        self.schemes = dict(schemes)
        self.names = dict(names)
        self.keep = keep
        self.factors: dict[str, torch.Tensor] = {}
        for fqn, scheme in self.schemes.items():
            if fqn.startswith("model.layers.") and learnable(scheme):
                stored = self.tensors[f"{fqn}.scale"]
                self.factors[fqn] = torch.zeros(stored.shape, dtype=torch.float32, requires_grad=True)
        self._blocks: dict[int, tuple[nn.Module, dict[str, LearnedScale]]] = {}
        self._ropes: dict[int, tuple[torch.Tensor, ...]] = {}
        self.head_weight = self._head_weight()

    @property
    def num_layers(self) -> int:
        return self.runner.num_layers

    def parameters(self) -> list[torch.Tensor]:
        return list(self.factors.values())

    def record(self, fqn: str) -> dict[str, torch.Tensor]:
        """The stored tensors of quantized layer `fqn` (as the artifact holds them now)."""
        return {name: self.tensors[f"{fqn}.{name}"] for name in self.names[fqn]}

    def trained(self) -> dict[str, dict[str, torch.Tensor]]:
        """{fqn: its stored tensors with the trained scale} for every learnable layer."""
        return {fqn: stored_with(self.record(fqn), factor) for fqn, factor in self.factors.items()}

    # ------------------------------------------------------------------ blocks

    def _template(self, index: int) -> nn.Module:
        streamed = self.runner.streamed
        source = streamed._templates[index] if streamed is not None else self.runner.layers[index]
        return copy.deepcopy(source)

    def _fp_tensors(self, index: int) -> dict[str, torch.Tensor]:
        """Block `index`'s tensors that are not parts of a quantized layer, by name within the block."""
        prefix = f"model.layers.{index}."
        owned = tuple(f"{fqn}." for fqn in self.schemes if fqn.startswith(prefix))
        return {
            name[len(prefix) :]: t
            for name, t in self.tensors.items()
            if name.startswith(prefix) and not name.startswith(owned)
        }

    def _layers_of(self, index: int) -> list[str]:
        prefix = f"model.layers.{index}."
        return [fqn for fqn in self.schemes if fqn.startswith(prefix)]

    def _base(self, index: int) -> nn.Module:
        """Block `index`'s template with the artifact's tensors that are not parts of a quantized layer."""
        layer = self._template(index)
        for name, tensor in self._fp_tensors(index).items():
            assign_tensor(layer, name, tensor.to(torch.float32))
        return layer

    def block(self, index: int) -> tuple[nn.Module, dict[str, LearnedScale]]:
        """Block `index` in FP32 from the artifact's tensors, and its learnable layers by name within the block
        (their weights are passed at each call: they depend on the factors)."""
        if index in self._blocks:
            return self._blocks[index]
        prefix = f"model.layers.{index}."
        layer = self._base(index)
        learned: dict[str, LearnedScale] = {}
        for fqn in self._layers_of(index):
            local, scheme, record = fqn[len(prefix) :], self.schemes[fqn], self.record(fqn)
            if f"{fqn}.bias" in self.tensors:
                assign_tensor(layer, f"{local}.bias", self.tensors[f"{fqn}.bias"].to(torch.float32))
            if fqn in self.factors:
                scale = learned_scale(scheme, record)
                scale.log_factor = self.factors[fqn]
                learned[local] = scale
            else:
                assign_tensor(layer, f"{local}.weight", handler_for(scheme).dequantize(scheme, record))
        built = (layer, learned)
        if self.keep:
            self._blocks[index] = built
        return built

    def runtime_block(self, index: int, device: torch.device | str = "cpu") -> nn.Module:
        """Block `index` as it will be served: the artifact's tensors (trained scales included once written
        back), its quantized layers as their runtime modules."""
        prefix = f"model.layers.{index}."
        layer = self._base(index)
        for fqn in self._layers_of(index):
            scheme = self.schemes[fqn]
            bias = self.tensors.get(f"{fqn}.bias")
            module = handler_for(scheme).build(scheme, self.record(fqn), bias, torch.device(device))
            set_module(layer, fqn[len(prefix) :], module)
        return layer

    def _rope(self, pack: Pack, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        key = id(pack)
        if key not in self._ropes:
            with torch.no_grad():
                self._ropes[key] = tuple(t.clone() for t in self.runner.rope(pack, hidden[:1]))
        return self._ropes[key]

    def run_block(self, index: int, hidden: torch.Tensor, pack: Pack) -> torch.Tensor:
        """hidden [1, T, H] -> [1, T, H] through block `index` with the current scales (a graph when grad is on)."""
        layer, learned = self.block(index)
        weights = {f"{name}.weight": scale.weight() for name, scale in learned.items()}
        out = torch.func.functional_call(
            layer,
            weights,
            (hidden,),
            {
                "attention_mask": pack.mask,
                "position_ids": pack.position_ids,
                "position_embeddings": self._rope(pack, hidden),
            },
        )
        return out[0] if isinstance(out, tuple) else out

    # ------------------------------------------------------------------ loss

    def _head_weight(self) -> torch.Tensor:
        if "lm_head" in self.schemes:
            scheme = self.schemes["lm_head"]
            return handler_for(scheme).dequantize(scheme, self.record("lm_head"))
        head: Any = self.runner.lm_head
        return head.weight.detach().to(torch.float32)

    def _embed(self, pack: Pack) -> torch.Tensor:
        with torch.no_grad():
            return self.runner.embed(pack).clone()

    def kl(self, pack: Pack, teacher: torch.Tensor) -> float:
        """Σ weight x KL(teacher || student) over the pack's positions, without a graph."""
        with torch.no_grad():
            hidden = self._embed(pack)
            for index in range(self.num_layers):
                hidden = self.run_block(index, hidden, pack)
            normed = self.runner.norm(hidden)[0]
            return sum(
                float(self._chunk_kl(normed[rows], teacher[rows], pack.weights[rows]))
                for rows in _chunks(pack)
            )

    def backward(self, pack: Pack, teacher: torch.Tensor, scale: float) -> float:
        """Accumulate `scale` x d(Σ weight x KL)/d(factors) into the factors' gradients; returns the Σ."""
        inputs: list[torch.Tensor] = []
        with torch.no_grad():
            hidden = self._embed(pack)
            for index in range(self.num_layers):
                inputs.append(hidden)
                hidden = self.run_block(index, hidden, pack)
        top = hidden.detach().requires_grad_(True)
        total = 0.0
        with torch.enable_grad():
            normed = self.runner.norm(top)[0]
            spans = _chunks(pack)
            for number, rows in enumerate(spans):
                loss = self._chunk_kl(normed[rows], teacher[rows], pack.weights[rows])
                total += float(loss.detach())
                (loss * scale).backward(retain_graph=number < len(spans) - 1)
        grad = top.grad
        assert grad is not None
        for index in reversed(range(self.num_layers)):
            x = inputs[index].detach().requires_grad_(index > 0)
            with torch.enable_grad():
                y = self.run_block(index, x, pack)
            y.backward(grad)
            grad = x.grad
            if grad is None:
                break
        return total

    def _chunk_kl(self, student: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = torch.log_softmax(self.teacher_head(teacher).float(), -1)
        logp = torch.log_softmax(F.linear(student, self.head_weight), -1)
        kl = (target.exp() * (target - logp)).sum(-1)
        return (kl * weights).sum()


def _chunks(pack: Pack) -> list[slice]:
    return [slice(start, min(start + CHUNK, pack.num_tokens)) for start in range(0, pack.num_tokens, CHUNK)]
