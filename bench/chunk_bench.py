#!/usr/bin/env python3
"""The chunk store (storage/chunks), measured against `--chunking false` side by side.

    python bench/chunk_bench.py                          # all three parts
    python bench/chunk_bench.py --parts artifact --versions 10
    python bench/chunk_bench.py --parts stream,reads --size 512MiB --reps 2

artifact  Ten successive versions of a tar of a csrc-like build output tree (bench/csrc_tree.py,
          40 operators, compiled with CMake + Ninja, -g3; one operator's host source changed per
          version; the tar holds every object, static library and the executable), each pushed
          as a Bazel-style ByteStream Write (16 KiB messages) to a server on a bucket (moto).
          Bytes the store counts on disk, bytes under the data dir, and bytes in the bucket after
          the ten, chunked vs whole. Versions 1 and 10 are read back and compared byte for byte.
stream    ByteStream Write (1 MiB messages) and Read of a fresh random blob of `--size`, with
          chunking on and off (servers alternated, order rotated each repetition): MiB/s, the
          server's CPU seconds, its peak resident memory (less file pages). With chunking on the
          write is answered once the blob is stored whole; the read waits until the background
          conversion has kept it as chunks (`at_rest_mib_s`: the size over both times).
reads     What the check of every whole read costs (the issue's "On reads": XXH3-64 now,
          SHA-256 before): with chunking off, a whole read (checked on the way) against a read of
          all but the last byte (a range: not checked), alternated; and single-core hash and
          checksum throughput.

Prints one JSON document. Not a timed test; figures go to bench/RESULTS.md, runs to bench/notes/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import io
import json
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.csrc_tree import generate
from bench.harness import Client, RssSampler, cpu_seconds, digest_of, random_blob
from bench.servers import Server, start_buildvault, start_buildvault_on_bucket, stop
from buildvault.config import parse_size
from buildvault.remote_apis import bs_pb2

MiB = 1 << 20
_HTTP = re.compile(r"http=(\S+)")


# -- artifact: ten versions of a build output tar ------------------------------------------------


def build_versions(work: Path, versions: int) -> list[Path]:
    """Compile the csrc tree, then change one operator per version; a tar of the outputs each."""
    src, build = work / "src", work / "build"
    generate(src)
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Debug",
                    "-DCMAKE_CXX_FLAGS=-g3"], check=True, capture_output=True)  # fmt: skip
    tars = []
    for version in range(versions):
        if version:
            op = (version * 7) % 40
            host = next(src.glob(f"family{op % 8}/ops/op{op:02d}/host.cc"))
            host.write_text(host.read_text() + f"\nint64_t op{op:02d}_v{version}() {{ return {version}; }}\n")
        subprocess.run(["ninja", "-C", str(build), "-j2"], check=True, capture_output=True)
        outputs = sorted(
            p for p in build.rglob("*") if p.is_file() and (p.suffix in (".o", ".a") or p.name == "csrc_demo")
        )
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for path in outputs:
                tar.add(path, arcname=str(path.relative_to(build)))
        tars.append(work / f"output-v{version + 1}.tar")
        tars[-1].write_bytes(buffer.getvalue())
    return tars


def http_address(server: Server) -> str:
    match = _HTTP.search(server.log_tail(1 << 20))
    if not match:
        raise RuntimeError("the server's banner names no HTTP address")
    return match.group(1)


def fetch_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


def backlog(http: str) -> float:
    with urllib.request.urlopen(f"http://{http}/metrics", timeout=30) as response:
        text = response.read().decode()
    match = re.search(r"^buildvault_upload_journal_backlog (\S+)$", text, re.M)
    return float(match.group(1)) if match else -1.0


def bucket_bytes(server: Server) -> tuple[int, int]:
    """(objects, bytes) in the server's bucket."""
    import boto3

    args = list(server.process.args)  # type: ignore[arg-type]
    endpoint = args[args.index("--s3-endpoint") + 1]
    session = boto3.session.Session(region_name="us-east-1", aws_access_key_id="bench", aws_secret_access_key="bench")
    s3 = session.client("s3", endpoint_url=endpoint)
    count = size = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket="bench"):
        for item in page.get("Contents", []):
            count += 1
            size += item["Size"]
    return count, size


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and "upload-journal" not in p.parts)


async def push_versions(server: Server, tars: list[Path], chunk: int) -> dict[str, Any]:
    client = Client(server.address, "", 600.0)
    http = http_address(server)
    started = time.perf_counter()
    try:
        for tar in tars:
            await client.bs_write(tar.read_bytes(), chunk)
        seconds = time.perf_counter() - started
        for tar in (tars[0], tars[-1]):
            data = tar.read_bytes()
            pieces, _ = await client.bs_read(digest_of(data))
            if b"".join(pieces) != data:
                raise RuntimeError(f"{tar.name} read back other bytes")
    finally:
        await client.close()
    deadline = time.monotonic() + 600
    while backlog(http) != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    status = fetch_json(f"http://{http}/status")
    objects, in_bucket = bucket_bytes(server)
    return {
        "push_seconds": round(seconds, 2),
        "store_bytes": status.get("current_size_bytes"),
        "data_dir_bytes": tree_bytes(server.data_dir),
        "bucket_objects": objects,
        "bucket_bytes": in_bucket,
    }


async def artifact(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    tars = build_versions(work / "tree", args.versions)
    sizes = [t.stat().st_size for t in tars]
    result: dict[str, Any] = {"versions": len(tars), "tar_bytes": sizes, "logical_bytes": sum(sizes)}
    for mode, extra in (("chunked", []), ("whole", ["--chunking", "false"])):
        server = start_buildvault_on_bucket(
            work / mode, work / f"{mode}.log", ["--http-address", "127.0.0.1:0", *extra]
        )
        try:
            result[mode] = await push_versions(server, tars, args.write_chunk)
        finally:
            stop(server)
            shutil.rmtree(work / mode, ignore_errors=True)
    for measure in ("store_bytes", "data_dir_bytes", "bucket_bytes"):
        result[f"ratio_{measure}"] = round(result["chunked"][measure] / result["whole"][measure], 3)
    return result


# -- stream: one large blob written and read, chunking on and off --------------------------------


async def stream_once(server: Server, size: int) -> dict[str, float]:
    data = random_blob(size)
    d = digest_of(data)
    client = Client(server.address, "", 600.0)
    sampler = RssSampler(server.pid)
    sampler.start()
    try:
        cpu = cpu_seconds(server.pid)
        started = time.perf_counter()
        await client.bs_write(data, MiB)
        write_s = time.perf_counter() - started
        write_cpu = cpu_seconds(server.pid) - cpu
        # Stored whole and answered; kept as chunks once the background conversion is done.
        cpu = cpu_seconds(server.pid)
        started = time.perf_counter()
        status_url = f"http://{http_address(server)}/status"
        while fetch_json(status_url).get("chunking", {}).get("backlog_blobs", 0):
            time.sleep(0.01)
        settle_s = time.perf_counter() - started
        settle_cpu = cpu_seconds(server.pid) - cpu
        cpu = cpu_seconds(server.pid)
        started = time.perf_counter()
        pieces, _ = await client.bs_read(d)
        read_s = time.perf_counter() - started
        read_cpu = cpu_seconds(server.pid) - cpu
    finally:
        sampler.stop()
        await client.close()
    if b"".join(pieces) != data:
        raise RuntimeError("the read returned other bytes")
    return {
        "write_mib_s": size / MiB / write_s,
        "at_rest_mib_s": size / MiB / (write_s + settle_s),
        "read_mib_s": size / MiB / read_s,
        "write_cpu_s": write_cpu,
        "settle_cpu_s": settle_cpu,
        "read_cpu_s": read_cpu,
        "peak_rss_mib": sampler.peak_mib() or 0.0,
    }


async def stream(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    for rep in range(args.reps):
        order = ["on", "off"] if rep % 2 == 0 else ["off", "on"]
        for mode in order:
            extra = ["--http-address", "127.0.0.1:0"] + ([] if mode == "on" else ["--chunking", "false"])
            server = start_buildvault(work / f"stream-{mode}", work / f"stream-{mode}.log", extra)
            try:
                runs[mode].append(await stream_once(server, args.size))
            finally:
                stop(server)
                shutil.rmtree(work / f"stream-{mode}", ignore_errors=True)
    result: dict[str, Any] = {"size_mib": args.size // MiB, "runs": runs}
    for field in ("write_mib_s", "read_mib_s"):
        ratios = [on[field] / off[field] for on, off in zip(runs["on"], runs["off"], strict=True)]
        result[f"ratio_{field}"] = round(statistics.median(ratios), 3)
    # Chunking on until the blob is kept as chunks, against off's write.
    at_rest = [on["at_rest_mib_s"] / off["write_mib_s"] for on, off in zip(runs["on"], runs["off"], strict=True)]
    result["ratio_at_rest_mib_s"] = round(statistics.median(at_rest), 3)
    result["peak_rss_mib"] = {m: round(max(r["peak_rss_mib"] for r in runs[m]), 1) for m in runs}
    return result


# -- reads: what the SHA-256 of every whole read costs -------------------------------------------


def single_core() -> dict[str, float]:
    """MB/s of one core over 256 MiB: SHA-256 (what reads verify with) and cheap checksums."""
    data = random_blob(256 * MiB)
    functions: dict[str, Any] = {"sha256": lambda b: hashlib.sha256(b).digest(), "zlib_crc32": zlib.crc32}
    for module, call in (("google_crc32c", "value"), ("xxhash", "xxh3_64_intdigest")):
        with contextlib.suppress(ImportError):  # not dependencies: measured when installed
            functions[module] = getattr(__import__(module), call)
    out = {}
    for name, function in functions.items():
        started = time.perf_counter()
        function(data)
        out[name] = round(len(data) / 1e6 / (time.perf_counter() - started))
    return out


async def read_range(client: Client, name: str, limit: int) -> int:
    got = 0
    request = bs_pb2.ReadRequest(resource_name=name, read_limit=limit)
    async for response in client.bytestream.Read(request, timeout=600):
        got += len(response.data)
    return got


async def reads(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    server = start_buildvault(work / "reads", work / "reads.log", ["--chunking", "false"])
    size = args.size
    data = random_blob(size)
    d = digest_of(data)
    name = f"blobs/{d.hash}/{d.size_bytes}"
    client = Client(server.address, "", 600.0)
    runs: dict[str, list[tuple[float, float]]] = {"whole_hashed": [], "range_unhashed": []}
    try:
        await client.bs_write(data, MiB)
        del data
        for rep in range(args.reps * 2):
            for kind in ["whole_hashed", "range_unhashed"] if rep % 2 == 0 else ["range_unhashed", "whole_hashed"]:
                cpu = cpu_seconds(server.pid)
                started = time.perf_counter()
                got = await read_range(client, name, 0 if kind == "whole_hashed" else size - 1)
                seconds = time.perf_counter() - started
                if got != (size if kind == "whole_hashed" else size - 1):
                    raise RuntimeError(f"{kind} read {got} bytes")
                runs[kind].append((size / MiB / seconds, cpu_seconds(server.pid) - cpu))
    finally:
        await client.close()
        stop(server)
        shutil.rmtree(work / "reads", ignore_errors=True)
    summary = {
        kind: {
            "mib_s": round(statistics.median(r[0] for r in values), 1),
            "server_cpu_s": round(statistics.median(r[1] for r in values), 3),
        }
        for kind, values in runs.items()
    }
    return {"size_mib": size // MiB, "runs": runs, "median": summary, "single_core_mb_s": single_core()}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="artifact,stream,reads")
    parser.add_argument("--versions", type=int, default=10)
    parser.add_argument("--write-chunk", type=parse_size, default=16 << 10, help="ByteStream message size (artifact)")
    parser.add_argument("--size", type=parse_size, default=512 * MiB, help="blob size (stream, reads)")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    parts = args.parts.split(",")
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with tempfile.TemporaryDirectory(prefix="chunk-bench-") as tmp:
        work = Path(tmp)
        for part, run in (("artifact", artifact), ("stream", stream), ("reads", reads)):
            if part in parts:
                report[part] = await run(args, work)
                print(json.dumps({part: report[part]}), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
