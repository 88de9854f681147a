"""The engine's thread: step while there is work, sleep on the engine's condition when there is none, give way to
a more accurate variant while it asks (`Engine.defer_to`), and survive a failed step. `warmup` runs before traffic.

Apart from the step itself (`serve.engine.core`) so that the step stays one iteration of continuous batching and
the threading around it is read in one place; the server (`serve.server`) and a fleet worker each start one
thread per engine on `run`.
"""

from __future__ import annotations

import logging
import threading
import time

from quantize.runtime.kernels import ops as kernels
from serve.core.request import SamplingParams
from serve.engine.core import Engine

_log = logging.getLogger("qpack.serve")


def run(engine: Engine, stop: threading.Event, idle_wait: float = 0.05) -> None:
    """Step `engine` until `stop` is set."""
    deferred: float | None = None  # since when this loop has given way to `defer_to`
    while not stop.is_set():
        if engine.paused.is_set():
            time.sleep(idle_wait)
            continue
        if engine.defer_to is not None and engine.defer_to():
            deferred = deferred if deferred is not None else time.monotonic()
            if time.monotonic() - deferred < 1.0:  # never starved: at most a second at a time
                time.sleep(0.002)
                continue
        deferred = None
        try:
            progressed = engine.step()
        except Exception as error:  # the loop must outlive one bad step: fail its requests, go on
            _log.exception("engine step failed")
            engine.fail_all(f"{type(error).__name__}: {error}")
            progressed = True
        if not progressed:
            with engine.wakeup:
                if not engine.scheduler.has_work() and not stop.is_set():
                    engine.wakeup.wait(timeout=idle_wait)


def warmup(engine: Engine) -> None:
    """Run one short request alone, then two together, then more than the fused native step takes, before
    traffic arrives: a compiled decode step builds its graphs (batch 1 and batch > 1) here instead of stalling the
    first users."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    crowd = [f"warmup-crowd-{i}" for i in range(kernels.max_rows() + 1)]
    for group in (["warmup-0"], ["warmup-1", "warmup-2"], crowd):
        for request_id in group:
            engine.add(request_id, [1, 2, 3, 4, 5], params, lambda _output: None)
        while engine.has_work():
            engine.step()
