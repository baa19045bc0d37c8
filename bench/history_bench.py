#!/usr/bin/env python3
"""The history's cost and the build pages' speed (issue 37):

1. The CPU of a recorded call in process (the wrapper on the event loop, the insert in the
   writer thread); the server's CPU per GetActionResult / UpdateActionResult with the history
   on and off; then ActionCache get/update and FindMissingBlobs at c1 and c16 through the
   harness, every call carrying Bazel's `requestmetadata-bin`, against `--history true` and
   `--history false`, interleaved (on, off, off, on, ...), `--reps` times each: medians of ops/s
   and the ratio. FindMissingBlobs is not recorded: no wrapper is put on it.
2. `/invocation/<id>` of an invocation of 10,000 actions (a miss and an upload each) and
   `/compare/<a>/<b>` of two actions of 5,000 inputs each (one in ten changed): the median
   wall time of `--page-reps` requests, against an in-process server.

    .venv/bin/python bench/history_bench.py                    # ~6 min on 2 cores
    .venv/bin/python bench/history_bench.py --reps 1 --no-ab   # the pages only

Prints numbers; not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from bench.servers import start_buildvault, stop  # noqa: E402

SCENARIOS = "ac_get_c1,ac_get_c16,ac_update_c1,ac_update_c16,fmb_c1,fmb_c16"


def run_ab(reps: int, scenarios: str) -> None:
    results: dict[tuple[str, str], list[float]] = {}
    order = ["true", "false"]
    with tempfile.TemporaryDirectory(prefix="history-bench-") as tmp:
        for rep in range(reps):
            for mode in order if rep % 2 == 0 else order[::-1]:
                data = Path(tmp) / f"{mode}-{rep}"
                flags = ["--history", mode, "--processes", "1"]
                server = start_buildvault(data, Path(tmp) / f"{mode}-{rep}.log", flags)
                out = Path(tmp) / f"{mode}-{rep}.json"
                try:
                    subprocess.run(
                        [sys.executable, "-m", "bench.harness", "--target", server.address, "--scenarios", scenarios,
                         "--request-metadata", "--json-out", str(out)],
                        cwd=ROOT, check=True, capture_output=True, timeout=900,
                    )  # fmt: skip
                finally:
                    stop(server)
                for item in _results(out):
                    results.setdefault((item["scenario"], mode), []).append(float(item["ops_per_s"]))
    print(f"history on vs off, {reps} interleaved runs each, every call with requestmetadata-bin")
    print(f"{'scenario':<16} {'on ops/s':>10} {'off ops/s':>10} {'on/off':>7}")
    for scenario in scenarios.split(","):
        on = results.get((scenario, "true"), [])
        off = results.get((scenario, "false"), [])
        if on and off:
            a, b = statistics.median(on), statistics.median(off)
            print(f"{scenario:<16} {a:>10.0f} {b:>10.0f} {a / b:>7.3f}")


def _results(path: Path) -> list[dict[str, object]]:
    """(scenario, ops/s) of a harness --json-out document (`value` in ops/s for these scenarios)."""
    document = json.loads(path.read_text())
    return [
        {"scenario": r["scenario"], "ops_per_s": r["value"]}
        for r in document["results"]
        if r.get("ok") and r.get("value") is not None
    ]


def _server_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_cpu_ab(reps: int, calls: int = 8000) -> None:
    """Server CPU per call (utime + stime of the server process, every thread), history on and off,
    interleaved: on a machine whose other load swings ops/s by 30 % this is the steadier measure."""
    import grpc

    from buildvault.history.metadata import metadata_header
    from buildvault.remote_apis import re_grpc, re_pb2

    header = [metadata_header(tool="bazel", tool_version="4.2.3", invocation=str(os.getpid()), action_id="0" * 64,
                              mnemonic="CppCompile", target="//bench:lib")]  # fmt: skip

    async def drive(address: str, method: str, n: int, concurrency: int) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            ac = re_grpc.ActionCacheStub(channel)
            digest = re_pb2.Digest(hash=hashlib.sha256(address.encode()).hexdigest(), size_bytes=140)
            result = re_pb2.ActionResult(exit_code=1, stdout_raw=b"x")
            update = re_pb2.UpdateActionResultRequest(action_digest=digest, action_result=result)
            await ac.UpdateActionResult(update, metadata=header)
            get = re_pb2.GetActionResultRequest(action_digest=digest)

            async def worker(k: int) -> None:
                for _ in range(k):
                    if method == "get":
                        await ac.GetActionResult(get, metadata=header)
                    else:
                        await ac.UpdateActionResult(update, metadata=header)

            await asyncio.gather(*(worker(n // concurrency) for _ in range(concurrency)))

    figures: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="history-cpu-") as tmp:
        for rep in range(reps):
            for mode in ("true", "false") if rep % 2 == 0 else ("false", "true"):
                flags = ["--history", mode, "--processes", "1", "--local-workers", "0"]
                server = start_buildvault(Path(tmp) / f"{mode}{rep}", Path(tmp) / f"{mode}{rep}.log", flags)
                try:
                    for method in ("get", "update"):
                        asyncio.run(drive(server.address, method, 500, 1))  # warm
                        before = _server_cpu(server.process.pid)
                        asyncio.run(drive(server.address, method, calls, 4))
                        time.sleep(1.0)  # the writer thread's last batch (0.5 s period)
                        used = _server_cpu(server.process.pid) - before
                        figures.setdefault((method, mode), []).append(1e6 * used / calls)
                finally:
                    stop(server)
    print(f"server CPU per call, history on vs off, {reps} interleaved servers each, {calls:,} calls at c4:")
    for method in ("get", "update"):
        on = statistics.median(figures[(method, "true")])
        off = statistics.median(figures[(method, "false")])
        name = "GetActionResult" if method == "get" else "UpdateActionResult"
        print(f"  {name:<20} on {on:.0f} us, off {off:.0f} us, on/off {on / off:.3f}")


def run_cost(calls: int = 20_000) -> None:
    """CPU per recorded call, without the network: the gRPC wrapper around a handler that does
    nothing (clock reads, header parse, one queued tuple), and the writer thread's insert."""
    import grpc

    from buildvault.history import Recorder
    from buildvault.history.metadata import metadata_header
    from buildvault.remote_apis import re_pb2
    from buildvault.server.grpc.recorded import recorded

    header = metadata_header(tool="bazel", tool_version="4.2.3", invocation=str(os.getpid()), action_id="0" * 64,
                             mnemonic="CppCompile", target="//bench:lib", configuration="k8-fastbuild")  # fmt: skip

    class Context:
        def invocation_metadata(self) -> tuple[tuple[str, object], ...]:
            return (("user-agent", "grpc-java-netty/1.33.1"), header)

        def code(self) -> None:
            return None

    async def handler(request: object, context: object) -> object:
        return request

    handlers = grpc.unary_unary_rpc_method_handler(handler)
    request = re_pb2.GetActionResultRequest(action_digest=re_pb2.Digest(hash="a" * 64, size_bytes=140))

    async def measure() -> tuple[float, float, float]:
        with tempfile.TemporaryDirectory(prefix="history-cost-") as tmp:
            recorder = Recorder(Path(tmp) / "h.sqlite", max_pending=calls + 1, prune=False)
            await recorder.start()
            wrapped = recorded(recorder, "/build.bazel.remote.execution.v2.ActionCache/GetActionResult", handlers)
            context = Context()
            start = time.process_time()
            for _ in range(calls):
                await handler(request, context)
            bare = time.process_time() - start
            start = time.process_time()
            for _ in range(calls):
                await wrapped.unary_unary(request, context)
            with_history = time.process_time() - start
            start = time.process_time()
            await recorder.flush()  # the writer thread: process time counts every thread
            write = time.process_time() - start
            await recorder.close()
            return bare, with_history, write

    bare, with_history, write = asyncio.run(measure())
    print(f"recorded call, CPU: wrapper {1e6 * (with_history - bare) / calls:.1f} us on the event loop, "
          f"insert {1e6 * write / calls:.1f} us in the writer thread ({calls:,} calls)")


async def run_pages(page_reps: int) -> None:
    import aiohttp

    from buildvault.config import Settings
    from buildvault.digest import Digest
    from buildvault.history.metadata import metadata_header, parse_metadata
    from buildvault.remote_apis import re_pb2
    from buildvault.server.app import App
    from buildvault.storage.memory import MemoryActionStore, MemoryBlobStore

    with tempfile.TemporaryDirectory(prefix="history-pages-") as tmp:
        settings = Settings(dir=Path(tmp), grpc_address="127.0.0.1:0", http_address="127.0.0.1:0", local_workers="0",
                            processes=1)  # fmt: skip
        blobs = MemoryBlobStore()
        app = App(settings, blobs=blobs, actions=MemoryActionStore())
        await app.start()
        try:
            recorder = app.services.history
            assert recorder is not None
            meta = parse_metadata([metadata_header(tool="bazel", invocation="big", mnemonic="CppCompile",
                                                   target="//big:lib")])  # fmt: skip
            now = time.time() - 3600
            for n in range(10_000):
                digest = f"{hashlib.sha256(str(n).encode()).hexdigest()}/140"
                recorder.record("grpc", "ac_get", "", digest, "miss", "NOT_FOUND", 0, now + n * 0.01, 0.001, meta)
                recorder.record("grpc", "ac_update", "", digest, "upload", "OK", 0, now + n * 0.01, 0.002, meta)
            await recorder.flush()

            async def tree(changed: bool) -> Digest:
                root = re_pb2.Directory()
                items = []
                for d in range(50):
                    sub = re_pb2.Directory()
                    for f in range(100):
                        content = f"{d}/{f}/{'new' if changed and f % 10 == 0 else 'old'}".encode()
                        fd = Digest.of(content)
                        items.append((fd, content))
                        sub.files.add(name=f"file_{f:03}.h", digest=fd.to_proto(re_pb2.Digest))
                    data = sub.SerializeToString()
                    sd = Digest.of(data)
                    items.append((sd, data))
                    root.directories.add(name=f"dir_{d:02}", digest=sd.to_proto(re_pb2.Digest))
                data = root.SerializeToString()
                rd = Digest.of(data)
                items.append((rd, data))
                await blobs.write_blobs(items)
                return rd

            actions = []
            for changed in (False, True):
                root = await tree(changed)
                arguments = ["cc", "-O2" if changed else "-O1", "-c", "x.cc"]
                command = re_pb2.Command(arguments=arguments, output_files=["x.o"])
                cd = Digest.of(command.SerializeToString())
                action = re_pb2.Action(command_digest=cd.to_proto(re_pb2.Digest),
                                       input_root_digest=root.to_proto(re_pb2.Digest))  # fmt: skip
                ad = Digest.of(action.SerializeToString())
                await blobs.write_blobs([(cd, command.SerializeToString()), (ad, action.SerializeToString())])
                actions.append(ad)

            async with aiohttp.ClientSession(f"http://{app.http_address}") as http:

                async def timed(url: str) -> float:
                    times = []
                    for _ in range(page_reps):
                        start = time.perf_counter()
                        async with http.get(url) as response:
                            body = await response.read()
                            assert response.status == 200, body[:300]
                        times.append(time.perf_counter() - start)
                    return statistics.median(times) * 1000

                a, b = actions
                invocation_ms = await timed("/invocation/big")
                all_ms = await timed("/invocation/big?misses=all")
                compare_ms = await timed(f"/compare/{a.hash}-{a.size_bytes}/{b.hash}-{b.size_bytes}")
            print(f"/invocation/<id>, 10,000 actions (20,000 calls, all missed): median {invocation_ms:.0f} ms"
                  f" of {page_reps}; with every miss listed (?misses=all, 10,000 rows): {all_ms:.0f} ms")
            print(f"/compare/<a>/<b>, 5,000 inputs each, 500 changed: median {compare_ms:.0f} ms of {page_reps}")
        finally:
            await app.stop(grace=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="interleaved runs per mode (default %(default)s)")
    parser.add_argument("--page-reps", type=int, default=7, help="requests per page (default %(default)s)")
    parser.add_argument("--scenarios", default=SCENARIOS)
    parser.add_argument("--no-ab", action="store_true", help="only the pages")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    run_cost()
    asyncio.run(run_pages(args.page_reps))
    if not args.no_ab:
        run_cpu_ab(max(args.reps, 2))
        run_ab(args.reps, args.scenarios)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
