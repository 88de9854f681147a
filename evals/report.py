"""Eval outputs for people and CI: a Markdown summary (for a PR comment) and PNG charts.

The charts are the two views a reviewer needs: which subjects moved and whether that is noise (per-subject
drift bars with paired-bootstrap 95% intervals), and how the per-question disagreement is distributed (KL
histogram, log scale: a long tail means a few questions changed a lot).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

from evals.results import DriftReport, Evaluation


def markdown(evaluation: Evaluation) -> str:
    mmlu = evaluation.mmlu
    lines = [f"### qpack evaluate: {evaluation.artifact.name} v{evaluation.artifact.version}", ""]
    lines.append(
        f"Reference: `{evaluation.reference.id}` · MMLU {mmlu.shots}-shot, {mmlu.questions} questions "
        f"({mmlu.layout}, sha256 `{mmlu.sha256[:12]}`)"
    )
    lines.append(
        f"Artifact numerics: prefill GEMMs in {evaluation.numerics.prefill_dtype}, native kernels "
        f"{evaluation.numerics.native_kernels or 'off (torch ops)'}; prompts scored on "
        f"{evaluation.numerics.prompt_path or 'unrecorded kernels'}"
    )
    lines.append("")
    lines.append(
        "| format | reference acc | artifact acc | drift (pts, 95% CI) | flip rate | R→W / W→R | answer KL | top-1 agree |"
    )
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for fmt, report in evaluation.formats.items():
        ref, cand = report.reference, report.candidate
        low, high = report.drift_ci95_points
        flips = report.flips
        lines.append(
            f"| {fmt} | {ref.accuracy:.1%} [{ref.ci95[0]:.1%}, {ref.ci95[1]:.1%}] "
            f"| {cand.accuracy:.1%} [{cand.ci95[0]:.1%}, {cand.ci95[1]:.1%}] "
            f"| {report.drift_points:+.2f} [{low:+.2f}, {high:+.2f}] | {flips.flip_rate:.1%} "
            f"| {flips.right_to_wrong} / {flips.wrong_to_right} | {report.answer_kl.mean:.4f} "
            f"| {report.top1_agreement:.1%} |"
        )
    heldout = evaluation.heldout
    if heldout:
        lines += [
            "",
            f"Held-out calibration queries ({heldout.tokens} tokens): next-token KL {heldout.kl:.4f}, "
            f"top-1 agreement {heldout.top1_agreement:.1%}, perplexity {heldout.ppl:.2f} "
            f"(reference {heldout.ppl_reference:.2f}).",
        ]
    gate = evaluation.gate
    if gate.checked:
        status = "passed" if gate.passed else "FAILED: " + "; ".join(gate.reasons)
        lines += ["", f"Gate ({', '.join(gate.checked)}): **{status}**"]
    return "\n".join(lines) + "\n"


def drift_png(report: DriftReport, title: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    subjects = list(report.subjects)
    drift = [report.subjects[s].drift_points for s in subjects]
    low = [report.subjects[s].drift_ci95_points[0] for s in subjects]
    high = [report.subjects[s].drift_ci95_points[1] for s in subjects]
    errors = [
        [d - lo for d, lo in zip(drift, low, strict=True)],
        [hi - d for d, hi in zip(drift, high, strict=True)],
    ]
    fig, ax = plt.subplots(figsize=(7, 1.5 + 0.18 * len(subjects)))
    colors = [
        "#c0392b" if hi < 0 else "#27ae60" if lo > 0 else "#7f8c8d" for lo, hi in zip(low, high, strict=True)
    ]
    ax.barh(range(len(subjects)), drift, xerr=errors, color=colors, ecolor="#333333", capsize=2)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.axvline(report.drift_points, color="#2c3e50", linestyle="--", linewidth=1, label="overall")
    ax.set_yticks(range(len(subjects)))
    ax.set_yticklabels([s.replace("_", " ") for s in subjects], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("accuracy drift, points (artifact - reference), paired bootstrap 95% CI")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def kl_histogram_png(values: Sequence[float], title: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    data = np.clip(np.asarray(values, dtype=np.float64), 1e-8, None)
    fig, ax = plt.subplots(figsize=(6, 3))
    bins = np.logspace(math.log10(max(data.min(), 1e-8)), math.log10(max(data.max(), 1e-7)) + 1e-9, 40)
    ax.hist(data, bins=bins.tolist(), color="#2980b9")
    ax.set_xscale("log")
    ax.set_xlabel("KL(reference || artifact) of the answer distribution, per question")
    ax.set_ylabel("questions")
    ax.set_title(title, fontsize=9)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()
