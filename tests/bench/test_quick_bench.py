"""bench/harness.py --quick against the real server: the benchmark doubles as a protocol test.

Starts `buildvault serve --grpc-address 127.0.0.1:0` with the integration tests'
ServerProcess (readiness: the banner's `buildvault ready: grpc=...` line), runs every quick
scenario with byte-for-byte verification, and checks that every scenario reported a result
and none failed. Two more tests prove the harness fails the run when a server answers
wrongly, and accepts a right answer in another order.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "tests" / "integration"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from server_process import ServerProcess  # noqa: E402  (the integration tests' real-server runner)

from bench import harness  # noqa: E402
from buildvault.remote_apis import re_grpc, re_pb2  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def run_harness(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.harness", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )


def json_rows(proc: subprocess.CompletedProcess[str]) -> list[dict]:
    """The harness's one JSON line per scenario."""
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_quick_bench_against_buildvault(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    with ServerProcess(tmp_path / "data", http_address="") as server:
        proc = run_harness(
            "--target", server.grpc_address, "--quick", "--server-pid", str(server.pid),
            "--label", "buildvault", "--json-out", str(out),
        )
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}\n{server.output()[-3000:]}"

    largest = harness.size_label(max(harness.QUICK.bs_sizes))
    expected = [s.name for s in harness.scenarios_for(harness.QUICK)] + [
        "server_rss_peak", f"server_rss_bs_{largest}",
    ]
    assert [row["scenario"] for row in json_rows(proc)] == expected
    results = json.loads(out.read_text())["results"]
    assert [row["scenario"] for row in results] == expected
    for row in results:
        assert row["ok"] and row["error"] is None, row
        assert row["value"] is not None and row["value"] > 0, row
        assert row["rss_peak_mib"] is not None and row["rss_peak_mib"] > 0, row
    # Every timed section measured the server's CPU beside the harness's (clock ticks are 10 ms,
    # so a quick section may read 0; the whole run cannot).
    timed = [row for row in results if not row["scenario"].startswith("server_rss")]
    for row in timed:
        assert row["detail"].get("server_per_client_cpu", -1) >= 0, (row["scenario"], row["detail"])
        assert row["detail"]["server_cpu_us_per_op"] >= 0, row
    assert sum(row["detail"]["server_cpu_us_per_op"] * row["ops"] for row in timed) > 0
    assert "| scenario |" in proc.stdout and f"{len(expected)} scenarios ok, 0 failed" in proc.stdout


class LyingCas(re_grpc.ContentAddressableStorageServicer):
    """Says every blob is present."""

    def FindMissingBlobs(self, request, context):
        return re_pb2.FindMissingBlobsResponse()

    def BatchUpdateBlobs(self, request, context):
        return re_pb2.BatchUpdateBlobsResponse(
            responses=[re_pb2.BatchUpdateBlobsResponse.Response(digest=r.digest) for r in request.requests]
        )


class ReorderingCas(LyingCas):
    """Correct, but names the missing digests in reverse order: the harness must accept it."""

    def __init__(self) -> None:
        self.stored: set[tuple[str, int]] = set()

    def FindMissingBlobs(self, request, context):
        missing = [d for d in request.blob_digests if (d.hash, d.size_bytes) not in self.stored]
        return re_pb2.FindMissingBlobsResponse(missing_blob_digests=missing[::-1])

    def BatchUpdateBlobs(self, request, context):
        self.stored.update((r.digest.hash, r.digest.size_bytes) for r in request.requests)
        return super().BatchUpdateBlobs(request, context)


class Capabilities(re_grpc.CapabilitiesServicer):
    def GetCapabilities(self, request, context):
        return re_pb2.ServerCapabilities(
            cache_capabilities=re_pb2.CacheCapabilities(digest_functions=[re_pb2.DigestFunction.SHA256])
        )


@contextlib.contextmanager
def fake_cas(cas: re_grpc.ContentAddressableStorageServicer) -> Iterator[str]:
    """A gRPC server with `cas` and Capabilities (SHA-256) on loopback; yields its address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    re_grpc.add_ContentAddressableStorageServicer_to_server(cas, server)
    re_grpc.add_CapabilitiesServicer_to_server(Capabilities(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def test_harness_fails_the_run_on_a_wrong_answer() -> None:
    with fake_cas(LyingCas()) as target:
        proc = run_harness("--target", target, "--quick", "--scenarios", "fmb_c1,ac_get_c1", timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = {row["scenario"]: row for row in json_rows(proc)}
    assert set(rows) == {"fmb_c1", "ac_get_c1"}
    assert not rows["fmb_c1"]["ok"] and "FindMissingBlobs" in rows["fmb_c1"]["error"]
    assert not rows["ac_get_c1"]["ok"] and "UNIMPLEMENTED" in rows["ac_get_c1"]["error"]


def test_harness_accepts_any_order_of_missing_digests() -> None:
    with fake_cas(ReorderingCas()) as target:
        proc = run_harness("--target", target, "--quick", "--scenarios", "fmb_*", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_client_warm_reads_verified_and_client_cpu_reported(tmp_path: Path) -> None:
    """--client-warm (bench/compare.py's default): the ByteStream reads still pass their byte-for-byte
    check, and each reports the harness's CPU per read beside the server's."""
    with ServerProcess(tmp_path / "data", http_address="") as server:
        proc = run_harness(
            "--target", server.grpc_address, "--quick", "--server-pid", str(server.pid),
            "--scenarios", "bs_read_*", "--client-warm",
        )
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    reads = [row for row in json_rows(proc) if row["scenario"].startswith("bs_read_")]
    assert [row["scenario"] for row in reads] == [
        f"bs_read_{harness.size_label(size)}" for size in harness.QUICK.bs_sizes
    ]
    for row in reads:
        assert row["ok"] and row["value"] > 0, row
        assert row["detail"]["client_cpu_us_per_op"] > 0, row


def test_pinned_server_runs_only_on_its_cpus(tmp_path: Path) -> None:
    """bench/compare.py --pin: every thread of the server (started after the pin) is confined."""
    from bench import servers

    server = servers.start_buildvault(tmp_path / "data", tmp_path / "server.log", cpus={0})
    try:
        tasks = list(Path(f"/proc/{server.pid}/task").iterdir())
        assert len(tasks) > 1  # the event loop and gRPC's own threads
        for task in tasks:
            status = (task / "status").read_text()
            allowed = next(line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list:"))
            assert allowed == "0", (task.name, allowed)
    finally:
        servers.stop(server)
