"""Engine configs for tests, in the words the tests use: `qpack serve`'s option names, mapped onto the engine's
nested configs by the same function the server uses (`serve.loading.engine_config`), so a test never repeats a
setting's name or default."""

from __future__ import annotations

import dataclasses
from typing import Any

from serve.engine.config import EngineConfig
from serve.loading import engine_config
from serve.options import ServeOptions

_SIZES = ("kv_memory", "kv_host_memory", "kv_disk_size", "draft_kv_memory")
_ENGINE_ONLY = ("model_hash", "device")  # settings of an engine that no command-line option sets


def config_from_options(**settings: Any) -> EngineConfig:
    """An engine config from option names (`block_size=4, kv_memory="16MB", max_num_seqs=2, ...`); sizes may be
    given as ints (bytes)."""
    direct = {name: settings.pop(name) for name in _ENGINE_ONLY if name in settings}
    for name in _SIZES:
        if isinstance(settings.get(name), int):
            settings[name] = str(settings[name])
    return dataclasses.replace(engine_config(ServeOptions(target=None, **settings)), **direct)
