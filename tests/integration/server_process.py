"""Run a real `buildvault serve` as a subprocess on loopback, for integration and e2e tests.

    server = ServerProcess(data_dir).start()     # waits for the "buildvault ready:" line
    server.grpc_address                          # "127.0.0.1:43121" (port 0 was asked for)
    server.restart()                             # same data dir, same ports
    server.stop()                                # SIGTERM, wait; returns the exit code
    server.status()                              # GET /status (JSON)

Readiness comes from the server's start-up banner, never from sleeping. The server's output
goes to `data_dir.parent / "<name>.log"` (and `server.output()`), which a failing test prints.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

from polling import wait_for

READY_PREFIX = "buildvault ready:"
_ADDRESS = re.compile(r"\b(grpc|http)=(\S+)")
START_TIMEOUT = 60.0


class ServerError(RuntimeError):
    pass


class ServerProcess:
    def __init__(
        self,
        data_dir: Path,
        *,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        log_level: str = "info",
        grpc_address: str = "127.0.0.1:0",
        http_address: str = "127.0.0.1:0",
        name: str = "buildvault",
    ) -> None:
        self.data_dir = Path(data_dir)
        self.extra_args = list(extra_args or [])
        self.extra_env = dict(env or {})
        self.log_level = log_level
        self._requested = {"grpc": grpc_address, "http": http_address}
        self.log_path = self.data_dir.parent / f"{name}.log"
        self.process: subprocess.Popen[str] | None = None
        self.grpc_address: str | None = None
        self.http_address: str | None = None
        self._lines: list[str] = []
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None
        self.starts = 0

    # -- lifecycle ------------------------------------------------------------------------

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "buildvault.cli",
            "serve",
            "--dir",
            str(self.data_dir),
            "--grpc-address",
            self._requested["grpc"],
            "--http-address",
            self._requested["http"],
            "--log-level",
            self.log_level,
            *self.extra_args,
        ]

    def start(self, timeout: float = START_TIMEOUT) -> ServerProcess:
        if self.process is not None and self.process.poll() is None:
            raise ServerError("already running")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("BUILDVAULT_")}
        env.update(self.extra_env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._ready = threading.Event()
        self.grpc_address = self.http_address = None
        self.process = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.starts += 1
        # The reader gets this start's event: the reader of a killed process, still draining
        # its pipe, must not mark the next start ready.
        self._reader = threading.Thread(target=self._read_output, args=(self.process, self._ready), daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout) or self.grpc_address is None and self.http_address is None:
            code = self.process.poll()
            self.kill()
            raise ServerError(
                f"buildvault did not become ready within {timeout}s (exit code {code}); output:\n{self.output()}"
            )
        return self

    def _read_output(self, process: subprocess.Popen[str], ready: threading.Event) -> None:
        assert process.stdout is not None
        with open(self.log_path, "a", encoding="utf-8") as log:
            log.write(f"--- start #{self.starts}: {' '.join(self.command())}\n")
            for line in process.stdout:
                log.write(line)
                log.flush()
                self._lines.append(line)
                if line.startswith(READY_PREFIX) and not ready.is_set():
                    for name, value in _ADDRESS.findall(line):
                        address = None if value == "off" else value
                        if name == "grpc":
                            self.grpc_address = address
                        else:
                            self.http_address = address
                    ready.set()
        ready.set()  # exited: unblock start()

    def stop(self, timeout: float = 60.0, sig: int = signal.SIGTERM) -> int | None:
        """Signal the server and wait for it to exit; returns its exit code (None if not running)."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise ServerError(f"buildvault did not stop within {timeout}s; output:\n{self.output()}") from None
        if self._reader is not None:
            self._reader.join(5)
        return process.returncode

    def kill(self) -> None:
        process = self.process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(10)
        if self._reader is not None:
            self._reader.join(5)  # the output is complete

    def restart(self, same_ports: bool = True, timeout: float = START_TIMEOUT) -> ServerProcess:
        """Stop cleanly and start again on the same data dir (and, by default, the same ports)."""
        if same_ports:
            if self.grpc_address:
                self._requested["grpc"] = self.grpc_address
            if self.http_address:
                self._requested["http"] = self.http_address
        self.stop()
        return self.start(timeout)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def output(self) -> str:
        return "".join(self._lines)

    def status(self) -> dict:
        """The HTTP listener's /status document."""
        with urllib.request.urlopen(f"http://{self.http_address}/status", timeout=10) as response:
            return json.load(response)

    def wait_chunked(self, timeout: float = 120.0) -> None:
        """Wait until no large blob stored whole waits to be chunked (the chunk store converts
        them after the write: docs/architecture.md, "The chunk store")."""
        wait_for(lambda: self.status()["chunking"]["backlog_blobs"] == 0, timeout, "large blobs kept as chunks")

    def __enter__(self) -> ServerProcess:
        return self.start() if not self.running else self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self.kill()
