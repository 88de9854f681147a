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
    from quantize.common.errors import QpackError
    from quantize.config import QuantizeConfig, QuantizeResult
    from quantize.formats.schemes import parse_scheme
    from quantize.io.artifact import LoadedArtifact, load_artifact, read_manifest, verify_artifact
    from quantize.model.sources import load_model, load_tokenizer, resolve_model
    from quantize.pipeline import quantize_model
    from quantize.planning.presets import PRESETS

_EXPORTS = {
    "QpackError": "quantize.common.errors",
    "QuantizeConfig": "quantize.config",
    "QuantizeResult": "quantize.config",
    "quantize_model": "quantize.pipeline",
    "PRESETS": "quantize.planning.presets",
    "LoadedArtifact": "quantize.io.artifact",
    "load_artifact": "quantize.io.artifact",
    "read_manifest": "quantize.io.artifact",
    "verify_artifact": "quantize.io.artifact",
    "parse_scheme": "quantize.formats.schemes",
    "resolve_model": "quantize.model.sources",
    "load_model": "quantize.model.sources",
    "load_tokenizer": "quantize.model.sources",
}
__all__ = [
    "PRESETS",
    "LoadedArtifact",
    "QpackError",
    "QuantizeConfig",
    "QuantizeResult",
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
