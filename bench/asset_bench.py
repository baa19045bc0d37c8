#!/usr/bin/env python3
"""Remote Asset: FetchBlob hit latency against GetActionResult, and download throughput from a
loopback origin against curl from the same origin, with the server's memory.

    python bench/asset_bench.py                      # ~1 min on 2 cores
    python bench/asset_bench.py --size 512MiB --calls 2000 --reps 3
    python bench/asset_bench.py --downloads-only --reps 5 [--server-arg=--chunking --server-arg=false]

Starts its own buildvault (`--asset-allow-hosts 127.0.0.1`, execution off, one process) and an
origin (aiohttp in a subprocess: sendfile with a Content-Length under /file/, 1 MiB chunks
without one under /chunked/). Prints one JSON line per measurement, then a markdown table:

- `hit_c1`, `hit_c16`: FetchBlob of an indexed 1 KiB asset (a checksum hit), calls/s and
  latency p50/p99 at 1 and 16 concurrent callers, beside `ac_c1`, `ac_c16`: GetActionResult of
  an entry with one small output on the same server (the issue's target: within 1.5x);
- `download`: a fresh `--size` asset (Content-Length and a sha256: streamed straight into the
  store) and `download_chunked` (no Content-Length: through the spool file), MiB/s and the
  server's peak anonymous memory (VmRSS less RssFile, sampled every 20 ms) and peak VmRSS
  during the fetch,
  beside `curl` of the same file to /dev/null and to a file on the same disk, and
  `bytestream_write`: the store's own rate for the same size (a ByteStream Write, 1 MiB chunks).
  Each repetition's `ratio` line: the download's rate over curl's to a file and to /dev/null
  (`--downloads-only`: the downloads and curl only, for A/B rounds).
Not a timed test; numbers go to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.harness import memory_kib
from bench.servers import free_port, start_buildvault, stop
from buildvault.config import parse_size
from buildvault.remote_apis import bs_grpc, bs_pb2, ra_grpc, ra_pb2, re_grpc, re_pb2

ORIGIN = r"""
import sys
from aiohttp import web
root = sys.argv[1]
async def chunked(request):
    response = web.StreamResponse()
    response.enable_chunked_encoding()
    await response.prepare(request)
    with open(root + "/" + request.match_info["name"], "rb") as f:
        while block := f.read(1 << 20):
            await response.write(block)
    await response.write_eof()
    return response
app = web.Application()
app.router.add_static("/file/", root)
app.router.add_get("/chunked/{name}", chunked)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[2]), print=None, access_log=None)
"""


def sri(digest: bytes) -> str:
    return "sha256-" + base64.b64encode(digest).decode()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _latency(call, calls: int, concurrency: int) -> dict[str, float]:
    samples: list[float] = []
    per = calls // concurrency

    async def loop() -> None:
        for _ in range(per):
            started = time.perf_counter()
            await call()
            samples.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    return {
        "calls_per_s": round(len(samples) / wall, 1),
        "p50_ms": round(1000 * percentile(samples, 0.5), 3),
        "p99_ms": round(1000 * percentile(samples, 0.99), 3),
    }


async def latencies(address: str, origin: str, data: bytes, calls: int) -> list[dict[str, object]]:
    async with grpc.aio.insecure_channel(address) as channel:
        fetch = ra_grpc.FetchStub(channel)
        ac = re_grpc.ActionCacheStub(channel)
        cas = re_grpc.ContentAddressableStorageStub(channel)
        digest = hashlib.sha256(data)
        request = ra_pb2.FetchBlobRequest(
            uris=[f"{origin}/file/small.bin"],
            qualifiers=[ra_pb2.Qualifier(name="checksum.sri", value=sri(digest.digest()))],
        )
        first = await fetch.FetchBlob(request)  # the download; every later call is a hit
        assert first.blob_digest.hash == digest.hexdigest()
        output = re_pb2.Digest(hash=digest.hexdigest(), size_bytes=len(data))
        await cas.BatchUpdateBlobs(
            re_pb2.BatchUpdateBlobsRequest(requests=[re_pb2.BatchUpdateBlobsRequest.Request(digest=output, data=data)])
        )
        action = re_pb2.Digest(hash=hashlib.sha256(b"bench action").hexdigest(), size_bytes=12)
        result = re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="out", digest=output)])
        await ac.UpdateActionResult(re_pb2.UpdateActionResultRequest(action_digest=action, action_result=result))
        get = re_pb2.GetActionResultRequest(action_digest=action)

        async def hit() -> None:
            await fetch.FetchBlob(request)

        async def ac_get() -> None:
            await ac.GetActionResult(get)

        out: list[dict[str, object]] = []
        for concurrency in (1, 16):
            for name, call in (("hit", hit), ("ac", ac_get)):
                await _latency(call, max(64, calls // 10), concurrency)  # warm-up
                out.append({"scenario": f"{name}_c{concurrency}", **await _latency(call, calls, concurrency)})
        return out


class Sampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak = 0
        self.peak_rss = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            rss, file_pages, _ = memory_kib(self.pid)
            self.peak = max(self.peak, rss - file_pages)
            self.peak_rss = max(self.peak_rss, rss)
            time.sleep(0.02)


async def download(address: str, url: str, digest: bytes, size: int, pid: int, name: str) -> dict[str, object]:
    idle_rss, idle_file, _ = memory_kib(pid)
    sampler = Sampler(pid)
    sampler.start()
    async with grpc.aio.insecure_channel(address) as channel:
        request = ra_pb2.FetchBlobRequest(
            uris=[url], qualifiers=[ra_pb2.Qualifier(name="checksum.sri", value=sri(digest))]
        )
        started = time.perf_counter()
        answer = await ra_grpc.FetchStub(channel).FetchBlob(request, timeout=600)
        seconds = time.perf_counter() - started
        # read back off the clock: the stored bytes are the origin's
        hasher = hashlib.sha256()
        resource = f"blobs/{answer.blob_digest.hash}/{answer.blob_digest.size_bytes}"
        async for part in bs_grpc.ByteStreamStub(channel).Read(bs_pb2.ReadRequest(resource_name=resource)):
            hasher.update(part.data)
        assert hasher.digest() == digest and answer.blob_digest.size_bytes == size
    sampler.stopped.set()
    sampler.join()
    return {
        "scenario": name,
        "seconds": round(seconds, 3),
        "mib_per_s": round(size / seconds / (1 << 20), 1),
        "server_anon_idle_mib": (idle_rss - idle_file) // 1024,
        "server_anon_peak_mib": sampler.peak // 1024,
        "server_rss_peak_mib": sampler.peak_rss // 1024,
    }


async def bytestream_write(address: str, path: Path, size: int) -> dict[str, object]:
    """The store's own rate for the same size: a ByteStream Write of the file in 1 MiB chunks."""
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            hasher.update(block)
    name = f"uploads/{os.urandom(8).hex()}/blobs/{hasher.hexdigest()}/{size}"

    async def requests():
        with open(path, "rb") as f:
            offset = 0
            while block := f.read(1 << 20):
                yield bs_pb2.WriteRequest(
                    resource_name=name if offset == 0 else "",
                    write_offset=offset,
                    data=block,
                    finish_write=offset + len(block) == size,
                )
                offset += len(block)

    async with grpc.aio.insecure_channel(address) as channel:
        started = time.perf_counter()
        await bs_grpc.ByteStreamStub(channel).Write(requests())
        seconds = time.perf_counter() - started
    return {
        "scenario": "bytestream_write",
        "seconds": round(seconds, 3),
        "mib_per_s": round(size / seconds / (1 << 20), 1),
    }


def write_random(path: Path, size: int) -> bytes:
    """A file of fresh random bytes (no server can answer from an earlier run); its SHA-256."""
    hasher = hashlib.sha256()
    with open(path, "wb") as f:
        left = size
        while left:
            block = os.urandom(min(left, 8 << 20))
            hasher.update(block)
            f.write(block)
            left -= len(block)
    return hasher.digest()


def curl(url: str, target: str, size: int, name: str) -> dict[str, object]:
    started = time.perf_counter()
    subprocess.run(["curl", "-sS", "--fail", "-o", target, url], check=True)
    seconds = time.perf_counter() - started
    return {"scenario": name, "seconds": round(seconds, 3), "mib_per_s": round(size / seconds / (1 << 20), 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="512MiB", help="download size (default 512MiB)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per latency scenario")
    parser.add_argument("--reps", type=int, default=1, help="download repetitions")
    parser.add_argument("--downloads-only", action="store_true",
                        help="downloads and curl only: no latency, no ByteStream row")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="an extra `buildvault serve` argument (repeatable)")
    args = parser.parse_args()
    if shutil.which("curl") is None:
        raise SystemExit("curl is needed for the comparison")
    size = parse_size(args.size)
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="asset-bench-", dir=os.environ.get("TMPDIR")) as tmp:
        root = Path(tmp)
        files = root / "files"
        files.mkdir()
        (files / "small.bin").write_bytes(os.urandom(1024))
        port = free_port()
        origin_process = subprocess.Popen([sys.executable, "-c", ORIGIN, str(files), str(port)])
        origin = f"http://127.0.0.1:{port}"
        server = start_buildvault(
            root / "data",
            root / "server.log",
            ["--asset-allow-hosts", "127.0.0.1", "--local-workers", "0", "--processes", "1", *args.server_arg],
        )
        try:
            deadline = time.monotonic() + 30
            while subprocess.run(["curl", "-s", "-o", "/dev/null", f"{origin}/file/small.bin"]).returncode != 0:
                if time.monotonic() > deadline:
                    raise SystemExit("the origin did not start")
                time.sleep(0.1)
            if not args.downloads_only:
                rows += asyncio.run(latencies(server.address, origin, (files / "small.bin").read_bytes(), args.calls))
            for rep in range(args.reps):
                blob = files / f"big{rep}.bin"
                digest = write_random(blob, size)
                devnull = curl(f"{origin}/file/{blob.name}", "/dev/null", size, "curl_devnull")
                to_file = curl(f"{origin}/file/{blob.name}", str(root / "curl.out"), size, "curl_file")
                (root / "curl.out").unlink()
                fetched = asyncio.run(
                    download(server.address, f"{origin}/file/{blob.name}", digest, size, server.pid, "download")
                )
                rows += [devnull, to_file, fetched]
                rate = float(str(fetched["mib_per_s"]))
                rows.append({"scenario": "ratio", "rep": rep,
                             "vs_curl_file": round(rate / float(str(to_file["mib_per_s"])), 3),
                             "vs_curl_devnull": round(rate / float(str(devnull["mib_per_s"])), 3),
                             "load_average": round(os.getloadavg()[0], 2)})  # fmt: skip
                blob.unlink()
                chunked = files / f"big{rep}c.bin"
                digest = write_random(chunked, size)
                rows.append(
                    asyncio.run(
                        download(
                            server.address,
                            f"{origin}/chunked/{chunked.name}",
                            digest,
                            size,
                            server.pid,
                            "download_chunked",
                        )
                    )
                )
                if args.downloads_only:
                    chunked.unlink()
                    continue
                write_random(chunked, size)  # fresh bytes again: the same write through ByteStream
                rows.append(asyncio.run(bytestream_write(server.address, chunked, size)))
                chunked.unlink()
        finally:
            stop(server)
            origin_process.terminate()
            origin_process.wait(10)
    for row in rows:
        print(json.dumps(row))
    print()
    print("| scenario | calls/s | p50 ms | p99 ms | MiB/s | s | server anon / RSS peak MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        if row["scenario"] == "ratio":
            continue
        memory = f"{row['server_anon_peak_mib']} / {row['server_rss_peak_mib']}" if "server_rss_peak_mib" in row else ""
        print(
            f"| {row['scenario']} | {row.get('calls_per_s', '')} | {row.get('p50_ms', '')} | {row.get('p99_ms', '')} "
            f"| {row.get('mib_per_s', '')} | {row.get('seconds', '')} | {memory} |"
        )
    ratios = sorted(float(str(r["vs_curl_file"])) for r in rows if r["scenario"] == "ratio")
    if ratios:
        print(f"\ndownload / curl to a file: median {statistics.median(ratios):.3f} (each: {ratios})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
