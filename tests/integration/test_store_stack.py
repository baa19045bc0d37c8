"""The store stack the server builds: with a bucket configured, BatchUpdateBlobs, BatchReadBlobs
and FindMissingBlobs make one store call per request into each tier, as without one (counted by
the per-tier metrics at the store boundary)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from reapi_client import CLIENT_OPTIONS, Stubs, batch_update, digest, make_stubs, missing
from s3_server import aws_env, bucket, put_objects, s3_endpoint  # noqa: F401 - fixtures

from buildvault.config import Settings
from buildvault.remote_apis import re_pb2
from buildvault.server.app import App

Calls = dict[tuple[str, str], float]


def store_calls(app: App) -> Calls:
    return {
        (s.labels["tier"], s.labels["operation"]): s.value
        for family in text_string_to_metric_families(app.metrics.render().decode())
        for s in family.samples
        if s.name == "buildvault_store_calls_total"
    }


# The uploader copies journaled blobs to the bucket in the background: one local read and one
# bucket write per journal entry, whatever the requests were. Not counted here.
UPLOADER = {("local", "read"), ("object_store", "write")}


def delta(before: Calls, after: Calls) -> Calls:
    """The calls made since `before`, except the uploader's."""
    return {
        key: value - before.get(key, 0)
        for key, value in after.items()
        if value != before.get(key, 0) and key not in UPLOADER
    }


@pytest.fixture(params=["disk", "disk + bucket"])
async def server(request, tmp_path: Path) -> AsyncIterator[tuple[App, Stubs, str]]:
    bucket_name = ""
    extra = {}
    if request.param == "disk + bucket":
        endpoint = request.getfixturevalue("s3_endpoint")
        bucket_name = request.getfixturevalue("bucket")
        # A long request budget: the in-process test S3 server answers HEADs one at a time.
        extra = dict(s3_endpoint=endpoint, s3_bucket=bucket_name, s3_region="us-east-1", s3_request_budget=10.0)
    settings = Settings(dir=tmp_path / "data", grpc_address="127.0.0.1:0", http_address="", **extra)
    app = App(settings)
    await app.start()
    try:
        async with grpc.aio.insecure_channel(app.grpc_address, options=CLIENT_OPTIONS) as channel:
            await channel.channel_ready()
            yield app, make_stubs(channel), bucket_name
    finally:
        await app.stop(grace=1)


async def test_batch_requests_make_one_store_call_per_tier(server, s3_endpoint):  # noqa: F811
    app, stubs, bucket_name = server
    tiered = bool(bucket_name)
    local = [os.urandom(100 + i) for i in range(30)]
    elsewhere = [os.urandom(200 + i) for i in range(10)]  # only in the bucket (another server uploaded them)
    if tiered:
        put_objects(s3_endpoint, bucket_name, {f"cas/sha256/{digest(d).hash}": d for d in elsewhere})
    unknown = [digest(os.urandom(64)) for _ in range(5)]

    before = store_calls(app)
    await batch_update(stubs, local)
    local_tier = {("local", "write_blobs"): 1} if tiered else {}  # disk only: the client meter is the only one
    assert delta(before, store_calls(app)) == {("client", "write_blobs"): 1} | local_tier

    before = store_calls(app)
    absent = await missing(stubs, [digest(d) for d in local + elsewhere] + unknown)
    expected_absent = {(d.hash, d.size_bytes) for d in unknown}
    if not tiered:
        expected_absent |= {(digest(d).hash, len(d)) for d in elsewhere}
    assert absent == expected_absent
    calls = {("client", "find_missing"): 1}
    if tiered:
        calls[("local", "find_missing")] = 1
        calls[("object_store", "find_missing")] = 1  # only about what the local tier lacks
    assert delta(before, store_calls(app)) == calls

    before = store_calls(app)
    reply = await stubs.cas.BatchReadBlobs(
        re_pb2.BatchReadBlobsRequest(digests=[digest(d) for d in local + elsewhere], digest_function=1)
    )
    found = {r.digest.hash: r.data for r in reply.responses if r.status.code == 0}
    assert len(found) == (40 if tiered else 30)
    calls = {("client", "read_blobs"): 1}
    if tiered:  # the bucket's blobs, in one call, and their backfill into the local tier in one call
        calls |= {("local", "read_blobs"): 1, ("object_store", "read_blobs"): 1, ("local", "write_blobs"): 1}
    assert delta(before, store_calls(app)) == calls
