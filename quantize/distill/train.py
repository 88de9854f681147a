"""The distillation loop: Adam on the student's scale factors, early stopping on a validation split, a budget in
minutes, the best scales kept.

The calibration rows are split once: a seeded `validation` share is never trained on and says when to stop (the
held-out queries the artifact is finally judged on stay untouched, so its reported KL is not the one that chose
the step). Each step trains on whole packed rows adding up to about `batch_tokens`, every row once per epoch; the
validation KL is measured every `eval_every` steps and at the end, and the scales of the best measurement are
the ones kept. The clock is injected (tests drive the budget without waiting).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from quantize.common.errors import QpackError
from quantize.common.progress import NULL_PROGRESS, Progress
from quantize.distill.settings import Distill
from quantize.distill.student import Student
from quantize.sequential.packing import Pack, row_batches


@dataclass
class DistillResult:
    steps: int
    best_step: int
    stopped: str  # "patience", "budget" or "max_steps"
    seconds: float
    validation_kl_before: float
    validation_kl: float
    curve: list[dict[str, float]] = field(default_factory=list)  # step, seconds, train_kl, validation_kl

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "best_step": self.best_step,
            "stopped": self.stopped,
            "seconds": round(self.seconds, 1),
            "validation_kl_before": self.validation_kl_before,
            "validation_kl": self.validation_kl,
            "curve": self.curve,
        }


def split(packs: list[Pack], teacher: list[torch.Tensor], settings: Distill) -> tuple[list[int], list[int]]:
    """(train, validation) row indices: a seeded `validation` share, at least one row each."""
    if len(packs) < 2:
        raise QpackError(
            f"distillation needs at least 2 packed calibration rows to train on one and validate on another "
            f"(got {len(packs)}); raise --calib-tokens"
        )
    assert len(packs) == len(teacher)
    order = list(range(len(packs)))
    random.Random(settings.seed).shuffle(order)
    held = min(len(packs) - 1, max(1, round(settings.validation * len(packs))))
    return sorted(order[held:]), sorted(order[:held])


def validation_kl(student: Student, packs: list[Pack], teacher: list[torch.Tensor], rows: list[int]) -> float:
    total = sum(student.kl(packs[i], teacher[i]) for i in rows)
    weight = sum(float(packs[i].weights.sum()) for i in rows)
    return total / max(weight, 1e-9)


def distill(
    student: Student,
    packs: list[Pack],
    teacher: list[torch.Tensor],
    settings: Distill,
    progress: Progress = NULL_PROGRESS,
    clock: Callable[[], float] = time.monotonic,
) -> DistillResult:
    """Train the student's scale factors against `teacher` (the FP32 final normed hidden states of `packs`)."""
    train, held = split(packs, teacher, settings)
    params = student.parameters()
    optimizer = torch.optim.Adam(params, lr=settings.lr)
    next_batch = row_batches(packs, train, settings.batch_tokens, random.Random(settings.seed))
    started = clock()
    best = before = validation_kl(student, packs, teacher, held)
    best_state = [p.detach().clone() for p in params]
    best_step, bad, step, stopped = 0, 0, 0, "max_steps"
    curve: list[dict[str, float]] = [{"step": 0, "seconds": 0.0, "validation_kl": before}]
    running: list[float] = []
    title = f"Distilling {len(params)} layers' scales on {len(train)} rows (validation: {len(held)})"
    with progress.task(title, total=settings.max_steps) as task:
        while step < settings.max_steps:
            if clock() - started >= settings.minutes * 60:
                stopped = "budget"
                break
            step += 1
            rows = next_batch()
            weight = sum(float(packs[i].weights.sum()) for i in rows)
            optimizer.zero_grad(set_to_none=True)
            total = sum(student.backward(packs[i], teacher[i], 1.0 / weight) for i in rows)
            optimizer.step()
            running.append(total / weight)
            task.advance()
            if step % settings.eval_every:
                continue
            kl = validation_kl(student, packs, teacher, held)
            curve.append(
                {
                    "step": step,
                    "seconds": round(clock() - started, 2),
                    "train_kl": sum(running) / len(running),
                    "validation_kl": kl,
                }
            )
            running = []
            if kl < best:
                best, best_step, bad = kl, step, 0
                best_state = [p.detach().clone() for p in params]
            else:
                bad += 1
                if bad >= settings.patience:
                    stopped = "patience"
                    break
    with torch.no_grad():
        for param, value in zip(params, best_state, strict=True):
            param.copy_(value)
    return DistillResult(step, best_step, stopped, clock() - started, before, best, curve)
