#!/usr/bin/env python3
"""Memory held by abandoned half-sent uploads: server RSS while clients keep starting ByteStream
Writes, sending half of each blob and cancelling the call (the upload then stays resumable for
the server's upload grace period), and again some time after the load stops.

    python bench/abandon_bench.py --clients 20 --blob 4MiB --seconds 20 --after 70
    python bench/abandon_bench.py --clients 20 --busy 64 --seconds 90 --after 70   # issue 15's mix
    python bench/abandon_bench.py --clients 20 --busy 64 --seconds 90 --after 75 --sample 15

`--busy N` adds N clients that loop over the other calls meanwhile: FindMissingBlobs of 100
digests, BatchUpdateBlobs and BatchReadBlobs of 10 x 4 KiB, a ByteStream Write of 1-8 MiB in
64 KiB chunks and its Read, an UpdateActionResult and a GetActionResult; their failed calls
are counted by status code.

Starts its own buildvault (`--max-size 8GiB`, a temporary directory). Prints one JSON line:
uploads abandoned, calls and errors of the busy clients, and the server's memory idle, at the
peak under load, right after, and `--after` seconds later (MiB): VmRSS, and anonymous memory
(VmRSS less RssFile: LMDB's mapped data file is page cache, not the server's own).
Not a timed test; numbers go to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.harness import memory_kib
from bench.servers import start_buildvault, stop
from buildvault.config import parse_size
from buildvault.remote_apis import bs_grpc, bs_pb2, re_grpc, re_pb2

CHUNK = 64 << 10


def memory_mib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmRSS less RssFile) of a process, MiB."""
    rss, file_pages, _ = memory_kib(pid)
    return rss // 1024, (rss - file_pages) // 1024


def _blob(size: int) -> tuple[bytes, re_pb2.Digest]:
    data = os.urandom(size)
    return data, re_pb2.Digest(hash=hashlib.sha256(data).hexdigest(), size_bytes=size)


async def _read_all(bytestream: bs_grpc.ByteStreamStub, name: str) -> int:
    return sum([len(r.data) async for r in bytestream.Read(bs_pb2.ReadRequest(resource_name=name))])


async def _counted(call: Awaitable[object], calls: list[int], errors: dict[str, int]) -> None:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        errors[e.code().name] = errors.get(e.code().name, 0) + 1
    calls[0] += 1


async def busy(address: str, stop_at: float, calls: list[int], errors: dict[str, int]) -> None:
    """One client of every other kind of call, in a loop (see the module docstring)."""
    async with grpc.aio.insecure_channel(address) as channel:
        cas = re_grpc.ContentAddressableStorageStub(channel)
        ac = re_grpc.ActionCacheStub(channel)
        bytestream = bs_grpc.ByteStreamStub(channel)
        while time.monotonic() < stop_at:
            small = [_blob(4096) for _ in range(10)]
            size = random.randint(1, 8) << 20
            data, digest = _blob(size)
            action = _blob(64)[1]

            async def chunks(data: bytes = data, digest: re_pb2.Digest = digest):
                name = f"uploads/{uuid.uuid4()}/blobs/{digest.hash}/{digest.size_bytes}"
                for offset in range(0, len(data), CHUNK):
                    yield bs_pb2.WriteRequest(resource_name=name if offset == 0 else "", write_offset=offset,
                                              data=data[offset : offset + CHUNK],
                                              finish_write=offset + CHUNK >= len(data))

            name = f"blobs/{digest.hash}/{digest.size_bytes}"
            tally = (calls, errors)
            missing = re_pb2.FindMissingBlobsRequest(blob_digests=[_blob(32)[1] for _ in range(100)])
            await _counted(cas.FindMissingBlobs(missing), *tally)
            await _counted(cas.BatchUpdateBlobs(re_pb2.BatchUpdateBlobsRequest(requests=[
                re_pb2.BatchUpdateBlobsRequest.Request(digest=d, data=b) for b, d in small])), *tally)
            await _counted(cas.BatchReadBlobs(re_pb2.BatchReadBlobsRequest(digests=[d for _, d in small])), *tally)
            await _counted(bytestream.Write(chunks()), *tally)
            await _counted(_read_all(bytestream, name), *tally)
            result = re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="out", digest=digest)])
            await _counted(ac.UpdateActionResult(re_pb2.UpdateActionResultRequest(
                action_digest=action, action_result=result)), *tally)
            await _counted(ac.GetActionResult(re_pb2.GetActionResultRequest(action_digest=action)), *tally)


async def abandoner(address: str, stop_at: float, size: int, abandoned: list[int]) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        bytestream = bs_grpc.ByteStreamStub(channel)
        while time.monotonic() < stop_at:
            data = os.urandom(size)
            name = f"uploads/{uuid.uuid4()}/blobs/{hashlib.sha256(data).hexdigest()}/{size}"
            sent = asyncio.Event()
            hang = asyncio.Event()  # never set: the stream stays open until the call is cancelled

            async def requests(
                data: bytes = data, name: str = name, sent: asyncio.Event = sent, hang: asyncio.Event = hang
            ):
                for offset in range(0, size // 2, CHUNK):
                    first = name if offset == 0 else ""
                    yield bs_pb2.WriteRequest(
                        resource_name=first, write_offset=offset, data=data[offset : offset + CHUNK]
                    )
                sent.set()
                await hang.wait()

            call = bytestream.Write(requests())
            await sent.wait()
            # The bytes handed to gRPC are on their way; the server has them once its reply
            # would be possible. QueryWriteStatus says when they are committed.
            query = bs_pb2.QueryWriteStatusRequest(resource_name=name)
            while (await bytestream.QueryWriteStatus(query)).committed_size < size // 2:
                await asyncio.sleep(0.01)
            call.cancel()
            abandoned[0] += 1


async def run(args: argparse.Namespace) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="buildvault-abandon-") as tmp:
        server = start_buildvault(Path(tmp) / "data", Path(tmp) / "server.log", ["--max-size", "8GiB"])
        try:
            idle = memory_mib(server.pid)
            abandoned, calls, errors = [0], [0], {}
            stop_at = time.monotonic() + args.seconds
            tasks = [
                asyncio.create_task(abandoner(server.address, stop_at, args.blob, abandoned))
                for _ in range(args.clients)
            ] + [asyncio.create_task(busy(server.address, stop_at, calls, errors)) for _ in range(args.busy)]
            peak = idle
            while not all(task.done() for task in tasks):
                await asyncio.wait(tasks, timeout=0.5)
                now = memory_mib(server.pid)
                peak = (max(peak[0], now[0]), max(peak[1], now[1]))
            await asyncio.gather(*tasks)
            right_after = memory_mib(server.pid)
            # What is left once the grace period passed, and on the way there every --sample seconds.
            marks: dict[str, int] = {}
            waited = 0.0
            while waited < args.after:
                step = min(args.sample or args.after, args.after - waited)
                await asyncio.sleep(step)
                waited += step
                marks[f"{waited:g}"] = memory_mib(server.pid)[1]
            later = memory_mib(server.pid)
        finally:
            stop(server)
    return {
        "clients": args.clients, "blob": args.blob, "seconds": args.seconds, "abandoned": abandoned[0],
        "busy_clients": args.busy, "busy_calls": calls[0], "busy_errors": errors,
        "rss_idle_mib": idle[0], "rss_peak_mib": peak[0], "rss_right_after_mib": right_after[0],
        f"rss_{args.after:g}s_after_mib": later[0],
        "anon_idle_mib": idle[1], "anon_peak_mib": peak[1], "anon_right_after_mib": right_after[1],
        f"anon_{args.after:g}s_after_mib": later[1], "anon_after_mib_by_second": marks,
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--blob", type=parse_size, default=parse_size("4MiB"))
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--after", type=float, default=70.0, help="seconds to wait after the load")
    parser.add_argument("--busy", type=int, default=0, help="clients of every other kind of call meanwhile")
    parser.add_argument("--sample", type=float, default=0.0, help="also sample memory every S seconds after the load")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
