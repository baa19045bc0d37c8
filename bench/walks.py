"""The path of a request through the code: which buildvault files and functions one request runs.

    .venv/bin/python bench/walks.py                  # the table (files, functions per request)
    .venv/bin/python bench/walks.py --list           # and every file and function of each walk

One in-process server (disk store, no bucket) on loopback; a profile hook in every thread records
each buildvault function that starts while one request is in flight (src/buildvault only, the
generated remote_apis modules left out). Each request runs three times with fresh blobs and only
what all three runs share is counted, so a background task that happens to wake (the disk's
syncer, the status sampler) does not count. The requests, as in issue 33:

- ByteStream Write of a large blob (4 MiB, 64 KiB messages);
- HTTP PUT /cas/{hash} of the same size;
- GetActionResult of an entry with an output file and an output directory (Tree), with the
  completeness check that reads the Tree and checks every file in it.

The main line leaves out what wraps a request whatever it asks (the request log, the RPC
wrappers put on at registration, the HTTP middleware, the metrics registry and the request
history they feed: WRAPPERS); the table gives both counts. Settings are the defaults: chunking
of large blobs included; `--no-chunking` stores them whole, as every commit before chunking
did. Run it at two commits to compare walks, e.g. with the older source first on the path:
`PYTHONPATH=../old/src .venv/bin/python bench/walks.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
import grpc

import buildvault
from buildvault.config import Settings
from buildvault.remote_apis import bs_grpc, bs_pb2, re_grpc, re_pb2
from buildvault.server.app import App
from buildvault.storage.chunks.store import CONVERTER_TASK

ROOT = os.path.dirname(os.path.abspath(buildvault.__file__)) + os.sep
GENERATED = os.path.join(ROOT, "remote_apis") + os.sep
LARGE = 4 << 20
# Passed by every request of a protocol, whatever it asks: not the request's main line.
WRAPPERS = frozenset(
    {"logs.py", "server/metrics.py", "server/grpc/__init__.py", "server/grpc/request_metrics.py",
     "server/grpc/recorded.py", "server/http/listener.py", "server/http/recorded.py", "history/recorder.py",
     "history/metadata.py"}
)  # fmt: skip
RUNS = 3


class Recorder:
    """A profile hook for every thread: (file, function) of each buildvault call while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.seen: set[tuple[str, str]] = set()
        self.lock = threading.Lock()
        self.loop_thread = threading.get_ident()

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        if threading.get_ident() == self.loop_thread:
            task = asyncio.current_task()
            if task is not None and task.get_name() == CONVERTER_TASK:
                return  # chunking after the write: background work, not the request's
        code = frame.f_code
        path = code.co_filename
        if path.startswith(ROOT) and not path.startswith(GENERATED):
            with self.lock:
                self.seen.add((path[len(ROOT) :], code.co_qualname))

    def install(self) -> None:
        sys.setprofile(self.hook)
        threading.setprofile(self.hook)  # every thread started from now on (the pools included)

    async def walk(
        self, request: Callable[[], Awaitable[None]], settle: Callable[[], Awaitable[None]]
    ) -> set[tuple[str, str]]:
        """What the request runs in each of RUNS runs (each once `settle` returns), intersected."""
        common: set[tuple[str, str]] | None = None
        for _ in range(RUNS):
            await settle()
            with self.lock:
                self.seen = set()
            self.on = True
            try:
                await request()
            finally:
                self.on = False
            common = set(self.seen) if common is None else common & self.seen
        return common or set()


def _digest(data: bytes) -> re_pb2.Digest:
    return re_pb2.Digest(hash=hashlib.sha256(data).hexdigest(), size_bytes=len(data))


async def _requests(name: str, data: bytes) -> AsyncIterator[bs_pb2.WriteRequest]:
    step = 64 << 10
    for offset in range(0, len(data), step):
        part = data[offset : offset + step]
        yield bs_pb2.WriteRequest(
            resource_name=name if offset == 0 else "",
            write_offset=offset,
            data=part,
            finish_write=offset + len(part) == len(data),
        )


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every file and function of each walk")
    parser.add_argument("--no-chunking", action="store_true", help="store large blobs whole (chunking = false)")
    args = parser.parse_args()
    recorder = Recorder()
    recorder.install()
    with tempfile.TemporaryDirectory(prefix="buildvault-walks-") as scratch:
        options: dict[str, Any] = {"chunking": False} if args.no_chunking else {}
        settings = Settings(
            dir=Path(scratch) / "data", grpc_address="127.0.0.1:0", http_address="127.0.0.1:0", **options
        )
        app = App(settings)
        await app.start()
        try:
            async with grpc.aio.insecure_channel(str(app.grpc_address)) as channel, aiohttp.ClientSession() as http:
                bytestream = bs_grpc.ByteStreamStub(channel)
                ac = re_grpc.ActionCacheStub(channel)
                cas = re_grpc.ContentAddressableStorageStub(channel)

                async def settled() -> None:
                    """The chunking after the write of the run before is not this run's walk."""
                    if app.stack is not None and app.stack.chunks is not None:
                        await app.stack.chunks.settled()

                async def bytestream_write() -> None:
                    data = os.urandom(LARGE)
                    d = _digest(data)
                    name = f"uploads/{uuid.uuid4()}/blobs/{d.hash}/{d.size_bytes}"
                    reply = await bytestream.Write(_requests(name, data))
                    assert reply.committed_size == len(data)

                base = f"http://{app.http_address}/cas/"

                async def http_put() -> None:
                    data = os.urandom(LARGE)
                    url = base + hashlib.sha256(data).hexdigest()
                    async with http.put(url, data=data) as response:
                        assert response.status == 200, response.status

                stored: list[re_pb2.Digest] = []

                async def prepare_entry() -> None:
                    out, inner = os.urandom(1000), os.urandom(2000)
                    tree = re_pb2.Tree(root=re_pb2.Directory(files=[re_pb2.FileNode(name="f", digest=_digest(inner))]))
                    tree_bytes = tree.SerializeToString()
                    blobs = [out, inner, tree_bytes]
                    await cas.BatchUpdateBlobs(
                        re_pb2.BatchUpdateBlobsRequest(
                            requests=[re_pb2.BatchUpdateBlobsRequest.Request(digest=_digest(b), data=b) for b in blobs]
                        )
                    )
                    action = _digest(os.urandom(32))
                    result = re_pb2.ActionResult(
                        output_files=[re_pb2.OutputFile(path="out", digest=_digest(out))],
                        output_directories=[re_pb2.OutputDirectory(path="dir", tree_digest=_digest(tree_bytes))],
                    )
                    await ac.UpdateActionResult(
                        re_pb2.UpdateActionResultRequest(action_digest=action, action_result=result)
                    )
                    stored.append(action)

                async def get_action_result() -> None:
                    action = stored.pop()
                    await ac.GetActionResult(re_pb2.GetActionResultRequest(action_digest=action))

                for _ in range(RUNS + 2):  # warm: every path taken once before it is measured
                    await bytestream_write()
                    await http_put()
                    await prepare_entry()
                    await get_action_result()
                for _ in range(RUNS):
                    await prepare_entry()
                walks = {
                    "ByteStream Write (4 MiB, disk)": await recorder.walk(bytestream_write, settled),
                    "HTTP PUT /cas/ (4 MiB, disk)": await recorder.walk(http_put, settled),
                    "GetActionResult (completeness check)": await recorder.walk(get_action_result, settled),
                }
        finally:
            await app.stop(1)
    print("| request | files, main line | functions, main line | files, all | functions, all |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, seen in walks.items():
        main_line = {(path, function) for path, function in seen if path not in WRAPPERS}
        files = len({path for path, _ in main_line})
        print(f"| {name} | {files} | {len(main_line)} | {len({path for path, _ in seen})} | {len(seen)} |")
    if args.list:
        for name, seen in walks.items():
            print(f"\n{name}:")
            by_file: dict[str, list[str]] = {}
            for path, function in sorted(seen):
                by_file.setdefault(path, []).append(function)
            for path, functions in by_file.items():
                print(f"  {path} ({len(functions)}): {', '.join(functions)}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
