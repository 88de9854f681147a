"""The serving engine, in the parts vLLM v1 readers know: the core step (`core`), the output processor (`output`,
with the incremental `detokenizer`), the builder of its parts from nested configs (`builder`, `config`), what it
counts (`accounting`), and the interface a controller drives (`protocol`).

The public names below are imported on first use, so importing a torch-free module of this package (`config`,
`protocol`) never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quantize.common.lazy import lazy_exports

if TYPE_CHECKING:
    from serve.engine.config import EngineConfig
    from serve.engine.core import Engine, QueueFull
    from serve.engine.output import RequestOutput

_EXPORTS = {
    "Engine": "serve.engine.core",
    "QueueFull": "serve.engine.core",
    "EngineConfig": "serve.engine.config",
    "RequestOutput": "serve.engine.output",
}
__all__ = ["Engine", "EngineConfig", "QueueFull", "RequestOutput"]

__getattr__ = lazy_exports("serve.engine", _EXPORTS)
