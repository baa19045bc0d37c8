"""The store stack the server builds (storage/build.py): its composition for the usual settings
(disk only, disk + bucket, read-only bucket, a secondary process); and with a bucket configured,
BatchUpdateBlobs, BatchReadBlobs and FindMissingBlobs make one store call per request into each
tier, as without one (counted by the per-tier metrics at the store boundary)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from reapi_client import CLIENT_OPTIONS, Stubs, batch_update, digest, make_stubs, missing
from s3_server import aws_env, bucket, put_objects, s3_endpoint, session  # noqa: F401 - fixtures

from buildvault.config import Settings
from buildvault.digest import Digest
from buildvault.remote_apis import re_pb2
from buildvault.server.app import App
from buildvault.server.metrics import Metrics
from buildvault.server.pins import PinRegistry
from buildvault.storage import (
    ActionStore,
    BlobStore,
    ForwardingActionStore,
    ForwardingBlobStore,
    MeteredActionStore,
    MeteredBlobStore,
    NotFound,
)
from buildvault.storage.build import Secondary, open_store_stack
from buildvault.storage.objectstore.tiered import TieredActionStore, TieredBlobStore
from buildvault.storage.processes.store_server import StoreServer

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


# -- the stack's composition, for the usual settings ---------------------------------------------


def layers(store: BlobStore | ActionStore) -> list[str]:
    """The stack's stores, outermost first: a meter carries its tier's name; a tiered store ends
    the list with its fast and slow sides."""
    names: list[str] = []
    while True:
        name = type(store).__name__
        if isinstance(store, (MeteredBlobStore, MeteredActionStore)):
            name += f"({store.tier})"
        if isinstance(store, (TieredBlobStore, TieredActionStore)):
            fast, slow = " > ".join(layers(store.fast)), " > ".join(layers(store.slow))
            return [*names, f"{name}[fast: {fast}; slow: {slow}]"]
        names.append(name)
        if not isinstance(store, (ForwardingBlobStore, ForwardingActionStore)):
            return names
        store = store.inner


TIERED_BLOBS = [
    "MeteredBlobStore(client)",
    "EmptyBlobStore",
    "ChunkedBlobStore",
    "TieredBlobStore[fast: MeteredBlobStore(local) > DiskBlobStore; "
    "slow: MeteredBlobStore(object_store) > FailOpenBlobStore > ExistenceCache > ObjectStore]",
]
TIERED_ACTIONS = [
    "WatchedPinningActionStore",  # a bucket is followed: namespaces asked about are noted
    "MeteredActionStore(client)",
    "TieredActionStore[fast: MeteredActionStore(local) > DiskActionStore; "
    "slow: MeteredActionStore(object_store) > FailOpenActionStore > ObjectStore]",
]


async def test_disk_only_stack(tmp_path: Path) -> None:
    stack = await open_store_stack(Settings(dir=tmp_path), Metrics(), pins=PinRegistry)
    try:
        assert layers(stack.blobs) == [
            "MeteredBlobStore(client)",
            "EmptyBlobStore",
            "ChunkedBlobStore",
            "DiskBlobStore",
        ]
        assert layers(stack.actions) == ["PinningActionStore", "MeteredActionStore(client)", "DiskActionStore"]
        assert stack.object_tier is None and stack.remote is None
        assert isinstance(stack.pins, PinRegistry)
        assert stack.max_blob_size == Settings().max_size and stack.local_stats is not None
        with pytest.raises(NotFound):
            await stack.actions.get("ac/team-a", Digest("ab" * 32, 1))
        assert "ac/team-a" not in stack.pins.known  # no bucket to follow: nothing asked is noted
    finally:
        await stack.aclose()


async def test_disk_and_bucket_stack(tmp_path: Path, s3_endpoint: str, bucket: str) -> None:  # noqa: F811
    settings = Settings(dir=tmp_path, s3_endpoint=s3_endpoint, s3_bucket=bucket, s3_region="us-east-1")
    stack = await open_store_stack(settings, Metrics(), pins=PinRegistry, session=session())
    try:
        assert layers(stack.blobs) == TIERED_BLOBS
        assert layers(stack.actions) == TIERED_ACTIONS
        tier = stack.object_tier
        assert tier is not None and stack.remote is None
        assert tier.journal is not None and tier.last_use is not None  # it writes the bucket
        assert not tier.cas.read_only and not tier.ac.read_only
        assert f"bucket {bucket} at {s3_endpoint}" in stack.label
        assert isinstance(stack.pins, PinRegistry) and "ac/team-a" not in stack.pins.known
        with pytest.raises(NotFound):
            await stack.actions.get("ac/team-a", Digest("ab" * 32, 1))
        assert "ac/team-a" in stack.pins.known  # the watcher reads its pin index from now on
    finally:
        await stack.aclose()


async def test_read_only_bucket_stack(tmp_path: Path, s3_endpoint: str, bucket: str) -> None:  # noqa: F811
    settings = Settings(
        dir=tmp_path, s3_endpoint=s3_endpoint, s3_bucket=bucket, s3_region="us-east-1", s3_read_only=True
    )
    stack = await open_store_stack(settings, Metrics(), pins=PinRegistry, session=session())
    try:
        assert layers(stack.blobs) == TIERED_BLOBS
        assert layers(stack.actions) == TIERED_ACTIONS
        tier = stack.object_tier
        assert tier is not None
        assert tier.journal is None and tier.last_use is None  # it never writes the bucket
        assert tier.cas.read_only and tier.ac.read_only
    finally:
        await stack.aclose()


async def one_chunk(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def test_secondary_stack_is_the_primarys_store(tmp_path: Path) -> None:
    primary = await open_store_stack(Settings(dir=tmp_path / "primary"), Metrics(), pins=PinRegistry)
    server = StoreServer(primary.blobs, primary.actions, None, str(tmp_path / "store.sock"))
    await server.start()
    role = Secondary(server.path, 1, max_blob_size=12345)
    stack = await open_store_stack(Settings(dir=tmp_path / "unused"), None, secondary=role)
    try:
        assert layers(stack.blobs) == ["RemoteBlobStore"]  # the primary's stack meters and rules
        assert layers(stack.actions) == ["RemoteActionStore"]
        assert stack.object_tier is None and stack.pins is None and stack.remote is not None
        assert stack.max_blob_size == 12345
        assert not (tmp_path / "unused").exists()  # a secondary opens no store of its own
        blob = os.urandom(3000)
        await stack.blobs.write(Digest.of(blob), one_chunk(blob))
        assert await primary.blobs.find_missing([Digest.of(blob)]) == []
        assert await stack.blobs.find_missing([Digest.of(b"")]) == []  # the primary's empty-blob rule
    finally:
        await stack.aclose()
        await server.stop()
        await primary.aclose()
