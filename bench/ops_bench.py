"""Speed of the admin commands (issue 14). Prints JSON.

    .venv/bin/python bench/ops_bench.py [--verify-mib 1024] [--gc-objects 100000] [--gc-real-run]

verify: data directories written straight into the disk layout (in the page cache, as on a live
server): 4 MiB blobs, 4 KiB blobs once as LMDB records (as the server keeps blobs up to 16 KiB)
and once as files, and 20 KiB files; `verify` re-hashes each, twice (the first run shares the
disk with the kernel's writeback of the seeding); MB/s is blob bytes over the whole run
(listing, open, read, hash). `--gc-objects 0` skips gc. gc: the S3 test server (moto) in a
process of its own (bench/moto_seeded.py: `--gc-objects` objects, 1 in 12 an ActionResult naming
5 blobs, about half of the blobs unreferenced), then a dry-run gc lists and decides them all
(with `--gc-real-run` a real gc follows, deleting the unreferenced half); the listing and the
reading of the entries are timed apart, and the CPU seconds moto and gc spent are measured apart
(the machine's cores are shared: see the load averages).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import moto_seeded
from harness import cpu_seconds

from buildvault.admin import gc, verify
from buildvault.config import Settings
from buildvault.digest import Digest
from buildvault.storage.disk import DiskStorage, records
from buildvault.storage.disk.core import cas_key


def _write_blob(root: Path, data: bytes) -> None:
    digest = hashlib.sha256(data).hexdigest()
    shard = root / "cas" / "sha256" / digest[:2]
    shard.mkdir(parents=True, exist_ok=True)
    (shard / f"{digest}-{len(data)}").write_bytes(data)


async def _lay_out(root: Path) -> None:
    """A store's directories, as the server leaves them."""
    storage = await DiskStorage.open(root, 1 << 30, checkpoint_interval=None)
    await storage.close()


def _write_records(root: Path, count: int, size: int) -> None:
    """Small blobs as the server keeps them: records in the store's LMDB, written by its own code."""
    asyncio.run(_lay_out(root))
    store = records.Records(str(root / "records"), max_size=4 * count * size + (64 << 20), limit=records.RECORD_LIMIT)
    store.open()
    try:
        for start in range(0, count, 1000):
            items = []
            for _ in range(min(1000, count - start)):
                data = os.urandom(size)
                digest = Digest(hashlib.sha256(data).hexdigest(), size)
                items.append((cas_key(digest), data, digest))
            assert records.put_many(store, items) == [None] * len(items)
    finally:
        store.close()


def _verify_dir(count: int, size: int, as_records: bool = False) -> dict[str, object]:
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/var/tmp")) as scratch:
        root = Path(scratch)
        if as_records:
            _write_records(root, count, size)
        for _ in range(0 if as_records else count):
            _write_blob(root, os.urandom(size))
        found = verify.verify(root, show_progress=False)
        again = verify.verify(root, show_progress=False)  # the kernel's writeback of the seeding is over
        assert found.problems == again.problems == 0
        return {
            "blobs": found.blobs,
            "mib": round(found.bytes / (1 << 20)),
            "seconds": round(found.seconds, 3),
            "mb_per_second": round(found.bytes / 1e6 / found.seconds, 1),
            "blobs_per_second": round(found.blobs / found.seconds),
            "second_run_mb_per_second": round(again.bytes / 1e6 / again.seconds, 1),
        }


def bench_verify(mib: int) -> dict[str, object]:
    """Large blobs (4 MiB: hashing-bound); small ones (4 KiB) as the server keeps them (LMDB
    records) and as files (a store written before records, until the server's next start moves
    them into records: the per-file cost); and the smallest files the server writes now (20 KiB,
    just above the record limit). The small kinds get a sixteenth of the bytes each."""
    share = (mib << 20) // 16
    return {
        "large_4mib": _verify_dir(max(1, mib // 4), 4 << 20),
        "small_4kib_records": _verify_dir(max(1, share // 4096), 4096, as_records=True),
        "small_4kib_files": _verify_dir(max(1, share // 4096), 4096),
        "files_20kib": _verify_dir(max(1, share // 20480), 20480),
    }


def _own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def _gc_run(settings: Settings, moto_pid: int, dry_run: bool) -> dict[str, object]:
    moto_before, ours_before = cpu_seconds(moto_pid), _own_cpu_seconds()
    plan = gc.collect(settings, max_age=30 * 86400, max_size=None, grace=3600, dry_run=dry_run, show_progress=False)
    return {
        "objects": plan.objects,
        "list_seconds": round(plan.list_seconds, 2),
        "read_seconds": round(plan.read_seconds, 2),
        "decide_seconds": round(plan.decide_seconds, 2),
        "seconds": round(plan.seconds, 2),
        "blobs_removed": len(plan.blobs_removed),
        "deleted": plan.deleted,
        "moto_cpu_seconds": round(cpu_seconds(moto_pid) - moto_before, 1),
        "gc_cpu_seconds": round(_own_cpu_seconds() - ours_before, 1),
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }


def bench_gc(objects: int, real_run: bool) -> dict[str, object]:
    """gc against moto in a process of its own (bench/moto_seeded.py), as an S3 server would be."""
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    command = [sys.executable, str(Path(__file__).with_name("moto_seeded.py")), "--objects", str(objects)]
    seeding = time.perf_counter()
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True) as moto:
        try:
            assert moto.stdout is not None
            endpoint = moto.stdout.readline().decode().strip()
            if not endpoint.startswith("http://"):
                raise RuntimeError(f"moto_seeded.py did not start (exit {moto.poll()})")
            report: dict[str, object] = {
                "objects": objects,
                "action_entries_read": moto_seeded.entry_count(objects),
                "seed_seconds": round(time.perf_counter() - seeding, 1),
                "load_average_before": [round(x, 2) for x in os.getloadavg()],
            }
            settings = Settings(s3_endpoint=endpoint, s3_bucket="bench", s3_region="us-east-1")
            report["dry_run"] = _gc_run(settings, moto.pid, dry_run=True)
            if real_run:
                report["real_run"] = _gc_run(settings, moto.pid, dry_run=False)
            return report
        finally:
            assert moto.stdin is not None
            moto.stdin.close()  # moto_seeded.py stops when its stdin closes
            try:
                moto.wait(30)
            except subprocess.TimeoutExpired:
                moto.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--verify-mib", type=int, default=1024)
    parser.add_argument("--gc-objects", type=int, default=100_000)
    parser.add_argument("--gc-real-run", action="store_true", help="after the dry run, a real gc on the same bucket")
    args = parser.parse_args()
    started = time.time()
    report: dict[str, object] = {"verify": bench_verify(args.verify_mib)}
    if args.gc_objects:
        report["gc"] = bench_gc(args.gc_objects, args.gc_real_run)
    report["load_average"] = os.getloadavg()
    report["wall_seconds"] = round(time.time() - started, 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
