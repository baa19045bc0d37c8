#!/usr/bin/env python3
"""What this machine allows: buildvault beside the transport floors and BuildGrid 0.9, and the raw
SHA-256 and disk figures, in one interleaved sitting (issue 15: "the physical floor ... goes in
RESULTS.md beside it").

    .venv/bin/python bench/floors.py --reps 3
    .venv/bin/python bench/floors.py --reps 1 --scenarios 'fmb_c1,batch_read_*' --no-peer

Each repetition runs bench/harness.py, in rotated order, against a fresh buildvault, the two
floor servers of bench/floor_server.py (every call answered from a dict in memory: grpc.aio, as
buildvault serves, and grpc's thread-pool server, as BuildGrid serves) and BuildGrid 0.9.1
(bench/compare.py makes its venv). Prints, as markdown, the medians, buildvault as a share of
the aio floor, buildvault's server CPU per harness CPU over the aio floor's (the harness does
the same work against both, so this ratio holds when the machine's speed swings), and what each
issue-15 target asks in absolute terms beside the best floor: a target above every floor cannot
be reached by any Python gRPC server on this machine.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import compare, servers  # noqa: E402

FLOORS = ("floor-aio", "floor-sync")
PEER = "buildgrid-0.9"


def start(name: str, data: Path, log_path: Path) -> servers.Server:
    if name.startswith("floor-"):
        return servers.start_floor(name.removeprefix("floor-"), log_path)
    return compare.start(name, data, log_path)


def sha256_mb_s(size: int, seconds: float = 1.0) -> float:
    """One thread hashing `size`-byte buffers, MB/s."""
    data = os.urandom(size)
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(max(1, (1 << 22) // size)):
            hashlib.sha256(data).digest()
            done += size
    return done / (time.perf_counter() - start) / 1e6


def fdatasync_ms(directory: Path, count: int = 200) -> float:
    """Median latency of write(4 KiB) + fdatasync to one file in `directory`, ms."""
    samples = []
    path = directory / "fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        block = os.urandom(4096)
        for i in range(count):
            start = time.perf_counter()
            os.pwrite(fd, block, i * 4096)
            os.fdatasync(fd)
            samples.append(time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink()
    return statistics.median(samples) * 1000


def sequential_write_mb_s(directory: Path, size: int = 256 << 20) -> float:
    """write + fsync of one `size`-byte file in 1 MiB writes, MB/s."""
    path = directory / "write-probe"
    block = os.urandom(1 << 20)
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(size // len(block)):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    path.unlink()
    return size / seconds / 1e6


def page_cache_write_mib_s(directory: Path, size: int = 512 << 20) -> tuple[float, float]:
    """write() of a new `size`-byte file in 1 MiB writes, no fsync, MiB/s: once, then again at
    once after unlinking the first (so the second reuses the page-cache pages the first freed).

    On a VM that hands freed memory back to its host (virtio free page reporting), the first
    pass pays a host fault per fresh page; that, not the disk, is what new bytes cost here."""
    block = os.urandom(1 << 20)
    rates = []
    for _ in range(2):
        path = directory / "page-cache-probe"
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(size // len(block)):
                os.write(fd, block)
        finally:
            os.close(fd)
        rates.append(size / (1 << 20) / (time.perf_counter() - start))
        path.unlink()
    return rates[0], rates[1]


def machine_floors(directory: Path) -> list[tuple[str, str]]:
    first, again = page_cache_write_mib_s(directory)
    return [
        ("SHA-256, one thread, 4 KiB buffers", f"{sha256_mb_s(4096):,.0f} MB/s"),
        ("SHA-256, one thread, 1 MiB buffers", f"{sha256_mb_s(1 << 20):,.0f} MB/s"),
        ("write 4 KiB + fdatasync, median", f"{fdatasync_ms(directory):.2f} ms"),
        ("sequential write 256 MiB + fsync", f"{sequential_write_mb_s(directory):,.0f} MB/s"),
        ("write() 512 MiB into the page cache, no fsync: first pass / again at once",
         f"{first:,.0f} / {again:,.0f} MiB/s"),
    ]  # fmt: skip


def cpu_share(runs: list[dict[str, Any]], scenario: str) -> float | None:
    """Median over the repetitions of the server's CPU over the harness's in `scenario`."""
    shares = [
        row["detail"]["server_per_client_cpu"]
        for document in runs for row in document.get("results", [])
        if row["scenario"] == scenario and "server_per_client_cpu" in row.get("detail", {})
    ]  # fmt: skip
    return statistics.median(shares) if shares else None


def report(names: list[str], runs: dict[str, list[dict[str, Any]]], machine: list[tuple[str, str]],
           command: str, load: tuple[str, str]) -> str:
    order, table = compare.summarize(runs)
    peer_columns = ("BG 0.9 | target asks | ", "---: | ---: | ") if PEER in names else ("", "")
    lines = [
        f"```sh\n{command}\n```",
        "",
        f"load average at start {load[0]}, at end {load[1]}; repetitions: {len(runs['buildvault'])}",
        "",
        f"| scenario | unit | buildvault | floor aio | floor sync | {peer_columns[0]}bv / floor aio "
        "| server CPU per harness CPU, bv / floor aio |",
        f"| --- | --- | ---: | ---: | ---: | {peer_columns[1]}---: | ---: |",
    ]
    for scenario in order:
        entry = table[scenario]
        if not entry["higher"]:
            continue
        medians = {name: compare.stats(entry["values"][name])[0] for name in names}
        cells = [scenario, entry["unit"], *(compare.fmt(medians[n]) for n in ("buildvault", *FLOORS))]
        if PEER in names:
            want = compare.TARGETS.get(scenario)
            peer = medians[PEER]
            cells.append(compare.fmt(peer))
            cells.append(compare.fmt(want * peer) if want and peer else "")
        floor = medians["floor-aio"]
        cells.append(f"{medians['buildvault'] / floor:.2f}" if floor and medians["buildvault"] else "—")
        cpu_bv, cpu_floor = cpu_share(runs["buildvault"], scenario), cpu_share(runs["floor-aio"], scenario)
        cells.append(f"{cpu_bv / cpu_floor:.2f}" if cpu_bv and cpu_floor else "—")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| this machine | figure |", "| --- | ---: |"]
    lines += [f"| {what} | {figure} |" for what, figure in machine]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--scenarios", help="harness scenario filter, e.g. 'fmb_*,bs_*_512MiB*'")
    parser.add_argument("--no-peer", action="store_true", help="leave BuildGrid 0.9 out")
    parser.add_argument("--quick", action="store_true", help="harness --quick sizes (a smoke test of this script)")
    parser.add_argument("--run-timeout", type=float, default=900.0)
    # compare.run_harness's options: the harness as compare.py runs it (warm client), never pinned.
    parser.add_argument("--no-client-warm", dest="client_warm", action="store_false",
                        help="run the harness without --client-warm (a cold client: first-touch memory)")  # fmt: skip
    parser.set_defaults(pin=False)
    args = parser.parse_args(argv)
    names = ["buildvault", *FLOORS] + ([] if args.no_peer else [PEER])
    if not args.no_peer:
        compare.ensure_buildgrid(servers.BUILDGRID_09_VENV, "0.9.1", False, python=compare.find_python313(None))
    command = " ".join([".venv/bin/python", "bench/floors.py", *(sys.argv[1:] if argv is None else argv)])
    load_start = compare.load_average()
    workdir = Path(tempfile.mkdtemp(prefix="buildvault-floors-"))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    try:
        for rep in range(args.reps):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                compare.log(f"repetition {rep + 1}/{args.reps}: {name}")
                data = workdir / f"{name}-{rep}"
                server = start(name, data, workdir / f"{name}-{rep}.log")
                try:
                    out = workdir / f"{name}-{rep}.json"
                    runs[name].append(compare.run_harness(server, args, out, workdir / f"{name}-{rep}.out"))
                finally:
                    servers.stop(server)
                    servers.remove(data)
        machine = machine_floors(workdir)
    finally:
        servers.remove(workdir)
    print(report(names, runs, machine, command, (load_start, compare.load_average())))
    return 0 if all(d.get("exit_code") == 0 for docs in runs.values() for d in docs) else 1


if __name__ == "__main__":
    sys.exit(main())
