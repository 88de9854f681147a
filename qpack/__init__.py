"""qpack, the application: the `qpack` command line, the CI build pipeline and the benchmarks.

The four libraries are siblings that import only `quantize` (the core): `calibrate`, `evals` and `serve`. This
package sits on top and is the only one that imports several of them: a CLI command parses its options, calls
one library function and renders the result (`qpack.cli`); `qpack build` chains calibrate -> quantize ->
evaluate (`qpack.build`); `qpack bench` measures decode and serving against baselines run beside them
(`qpack.bench`). `python -m qpack` is the same as the `qpack` console script.
"""

from __future__ import annotations

from quantize.common.version import __version__

__all__ = ["__version__"]
