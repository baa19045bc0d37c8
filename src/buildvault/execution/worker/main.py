"""A worker process fed over stdin/stdout (execution.wire): the server's local workers.

    python -m buildvault.execution.worker.main --server 127.0.0.1:9092 --name host/local-0 \\
        --work-dir DIR --sandbox auto [--concurrency 1]

Inputs are fetched from and outputs uploaded to the server's gRPC CAS, the same path a remote
worker uses. Each job frame gets one result frame. Closing stdin ends the worker once its running
jobs are answered; a cancel frame stops that job's process group.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from buildvault.client.remote import Remote
from buildvault.execution import wire
from buildvault.execution.worker import process, sandbox
from buildvault.execution.worker.runner import Runner

log = logging.getLogger("buildvault.worker")


class CasClients:
    """One CAS client per instance name, all to the same server."""

    def __init__(self, server: str) -> None:
        self.server = server
        self._clients: dict[str, Remote] = {}
        self._lock = threading.Lock()

    def get(self, instance: str) -> Remote:
        with self._lock:
            client = self._clients.get(instance)
            if client is None:
                client = Remote(f"grpc://{self.server}", instance, timeout=120.0, upload_timeout=300.0)
                self._clients[instance] = client
            return client

    def close(self) -> None:
        for client in self._clients.values():
            client.close()


class StdioWorker:
    def __init__(self, server: str, name: str, work_dir: Path, sandbox_kind: str, concurrency: int) -> None:
        self.cas = CasClients(server)
        self.name = name
        self.work_dir = work_dir
        self.sandbox_kind = sandbox_kind
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="job")
        self.cancels: dict[str, process.Cancel] = {}
        self.write_lock = threading.Lock()

    def serve(self, frames_in: BinaryIO, frames_out: BinaryIO) -> None:
        for line in frames_in:
            frame = wire.decode(line)
            if isinstance(frame, wire.JobFrame):
                cancel = self.cancels.setdefault(frame.id, process.Cancel())
                self.pool.submit(self._run, frame, cancel, frames_out)
            elif isinstance(frame, wire.CancelFrame):
                self.cancels.setdefault(frame.id, process.Cancel()).set()
        # End of input: the server is gone or closing us; nothing may keep running.
        for cancel in list(self.cancels.values()):
            cancel.set()
        self.pool.shutdown(wait=True)
        self.cas.close()

    def _run(self, job: wire.JobFrame, cancel: process.Cancel, frames_out: BinaryIO) -> None:
        runner = Runner(self.cas.get(job.instance), self.work_dir, sandbox_kind=self.sandbox_kind, name=self.name)
        try:
            result, status, logs = runner.run(job, cancel)
        finally:
            self.cancels.pop(job.id, None)
        frame = wire.ResultFrame(job.id, result, status, logs).encode()
        with self.write_lock, contextlib.suppress(BrokenPipeError):
            frames_out.write(frame)
            frames_out.flush()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="buildvault-local-worker")
    parser.add_argument("--server", required=True, help="the server's gRPC address (HOST:PORT)")
    parser.add_argument("--name", required=True)
    parser.add_argument("--work-dir", required=True, type=Path)
    parser.add_argument("--sandbox", default="auto", choices=("auto", "bwrap", "none"))
    parser.add_argument("--concurrency", default=1, type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"worker {args.name}: %(message)s", stream=sys.stderr)
    try:
        kind = sandbox.choose(args.sandbox)
    except sandbox.SandboxError as e:
        print(f"worker {args.name}: --sandbox bwrap: {e}", file=sys.stderr)
        return 2
    args.work_dir.mkdir(parents=True, exist_ok=True)
    # The first line tells the server which sandbox this worker really uses.
    sys.stdout.buffer.write(f'{{"type":"hello","sandbox":"{kind}"}}\n'.encode())
    sys.stdout.buffer.flush()
    worker = StdioWorker(args.server, args.name, args.work_dir, kind, args.concurrency)
    worker.serve(sys.stdin.buffer, sys.stdout.buffer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
