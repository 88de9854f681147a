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
MAX_MEMORY_HELP = "Memory the run may use (8GB, 0.5 = half of what is free; default 90% of free)."
MaxMemory = Annotated[str | None, typer.Option("--max-memory", help=MAX_MEMORY_HELP)]

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

# qpack serve
Target = Annotated[
    str, typer.Argument(help="Artifact directory, or a model (HF folder, .gguf, Hub id, alias).")
]
Host = Annotated[str, typer.Option("--host", help="Address to bind (default loopback only).")]
Port = Annotated[int, typer.Option("--port", help="Port.")]
KVMemory = Annotated[
    str, typer.Option("--kv-memory", help="KV pool size: bytes (512MB, 2GiB) or a fraction of free memory.")
]
BlockSize = Annotated[
    int, typer.Option("--block-size", help="Tokens per KV block (smaller: less of the pool left unfilled).")
]
KVDtype = Annotated[
    str,
    typer.Option("--kv-dtype", help="KV pool element type: float32, bfloat16 (half the memory) or float16."),
]
MaxBatchedTokens = Annotated[int, typer.Option("--max-num-batched-tokens", help="Token budget per step.")]
MaxSeqs = Annotated[int, typer.Option("--max-num-seqs", help="Sequences per batch.")]
MaxQueue = Annotated[int, typer.Option("--max-queue", help="Waiting requests before 429.")]
MaxModelLen = Annotated[
    int | None, typer.Option("--max-model-len", help="Context limit (default: the model's).")
]
RequestTimeout = Annotated[
    float, typer.Option("--request-timeout", help="Seconds before a request is aborted.")
]
ApiKeys = Annotated[
    list[str],
    typer.Option(
        "--api-key",
        envvar="QPACK_API_KEY",
        help="Require 'Authorization: Bearer KEY' (repeatable: any listed key is accepted).",
    ),
]
ApiKeyFile = Annotated[
    Path | None, typer.Option("--api-key-file", help="File of accepted API keys, one per line (# comments).")
]
MaxRequestBytes = Annotated[
    int, typer.Option("--max-request-bytes", help="Largest request body; bigger ones get 413 before parsing.")
]
Dtype = Annotated[str, typer.Option("--dtype", help="For plain models: float32, bfloat16 or float16.")]
PrefixCaching = Annotated[
    bool, typer.Option("--prefix-caching/--no-prefix-caching", help="Share cached prompt prefixes.")
]
KVHostMemory = Annotated[
    str,
    typer.Option(
        "--kv-host-memory",
        help="Host memory for KV blocks of returning conversations (T1), e.g. 2GB; 0: off.",
    ),
]
KVDisk = Annotated[
    str | None, typer.Option("--kv-disk", help="Directory for KV blocks on disk (T2); survives restarts.")
]
KVDiskSize = Annotated[str, typer.Option("--kv-disk-size", help="Bytes --kv-disk may hold (LRU beyond).")]
KVCodec = Annotated[
    str, typer.Option("--kv-codec", help="Stored-block compression: zstd, zlib, lz4 or none.")
]
SessionTTL = Annotated[
    float | None, typer.Option("--session-ttl", help="Seconds an idle session's KV is kept.")
]
IsolateUsers = Annotated[
    bool,
    typer.Option(
        "--isolate-users", help="Salt prefix caching by each request's `user`: no sharing across users."
    ),
]
ServeTarget = Annotated[
    str | None,
    typer.Argument(
        help="Artifact directory, or a model (HF folder, .gguf, Hub id, alias); not needed by --role gateway."
    ),
]
Redis = Annotated[
    str | None,
    typer.Option("--redis", help="Redis URL of the fleet's queue (redis://127.0.0.1:6379/0); needs --role."),
]
Role = Annotated[
    str,
    typer.Option(
        "--role",
        help="single (one process, no Redis), gateway (API, no model), worker (engine behind Redis), "
        "or all (gateway + --workers workers here).",
    ),
]
Workers = Annotated[int, typer.Option("--workers", help="Workers --role all starts beside its gateway.")]
ClaimIdle = Annotated[
    float,
    typer.Option("--claim-idle", help="Seconds before a dead worker's requests are taken over by another."),
]
Threads = Annotated[
    int | None, typer.Option("--threads", help="Compute threads of this process (default: torch's).")
]
Compile = Annotated[
    bool,
    typer.Option(
        "--compile",
        help="torch.compile the decode steps the fused native step doesn't cover (over 16 sequences, layers "
        "it can't run, no native kernels); minutes of warm-up at start.",
    ),
]
PrefillDtype = Annotated[
    str,
    typer.Option(
        "--prefill-dtype",
        help="Precision of prefill-sized GEMMs of int8/int4 layers: float32 (every CPU, the default) or "
        "bfloat16 (faster where the CPU has AMX-BF16/AVX512-BF16, at a KL cost; emulated elsewhere).",
    ),
]
BatchInvariant = Annotated[
    bool,
    typer.Option(
        "--batch-invariant",
        help="Every token through one native path (prefill too), so outputs don't depend on the batch or on "
        "reused KV (prefix cache, --kv-host-memory, --kv-disk); prefill is slower. CPU with native kernels, "
        "int8/int4/bf16/FP32 linears.",
    ),
]
Reference = Annotated[
    str | None,
    typer.Option("--reference", "-r", help="Reference model or artifact (default: the artifact's source)."),
]
Limit = Annotated[int | None, typer.Option("--limit", help="At most N questions per subject (stratified).")]
Cache = Annotated[
    bool, typer.Option("--cache/--no-cache", help="Reuse the reference's cached scores (and add to them).")
]
