#!/usr/bin/env python3
"""REAPI v2 benchmark driver for any cache endpoint (buildvault, BuildGrid, bazel-remote, ...).

    python -m bench.harness --target 127.0.0.1:9092 [--server-pid PID] [--quick]
    python bench/harness.py --target 127.0.0.1:9092 --scenarios 'fmb_*,bs_*_512MiB*'

One grpc.aio client (our own generated protos), one channel (--channels N: N connections).
Every scenario prints one JSON line when it ends; a markdown table follows at the end. Every
read-back is verified byte for byte, every write's reply is checked: any RPC error or mismatch
marks the scenario failed and the process exits 1 (2 when the endpoint cannot be reached at
all). Blob contents are fresh
random bytes on every run, so no server can answer from an earlier run's data.

With --server-pid, a thread samples /proc/PID/status (VmRSS less RssFile: memory of its own, not
mapped file pages such as an LMDB data file; and VmHWM) of that process and all its descendants
every 20 ms: each scenario reports the peak it saw, and two extra rows report
the run's peak and the peak while streaming the largest ByteStream blobs. Each timed section
also records the CPU of that process tree and of the harness (detail: server_cpu_us_per_op and
server_per_client_cpu, the server's CPU over the harness's own: steadier than wall time when the
machine's speed swings, since the harness does the same work against every server).

--quick shrinks every size and count so the whole run takes seconds: the protocol-regression
mode used by tests/bench/test_quick_bench.py.

--client-warm (bench/compare.py passes it by default) makes the client's receive cost what it
costs in steady state, the same for every server: glibc keeps the memory the client frees
(`keep_memory`: no trimming, buffers up to 32 MiB from the heap) and each ByteStream blob is read
once untimed, and verified, before its timed read. Without it a 512 MiB read is the process's
first touch of 512 MiB: the page faults cost the client more CPU than either server spends
serving the read, and the client, not the server, bounds the figure (bench/notes/
2026-12-06-reads-vs-buildgrid.md).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import fnmatch
import hashlib
import json
import os
import random
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

try:
    from buildvault.remote_apis import bs_grpc, bs_pb2, re_grpc, re_pb2
except ImportError:  # a checkout whose package is not installed in this interpreter
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from buildvault.remote_apis import bs_grpc, bs_pb2, re_grpc, re_pb2
import blake3
import grpc

from buildvault.history.metadata import metadata_header

KiB = 1024
MiB = 1024 * KiB
HARNESS_VERSION = 1


# --------------------------------------------------------------------------------------------
# Sizes and counts
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """Every size and count the scenarios use; FULL for measurements, QUICK for regressions."""

    capabilities_calls: int
    fmb_digests: int
    fmb_calls: dict[int, int]  # concurrency -> total calls
    batch_blob_size: int
    batch_blobs_per_call: int
    batch_calls: dict[int, int]
    bs_sizes: tuple[int, ...]
    bs_chunks: tuple[int, ...]
    bs_small_chunk: tuple[int, int]  # (blob size, chunk): Bazel 4's 16 KiB upload chunks, one size
    bs_count: dict[int, int]  # blob size -> blobs per scenario
    ac_ops: dict[int, int]
    ac_outputs: int
    mixed_clients: int
    mixed_actions: int  # per client
    mixed_large: int  # size of every 4th action's ByteStream output


FULL = Plan(
    capabilities_calls=300,
    fmb_digests=1000,
    fmb_calls={1: 100, 16: 320},
    batch_blob_size=4 * KiB,
    batch_blobs_per_call=100,
    batch_calls={1: 60, 8: 160},
    bs_sizes=(1 * MiB, 64 * MiB, 512 * MiB),
    bs_chunks=(64 * KiB, 1 * MiB),
    bs_small_chunk=(64 * MiB, 16 * KiB),
    bs_count={1 * MiB: 32, 64 * MiB: 2, 512 * MiB: 1},
    ac_ops={1: 300, 16: 960},
    ac_outputs=3,
    mixed_clients=8,
    mixed_actions=30,
    mixed_large=1 * MiB,
)

QUICK = Plan(
    capabilities_calls=5,
    fmb_digests=20,
    fmb_calls={1: 3, 16: 16},
    batch_blob_size=4 * KiB,
    batch_blobs_per_call=5,
    batch_calls={1: 3, 8: 8},
    bs_sizes=(10 * KiB, 200 * KiB, 2 * MiB + 1),
    bs_chunks=(64 * KiB, 1 * MiB),
    bs_small_chunk=(200 * KiB, 16 * KiB),
    bs_count={10 * KiB: 2, 200 * KiB: 1, 2 * MiB + 1: 1},
    ac_ops={1: 5, 16: 16},
    ac_outputs=2,
    mixed_clients=8,
    mixed_actions=2,
    mixed_large=100 * KiB,
)


def size_label(n: int) -> str:
    for unit, name in ((MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit}{name}"
    return f"{n}B"


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


class Mismatch(Exception):
    """The server answered, but not what the protocol (or the data we stored) says."""


@dataclass
class Result:
    scenario: str
    unit: str
    value: float | None = None
    higher_is_better: bool = True
    ops: int = 0
    bytes: int = 0
    seconds: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    rss_peak_mib: float | None = None
    ok: bool = True
    error: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        data = asdict(self)
        for key in ("value", "seconds", "p50_ms", "p99_ms", "rss_peak_mib"):
            if isinstance(data[key], float):
                data[key] = round(data[key], 4)
        return json.dumps(data, sort_keys=False)


def percentile(samples: list[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index] * 1000.0


class Timing:
    """Wall time of a measured section plus per-operation latencies."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.seconds = 0.0

    async def op(self, awaitable: Awaitable[Any]) -> Any:
        start = time.perf_counter()
        value = await awaitable
        self.latencies.append(time.perf_counter() - start)
        return value


class CpuMeter:
    """CPU seconds of the server's process tree (--server-pid) and of this harness over each timed
    section. The server's CPU over the client's is steadier than wall time on a shared machine whose
    speed swings: the client does the same work against every server, so it pays the same machine."""

    def __init__(self) -> None:
        self.server_pid: int | None = None
        self._start: tuple[float, float] | None = None
        self._window: tuple[float, float] | None = None

    def _now(self) -> tuple[float, float]:
        assert self.server_pid is not None
        return sum(cpu_seconds(pid) for pid in _process_tree(self.server_pid)), time.process_time()

    def start(self, add: bool = False) -> None:
        """A timed section begins: it replaces the last one, or with `add` adds to it (reads timed
        one by one)."""
        if not add:
            self._window = None
        self._start = self._now() if self.server_pid else None

    def stop(self) -> None:
        if self._start is not None:
            server, client = self._now()
            done = self._window or (0.0, 0.0)
            self._window = (done[0] + server - self._start[0], done[1] + client - self._start[1])
            self._start = None

    def take(self) -> tuple[float, float] | None:
        """(server CPU s, harness CPU s) of the last timed section, once."""
        window, self._window = self._window, None
        return window


CPU = CpuMeter()


async def run_workers(concurrency: int, total: int, operation: Callable[[int], Awaitable[None]]) -> float:
    """Run operation(0..total-1) on `concurrency` workers; return wall seconds; first error wins."""
    counter = iter(range(total))

    async def worker() -> None:
        for index in counter:
            await operation(index)

    CPU.start()
    start = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for _ in range(min(concurrency, total)):
            group.create_task(worker())
    seconds = time.perf_counter() - start
    CPU.stop()
    return seconds


def first_error(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def describe(exc: BaseException) -> str:
    exc = first_error(exc)
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"RPC {exc.code().name}: {(exc.details() or '')[:300]}"
    if isinstance(exc, Mismatch):
        return f"mismatch: {exc}"
    return f"{type(exc).__name__}: {exc}"[:400]


# --------------------------------------------------------------------------------------------
# Server memory sampling
# --------------------------------------------------------------------------------------------


def memory_kib(pid: int) -> tuple[int, int, int]:
    """(VmRSS, RssFile, VmHWM) of a process in KiB; zeros once it is gone. File pages (mapped
    libraries, an LMDB data file) are page cache the kernel drops under pressure, not the
    process's own memory: the benchmarks report VmRSS less RssFile."""
    fields = {"VmRSS:": 0, "RssFile:": 0, "VmHWM:": 0}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as handle:
            for line in handle:
                words = line.split()  # "VmRSS:", "1234", "kB"
                if words and words[0] in fields:
                    fields[words[0]] = int(words[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return fields["VmRSS:"], fields["RssFile:"], fields["VmHWM:"]


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>


def keep_memory() -> None:
    """glibc: serve allocations up to 32 MiB (its largest mmap threshold) from the heap and never
    give freed heap memory back, so buffers freed after one read are reused, already faulted in,
    by the next. Fails (SystemExit) where that cannot be set: the figures would mean another thing."""
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    if mallopt is None or not (mallopt(M_MMAP_THRESHOLD, 32 * MiB) and mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1)):
        raise SystemExit("harness: --client-warm needs glibc's mallopt")


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of a process so far, seconds (0.0 when unknown or gone): wall time
    lies on a busy machine."""
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _process_tree(pid: int) -> list[int]:
    pids, pending = [], [pid]
    while pending:
        current = pending.pop()
        pids.append(current)
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children", encoding="ascii") as handle:
                    pending.extend(int(child) for child in handle.read().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return pids


class RssSampler(threading.Thread):
    """Samples the summed resident memory (less file pages) of a process tree; windows give
    per-scenario peaks."""

    def __init__(self, pid: int, period: float = 0.02) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.pid = pid
        self.period = period
        self.samples: list[tuple[float, int]] = []  # (monotonic time, KiB)
        self.hwm_kib = 0
        self._stop_event = threading.Event()
        self._lock = threading.Lock()  # keeps samples in time order across the two threads

    def sample(self) -> None:
        total_rss = total_hwm = 0
        for pid in _process_tree(self.pid):
            rss, file_pages, hwm = memory_kib(pid)
            total_rss += rss - file_pages
            total_hwm += hwm
        with self._lock:
            self.samples.append((time.monotonic(), total_rss))
        self.hwm_kib = max(self.hwm_kib, total_hwm)

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.period)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)
        self.sample()

    def peak_mib(self, start: float | None = None, end: float | None = None) -> float | None:
        values = [kib for at, kib in self.samples if (start is None or at >= start) and (end is None or at <= end)]
        return max(values) / 1024.0 if values else None


# --------------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------------


def random_blob(size: int) -> bytes:
    """Fresh random bytes; BLAKE3's XOF keeps large blobs cheap to make (~1 GB/s)."""
    if size <= 64 * KiB:
        return os.urandom(size)
    return blake3.blake3(os.urandom(32)).digest(length=size)


def digest_of(data: bytes) -> re_pb2.Digest:
    return re_pb2.Digest(hash=hashlib.sha256(data).hexdigest(), size_bytes=len(data))


def key(digest: re_pb2.Digest) -> tuple[str, int]:
    return digest.hash, digest.size_bytes


class _Authorization(
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor,
):
    """Adds headers to every call: `authorization: VALUE` (--authorization: measure a server with
    access control) and Bazel's `requestmetadata-bin` (--request-metadata: measure the history)."""

    def __init__(self, entries: list[tuple[str, str | bytes]]) -> None:
        self._entries = entries

    def _details(self, details: Any) -> Any:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._entries)
        return details._replace(metadata=metadata)

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class Client:
    """`channels` > 1: that many connections (a local subchannel pool each, or grpc would share one),
    every call on the next one in turn, as a client with several connections to a server whose
    processes share the port (`buildvault serve --processes N`) spreads its load."""

    def __init__(
        self, target: str, instance: str, rpc_timeout: float, authorization: str = "", channels: int = 1,
        request_metadata: bool = False,
    ) -> None:
        self.target = target
        self.instance = instance
        self.warm = False  # bs_read: one untimed read of each blob first (--client-warm)
        self.timeout = rpc_timeout
        self.prefix = f"{instance}/" if instance else ""
        options = [
            ("grpc.max_receive_message_length", -1),
            ("grpc.max_send_message_length", -1),
            ("grpc.enable_retries", 0),
        ]
        if channels > 1:
            options.append(("grpc.use_local_subchannel_pool", 1))
        headers: list[tuple[str, str | bytes]] = [("authorization", authorization)] if authorization else []
        if request_metadata:  # what Bazel sends on every call (one invocation, one action)
            headers.append(metadata_header(tool="bazel", tool_version="4.2.3", invocation=str(uuid.uuid4()),
                                           action_id="0" * 64, mnemonic="CppCompile", target="//bench:lib",
                                           configuration="k8-fastbuild"))  # fmt: skip
        interceptors = [_Authorization(headers)] if headers else None
        self.channels = [
            grpc.aio.insecure_channel(target, options=options, interceptors=interceptors) for _ in range(channels)
        ]
        self.channel = self.channels[0]
        self._stubs = [
            (
                re_grpc.ContentAddressableStorageStub(c),
                re_grpc.ActionCacheStub(c),
                bs_grpc.ByteStreamStub(c),
                # bytes in, bytes out: FindMissingBlobs with a pre-serialized request and the reply
                # compared as bytes first, so the client's own CPU stays small next to the server's
                c.unary_unary("/build.bazel.remote.execution.v2.ContentAddressableStorage/FindMissingBlobs"),
            )
            for c in self.channels
        ]
        self._turn = 0
        self.capabilities = re_grpc.CapabilitiesStub(self.channel)

    def _next(self) -> tuple[Any, Any, Any, Any]:
        stubs = self._stubs[self._turn % len(self._stubs)]
        self._turn += 1
        return stubs

    @property
    def cas(self) -> Any:
        return self._next()[0]

    @property
    def ac(self) -> Any:
        return self._next()[1]

    @property
    def bytestream(self) -> Any:
        return self._next()[2]

    @property
    def _find_missing_raw(self) -> Any:
        return self._next()[3]

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.channels))

    async def get_capabilities(self) -> re_pb2.ServerCapabilities:
        reply = await self.capabilities.GetCapabilities(
            re_pb2.GetCapabilitiesRequest(instance_name=self.instance), timeout=self.timeout
        )
        if re_pb2.DigestFunction.SHA256 not in reply.cache_capabilities.digest_functions:
            raise Mismatch(f"SHA256 not among digest_functions {list(reply.cache_capabilities.digest_functions)}")
        return reply

    async def find_missing(self, request: re_pb2.FindMissingBlobsRequest) -> set[tuple[str, int]]:
        reply = await self.cas.FindMissingBlobs(request, timeout=self.timeout)
        return {key(d) for d in reply.missing_blob_digests}

    async def find_missing_raw(self, request: bytes, expected_reply: bytes) -> set[tuple[str, int]] | None:
        """None when the reply is byte-identical to `expected_reply`; else the missing set."""
        reply = await self._find_missing_raw(request, timeout=self.timeout)
        if reply == expected_reply:
            return None
        return {key(d) for d in re_pb2.FindMissingBlobsResponse.FromString(reply).missing_blob_digests}

    def find_missing_request(self, digests: list[re_pb2.Digest]) -> re_pb2.FindMissingBlobsRequest:
        return re_pb2.FindMissingBlobsRequest(instance_name=self.instance, blob_digests=digests)

    def batch_update_request(self, blobs: list[bytes]) -> re_pb2.BatchUpdateBlobsRequest:
        return re_pb2.BatchUpdateBlobsRequest(
            instance_name=self.instance,
            requests=[re_pb2.BatchUpdateBlobsRequest.Request(digest=digest_of(b), data=b) for b in blobs],
        )

    async def batch_update(self, request: re_pb2.BatchUpdateBlobsRequest) -> None:
        reply = await self.cas.BatchUpdateBlobs(request, timeout=self.timeout)
        wanted = {key(r.digest) for r in request.requests}
        seen = set()
        for response in reply.responses:
            if response.status.code != 0:
                raise Mismatch(f"BatchUpdateBlobs {response.digest.hash[:12]}: status {response.status.code} "
                               f"{response.status.message[:200]}")
            seen.add(key(response.digest))
        if seen != wanted:
            raise Mismatch(f"BatchUpdateBlobs answered for {len(seen)} digests, sent {len(wanted)}")

    async def upload_small(self, blobs: list[bytes], per_call: int = 100) -> None:
        for start in range(0, len(blobs), per_call):
            await self.batch_update(self.batch_update_request(blobs[start : start + per_call]))

    async def batch_read(self, request: re_pb2.BatchReadBlobsRequest, expected: dict[tuple[str, int], bytes]) -> None:
        reply = await self.cas.BatchReadBlobs(request, timeout=self.timeout)
        seen = set()
        for response in reply.responses:
            k = key(response.digest)
            if response.status.code != 0:
                raise Mismatch(f"BatchReadBlobs {response.digest.hash[:12]}: status {response.status.code} "
                               f"{response.status.message[:200]}")
            if response.data != expected.get(k):
                raise Mismatch(f"BatchReadBlobs returned wrong bytes for {response.digest.hash[:12]}")
            seen.add(k)
        if seen != {key(d) for d in request.digests}:
            raise Mismatch(f"BatchReadBlobs answered for {len(seen)} digests, asked {len(request.digests)}")

    async def bs_write(self, data: bytes, chunk: int, digest: re_pb2.Digest | None = None) -> None:
        digest = digest or digest_of(data)
        name = f"{self.prefix}uploads/{uuid.uuid4()}/blobs/{digest.hash}/{digest.size_bytes}"
        size = len(data)

        async def requests():  # type: ignore[no-untyped-def]
            offset = 0
            while True:
                piece = data[offset : offset + chunk]
                end = offset + len(piece)
                request = bs_pb2.WriteRequest(write_offset=offset, data=piece, finish_write=end >= size)
                if offset == 0:
                    request.resource_name = name
                yield request
                offset = end
                if offset >= size:
                    return

        reply = await self.bytestream.Write(requests(), timeout=self.timeout)
        if reply.committed_size != size:
            raise Mismatch(f"ByteStream.Write of {size} bytes: committed_size {reply.committed_size}")

    async def bs_read(self, digest: re_pb2.Digest) -> tuple[list[bytes], int]:
        """Return the chunks as received (verify later, off the clock) and the largest chunk."""
        name = f"{self.prefix}blobs/{digest.hash}/{digest.size_bytes}"
        chunks: list[bytes] = []
        largest = 0
        async for response in self.bytestream.Read(bs_pb2.ReadRequest(resource_name=name), timeout=self.timeout):
            data = response.data  # once: each access of a bytes field copies it out of the message
            chunks.append(data)
            largest = max(largest, len(data))
        return chunks, largest

    async def update_action(self, action: re_pb2.Digest, result: re_pb2.ActionResult) -> None:
        await self.ac.UpdateActionResult(
            re_pb2.UpdateActionResultRequest(instance_name=self.instance, action_digest=action, action_result=result),
            timeout=self.timeout,
        )

    async def get_action(self, action: re_pb2.Digest) -> re_pb2.ActionResult | None:
        try:
            return await self.ac.GetActionResult(
                re_pb2.GetActionResultRequest(instance_name=self.instance, action_digest=action),
                timeout=self.timeout,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise


def verify_chunks(chunks: list[bytes], data: bytes, what: str) -> None:
    joined = b"".join(chunks)
    if len(joined) != len(data):
        raise Mismatch(f"{what}: read {len(joined)} bytes, stored {len(data)}")
    if joined != data:
        raise Mismatch(f"{what}: read bytes differ from what was stored")


def action_result_summary(result: re_pb2.ActionResult) -> tuple[Any, ...]:
    return (
        result.exit_code,
        tuple(sorted((f.path, f.digest.hash, f.digest.size_bytes, f.is_executable) for f in result.output_files)),
    )


def check_action_result(got: re_pb2.ActionResult | None, want: re_pb2.ActionResult, action: re_pb2.Digest) -> None:
    if got is None:
        raise Mismatch(f"GetActionResult {action.hash[:12]}: NOT_FOUND after UpdateActionResult")
    if action_result_summary(got) != action_result_summary(want):
        raise Mismatch(f"GetActionResult {action.hash[:12]}: result differs from what was stored")


def random_action_digest() -> re_pb2.Digest:
    return digest_of(os.urandom(random.randint(120, 400)))


def make_action_result(outputs: list[re_pb2.Digest], tag: str) -> re_pb2.ActionResult:
    return re_pb2.ActionResult(
        exit_code=0,
        output_files=[
            re_pb2.OutputFile(path=f"bazel-out/k8-fastbuild/bin/{tag}/out{i}.o", digest=d, is_executable=(i == 0))
            for i, d in enumerate(outputs)
        ],
    )


# --------------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------------


@dataclass
class Scenario:
    name: str
    run: Callable[[Client, Plan, dict[str, Any]], Awaitable[Result]]
    description: str


def finish(result: Result, timing: Timing) -> Result:
    result.seconds = timing.seconds
    result.p50_ms = percentile(timing.latencies, 0.50)
    result.p99_ms = percentile(timing.latencies, 0.99)
    cpu = CPU.take()
    if cpu is not None:
        server, client = cpu
        if result.ops:
            result.detail["server_cpu_us_per_op"] = round(server / result.ops * 1e6, 1)
            result.detail["client_cpu_us_per_op"] = round(client / result.ops * 1e6, 1)
        if client > 0:
            result.detail["server_per_client_cpu"] = round(server / client, 3)
    return result


async def scenario_capabilities(client: Client, plan: Plan, state: dict[str, Any]) -> Result:
    timing = Timing()

    async def op(_: int) -> None:
        await timing.op(client.get_capabilities())

    timing.seconds = await run_workers(1, plan.capabilities_calls, op)
    result = Result("capabilities", "calls/s", plan.capabilities_calls / timing.seconds, ops=plan.capabilities_calls)
    return finish(result, timing)


def make_fmb(concurrency: int) -> Scenario:
    name = f"fmb_c{concurrency}"

    async def run(client: Client, plan: Plan, state: dict[str, Any]) -> Result:
        if "fmb" not in state:
            half = plan.fmb_digests // 2
            present = [os.urandom(random.randint(64, 512)) for _ in range(half)]
            await client.upload_small(present)
            absent = [digest_of(os.urandom(random.randint(64, 512))) for _ in range(plan.fmb_digests - half)]
            digests = [digest_of(b) for b in present] + absent
            random.shuffle(digests)
            absent_keys = {key(d) for d in absent}
            in_order = [d for d in digests if key(d) in absent_keys]  # what an order-keeping server says
            state["fmb"] = (
                client.find_missing_request(digests).SerializeToString(),
                re_pb2.FindMissingBlobsResponse(missing_blob_digests=in_order).SerializeToString(),
                absent_keys,
            )
        request, expected_reply, expected = state["fmb"]
        timing = Timing()
        calls = plan.fmb_calls[concurrency]

        async def op(_: int) -> None:
            missing = await timing.op(client.find_missing_raw(request, expected_reply))
            if missing is not None and missing != expected:  # other order is fine, other content not
                raise Mismatch(
                    f"FindMissingBlobs: {len(missing)} missing reported, {len(expected)} expected "
                    f"({len(missing - expected)} present ones called missing, {len(expected - missing)} absent ones "
                    "called present)"
                )

        timing.seconds = await run_workers(concurrency, calls, op)
        result = Result(name, "calls/s", calls / timing.seconds, ops=calls)
        result.detail = {
            "digests_per_call": plan.fmb_digests,
            "digests_per_s": round(calls * plan.fmb_digests / timing.seconds),
        }
        return finish(result, timing)

    return Scenario(
        name, run, f"FindMissingBlobs, {FULL.fmb_digests} digests (half present), concurrency {concurrency}"
    )


def make_batch(concurrency: int, write: bool) -> Scenario:
    name = f"batch_{'update' if write else 'read'}_c{concurrency}"
    slot = f"batch_c{concurrency}"

    async def prepare(client: Client, plan: Plan) -> list[bytes]:
        count = plan.batch_calls[concurrency] * plan.batch_blobs_per_call
        return [random_blob(plan.batch_blob_size) for _ in range(count)]

    async def run(client: Client, plan: Plan, state: dict[str, Any]) -> Result:
        per_call = plan.batch_blobs_per_call
        calls = plan.batch_calls[concurrency]
        timing = Timing()
        if write:
            blobs = await prepare(client, plan)
            requests = [client.batch_update_request(blobs[i * per_call : (i + 1) * per_call]) for i in range(calls)]

            async def op(index: int) -> None:
                await timing.op(client.batch_update(requests[index]))

            timing.seconds = await run_workers(concurrency, calls, op)
            state[slot] = blobs
        else:
            blobs = state.pop(slot, None)
            if blobs is None:
                blobs = await prepare(client, plan)
                await client.upload_small(blobs, per_call)
            expected = {key(digest_of(b)): b for b in blobs}
            order = list(expected)
            random.shuffle(order)  # read back in groups other than the ones written
            requests = [
                re_pb2.BatchReadBlobsRequest(
                    instance_name=client.instance,
                    digests=[re_pb2.Digest(hash=h, size_bytes=s) for h, s in order[i * per_call : (i + 1) * per_call]],
                )
                for i in range(calls)
            ]

            async def op(index: int) -> None:
                await timing.op(client.batch_read(requests[index], expected))

            timing.seconds = await run_workers(concurrency, calls, op)
            state[slot] = blobs  # a measured run after a --warmup run reads the same, stored blobs
        blobs_total = calls * per_call
        result = Result(
            name, "blobs/s", blobs_total / timing.seconds, ops=calls, bytes=blobs_total * plan.batch_blob_size
        )
        result.detail = {
            "blobs_per_call": per_call,
            "blob_bytes": plan.batch_blob_size,
            "calls_per_s": round(calls / timing.seconds, 2),
            "mib_per_s": round(result.bytes / MiB / timing.seconds, 2),
        }
        return finish(result, timing)

    verb = "BatchUpdateBlobs" if write else "BatchReadBlobs"
    return Scenario(name, run, f"{verb}, 4 KiB blobs, 100 per call, concurrency {concurrency}")


def make_bs_write(size: int, chunk: int) -> Scenario:
    name = f"bs_write_{size_label(size)}_chunk{size_label(chunk)}"

    async def run(client: Client, plan: Plan, state: dict[str, Any]) -> Result:
        count = plan.bs_count[size]
        blobs = [random_blob(size) for _ in range(count)]
        digests = [digest_of(b) for b in blobs]
        timing = Timing()

        async def op(index: int) -> None:
            await timing.op(client.bs_write(blobs[index], chunk, digests[index]))

        timing.seconds = await run_workers(1, count, op)
        # the read scenario for this size reads the first variant's blobs
        state.setdefault(f"bs_{size}", list(zip(blobs, digests, strict=True)))
        total = size * count
        result = Result(name, "MiB/s", total / MiB / timing.seconds, ops=count, bytes=total)
        result.detail = {"blob_bytes": size, "chunk_bytes": chunk, "blobs": count}
        return finish(result, timing)

    return Scenario(name, run, f"ByteStream.Write, {size_label(size)} blobs in {size_label(chunk)} chunks")


def make_bs_read(size_index: int, plan: Plan) -> Scenario:
    size = plan.bs_sizes[size_index]
    name = f"bs_read_{size_label(size)}"

    async def run(client: Client, plan: Plan, state: dict[str, Any]) -> Result:
        stored = state.pop(f"bs_{size}", None)
        if stored is None:
            stored = []
            for _ in range(plan.bs_count[size]):
                blob = random_blob(size)
                digest = digest_of(blob)
                await client.bs_write(blob, plan.bs_chunks[-1], digest)
                stored.append((blob, digest))
        timing = Timing()
        largest_chunk = 0
        CPU.take()  # the uploads above are not part of the reads
        for blob, digest in stored:  # one at a time: verification stays off the clock
            if client.warm:  # untimed: the client's memory for this read faulted in (--client-warm)
                chunks, _ = await client.bs_read(digest)
                verify_chunks(chunks, blob, f"ByteStream.Read {digest.hash[:12]} (untimed)")
                del chunks
            CPU.start(add=True)
            start = time.perf_counter()
            chunks, largest = await client.bs_read(digest)
            elapsed = time.perf_counter() - start
            CPU.stop()
            timing.latencies.append(elapsed)
            timing.seconds += elapsed
            largest_chunk = max(largest_chunk, largest)
            verify_chunks(chunks, blob, f"ByteStream.Read {digest.hash[:12]}")
            del chunks
        total = size * len(stored)
        result = Result(name, "MiB/s", total / MiB / timing.seconds, ops=len(stored), bytes=total)
        result.detail = {"blob_bytes": size, "blobs": len(stored), "server_chunk_bytes": largest_chunk}
        return finish(result, timing)

    return Scenario(name, run, f"ByteStream.Read, {size_label(size)} blobs (the server picks the chunk size)")


def make_ac(concurrency: int, write: bool) -> Scenario:
    name = f"ac_{'update' if write else 'get'}_c{concurrency}"
    slot = f"ac_c{concurrency}"

    async def prepare(client: Client, plan: Plan) -> list[tuple[re_pb2.Digest, re_pb2.ActionResult]]:
        # Every referenced output exists in the CAS: servers may (buildvault does) refuse to
        # serve an ActionResult whose blobs are gone.
        pool = [random_blob(random.randint(256, 8 * KiB)) for _ in range(64)]
        await client.upload_small(pool)
        pool_digests = [digest_of(b) for b in pool]
        entries = []
        for i in range(plan.ac_ops[concurrency]):
            action = random_action_digest()
            entries.append((action, make_action_result(random.sample(pool_digests, plan.ac_outputs), f"t{i}")))
        return entries

    async def run(client: Client, plan: Plan, state: dict[str, Any]) -> Result:
        ops = plan.ac_ops[concurrency]
        timing = Timing()
        if write:
            entries = await prepare(client, plan)

            async def op(index: int) -> None:
                await timing.op(client.update_action(*entries[index]))

            timing.seconds = await run_workers(concurrency, ops, op)
            state[slot] = entries
        else:
            entries = state.pop(slot, None)
            if entries is None:
                entries = await prepare(client, plan)
                for action, result in entries:
                    await client.update_action(action, result)
            order = list(range(ops))
            random.shuffle(order)

            async def op(index: int) -> None:
                action, want = entries[order[index]]
                check_action_result(await timing.op(client.get_action(action)), want, action)

            timing.seconds = await run_workers(concurrency, ops, op)
        result = Result(name, "calls/s", ops / timing.seconds, ops=ops)
        return finish(result, timing)

    verb = "UpdateActionResult" if write else "GetActionResult (hits)"
    return Scenario(name, run, f"{verb}, concurrency {concurrency}")


@dataclass
class SimAction:
    digest: re_pb2.Digest
    inputs: list[bytes]
    small_outputs: list[bytes]
    large_output: bytes | None
    result: re_pb2.ActionResult | None = None


def plan_mixed(plan: Plan) -> list[list[SimAction]]:
    shared = [random_blob(random.randint(2 * KiB, 16 * KiB)) for _ in range(40)]  # "system headers"
    clients = []
    for _ in range(plan.mixed_clients):
        actions = []
        for a in range(plan.mixed_actions):
            inputs = random.sample(shared, 6) + [random_blob(random.randint(4 * KiB, 32 * KiB)) for _ in range(2)]
            small = [random_blob(random.randint(1 * KiB, 16 * KiB)) for _ in range(2)]
            if a % 4 == 3:
                large = random_blob(plan.mixed_large)
            else:
                small.append(random_blob(64 * KiB))
                large = None
            actions.append(SimAction(random_action_digest(), inputs, small, large))
        clients.append(actions)
    return clients


async def mixed_cold_action(client: Client, action: SimAction, timing: Timing) -> None:
    start = time.perf_counter()
    if await client.get_action(action.digest) is not None:
        raise Mismatch(f"GetActionResult {action.digest.hash[:12]}: hit for an action never stored")
    by_key = {key(digest_of(b)): b for b in action.inputs + action.small_outputs}
    large_digest = digest_of(action.large_output) if action.large_output is not None else None
    wanted = list(by_key)
    if large_digest is not None:
        wanted.append(key(large_digest))
    missing = await client.find_missing(
        client.find_missing_request([re_pb2.Digest(hash=h, size_bytes=s) for h, s in wanted])
    )
    fresh = {key(digest_of(b)) for b in action.inputs[6:] + action.small_outputs}
    if large_digest is not None:
        fresh.add(key(large_digest))
    if not fresh <= missing or not missing <= set(wanted):
        raise Mismatch(f"FindMissingBlobs: wrong missing set for action {action.digest.hash[:12]}")
    small_missing = [by_key[k] for k in missing if k in by_key]
    if small_missing:
        await client.batch_update(client.batch_update_request(small_missing))
    if large_digest is not None and key(large_digest) in missing:
        await client.bs_write(action.large_output, 1 * MiB, large_digest)  # type: ignore[arg-type]
    outputs = [digest_of(b) for b in action.small_outputs] + ([large_digest] if large_digest is not None else [])
    action.result = make_action_result(outputs, action.digest.hash[:8])
    await client.update_action(action.digest, action.result)
    timing.latencies.append(time.perf_counter() - start)


async def mixed_warm_action(client: Client, action: SimAction, timing: Timing) -> None:
    start = time.perf_counter()
    assert action.result is not None
    check_action_result(await client.get_action(action.digest), action.result, action.digest)
    expected = {key(digest_of(b)): b for b in action.small_outputs}
    await client.batch_read(
        re_pb2.BatchReadBlobsRequest(
            instance_name=client.instance, digests=[re_pb2.Digest(hash=h, size_bytes=s) for h, s in expected]
        ),
        expected,
    )
    if action.large_output is not None:
        digest = digest_of(action.large_output)
        chunks, _ = await client.bs_read(digest)
        verify_chunks(chunks, action.large_output, f"ByteStream.Read {digest.hash[:12]}")
    timing.latencies.append(time.perf_counter() - start)


async def run_mixed_pass(
    client: Client, clients: list[list[SimAction]], step: Callable[..., Awaitable[None]]
) -> Timing:
    timing = Timing()

    async def one_client(actions: list[SimAction]) -> None:
        for action in actions:
            await step(client, action, timing)

    CPU.start()
    start = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for actions in clients:
            group.create_task(one_client(actions))
    timing.seconds = time.perf_counter() - start
    CPU.stop()
    return timing


def make_mixed(warm: bool) -> Scenario:
    name = f"mixed_{'warm' if warm else 'cold'}"

    async def run(client: Client, plan: Plan, state: dict[str, Any]) -> Result:
        if warm:
            clients = state.pop("mixed", None)
            if clients is None:
                clients = plan_mixed(plan)
                await run_mixed_pass(client, clients, mixed_cold_action)
            timing = await run_mixed_pass(client, clients, mixed_warm_action)
        else:
            clients = plan_mixed(plan)
            timing = await run_mixed_pass(client, clients, mixed_cold_action)
            state["mixed"] = clients
        actions = sum(len(c) for c in clients)
        result = Result(name, "actions/s", actions / timing.seconds, ops=actions)
        result.detail = {"clients": len(clients), "actions": actions}
        return finish(result, timing)

    what = (
        "warm pass: GetActionResult hit, BatchReadBlobs + ByteStream.Read of the outputs"
        if warm
        else (
            "cold pass: GetActionResult miss, FindMissingBlobs, BatchUpdateBlobs + ByteStream.Write, "
            "UpdateActionResult"
        )
    )
    return Scenario(name, run, f"{FULL.mixed_clients} concurrent simulated build clients, {what}")


def scenarios_for(plan: Plan) -> list[Scenario]:
    out = [Scenario("capabilities", scenario_capabilities, "GetCapabilities, sequential")]
    out += [make_fmb(c) for c in plan.fmb_calls]
    for c in plan.batch_calls:
        out += [make_batch(c, write=True), make_batch(c, write=False)]
    for s in range(len(plan.bs_sizes)):
        size = plan.bs_sizes[s]
        chunks = sorted({*plan.bs_chunks, *([plan.bs_small_chunk[1]] if plan.bs_small_chunk[0] == size else [])})
        out += [make_bs_write(size, chunk) for chunk in chunks]
        out.append(make_bs_read(s, plan))
    for c in plan.ac_ops:
        out += [make_ac(c, write=True), make_ac(c, write=False)]
    out += [make_mixed(warm=False), make_mixed(warm=True)]
    return out


def select(scenarios: list[Scenario], patterns: str | None) -> list[Scenario]:
    if not patterns:
        return scenarios
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    return [s for s in scenarios if any(fnmatch.fnmatchcase(s.name, p) for p in wanted)]


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def markdown_table(results: list[Result], title: str) -> str:
    lines = [
        f"### {title}",
        "",
        "| scenario | result | unit | p50 ms | p99 ms | server RSS peak MiB | status |",
        "| --- | ---: | --- | ---: | ---: | ---: | --- |",
    ]

    def fmt(v: float | None, digits: int = 1) -> str:
        return "—" if v is None else f"{v:,.{digits}f}"

    for r in results:
        status = "ok" if r.ok else f"FAILED: {r.error}".replace("|", "/")
        lines.append(
            f"| {r.scenario} | {fmt(r.value)} | {r.unit} | {fmt(r.p50_ms, 2)} | {fmt(r.p99_ms, 2)} | "
            f"{fmt(r.rss_peak_mib)} | {status} |"
        )
    return "\n".join(lines)


async def wait_ready(client: Client, seconds: float) -> re_pb2.ServerCapabilities:
    deadline = time.monotonic() + seconds
    while True:
        try:
            return await client.get_capabilities()
        except grpc.aio.AioRpcError:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.1)


async def main_async(args: argparse.Namespace) -> int:
    plan = QUICK if args.quick else FULL
    scenarios = select(scenarios_for(plan), args.scenarios)
    if args.list:
        for s in scenarios_for(plan):
            print(f"{s.name:32} {s.description}")
        return 0
    if not scenarios:
        print(f"harness: no scenario matches {args.scenarios!r}; --list shows them", file=sys.stderr)
        return 2
    if args.seed is not None:
        random.seed(args.seed)

    if args.client_warm:
        keep_memory()
    client = Client(args.target, args.instance, args.rpc_timeout, args.authorization, args.channels,
                    args.request_metadata)  # fmt: skip
    client.warm = args.client_warm
    try:
        capabilities = await wait_ready(client, args.wait)
    except grpc.aio.AioRpcError as exc:
        print(f"harness: cannot reach {args.target}: {describe(exc)}", file=sys.stderr)
        await client.close()
        return 2

    sampler = None
    if args.server_pid:
        if not os.path.exists(f"/proc/{args.server_pid}/status"):
            print(f"harness: no process {args.server_pid}", file=sys.stderr)
            await client.close()
            return 2
        sampler = RssSampler(args.server_pid)
        sampler.start()
        CPU.server_pid = args.server_pid

    results: list[Result] = []
    state: dict[str, Any] = {}
    bs_windows: list[tuple[float, float]] = []
    largest = max(plan.bs_sizes)
    run_start = time.monotonic()
    try:
        for scenario in scenarios:
            started = time.monotonic()
            if sampler is not None:
                sampler.sample()
            CPU.take()  # nothing from before this scenario counts in its figures
            try:
                if args.warmup:  # an untimed run first: the blobs stored, the server's caches warm
                    await asyncio.wait_for(scenario.run(client, plan, state), timeout=args.scenario_timeout)
                if args.wait_journal:
                    await wait_journal_drained(args.wait_journal, args.scenario_timeout)
                result = await asyncio.wait_for(scenario.run(client, plan, state), timeout=args.scenario_timeout)
            except (Exception, BaseExceptionGroup) as exc:
                result = Result(scenario.name, "", ok=False, error=describe(exc))
                if isinstance(first_error(exc), TimeoutError):
                    result.error = f"timed out after {args.scenario_timeout:.0f} s"
            if sampler is not None:
                sampler.sample()
            ended = time.monotonic()
            if sampler is not None:
                result.rss_peak_mib = sampler.peak_mib(started, ended)
                if scenario.name.startswith("bs_") and f"_{size_label(largest)}" in scenario.name:
                    bs_windows.append((started, ended))
            results.append(result)
            print(result.to_json(), flush=True)
        if sampler is not None:
            sampler.stop()
            peak = Result("server_rss_peak", "MiB", sampler.peak_mib(run_start, None), higher_is_better=False)
            peak.detail = {"vmhwm_mib": round(sampler.hwm_kib / 1024.0, 1), "pid": args.server_pid}
            peak.rss_peak_mib = peak.value
            results.append(peak)
            print(peak.to_json(), flush=True)
            if bs_windows:
                values = [sampler.peak_mib(a, b) for a, b in bs_windows]
                stream = Result(
                    f"server_rss_bs_{size_label(largest)}",
                    "MiB",
                    max(v for v in values if v is not None),
                    higher_is_better=False,
                )
                stream.rss_peak_mib = stream.value
                stream.detail = {"what": f"peak server RSS while streaming {size_label(largest)} blobs"}
                results.append(stream)
                print(stream.to_json(), flush=True)
    finally:
        await client.close()

    failed = [r for r in results if not r.ok]
    title = f"{args.label or args.target}{' (quick)' if args.quick else ''}"
    print()
    print(markdown_table(results, title))
    print()
    print(f"{len(results) - len(failed)} scenarios ok, {len(failed)} failed", flush=True)
    if args.json_out:
        document = {
            "harness_version": HARNESS_VERSION,
            "label": args.label,
            "quick": args.quick,
            "instance": args.instance,
            "server_api": f"{capabilities.low_api_version.major}.{capabilities.low_api_version.minor}-"
            f"{capabilities.high_api_version.major}.{capabilities.high_api_version.minor}",
            "results": [asdict(r) for r in results],
        }
        Path(args.json_out).write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    return 1 if failed else 0


async def wait_journal_drained(metrics_url: str, timeout: float) -> None:
    """Until buildvault's /metrics shows an empty upload journal (its bucket uploads are done)."""
    import urllib.request

    def backlog() -> float:
        with urllib.request.urlopen(metrics_url, timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("buildvault_upload_journal_backlog "):
                    return float(line.split()[1])
        raise RuntimeError(f"{metrics_url} has no buildvault_upload_journal_backlog")

    deadline = time.monotonic() + timeout
    while await asyncio.to_thread(backlog) > 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the upload journal did not drain in {timeout:.0f} s")
        await asyncio.sleep(0.2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.harness",
        description="Benchmark any REAPI v2 cache endpoint (CAS, ActionCache, ByteStream, Capabilities).",
    )
    parser.add_argument("--target", default="127.0.0.1:9092", help="gRPC address host:port (default %(default)s)")
    parser.add_argument("--instance", default="", help="REAPI instance name (default: empty)")
    parser.add_argument(
        "--authorization", default="", help="send `authorization: VALUE` on every call, e.g. 'Bearer TOKEN'"
    )
    parser.add_argument("--server-pid", type=int, help="sample this process tree's RSS (VmRSS/VmHWM)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and counts: a protocol-regression run")
    parser.add_argument("--scenarios", help="comma-separated names or globs, e.g. 'fmb_*,bs_*_512MiB*'")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--label", default="", help="name of the server in the table title and JSON")
    parser.add_argument("--json-out", help="also write every result to this JSON file")
    parser.add_argument(
        "--wait", type=float, default=10.0, help="seconds to wait for the endpoint (default %(default)s)"
    )
    parser.add_argument("--rpc-timeout", type=float, default=300.0, help="deadline of each RPC, seconds")
    parser.add_argument("--scenario-timeout", type=float, default=600.0, help="give up on a scenario after, seconds")
    parser.add_argument("--seed", type=int, help="seed the scenario shapes (blob bytes stay random)")
    parser.add_argument("--warmup", action="store_true", help="run each scenario once untimed before measuring it")
    parser.add_argument(
        "--wait-journal", metavar="METRICS_URL",
        help="before each measured run, wait until buildvault's /metrics at this URL shows an empty upload journal",
    )  # fmt: skip
    parser.add_argument(
        "--channels", type=int, default=1, help="connections, calls spread over them in turn (default %(default)s)"
    )
    parser.add_argument(
        "--client-warm", action="store_true",
        help="keep freed memory (glibc mallopt) and read each ByteStream blob once untimed before its timed read",
    )  # fmt: skip
    parser.add_argument("--request-metadata", action="store_true",
                        help="send Bazel's requestmetadata-bin on every call (the history records it)")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
