"""ObjectStore against a real S3-compatible HTTP server (moto's ThreadedMotoServer on loopback, see s3_server)."""

from __future__ import annotations

import asyncio
import os

import pytest
import s3_server
from s3_server import free_port, raw_client, session

from buildvault.config import Settings
from buildvault.digest import Digest, DigestFunction
from buildvault.storage import CHUNK_SIZE, ActionStore, BlobStore, DigestMismatch, InvalidRange, NotFound, Unavailable
from buildvault.storage.objectstore.store import S3_MIN_PART_SIZE, CorruptObject, ObjectStore

# Fixtures from s3_server (bound by name so pytest finds them in this module).
aws_env = s3_server.aws_env
bucket = s3_server.bucket
s3_endpoint = s3_server.s3_endpoint

MiB = 1 << 20


def settings_for(endpoint: str, bucket: str, tmp_path, **overrides) -> Settings:
    return Settings(dir=tmp_path, s3_endpoint=endpoint, s3_bucket=bucket, s3_region="us-east-1", **overrides)


@pytest.fixture
async def store(s3_endpoint, bucket, tmp_path):
    s = ObjectStore.from_settings(
        settings_for(s3_endpoint, bucket, tmp_path, s3_prefix="team/"),
        part_size=S3_MIN_PART_SIZE,
        multipart_threshold=S3_MIN_PART_SIZE,
        max_attempts=1,
        session=session(),
    )
    yield s
    s.close()


async def chunked(data: bytes, size: int = 256 * 1024):
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def read_all(store, digest: Digest, offset: int = 0, limit: int = 0) -> bytes:
    return b"".join([chunk async for chunk in await store.read(digest, offset, limit)])


def blob(n: int, seed: int = 0) -> bytes:
    return (seed.to_bytes(4, "big") + os.urandom(16)) * (n // 20) + b"x" * (n % 20)


# -- configuration -------------------------------------------------------------------------


def test_checksum_config_defaults_to_when_required(s3_endpoint, tmp_path):
    settings = settings_for(s3_endpoint, "b", tmp_path)
    assert settings.s3_checksums == "when_required"
    store = ObjectStore.from_settings(settings)
    try:
        config = store.client.meta.config
        assert config.request_checksum_calculation == "when_required"
        assert config.response_checksum_validation == "when_required"
        assert config.s3["addressing_style"] == "path"
        assert store.client.meta.endpoint_url == s3_endpoint
    finally:
        store.close()
    other = ObjectStore.from_settings(
        settings_for(s3_endpoint, "b", tmp_path, s3_checksums="when_supported", s3_addressing="virtual")
    )
    try:
        assert other.client.meta.config.request_checksum_calculation == "when_supported"
        assert other.client.meta.config.response_checksum_validation == "when_supported"
        assert other.client.meta.config.s3["addressing_style"] == "virtual"
    finally:
        other.close()


async def test_uploads_carry_no_crc_checksum_headers(store):
    """What OBS rejects: boto3 >= 1.36's default CRC32 / aws-chunked trailer headers."""
    seen: list[dict[str, str]] = []
    for operation in ("PutObject", "UploadPart"):
        store.client.meta.events.register(
            f"before-send.s3.{operation}", lambda request, **_: seen.append(dict(request.headers))
        )
    for data in (b"small", blob(6 * MiB)):
        digest = Digest.of(data)
        await store.write(digest, chunked(data))
    assert len(seen) >= 3
    for headers in seen:
        lowered = {k.lower(): str(v) for k, v in headers.items()}
        assert not any(k.startswith("x-amz-checksum") for k in lowered), lowered
        assert "x-amz-sdk-checksum-algorithm" not in lowered
        assert "x-amz-trailer" not in lowered
        assert "STREAMING" not in lowered.get("x-amz-content-sha256", "")


# -- CAS -----------------------------------------------------------------------------------


async def test_protocols(store):
    assert isinstance(store, BlobStore)
    assert isinstance(store, ActionStore)


async def test_round_trip(store, bucket, s3_endpoint):
    blobs = [b"", b"a", blob(CHUNK_SIZE * 2 + 17, 1), blob(1000, 2)]
    digests = [Digest.of(b) for b in blobs]
    blake = Digest.of(b"a", DigestFunction.BLAKE3)
    assert await store.find_missing(digests + [blake, digests[1]]) == digests + [blake]
    for digest, data in zip(digests, blobs, strict=True):
        await store.write(digest, chunked(data))
    assert await store.find_missing(digests + [blake]) == [blake]
    for digest, data in zip(digests, blobs, strict=True):
        assert await read_all(store, digest) == data
    with pytest.raises(NotFound):
        await store.read(blake)
    keys = {o["Key"] for o in raw_client(s3_endpoint).list_objects_v2(Bucket=bucket)["Contents"]}
    assert keys == {f"team/cas/sha256/{d.hash}" for d in digests}
    assert store.request_counts["PUT"] == len(blobs)
    assert store.request_counts["GET"] == len(blobs) + 1


async def test_write_mismatch_leaves_nothing(store):
    data = blob(3000)
    wrong = Digest.of(b"something else" * 10)
    with pytest.raises(DigestMismatch):
        await store.write(Digest(wrong.hash, len(data)), chunked(data))
    with pytest.raises(DigestMismatch):
        await store.write(Digest(Digest.of(data).hash, len(data) - 1), chunked(data))
    assert store.request_counts["PUT"] == 0
    assert await store.find_missing([Digest(wrong.hash, len(data))]) == [Digest(wrong.hash, len(data))]


async def test_ranged_reads(store):
    data = blob(CHUNK_SIZE * 2 + 1234, 3)
    digest = Digest.of(data)
    await store.write(digest, chunked(data))
    ranges = [(0, 10), (5, 0), (CHUNK_SIZE - 3, 7), (len(data) - 1, 0), (100, CHUNK_SIZE * 2), (0, len(data) * 2)]
    for offset, limit in ranges:
        expected = data[offset:] if limit == 0 else data[offset : offset + limit]
        assert await read_all(store, digest, offset, limit) == expected, (offset, limit)
    assert await read_all(store, digest, len(data), 0) == b""
    with pytest.raises(InvalidRange):
        await store.read(digest, len(data) + 1)
    with pytest.raises(InvalidRange):
        await store.read(digest, -1)
    with pytest.raises(NotFound):
        await store.read(Digest.of(b"nope"), 1, 1)


async def test_multipart_upload(store, bucket, s3_endpoint):
    data = blob(2 * S3_MIN_PART_SIZE + 12345, 4)
    digest = Digest.of(data)
    await store.write(digest, chunked(data, 300_000))
    assert store.request_counts["MULTIPART_CREATE"] == 1
    assert store.request_counts["MULTIPART_PART"] == 3
    assert store.request_counts["MULTIPART_COMPLETE"] == 1
    assert store.request_counts["PUT"] == 0
    assert await read_all(store, digest) == data
    boundary = S3_MIN_PART_SIZE - 10
    assert await read_all(store, digest, boundary, 20) == data[boundary : boundary + 20]

    # A mismatching multipart upload is aborted: nothing visible, no parts left behind.
    bad = Digest(Digest.of(b"other").hash, len(data))
    with pytest.raises(DigestMismatch):
        await store.write(bad, chunked(data))
    assert store.request_counts["MULTIPART_ABORT"] == 1
    assert not await store.exists(bad)
    assert not raw_client(s3_endpoint).list_multipart_uploads(Bucket=bucket).get("Uploads")


async def test_corrupted_object_is_never_served(store, bucket, s3_endpoint):
    data = blob(3 * CHUNK_SIZE + 5, 5)
    digest = Digest.of(data)
    await store.write(digest, chunked(data))
    key = store.cas_key(digest)
    s3 = raw_client(s3_endpoint)

    # Same size, flipped byte near the end: detected while streaming, before the last chunk.
    corrupted = bytearray(data)
    corrupted[-2] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(corrupted))
    received = bytearray()
    with pytest.raises(CorruptObject):
        async for chunk in await store.read(digest):
            received += chunk
    assert len(received) < len(data)
    assert bytes(received) == data[: len(received)]
    assert store.corrupt_objects == 1
    assert isinstance(CorruptObject("x"), NotFound)

    # Wrong size: refused before any byte, and not reported present.
    s3.put_object(Bucket=bucket, Key=key, Body=data[:-1])
    with pytest.raises(CorruptObject):
        await store.read(digest)
    assert await store.find_missing([digest]) == [digest]
    assert store.corrupt_objects == 3

    # A small (one-chunk) corrupt blob yields nothing at all.
    small = b"hello world"
    small_digest = Digest.of(small)
    s3.put_object(Bucket=bucket, Key=store.cas_key(small_digest), Body=b"hello w0rld")
    received.clear()
    with pytest.raises(CorruptObject):
        async for chunk in await store.read(small_digest):
            received += chunk
    assert received == b""

    # Re-uploading the blob repairs it.
    await store.write(digest, chunked(data))
    assert await read_all(store, digest) == data


# -- AC ------------------------------------------------------------------------------------


async def test_action_entries(store, bucket, s3_endpoint):
    action = Digest.of(b"action")
    with pytest.raises(NotFound):
        await store.get("ac", action)
    await store.put("ac", action, b"result-1")
    await store.put("ac/inst", action, b"result-2")
    await store.put("raw", Digest.of(b"action", DigestFunction.BLAKE3), b"raw")
    assert await store.get("ac", action) == b"result-1"
    assert await store.get("ac/inst", action) == b"result-2"
    await store.put("ac", action, b"result-3")
    assert await store.get("ac", action) == b"result-3"
    s3 = raw_client(s3_endpoint)
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}
    blake = Digest.of(b"action", DigestFunction.BLAKE3)
    assert keys == {
        f"team/ac/ac/sha256/{action.hash}",
        f"team/ac/ac/inst/sha256/{action.hash}",
        f"team/ac/raw/blake3/{blake.hash}",
    }
    # A tampered entry (checksum metadata mismatch) is not served.
    s3.put_object(Bucket=bucket, Key=f"team/ac/ac/sha256/{action.hash}", Body=b"evil", Metadata={"bv-sha256": "0" * 64})
    with pytest.raises(CorruptObject):
        await store.get("ac", action)


async def test_read_only_store_refuses_writes(s3_endpoint, bucket, tmp_path):
    store = ObjectStore.from_settings(settings_for(s3_endpoint, bucket, tmp_path, s3_read_only=True), session=session())
    try:
        with pytest.raises(Exception, match="read-only"):
            await store.write(Digest.of(b"x"), chunked(b"x"))
        with pytest.raises(Exception, match="read-only"):
            await store.put("ac", Digest.of(b"x"), b"r")
        assert store.request_counts["PUT"] == 0
    finally:
        store.close()


async def test_unreachable_endpoint_is_unavailable(tmp_path):
    store = ObjectStore.from_settings(
        settings_for(f"http://127.0.0.1:{free_port()}", "b", tmp_path),
        max_attempts=1,
        connect_timeout=1,
        session=session(),
    )
    try:
        with pytest.raises(Unavailable):
            await store.exists(Digest.of(b"x"))
        with pytest.raises(Unavailable):
            await store.read(Digest.of(b"x"))
        with pytest.raises(Unavailable):
            await store.probe()
    finally:
        store.close()


async def test_concurrent_calls_run_off_the_event_loop(store):
    """Twenty concurrent writes and reads make progress together (nothing blocks the loop)."""
    blobs = [blob(50_000, i) for i in range(20)]
    digests = [Digest.of(b) for b in blobs]
    ticks = 0
    done = asyncio.Event()

    async def ticker():
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.ensure_future(ticker())
    await asyncio.gather(*(store.write(d, chunked(b)) for d, b in zip(digests, blobs, strict=True)))
    assert [await read_all(store, d) for d in digests] == blobs
    done.set()
    await task
    assert ticks > 20
