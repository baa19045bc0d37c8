"""Remote execution figures: Execute latency, throughput with local workers, Bazel cold builds.

    .venv/bin/python bench/exec_bench.py                  # everything (~3 min on 2 cores)
    .venv/bin/python bench/exec_bench.py --no-bazel       # the gRPC figures only

1. Latency of Execute for a trivial action (`/bin/true`, inputs present, a fresh salt each time so
   nothing is a cache hit or a dedup merge) through COMPLETED: p50 and p99 at 1 and 16 concurrent
   clients, embedded scheduler with 2 local workers.
2. Throughput: actions per second with 2 local workers on 1,000 tiny actions (64 in flight).
3. The e2e workspace (tests/e2e/bazel_workspace) cold build with --remote_executor (2 local
   workers) vs Bazel's own local sandboxed execution, wall time ratio; then `bazel clean` and the
   all-cache-hits rebuild. Bazel's server is started before the timed build.
4. Figures 1 and 2 again with `--queue redis://` (a private redis-server) and two `buildvault worker`s.

Every response is checked (status OK, exit code 0, not cached); one JSON line per figure.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

import grpc  # noqa: E402

from bench import servers  # noqa: E402
from buildvault.remote_apis import re_grpc, re_pb2  # noqa: E402


def _digest(data: bytes) -> re_pb2.Digest:
    return re_pb2.Digest(hash=hashlib.sha256(data).hexdigest(), size_bytes=len(data))


class Actions:
    """Trivial actions sharing one Command and an empty input root; each has its own salt."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.cas = re_grpc.ContentAddressableStorageStub(channel)
        self.execution = re_grpc.ExecutionStub(channel)
        command = re_pb2.Command(arguments=["/bin/true"])
        self.command = command.SerializeToString(deterministic=True)
        self.root = re_pb2.Directory().SerializeToString(deterministic=True)

    async def upload(self, count: int) -> list[re_pb2.Digest]:
        actions = []
        for _ in range(count):
            action = re_pb2.Action(
                command_digest=_digest(self.command), input_root_digest=_digest(self.root), salt=os.urandom(16)
            )
            actions.append(action.SerializeToString(deterministic=True))
        blobs = [self.command, *actions]
        for start in range(0, len(blobs), 500):
            part = blobs[start : start + 500]
            request = re_pb2.BatchUpdateBlobsRequest(
                requests=[re_pb2.BatchUpdateBlobsRequest.Request(digest=_digest(b), data=b) for b in part]
            )
            reply = await self.cas.BatchUpdateBlobs(request)
            assert all(r.status.code == 0 for r in reply.responses), reply
        return [_digest(a) for a in actions]

    async def run(self, action_digest: re_pb2.Digest) -> float:
        started = time.perf_counter()
        last = None
        async for operation in self.execution.Execute(re_pb2.ExecuteRequest(action_digest=action_digest)):
            last = operation
        elapsed = time.perf_counter() - started
        response = re_pb2.ExecuteResponse()
        assert last is not None and last.done and last.response.Unpack(response), last
        assert response.status.code == 0 and response.result.exit_code == 0 and not response.cached_result, response
        return elapsed


async def _many(actions: Actions, digests: list[re_pb2.Digest], concurrency: int) -> list[float]:
    queue = list(digests)
    latencies: list[float] = []

    async def client() -> None:
        while queue:
            latencies.append(await actions.run(queue.pop()))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


async def grpc_figures(address: str, latency_count: int, throughput_count: int, label: str) -> list[dict[str, Any]]:
    rows = []
    async with grpc.aio.insecure_channel(address) as channel:
        actions = Actions(channel)
        await _many(actions, await actions.upload(4), 2)  # start the worker processes
        for concurrency in (1, 16):
            digests = await actions.upload(latency_count if concurrency == 1 else latency_count * 4)
            latencies = await _many(actions, digests, concurrency)
            rows.append({
                "figure": f"execute_latency_{label}_c{concurrency}", "actions": len(latencies),
                "p50_ms": round(_percentile(latencies, 50) * 1000, 1),
                "p99_ms": round(_percentile(latencies, 99) * 1000, 1),
            })  # fmt: skip
        digests = await actions.upload(throughput_count)
        started = time.perf_counter()
        await _many(actions, digests, 64)
        elapsed = time.perf_counter() - started
        rows.append({"figure": f"throughput_{label}", "actions": throughput_count, "seconds": round(elapsed, 2),
                     "actions_per_second": round(throughput_count / elapsed, 1)})  # fmt: skip
    return rows


def bazel_figures(address: str, scratch: Path) -> list[dict[str, Any]]:
    from bazel_harness import ALL_HITS, CACHEABLE_SPAWNS, EXPECTED_OUTPUT, BazelWorkspace

    remote = BazelWorkspace(scratch / "remote")
    local = BazelWorkspace(scratch / "local")
    try:
        for ws in (remote, local):
            ws.info("execution_root")  # the Bazel server is up before anything is timed
        started = time.perf_counter()
        local_build = local.build(check=True)
        local_seconds = time.perf_counter() - started
        assert local_build.processes.executed == CACHEABLE_SPAWNS, local_build.processes.line
        flags = (f"--remote_executor=grpc://{address}", "--spawn_strategy=remote", "--noremote_local_fallback")
        started = time.perf_counter()
        cold = remote.build(*flags, check=True)
        remote_seconds = time.perf_counter() - started
        assert cold.processes["remote"] == CACHEABLE_SPAWNS, cold.processes.line
        assert remote.run_binary().stdout.strip() == EXPECTED_OUTPUT
        remote.clean()
        started = time.perf_counter()
        warm = remote.build(*flags, check=True)
        warm_seconds = time.perf_counter() - started
        assert warm.processes.as_dict() == ALL_HITS, warm.processes.line
    finally:
        remote.shutdown()
        local.shutdown()
    return [{
        "figure": "bazel_e2e_cold_build", "local_sandboxed_s": round(local_seconds, 2),
        "remote_2_workers_s": round(remote_seconds, 2), "ratio": round(remote_seconds / local_seconds, 2),
        "remote_cache_hit_rebuild_s": round(warm_seconds, 2),
    }]  # fmt: skip


def _wait_redis(port: int, timeout: float = 20.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not answer within {timeout:g}s")


def redis_figures(scratch: Path, latency_count: int, throughput_count: int) -> list[dict[str, Any]]:
    """The same gRPC figures with `--queue redis://` and two `buildvault worker` processes."""
    port = servers.free_port()
    redis = subprocess.Popen(
        ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    processes: list[subprocess.Popen[bytes]] = []
    server = None
    try:
        _wait_redis(port)
        server = servers.start_buildvault(scratch / "rdata", scratch / "rserver.log", ["--queue", url])
        for n in range(2):
            log = open(scratch / f"worker{n}.log", "wb")  # noqa: SIM115 - closed with the process
            processes.append(subprocess.Popen(
                [*servers.buildvault_command(), "worker", "--server", f"grpc://{server.address}", "--queue", url,
                 "--work-dir", str(scratch / f"w{n}"), "--name", f"bench-{n}"],
                stdout=log, stderr=subprocess.STDOUT,
            ))  # fmt: skip
        return asyncio.run(grpc_figures(server.address, latency_count, throughput_count, "redis_2_workers"))
    finally:
        for process in processes:
            process.terminate()
            process.wait(20)
        if server is not None:
            servers.stop(server)
        redis.terminate()
        redis.wait(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--latency-actions", type=int, default=100, help="actions at c1 (c16 runs 4x as many)")
    parser.add_argument("--throughput-actions", type=int, default=1000)
    parser.add_argument("--no-bazel", action="store_true")
    parser.add_argument("--no-redis", action="store_true", help="skip the Redis-queue figures")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="exec-bench-"))
    server = servers.start_buildvault(scratch / "data", scratch / "server.log", ["--local-workers", "2"])
    try:
        rows = asyncio.run(grpc_figures(server.address, args.latency_actions, args.throughput_actions, "embedded"))
        if not args.no_bazel:
            rows += bazel_figures(server.address, scratch)
    finally:
        servers.stop(server)
    if not args.no_redis:
        rows += redis_figures(scratch, args.latency_actions, args.throughput_actions)
    for row in rows:
        print(json.dumps(row))
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
