"""Dedup at rest in the bucket: two servers sharing one bucket (the S3 test server) and the
chunk store (storage/chunks) on both.

A blob written on server A is kept in the bucket as its chunks (ordinary CAS objects) plus its
chunk list (an action entry under `ac/chunks/`), never whole; two blobs sharing chunks store the
shared ones once. Server B, which never saw either, reports both present, reads them back
exactly (ranges too) and answers SplitBlob from the list A wrote.
"""

from __future__ import annotations

import hashlib
import random

import grpc
import s3_server
from reapi_client import CLIENT_OPTIONS, digest, make_stubs, missing, read, write
from s3_server import bucket_keys, raw_client, tier_args, wait_drained

from buildvault.remote_apis import re_pb2
from buildvault.storage.chunks import ChunkingParams, cut

aws_env = s3_server.aws_env
s3_endpoint = s3_server.s3_endpoint
bucket = s3_server.bucket


def object_sizes(endpoint: str, bucket: str) -> dict[str, int]:
    s3 = raw_client(endpoint)
    sizes: dict[str, int] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        sizes |= {o["Key"]: o["Size"] for o in page.get("Contents", [])}
    return sizes


async def test_a_chunked_blob_written_on_one_server_is_read_on_another(
    s3_endpoint: str, bucket: str, buildvault_server_factory
) -> None:
    rng = random.Random(4)
    shared = rng.randbytes(5 << 20)
    first = rng.randbytes(1 << 20) + shared
    second = shared + rng.randbytes(1 << 20)
    params = ChunkingParams()
    chunks = {name: [bytes(c) for c in cut(data, params)] for name, data in (("first", first), ("second", second))}
    common = {hashlib.sha256(c).hexdigest() for c in chunks["first"]} & {
        hashlib.sha256(c).hexdigest() for c in chunks["second"]
    }
    assert len(common) >= 4  # the shared region cuts into the same chunks in both

    a = buildvault_server_factory("a", extra_args=tier_args(s3_endpoint, bucket))
    async with grpc.aio.insecure_channel(a.grpc_address, options=CLIENT_OPTIONS) as channel:
        stubs = make_stubs(channel)
        for data in (first, second):
            assert await write(stubs, data) == len(data)
    wait_drained(a.http_address)

    sizes = object_sizes(s3_endpoint, bucket)
    for data in (first, second):
        blob_hash = hashlib.sha256(data).hexdigest()
        assert f"cas/sha256/{blob_hash}" not in sizes  # never whole in the bucket
        assert [k for k in sizes if k.startswith("ac/chunks/") and k.endswith(blob_hash)], sorted(sizes)
    chunk_keys = {f"cas/sha256/{hashlib.sha256(c).hexdigest()}" for name in chunks for c in chunks[name]}
    assert chunk_keys <= set(sizes)
    stored = sum(size for key, size in sizes.items() if key.startswith("cas/"))
    assert stored == sum(len(c) for c in {hashlib.sha256(c).hexdigest(): c for n in chunks for c in chunks[n]}.values())
    assert stored < 0.65 * (len(first) + len(second))  # the 5 MiB in common is stored once

    b = buildvault_server_factory("b", extra_args=tier_args(s3_endpoint, bucket))
    async with grpc.aio.insecure_channel(b.grpc_address, options=CLIENT_OPTIONS) as channel:
        stubs = make_stubs(channel)
        assert await missing(stubs, [digest(first), digest(second)]) == set()
        assert await read(stubs, digest(first)) == first
        assert await read(stubs, digest(second), offset=3 << 20, limit=1 << 20) == second[3 << 20 : 4 << 20]
        reply = await stubs.cas.SplitBlob(re_pb2.SplitBlobRequest(blob_digest=digest(second)))
        assert list(reply.chunk_digests) == [digest(c) for c in chunks["second"]]
    assert bucket_keys(s3_endpoint, bucket) == set(sizes)  # B read through; it wrote nothing new
