#!/usr/bin/env python3
"""The disk store's records under eviction churn: does LMDB's data file stay within the cap?
And how long a restart takes with many records, after kill -9 and after a clean stop.

    .venv/bin/python bench/records_churn.py [--cap-mib 4] [--blobs 8000] [--restart 200000]

For each mix of sizes, writes `--blobs` blobs in batches of 100 through a DiskStorage with a
cap of `--cap-mib` MiB (eviction hold 0: plain LRU), then prints the bytes the index counts,
the data file's bytes on disk, and their ratio to the cap. Records' sizes count in the cap by
records.charge; LMDB reuses freed pages but never shrinks its file (storage/disk/records.py).
With --restart N: N blobs of 1 KiB are written, the store abandoned as a killed process leaves
it (the snapshot is older than the writes: the records' keys are walked) and reopened, then
closed cleanly and reopened (the snapshot matches LMDB: nothing is walked); both opens timed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from buildvault.digest import Digest  # noqa: E402
from buildvault.storage.disk import DiskStorage  # noqa: E402

KiB = 1024
MIXES: dict[str, Callable[[int], int]] = {
    "4 KiB": lambda n: 4 * KiB,
    "random up to 4 KiB": lambda n: random.randint(100, 4 * KiB),
    "random up to 16 KiB": lambda n: random.randint(100, 16 * KiB),
    "4 KiB + every 10th 8 KiB": lambda n: 8 * KiB if n % 10 == 0 else 4 * KiB,
    "4 KiB + every 10th 16 KiB": lambda n: 16 * KiB if n % 10 == 0 else 4 * KiB,
}


async def churn(root: Path, cap: int, blobs: int, size: Callable[[int], int]) -> tuple[int, int]:
    storage = await DiskStorage.open(root, cap, hold_seconds=0, sync_interval=None)
    try:
        for start in range(0, blobs, 100):
            batch = []
            for n in range(start, start + 100):
                data = os.urandom(size(n))
                batch.append((Digest.of(data), data))
            await storage.cas.write_blobs(batch)
        await storage.wait_idle()
        return storage.stats().used_bytes, int((await storage.record_stats())["disk_bytes"])
    finally:
        await storage.close()


async def restart(root: Path, count: int) -> None:
    storage = await DiskStorage.open(root, 64 << 30, sync_interval=None, checkpoint_interval=None)
    for _batch in range(0, count, 1000):
        batch = []
        for _ in range(1000):
            data = os.urandom(1024)
            batch.append((Digest.of(data), data))
        await storage.cas.write_blobs(batch)
    storage.abandon()
    started = time.perf_counter()
    storage = await DiskStorage.open(root, 64 << 30, sync_interval=None, checkpoint_interval=None)
    unclean = time.perf_counter() - started
    walked = storage.load_info["records_walked"]
    await storage.close()
    started = time.perf_counter()
    storage = await DiskStorage.open(root, 64 << 30, sync_interval=None, checkpoint_interval=None)
    clean = time.perf_counter() - started
    assert storage.stats().blob_count == count
    await storage.close()
    print(f"\nrestart with {count} records: after kill -9 {unclean:.2f} s ({walked} keys walked), clean {clean:.2f} s")


async def main_async(args: argparse.Namespace) -> None:
    if args.restart:
        with tempfile.TemporaryDirectory(prefix="bv-restart-") as tmp:
            await restart(Path(tmp), args.restart)
        return
    cap = args.cap_mib << 20
    print("| sizes | counted (MiB) | data file on disk (MiB) | data file / cap |\n| --- | ---: | ---: | ---: |")
    for name, size in MIXES.items():
        with tempfile.TemporaryDirectory(prefix="bv-churn-") as tmp:
            used, disk = await churn(Path(tmp), cap, args.blobs, size)
        print(f"| {name} | {used / 2**20:.2f} | {disk / 2**20:.2f} | {disk / cap:.2f} |", flush=True)
    print(f"\ncap {args.cap_mib} MiB, {args.blobs} blobs per mix, batches of 100")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cap-mib", type=int, default=4)
    parser.add_argument("--blobs", type=int, default=8000)
    parser.add_argument("--restart", type=int, default=0, help="time restarts with this many records instead")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
