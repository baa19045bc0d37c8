"""The S3 test server (moto) in a process of its own, with a bucket seeded straight into its state.

    python bench/moto_seeded.py --objects 100000 [--bucket bench]

Seeding over HTTP would cost ~8 ms a PUT (15 minutes for 100,000 objects), so this process
writes the objects into moto's backend itself, then serves them with moto's own threaded
server (what `moto_server` runs) on a free loopback port. It prints the endpoint URL on one line
once it serves, and stops when its stdin closes. The bucket: `--objects` objects, 3 days old,
1 in 12 an ActionResult naming 5 blobs of its own, the rest unreferenced blobs (so about half
of all the blobs are referenced). Used by bench/ops_bench.py, which measures gc against it.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import logging
import os
import sys

from buildvault.remote_apis import re_pb2

BLOBS_PER_ENTRY = 5


def entry_count(objects: int) -> int:
    return objects // 12


def seed(bucket: str, objects: int) -> None:
    from moto.core.models import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    backend.create_bucket(bucket, "us-east-1")
    old = datetime.datetime.now(datetime.UTC).replace(tzinfo=None) - datetime.timedelta(days=3)
    made = 0
    for e in range(entry_count(objects)):
        digests = []
        for b in range(BLOBS_PER_ENTRY):
            data = f"blob {e} {b}".encode()
            digest = re_pb2.Digest(hash=hashlib.sha256(data).hexdigest(), size_bytes=len(data))
            backend.put_object(bucket, f"cas/sha256/{digest.hash}", data).last_modified = old
            digests.append(digest)
        result = re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="o", digest=d) for d in digests])
        key = f"ac/ac/sha256/{hashlib.sha256(str(e).encode()).hexdigest()}"
        backend.put_object(bucket, key, result.SerializeToString()).last_modified = old
        made += BLOBS_PER_ENTRY + 1
    for i in range(objects - made):
        data = f"loose {i}".encode()
        backend.put_object(bucket, f"cas/sha256/{hashlib.sha256(data).hexdigest()}", data).last_modified = old


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--objects", type=int, required=True)
    parser.add_argument("--bucket", default="bench")
    args = parser.parse_args()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    seed(args.bucket, args.objects)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        print(f"http://{host}:{port}", flush=True)
        sys.stdin.read()  # until the parent closes it (or exits)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
