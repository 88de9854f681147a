"""A throwaway `redis-server` on a free loopback port in its own directory, for tests, benchmarks and a
one-machine fleet: the real server (a mock would hide exactly the failures a fleet must survive), started,
restarted (AOF keeps the streams across a restart when `appendonly`) and stopped by its owner."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from types import TracebackType

from quantize.common.errors import QpackError


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalRedis:
    def __init__(self, directory: Path, port: int | None = None, appendonly: bool = False) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise QpackError(
                "redis-server is not installed; install it with `apt-get install redis-server` "
                "(`make setup` does this as root)"
            )
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or _free_port()
        self.appendonly = appendonly
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> LocalRedis:
        command = [
            str(self.binary),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "everysec",
            "--logfile",
            str(self.directory / "redis.log"),
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if client.ping():
                    client.close()
                    return
            except redis.RedisError:
                pass
            if self.process is not None and self.process.poll() is not None:
                log = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
                raise QpackError(f"redis-server on port {self.port} exited at start: {log}")
            if time.monotonic() > deadline:
                raise QpackError(f"redis-server on port {self.port} did not answer within {timeout:.0f} s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def restart(self, down_for: float = 0.0) -> None:
        self.stop()
        time.sleep(down_for)
        self.start()

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
