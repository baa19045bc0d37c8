"""Start-up time and index memory of the disk store, plus a few hot-path timings. Prints JSON.

    .venv/bin/python bench/disk_restart.py [--blobs 100000] [--dir DIR] [--keep]
    .venv/bin/python bench/disk_restart.py --records --blobs 10000000 --no-throughput

Creates N small blobs directly in the on-disk layout (fast; the store's write path is measured
separately), then times DiskStorage.open(): without a snapshot (every directory listed, every
file stat'ed for its mtime) and with one (after a clean close: no directory changed, none listed).
A third open follows changes to every sha256 directory (the worst case after a crash: only
changed directories are listed, only unknown files stat'ed). Index bytes/blob is tracemalloc's
count of what open() keeps, divided by N.

--records: the blobs are LMDB records, as the server keeps blobs up to 16 KiB (written with the
store's own records.put_many), for counts no file tree holds: the first open walks the records,
the second loads the snapshot. Index memory is then the process's anonymous resident memory
(VmRSS less RssFile: LMDB's map is file pages) after the timed open less before it (tracemalloc
would take hours at 10 M); the crash case (files) is skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness import memory_kib  # noqa: E402
from buildvault.digest import Digest  # noqa: E402
from buildvault.storage.disk import DiskStorage, records  # noqa: E402
from buildvault.storage.disk.core import cas_key  # noqa: E402


def create_blobs(root: Path, count: int, write: bool = True) -> list[Digest]:
    """Blob i is 8..128 bytes; with write=False only the digests (to reuse a directory made before)."""
    base = root / "cas" / "sha256"
    for i in range(256):
        (base / f"{i:02x}").mkdir(parents=True, exist_ok=True)
    digests = []
    for i in range(count):
        data = blob_data(i)
        digest = Digest(hashlib.sha256(data).hexdigest(), len(data))
        if write:
            with open(base / digest.hash[:2] / f"{digest.hash}-{digest.size_bytes}", "wb") as f:
                f.write(data)
        digests.append(digest)
    return digests


def blob_data(i: int) -> bytes:
    return i.to_bytes(8, "big") * (1 + i % 16)


async def create_records(root: Path, count: int) -> list[Digest]:
    """Blob i (as create_blobs) as a record; returns a sample of 500 digests, not all (memory)."""
    storage = await DiskStorage.open(root, 1 << 40, checkpoint_interval=None)
    await storage.close()  # the store's directories
    store = records.Records(str(root / "records"), 1 << 40, records.RECORD_LIMIT)
    store.open()
    sample = []
    step = max(1, count // 500)
    try:
        for start in range(0, count, 10_000):
            items = []
            for i in range(start, min(count, start + 10_000)):
                data = blob_data(i)
                digest = Digest(hashlib.sha256(data).hexdigest(), len(data))
                items.append((cas_key(digest), data, None))
                if i % step == 0 and len(sample) < 500:
                    sample.append(digest)
            assert records.put_many(store, items) == [None] * len(items)
    finally:
        store.close()
    return sample


def anonymous_rss() -> int:
    """This process's resident memory less file-backed pages (LMDB's map), bytes."""
    rss, file_pages, _ = memory_kib(os.getpid())
    return (rss - file_pages) * 1024


async def timed_open(root: Path, max_size: int) -> tuple[DiskStorage, float]:
    started = time.perf_counter()
    storage = await DiskStorage.open(root, max_size, checkpoint_interval=None)
    return storage, time.perf_counter() - started


async def chunks_of(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def throughput(root: Path, rounds: int = 3) -> dict[str, float]:
    """MB/s of a 64 MiB blob written in 16 KiB chunks (as Bazel sends them) and read back."""
    storage = await DiskStorage.open(root, 1 << 33, checkpoint_interval=None)
    writes, reads = [], []
    for _ in range(rounds):
        data = os.urandom(64 << 20)
        digest = Digest.of(data)
        started = time.perf_counter()
        await storage.cas.write(digest, chunks_of(data, 16 * 1024))
        writes.append(64 / (time.perf_counter() - started))
        started = time.perf_counter()
        total = 0
        async for chunk in await storage.cas.read(digest):
            total += len(chunk)
        reads.append(64 / (time.perf_counter() - started))
        assert total == len(data)
    await storage.close()
    return {"write_64MiB_MBps": round(statistics.median(writes)), "read_64MiB_MBps": round(statistics.median(reads))}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blobs", type=int, default=100_000)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--reuse", action="store_true", help="the blobs already exist in --dir (from --keep)")
    parser.add_argument("--no-throughput", action="store_true")
    parser.add_argument("--records", action="store_true", help="the blobs as LMDB records (see above)")
    args = parser.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="bv-disk-bench-"))
    root = work / "store"
    max_size = 1 << 40
    result: dict[str, object] = {"blobs": args.blobs}
    try:
        started = time.perf_counter()
        if args.records:
            digests = await create_records(root, args.blobs)
        else:
            digests = create_blobs(root, args.blobs, write=not args.reuse)
        result["create_seconds"] = round(time.perf_counter() - started, 2)
        (root / "index.lru").unlink(missing_ok=True)
        result["loadavg_1min"] = os.getloadavg()[0]

        storage, seconds = await timed_open(root, max_size)  # no snapshot yet: stat per blob
        result["open_without_snapshot_seconds"] = round(seconds, 3)
        result["open_without_snapshot_stat_calls"] = storage.load_info["stat_calls"]
        started = time.perf_counter()
        await storage.close()  # writes the LRU snapshot
        result["close_seconds"] = round(time.perf_counter() - started, 3)

        storage, seconds = await timed_open(root, max_size)
        result["open_with_snapshot_seconds"] = round(seconds, 3)
        result["open_with_snapshot_stat_calls"] = storage.load_info["stat_calls"]
        result["open_with_snapshot_scanned_dirs"] = storage.load_info["scanned_dirs"]
        assert storage.stats().blob_count == args.blobs

        probe = digests[:: max(1, len(digests) // 500)][:500] + [Digest.of(str(i).encode()) for i in range(500)]
        timings = []
        for _ in range(20):
            started = time.perf_counter()
            missing = await storage.cas.find_missing(probe)
            timings.append(time.perf_counter() - started)
        assert len(missing) == 500
        result["find_missing_1000_ms"] = round(statistics.median(timings) * 1000, 3)
        await storage.close()
        if args.records:
            gc.collect()
            before = anonymous_rss()
            storage, seconds = await timed_open(root, max_size)
            result["open_with_snapshot_again_seconds"] = round(seconds, 3)
            result["index_rss_bytes_per_blob"] = round((anonymous_rss() - before) / args.blobs, 1)
            result["index_rss_gib"] = round((anonymous_rss() - before) / (1 << 30), 2)
            await storage.close()
            print(json.dumps(result, indent=2))
            return

        # Worst crash recovery: every sha256 directory changed after the last snapshot.
        await asyncio.sleep(0.05)
        shards: set[str] = set()
        i = 0
        while len(shards) < 256:  # one new blob in each shard
            data = f"after the snapshot {i}".encode()
            i += 1
            digest = Digest(hashlib.sha256(data).hexdigest(), len(data))
            if digest.hash[:2] not in shards:
                shards.add(digest.hash[:2])
                (root / "cas" / "sha256" / digest.hash[:2] / f"{digest.hash}-{len(data)}").write_bytes(data)
        storage, seconds = await timed_open(root, max_size)
        result["open_all_dirs_changed_seconds"] = round(seconds, 3)
        result["open_all_dirs_changed_scanned_dirs"] = storage.load_info["scanned_dirs"]
        result["open_all_dirs_changed_stat_calls"] = storage.load_info["stat_calls"]
        await storage.close()

        tracemalloc.start()
        baseline = tracemalloc.get_traced_memory()[0]
        storage, _ = await timed_open(root, max_size)
        kept, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        result["index_bytes_per_blob"] = round((kept - baseline) / args.blobs, 1)
        result["open_peak_bytes_per_blob"] = round((peak - baseline) / args.blobs, 1)
        await storage.close()

        if not args.no_throughput:
            result.update(await throughput(work / "throughput"))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
