"""`qpack quantize` and `qpack inspect`: options -> `quantize.pipeline.quantize_model` / the artifact reader ->
plan and artifact tables."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import typer

from qpack.cli import options as opt
from qpack.cli.app import app, memory_limit, output, run, sizes
from qpack.cli.fields import Option, Options, choice
from qpack.cli.render import artifact_table, inspect_table, plan_summary, plan_table
from quantize.algorithms import AWQ, GPTQ, RTN, Algorithm, Auto, AutoRound, SmoothQuant
from quantize.common.config import Problems
from quantize.common.errors import QpackError
from quantize.config import QuantizeConfig
from quantize.distill import Distill
from quantize.formats.schemes import Int4, Scheme, parse_scheme
from quantize.io.exports import CompressedTensors
from quantize.planning.plan import PlanRules
from quantize.planning.presets import PRESETS


def _schemes(texts: list[str], group_size: int, problems: Problems) -> tuple[Scheme, ...]:
    """--scheme values as schemes; a bare `int4` takes --group-size."""
    schemes: list[Scheme] = []
    for text in texts:
        try:
            scheme = parse_scheme(text)
        except QpackError as error:
            problems.add("schemes", error.message)
            continue
        if scheme is None:
            problems.add("schemes", "fp32 is not a candidate (keep layers FP32 with --override)")
        elif isinstance(scheme, Int4) and text.strip().lower() == "int4":
            schemes.append(Int4(group_size=group_size))
        else:
            schemes.append(scheme)
    return tuple(schemes)


def _algorithm(values: dict[str, Any], problems: Problems) -> Algorithm | None:
    gptq = GPTQ(damp=values["damp"], act_order=values["act_order"])
    smoothquant = SmoothQuant(alpha=values["alpha"])
    choices: dict[str, Algorithm] = {
        "auto": Auto(gptq=gptq, smoothquant=smoothquant),
        "rtn": RTN(),
        "gptq": gptq,
        "awq": AWQ(),
        "smoothquant": smoothquant,
        "autoround": AutoRound(
            iters=values["autoround_iters"],
            batch_tokens=values["autoround_batch_tokens"],
            init=values["autoround_init"],
            gptq=gptq,
        ),
    }
    name = values["algorithm"]
    problems.check_choice(name, "algorithm", choices)
    return choices.get(name)


def _build(values: dict[str, Any], problems: Problems) -> dict[str, Any]:
    """The fields several options make: candidates with --group-size, the algorithm with its settings."""
    group_size = values["group_size"]
    problems.check_choice(group_size, "group_size", Int4.GROUP_SIZES)
    fields: dict[str, Any] = {"schemes": _schemes(values["scheme"], group_size, problems)}
    preset = values.get("preset")
    if preset is not None:
        fields["preset"] = (
            dataclasses.replace(preset, candidates=(Int4(group_size=group_size),))
            if preset.name == "int4"
            else preset
        )
    algorithm = _algorithm(values, problems)
    if algorithm is not None:
        fields["algorithm"] = algorithm
    if values["distill"]:
        fields["distill"] = Distill(
            minutes=values["distill_minutes"],
            lr=values["distill_lr"],
            batch_tokens=values["distill_batch_tokens"],
        )
    return fields


QUANTIZE = Options(
    QuantizeConfig,
    [
        Option("output", ("--output", "-o")),
        Option("calibration", ("--calibration", "-c")),
        Option("model", ("--model", "-m")),
        "name",
        "version",
        Option("preset", ("--preset", "-p"), str, "mixed", choice(PRESETS, "preset"), name="preset"),
        "target_bits",
        "max_kl",
        Option("", ("--scheme",), list[str], [], doc=(QuantizeConfig, "schemes"), name="scheme"),
        Option(
            "",
            ("--group-size",),
            int,
            64,
            help="int4 group size of the int4 preset and --scheme int4.",
            name="group_size",
        ),
        Option(
            "overrides",
            ("--override",),
            list[str],
            [],
            PlanRules.parse,
            help="PATTERN=SCHEME, e.g. 're:.*down_proj=int8' (repeatable; fp32 keeps a layer FP32).",
        ),
        Option(
            "",
            ("--algorithm",),
            str,
            "auto",
            help="auto (gptq for int8/int4, smoothquant for w8a8), rtn, gptq, awq, smoothquant or autoround.",
            name="algorithm",
        ),
        Option("", ("--damp",), float, GPTQ.damp, doc=(GPTQ, "damp"), name="damp"),
        Option(
            "",
            ("--act-order/--no-act-order",),
            bool,
            GPTQ.act_order,
            doc=(GPTQ, "act_order"),
            name="act_order",
        ),
        Option(
            "", ("--smoothquant-alpha",), float, SmoothQuant.alpha, doc=(SmoothQuant, "alpha"), name="alpha"
        ),
        Option(
            "", ("--autoround-iters",), int, AutoRound.iters, doc=(AutoRound, "iters"), name="autoround_iters"
        ),
        Option(
            "",
            ("--autoround-init",),
            str,
            AutoRound.init,
            doc=(AutoRound, "init"),
            name="autoround_init",
        ),
        Option(
            "",
            ("--autoround-batch-tokens",),
            int,
            AutoRound.batch_tokens,
            doc=(AutoRound, "batch_tokens"),
            name="autoround_batch_tokens",
        ),
        Option(
            "",
            ("--distill/--no-distill",),
            bool,
            False,
            doc=(QuantizeConfig, "distill"),
            name="distill",
        ),
        Option(
            "",
            ("--distill-minutes",),
            float,
            Distill.minutes,
            doc=(Distill, "minutes"),
            name="distill_minutes",
        ),
        Option("", ("--distill-lr",), float, Distill.lr, doc=(Distill, "lr"), name="distill_lr"),
        Option(
            "",
            ("--distill-batch-tokens",),
            int,
            Distill.batch_tokens,
            doc=(Distill, "batch_tokens"),
            name="distill_batch_tokens",
        ),
        Option("sensitivity.method", ("--sensitivity",)),
        Option("sensitivity.budget_minutes", ("--sensitivity-budget",)),
        Option("sensitivity.num_tokens", ("--sensitivity-tokens",)),
        "calib_tokens",
        "eval_tokens",
        "rotate",
        "rotate_seed",
        Option(
            "export",
            ("--export",),
            str | None,
            None,
            choice({"compressed-tensors": CompressedTensors()}, "export"),
            doc=(QuantizeConfig, "export"),
        ),
        Option("seed", also=("sensitivity.seed",)),
        Option(
            "max_shard_size", ("--max-shard-size",), str, "2GB", lambda text: sizes(text, "--max-shard-size")
        ),
        Option("max_memory", ("--max-memory",), str | None, None, memory_limit, help=opt.MAX_MEMORY_HELP),
        "overwrite",
    ],
    "quantize",
    build=_build,
    names={
        "schemes": "--scheme",
        "group_size": "--group-size",
        "algorithm": "--algorithm",
        "algorithm.damp": "--damp",
        "algorithm.gptq.damp": "--damp",
        "algorithm.act_order": "--act-order",
        "algorithm.alpha": "--smoothquant-alpha",
        "algorithm.smoothquant.alpha": "--smoothquant-alpha",
        "algorithm.iters": "--autoround-iters",
        "algorithm.init": "--autoround-init",
        "algorithm.batch_tokens": "--autoround-batch-tokens",
        "distill": "--distill",
        "distill.minutes": "--distill-minutes",
        "distill.lr": "--distill-lr",
        "distill.batch_tokens": "--distill-batch-tokens",
    },
)


@app.command(help="Quantize a model with layer-wise mixed precision into a versioned artifact.")
@QUANTIZE.command
def quantize(ctx: typer.Context, **values: Any) -> None:
    from quantize.pipeline import quantize_model

    out = output(ctx)
    config = run(out, lambda: QUANTIZE.config(values))

    def on_plan(plan: Any, info: dict[str, Any]) -> None:
        if not out.quiet and not out.json_mode:
            out.stderr.print(plan_table(plan))
            out.stderr.print(plan_summary(plan, info))

    result = run(out, lambda: QUANTIZE.translated(lambda: quantize_model(config, out.progress(), on_plan)))
    for warning in result.warnings:
        out.warn(warning)
    data = {"ok": True, **result.to_json()}
    out.result(data, artifact_table(result.manifest, result.output, result.seconds))


@app.command(help="Print an artifact's manifest: plan, sizes, quality, evals; verify its hashes.")
def inspect(
    ctx: typer.Context,
    artifact: Path = typer.Argument(..., help="Artifact directory."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Check every file's sha256."),
) -> None:
    from quantize.io.artifact import read_manifest, verify_artifact
    from quantize.planning.plan import Plan

    out = output(ctx)

    def load() -> dict[str, Any]:
        manifest = read_manifest(artifact)
        if verify:
            verify_artifact(artifact, manifest)
        return manifest

    manifest = run(out, load)
    plan = Plan.from_json(manifest["modules"])
    out.result(manifest, plan_table(plan), inspect_table(manifest, plan, verify))
