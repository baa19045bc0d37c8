#!/usr/bin/env python3
"""Server CPU seconds per whole ByteStream read: buildvault against BuildGrid 0.9.1, alternated.

    .venv/bin/python bench/read_cpu.py [--size 512MiB] [--reps 2] [--reads 3] [--serve-args '--chunking false']
    .venv/bin/python bench/read_cpu.py --pin --client-warm --reads 8    # steady state, own CPUs

Each repetition starts a fresh server of each kind in turn (order rotated), writes one fresh
random blob of `--size` (1 MiB messages), reads it back whole `--reads` times and compares every
read byte for byte. Per read: MiB/s, the server's CPU seconds (user + system, /proc), and this
client's own. CPU seconds are steadier than MiB/s on a shared machine. --client-warm: the
harness's (glibc keeps freed memory, one untimed read first); --pin: each server on CPU 0, this
client on CPU 1, as bench/compare.py --pin. BuildGrid 0.9.1 comes from
`bench/.venv-buildgrid-0.9` (made by bench/compare.py). Prints one line per server and repetition,
then the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.harness import Client, cpu_seconds, digest_of, keep_memory, random_blob
from bench.servers import Server, start_buildgrid_09, start_buildvault, stop
from buildvault.config import parse_size

MiB = 1 << 20
KINDS = ("buildvault", "buildgrid-0.9")


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def measure(server: Server, size: int, reads: int, warm: bool) -> list[tuple[float, float, float]]:
    data = random_blob(size)
    digest = digest_of(data)
    client = Client(server.address, "", 600.0)
    out = []
    try:
        await client.bs_write(data, MiB)
        if warm:  # untimed, as the harness's --client-warm
            pieces, _ = await client.bs_read(digest)
            if b"".join(pieces) != data:
                raise RuntimeError(f"{server.name}: the read returned other bytes")
            del pieces
        for _ in range(reads):
            server_cpu, client_cpu, started = cpu_seconds(server.pid), own_cpu(), time.perf_counter()
            pieces, _ = await client.bs_read(digest)
            wall = time.perf_counter() - started
            out.append((size / MiB / wall, cpu_seconds(server.pid) - server_cpu, own_cpu() - client_cpu))
            if b"".join(pieces) != data:
                raise RuntimeError(f"{server.name}: the read returned other bytes")
            del pieces
    finally:
        await client.close()
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=512 * MiB)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--reads", type=int, default=3, help="whole reads of the blob per server")
    parser.add_argument("--serve-args", default="", help="more `buildvault serve` arguments")
    parser.add_argument("--client-warm", action="store_true", help="as the harness's --client-warm")
    parser.add_argument("--pin", action="store_true", help="servers on CPU 0, this client on CPU 1")
    args = parser.parse_args()
    cpus = {0} if args.pin else None
    if args.pin:
        os.sched_setaffinity(0, {1})
    if args.client_warm:
        keep_memory()
    runs: dict[str, list[tuple[float, float, float]]] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory(prefix="bv-read-cpu-") as tmp:
        for rep in range(args.reps):
            for kind in KINDS if rep % 2 == 0 else KINDS[::-1]:
                work = Path(tmp) / kind
                if kind == "buildvault":
                    server = start_buildvault(work / "data", work / "log", shlex.split(args.serve_args), cpus=cpus)
                else:
                    server = start_buildgrid_09(work / "data", work / "log", cpus=cpus)
                try:
                    got = await measure(server, args.size, args.reads, args.client_warm)
                finally:
                    stop(server)
                    shutil.rmtree(work, ignore_errors=True)
                runs[kind] += got
                figures = "  ".join(f"{m:.0f} MiB/s, server {s:.2f} s, client {c:.2f} s" for m, s, c in got)
                print(f"rep {rep} {kind}: {figures}  (load {os.getloadavg()[0]:.2f})", flush=True)
    for kind, values in runs.items():
        print(f"{kind}: median {statistics.median(v[0] for v in values):.0f} MiB/s, server CPU "
              f"{statistics.median(v[1] for v in values):.3f} s, client CPU "
              f"{statistics.median(v[2] for v in values):.3f} s per read of {args.size // MiB} MiB")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
