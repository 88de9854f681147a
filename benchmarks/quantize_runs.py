"""One `quantize_model` run per process, for the benchmarks that compare quantize configurations: each child's
peak RSS is its own, and a configuration is plain JSON (`preset` name, optional `group_size` for int4, optional
`algorithm` as its `to_json` dict, without one the preset's default; optional `distill` settings,
`calib_tokens`, `eval_tokens`, `rotate` and `rotate_seed`), so a run is reproducible from its line
in the results file."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from quantize.algorithms import Algorithm
from quantize.common.memory import peak_rss_mb, release_freed_memory
from quantize.formats.schemes import Int4
from quantize.pipeline import QuantizeConfig, quantize_model
from quantize.planning.presets import PRESETS
release_freed_memory()
spec = json.loads(sys.argv[1])
options = spec["options"]
group = options.get("group_size")
extra = {"algorithm": Algorithm.from_json(options["algorithm"])} if "algorithm" in options else {}
if "distill" in options:
    from quantize.distill import Distill
    extra["distill"] = Distill(**options["distill"])
for key in ("calib_tokens", "eval_tokens", "rotate", "rotate_seed"):
    if key in options:
        extra[key] = options[key]
started = time.perf_counter()
result = quantize_model(QuantizeConfig(
    output=Path(spec["output"]), calibration=Path(spec["calibration"]), overwrite=True,
    preset=PRESETS[options["preset"]], schemes=(Int4(group),) if group else (), **extra,
))
print(json.dumps({
    "seconds": time.perf_counter() - started,
    "peak_rss_mb": peak_rss_mb(),
    "quality": result.manifest["quality"],
    "size": result.manifest["size"],
    "timings": result.manifest["timings_s"],
    "plan": result.manifest["quantization"]["summary"],
    "rotation": result.manifest["quantization"].get("rotation"),
    "distill": {k: v for k, v in result.manifest["quantization"].get("distill", {}).items() if k != "curve"},
}))
"""


def run(name: str, calibration: Path, out: Path, options: dict[str, object]) -> dict[str, object]:
    """Quantize `calibration`'s model with `options` into `out/name` in a child process; its measurements, and
    `wall_s` the child's whole life (start-up and imports included)."""
    spec = {"output": str(out / name), "calibration": str(calibration), "options": options}
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(spec), str(ROOT)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - started
    return result
