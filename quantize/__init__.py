"""qpack's core: model sources, quantization schemes and kernels, the planner and the artifact format.

`calibrate`, `evals` and `serve` build on this package; it never imports them. The public names below are
imported on first use, so `import quantize` (and `qpack --help`) stays instant; the `TYPE_CHECKING` block gives
type checkers and editors the same names.

Rooms: `common` (errors, progress, files, memory: what every library imports), `formats` (quantization math,
schemes and their stored form), `runtime` (quantized modules, native kernels, the serving skeleton: all that
serving needs of the quantizer), `io` (artifacts, checkpoints, calibration data, exports), `model` (where models
come from, module surgery), `algorithms` (one module per method), `sequential` (the block-at-a-time pass),
`sensitivity`, `planning`; `config`, `pipeline` and `quality` are `qpack quantize` itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quantize.common.lazy import lazy_exports
from quantize.common.version import __version__

if TYPE_CHECKING:
    from quantize.algorithms.settings import AWQ, GPTQ, RTN, Algorithm, Auto, AutoRound, SmoothQuant
    from quantize.common.config import ConfigError
    from quantize.common.errors import QpackError
    from quantize.config import HeldoutQuality, QuantizeConfig, QuantizeResult
    from quantize.formats.schemes import BF16, FP16, W8A8, BnbInt8, BnbNF4, Int4, Int8, Scheme, parse_scheme
    from quantize.io.artifact import LoadedArtifact, load_artifact, read_manifest, verify_artifact
    from quantize.io.exports import CompressedTensors
    from quantize.model.sources import load_model, load_tokenizer, resolve_model
    from quantize.pipeline import quantize_model
    from quantize.planning.presets import PRESETS, Preset
    from quantize.sensitivity.settings import SensitivityConfig

_EXPORTS = {
    "QpackError": "quantize.common.errors",
    "ConfigError": "quantize.common.config",
    "QuantizeConfig": "quantize.config",
    "QuantizeResult": "quantize.config",
    "quantize_model": "quantize.pipeline",
    "PRESETS": "quantize.planning.presets",
    "Preset": "quantize.planning.presets",
    "SensitivityConfig": "quantize.sensitivity.settings",
    "CompressedTensors": "quantize.io.exports",
    "HeldoutQuality": "quantize.config",
    **dict.fromkeys(
        ("Scheme", "Int8", "Int4", "BF16", "FP16", "W8A8", "BnbInt8", "BnbNF4", "parse_scheme"),
        "quantize.formats.schemes",
    ),
    **dict.fromkeys(
        ("Algorithm", "Auto", "AutoRound", "RTN", "GPTQ", "AWQ", "SmoothQuant"),
        "quantize.algorithms.settings",
    ),
    "LoadedArtifact": "quantize.io.artifact",
    "load_artifact": "quantize.io.artifact",
    "read_manifest": "quantize.io.artifact",
    "verify_artifact": "quantize.io.artifact",
    "resolve_model": "quantize.model.sources",
    "load_model": "quantize.model.sources",
    "load_tokenizer": "quantize.model.sources",
}
__all__ = [
    "AWQ",
    "BF16",
    "FP16",
    "GPTQ",
    "PRESETS",
    "RTN",
    "W8A8",
    "Algorithm",
    "Auto",
    "AutoRound",
    "BnbInt8",
    "BnbNF4",
    "CompressedTensors",
    "ConfigError",
    "HeldoutQuality",
    "Int4",
    "Int8",
    "LoadedArtifact",
    "Preset",
    "QpackError",
    "QuantizeConfig",
    "QuantizeResult",
    "Scheme",
    "SensitivityConfig",
    "SmoothQuant",
    "__version__",
    "load_artifact",
    "load_model",
    "load_tokenizer",
    "parse_scheme",
    "quantize_model",
    "read_manifest",
    "resolve_model",
    "verify_artifact",
]

__getattr__ = lazy_exports("quantize", _EXPORTS)
