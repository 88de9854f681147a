"""Running an HTTP app with uvicorn: in the foreground until a signal drains it (`serve_app`), or on a thread
(`BackgroundServer`: tests, benchmarks, a fleet worker's /health and /metrics).

Binds 127.0.0.1 unless told otherwise. SIGTERM (or Ctrl-C) starts a drain: the app's `state.start_draining()`
turns health 503 and refuses new requests, running requests finish and stream to the end, then the process
exits 0. The fleet runs its gateway and workers through this module, never through the launcher.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from typing import Any

from serve.engine.core import Engine
from serve.openai.routes import ServerInfo
from serve.server import create_app
from serve.variants import Variants


class _DrainingServer:
    """uvicorn.Server that flips the app into draining mode the moment a shutdown signal arrives."""

    def __init__(self, app: Any, host: str, port: int, log_level: str) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:
                # Drain instead of re-raising the signal after shutdown: a completed drain exits 0.
                app.state.start_draining()
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True
                else:
                    self.should_exit = True

        self.server = Server(
            uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=600)
        )

    def run(self) -> None:
        self.server.run()


def serve_app(app: Any, host: str, port: int, log_level: str = "warning") -> None:
    """Run an app (needs `app.state.start_draining`) until a signal drains it."""
    _DrainingServer(app, host, port, log_level).run()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def bound_socket(host: str, port: int) -> socket.socket | None:
    """A TCP socket bound to `port` on `host` (0: any free port), held until the server listens on it; None when
    something holds the port (a listener, or a connection's local end)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        return None
    return sock


class BackgroundServer:
    """A server on a thread: `with BackgroundServer(engine, info) as url: ...`, or any app with
    `state.start_draining`: `BackgroundServer(app)`. It binds its port when made and keeps it (no window for
    another process to take it before it listens); a taken `port` is an `OSError`, or with `any_port` a free
    port instead (`self.port` says which)."""

    def __init__(
        self,
        app: Any,
        info: ServerInfo | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        any_port: bool = False,
    ) -> None:
        import uvicorn

        self.app = create_app(app, info) if isinstance(app, Engine | Variants) and info is not None else app
        sock = bound_socket(host, port or 0) or (bound_socket(host, 0) if any_port else None)
        if sock is None:
            raise OSError(f"port {port} on {host} is in use; free it or choose another port")
        self.socket = sock
        self.port = int(sock.getsockname()[1])
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.app.state.start_draining()
        self.server.should_exit = True
        self.thread.join(timeout=60)
        self.socket.close()
