"""qpack's core: model sources, quantization schemes and kernels, the planner and the artifact format.

`calibrate`, `evals` and `serve` build on this package; it never imports them. The public names below are
imported on first use, so `import quantize` (and `qpack --help`) stays instant.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from quantize.exports import lazy_exports

try:
    __version__ = version("qpack")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0+local"

_EXPORTS = {
    "QpackError": "quantize.errors",
    "QuantizeConfig": "quantize.pipeline",
    "QuantizeResult": "quantize.pipeline",
    "quantize_model": "quantize.pipeline",
    "PRESETS": "quantize.pipeline",
    "LoadedArtifact": "quantize.artifact",
    "load_artifact": "quantize.artifact",
    "read_manifest": "quantize.artifact",
    "verify_artifact": "quantize.artifact",
    "parse_scheme": "quantize.schemes",
    "resolve_model": "quantize.models",
    "load_model": "quantize.models",
    "load_tokenizer": "quantize.models",
}
__all__ = ["__version__", *_EXPORTS]

__getattr__ = lazy_exports("quantize", _EXPORTS)
