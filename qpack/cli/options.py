"""Options that several commands share, declared once (`qpack build` takes most of calibrate's, quantize's and
evaluate's), so their flags, help and defaults cannot drift apart."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

ModelSpec = Annotated[
    str | None, typer.Option("--model", "-m", help="HF folder, .gguf file, Hub id, or alias (smollm2-135m).")
]
Queries = Annotated[
    list[Path],
    typer.Option(
        "--queries", help="Query file(s): JSONL, JSON, CSV, TSV, TXT, Parquet or a saved datasets folder."
    ),
]
NumSamples = Annotated[
    int, typer.Option("--num-samples", "-n", help="Samples to keep (calibration + held-out).")
]
Seed = Annotated[int, typer.Option("--seed", help="Seed for sampling.")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace existing outputs.")]

Name = Annotated[str | None, typer.Option("--name", help="Artifact name (default: model-preset).")]
Version = Annotated[str, typer.Option("--version", help="Artifact version.")]
Preset = Annotated[str, typer.Option("--preset", "-p", help="mixed (default), int8, int4 or w8a8.")]
TargetBits = Annotated[float | None, typer.Option("--target-bits", help="Average bits per quantized weight.")]
Overrides = Annotated[
    list[str], typer.Option("--override", help="PATTERN=SCHEME, e.g. 're:.*down_proj=int8' (repeatable).")
]

Mmlu = Annotated[Path | None, typer.Option("--mmlu", help="MMLU directory (hendrycks or cais layout).")]
Subjects = Annotated[str | None, typer.Option("--subjects", help="Comma-separated subset of subjects.")]
Shots = Annotated[int, typer.Option("--shots", help="Few-shot examples from the dev split (0-5).")]
Format = Annotated[str, typer.Option("--format", help="letter, cloze or both.")]
MaxDrift = Annotated[
    float | None, typer.Option("--max-drift", help="Gate: fail if accuracy drops more (points).")
]
MaxKL = Annotated[
    float | None, typer.Option("--max-kl", help="Gate: fail if held-out next-token KL is higher.")
]
MaxFlipRate = Annotated[
    float | None, typer.Option("--max-flip-rate", help="Gate: fail if more answers flip (0-1).")
]
MaxMemory = Annotated[
    str | None,
    typer.Option(
        "--max-memory", help="Memory the run may use (8GB, 0.5 = half of what is free; default 90% of free)."
    ),
]

# qpack quantize
Calibration = Annotated[
    Path, typer.Option("--calibration", "-c", help="Calibration directory (qpack calibrate).")
]
MaxKLBudget = Annotated[
    float | None, typer.Option("--max-kl", help="Fewest bits with predicted KL under this.")
]
Schemes = Annotated[
    list[str], typer.Option("--scheme", help="Candidate schemes for the planner (repeatable).")
]
GroupSize = Annotated[
    int, typer.Option("--group-size", help="int4 group size for the int4 preset (32/64/128).")
]
Algorithm = Annotated[str, typer.Option("--algorithm", help="auto, rtn, gptq, awq or smoothquant.")]
Sensitivity = Annotated[
    str,
    typer.Option(
        "--sensitivity",
        help="auto (exact kl where it fits --sensitivity-budget, else fisher), kl, kl-all, fisher or mse.",
    ),
]
SensitivityBudget = Annotated[
    float,
    typer.Option(
        "--sensitivity-budget", help="Minutes exact KL may take before auto picks the Fisher estimate."
    ),
]
SensitivityTokens = Annotated[
    int, typer.Option("--sensitivity-tokens", help="Held-out tokens for sensitivity.")
]
CalibTokens = Annotated[int, typer.Option("--calib-tokens", help="Calibration tokens for GPTQ/AWQ.")]
EvalTokens = Annotated[int, typer.Option("--eval-tokens", help="Held-out tokens for the final KL/PPL check.")]
ActOrder = Annotated[bool, typer.Option("--act-order/--no-act-order", help="GPTQ activation order.")]
Damp = Annotated[float, typer.Option("--damp", help="GPTQ damping (fraction of mean Hessian diagonal).")]
SmoothQuantAlpha = Annotated[
    float, typer.Option("--smoothquant-alpha", help="SmoothQuant migration strength.")
]
Export = Annotated[str | None, typer.Option("--export", help="Also export: compressed-tensors.")]
MaxShardSize = Annotated[str, typer.Option("--max-shard-size", help="Largest weights file of the artifact.")]
