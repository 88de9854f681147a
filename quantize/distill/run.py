"""`--distill` inside a quantize run: between the pass (which held every tensor back and kept the FP32 teacher's
hidden states) and the artifact's files. Trains, writes the trained scales into the held tensors, measures the
artifact again on the held-out queries with its runtime modules (the numbers the manifest reports are those of
what is stored), and draws the loss curve."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch

from quantize.common.memory import available_memory
from quantize.common.progress import NULL_PROGRESS, Progress
from quantize.config import HeldoutQuality
from quantize.distill.settings import Distill
from quantize.distill.student import Student
from quantize.distill.train import DistillResult, distill
from quantize.io.artifact import ArtifactWriter
from quantize.planning.plan import Plan
from quantize.quality import compare_hidden
from quantize.runtime.modules import prefill_dtype_set
from quantize.sequential.apply import PassResult
from quantize.sequential.packing import Pack
from quantize.sequential.runner import BlockRunner

CURVE_FILE = "distill.png"
WHAT = (
    "the scales of every int4 and int8 layer of the blocks (codes and zero points fixed); norms, embeddings, the "
    "head and every other layer stay as quantized"
)


@dataclass
class Distilled:
    result: DistillResult
    quality: HeldoutQuality  # the artifact after distillation, runtime modules, held-out queries
    before: HeldoutQuality  # the same before it
    kept_blocks: bool  # the student's blocks stayed built (else rebuilt at each use: streamed)
    png: bytes
    prompt_int8: HeldoutQuality | None = None  # after distillation, prompts on int8 activations (`quality`'s)

    def to_json(self, settings: Distill) -> dict[str, Any]:
        return {
            "settings": settings.to_json(),
            "trained": WHAT,
            "kept_blocks": self.kept_blocks,
            **self.result.to_json(),
            "heldout_kl_before": self.before.kl,
            "heldout_kl": self.quality.kl,
            "heldout_top1_before": self.before.top1_agreement,
            "heldout_top1": self.quality.top1_agreement,
        }


def keep_blocks(runner: BlockRunner, limit: int | None) -> bool:
    """Whether every block of the student fits at once (twice its FP32 size: the blocks and their grids), beside
    what the run holds throughout (the FP32 embeddings and head: 3.9 GiB at Llama-3-8B's shape and vocabulary),
    within half the run's memory limit."""
    streamed = runner.streamed
    if streamed is None:
        return True
    total = sum(streamed.block_bytes(i) for i in range(runner.num_layers))
    budget = 0.5 * (limit if limit is not None else available_memory())
    return streamed.resident_bytes() + 2 * total <= budget


def distill_held(
    runner: BlockRunner,
    plan: Plan,
    writer: ArtifactWriter,
    passed: PassResult,
    eval_packs: list[Pack],
    before: HeldoutQuality,
    settings: Distill,
    limit: int | None,
    progress: Progress = NULL_PROGRESS,
    keep: bool | None = None,
) -> Distilled:
    """Distill the tensors `writer` holds; they end with the best scales found."""
    kept = keep_blocks(runner, limit) if keep is None else keep
    student = Student(
        runner, writer.pending, plan.quantized(), writer.tensor_names, kept, passed.reference_head
    )
    result = distill(student, passed.packs, passed.teacher, settings, progress)
    for fqn, tensors in student.trained().items():
        writer.pending[f"{fqn}.scale"] = tensors["scale"]
    with progress.task("Measuring the distilled artifact against FP32 on held-out tokens"):
        candidate = _runtime_hidden(student, eval_packs)
        quality = compare_hidden(
            eval_packs, passed.reference, candidate, passed.reference_head, passed.candidate_head
        )
        prompt_int8 = None
        if passed.candidate_int8 is not None:
            candidate = _runtime_hidden(student, eval_packs, "int8")
            prompt_int8 = compare_hidden(
                eval_packs, passed.reference, candidate, passed.reference_head, passed.candidate_head
            )
    return Distilled(result, quality, before, kept, curve_png(result, before, quality), prompt_int8)


@torch.inference_mode()
def _runtime_hidden(
    student: Student, packs: list[Pack], prefill_dtype: str = "float32"
) -> list[torch.Tensor]:
    """The final normed hidden states of the artifact as served (runtime modules, prompt-sized products in
    `prefill_dtype`), block by block."""
    runner = student.runner
    hidden = [runner.embed(p) for p in packs]
    for index in range(student.num_layers):
        layer = student.runtime_block(index)
        outputs = []
        for h, pack in zip(hidden, packs, strict=True):
            with prefill_dtype_set(layer, prefill_dtype):
                out = layer(
                    h,
                    attention_mask=pack.mask,
                    position_ids=pack.position_ids,
                    position_embeddings=runner.rope(pack, h[:1]),
                )
            outputs.append(out[0] if isinstance(out, tuple) else out)
        hidden = outputs
        del layer
    return [runner.norm(h)[0] for h in hidden]


def curve_png(result: DistillResult, before: HeldoutQuality, after: HeldoutQuality) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    train = [(p["step"], p["train_kl"]) for p in result.curve if "train_kl" in p]
    valid = [(p["step"], p["validation_kl"]) for p in result.curve]
    if train:
        ax.plot(*zip(*train, strict=True), label="train KL (mean over the steps since the last point)")
    ax.plot(*zip(*valid, strict=True), marker="o", label="validation KL")
    ax.axvline(result.best_step, color="grey", linestyle=":", label=f"kept: step {result.best_step}")
    ax.set_xlabel("step")
    ax.set_ylabel("KL(FP32 || quantized), nats")
    ax.set_title(
        f"held-out KL {before.kl:.4f} -> {after.kl:.4f} ({result.stopped} after {result.steps} steps, "
        f"{result.seconds / 60:.1f} min)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()
