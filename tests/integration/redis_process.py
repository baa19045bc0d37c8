"""A private `redis-server` on a free loopback port (never 6379), and `buildvault worker`s.

    with RedisProcess(tmp_path) as redis:  redis.url -> "redis://127.0.0.1:P/0"
    worker = WorkerProcess(server_address, redis.url, "soc=a", tmp_path / "w1").start()

A missing redis-server fails the test with the install hint (scripts/install-system-deps.sh).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from polling import wait_for


def free_port() -> int:
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port != 6379:
            return port


class RedisProcess:
    def __init__(self, directory: Path) -> None:
        exe = shutil.which("redis-server")
        assert exe, "redis-server is not installed: run scripts/install-system-deps.sh"
        self.exe = exe
        self.directory = directory
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> RedisProcess:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [self.exe, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", str(self.directory)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_for(self._answers, 20, f"redis-server on port {self.port}")
        return self

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)


class WorkerProcess:
    def __init__(
        self, server: str, queue: str, platform: str, work_dir: Path, name: str, lease: float = 3.0,
        extra_args: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        self.argv = [
            sys.executable, "-m", "buildvault.cli", "worker", "--server", f"grpc://{server}", "--queue", queue,
            "--platform", platform, "--work-dir", str(work_dir), "--name", name, "--lease", str(lease), *extra_args,
        ]  # fmt: skip
        self.name = name
        self.log = work_dir.parent / f"{name.replace('/', '_')}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: b"buildvault worker ready" in self.log.read_bytes() or self.process.poll() is not None,
                 60, f"worker {self.name} to start")  # fmt: skip
        assert self.process.poll() is None, self.log.read_text()
        return self

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def wait_workers(status, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    wait_for(lambda: len(status()["execution"]["workers"]) >= count, max(1.0, deadline - time.monotonic()),
             f"{count} workers registered")  # fmt: skip
