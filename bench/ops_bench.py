"""Speed of the admin commands (issue 14). Prints JSON.

    .venv/bin/python bench/ops_bench.py [--verify-mib 1024] [--gc-objects 100000]

verify: data directories of 4 MiB blobs and of 4 KiB blobs written straight into the disk
layout (in the page cache, as on a live server), then `verify` re-hashes each, twice (the first
run shares the disk with the kernel's writeback of the seeding); MB/s is blob bytes over the
whole run (listing, open, read, hash). `--gc-objects 0` skips gc. gc: the in-process S3 test
server (moto) seeded with `--gc-objects` objects (1 in 12 an ActionResult naming 5 blobs, half
of the blobs unreferenced), then a dry-run gc lists and decides them all; the listing and the
reading of the entries are timed apart.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

from buildvault.admin import gc, verify
from buildvault.config import Settings
from buildvault.remote_apis import re_pb2


def _write_blob(root: Path, data: bytes) -> None:
    digest = hashlib.sha256(data).hexdigest()
    shard = root / "cas" / "sha256" / digest[:2]
    shard.mkdir(parents=True, exist_ok=True)
    (shard / f"{digest}-{len(data)}").write_bytes(data)


def _verify_dir(count: int, size: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/var/tmp")) as scratch:
        root = Path(scratch)
        for _ in range(count):
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
    """Large blobs (4 MiB: hashing-bound) and small ones (4 KiB: per-file cost) measured apart."""
    return {
        "large_4mib": _verify_dir(max(1, mib // 4), 4 << 20),
        "small_4kib": _verify_dir(max(1, (mib << 20) // 16 // 4096), 4096),  # a sixteenth of the bytes
    }


def bench_gc(objects: int) -> dict[str, object]:
    from moto.core.models import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends
    from moto.server import ThreadedMotoServer

    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
        backend.create_bucket("bench", "us-east-1")
        old = datetime.datetime.now(datetime.UTC).replace(tzinfo=None) - datetime.timedelta(days=3)
        entries = objects // 12
        made = 0
        for e in range(entries):
            digests = []
            for b in range(5):
                data = f"blob {e} {b}".encode()
                digest = re_pb2.Digest(hash=hashlib.sha256(data).hexdigest(), size_bytes=len(data))
                backend.put_object("bench", f"cas/sha256/{digest.hash}", data).last_modified = old
                digests.append(digest)
            result = re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="o", digest=d) for d in digests])
            key = f"ac/ac/sha256/{hashlib.sha256(str(e).encode()).hexdigest()}"
            backend.put_object("bench", key, result.SerializeToString()).last_modified = old
            made += 6
        for i in range(objects - made):
            data = f"loose {i}".encode()
            backend.put_object("bench", f"cas/sha256/{hashlib.sha256(data).hexdigest()}", data).last_modified = old
        settings = Settings(s3_endpoint=endpoint, s3_bucket="bench", s3_region="us-east-1")
        plan = gc.collect(settings, max_age=30 * 86400, max_size=None, grace=3600, dry_run=True, show_progress=False)
        return {
            "objects": plan.objects,
            "action_entries_read": entries,
            "list_seconds": round(plan.list_seconds, 2),
            "read_seconds": round(plan.read_seconds, 2),
            "decide_seconds": round(plan.decide_seconds, 2),
            "would_delete": len(plan.blobs_removed),
        }
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--verify-mib", type=int, default=1024)
    parser.add_argument("--gc-objects", type=int, default=100_000)
    args = parser.parse_args()
    started = time.time()
    report: dict[str, object] = {"verify": bench_verify(args.verify_mib)}
    if args.gc_objects:
        report["gc"] = bench_gc(args.gc_objects)
    report["load_average"] = os.getloadavg()
    report["wall_seconds"] = round(time.time() - started, 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
