"""SplitBlob and SpliceBlob (REAPI v2.12) through a real server, with a client that chunks the way
the specification says (FastCDC 2020 with the advertised parameters), and the errors hostile
requests get."""

from __future__ import annotations

import asyncio
import hashlib
import random

import grpc
import pytest
from reapi_client import batch_update, digest, missing, read, write

from buildvault.remote_apis import re_pb2
from buildvault.storage.chunks import ChunkingParams, cut

AVG = 512 * 1024
MIN, MAX = AVG // 4, AVG * 4
SIZES = [0, 1, MIN - 1, MIN, AVG, MAX, MAX + 1, 3 * MAX + 12345, 64 << 20]


async def capabilities(stubs) -> re_pb2.CacheCapabilities:
    reply = await stubs.capabilities.GetCapabilities(re_pb2.GetCapabilitiesRequest())
    return reply.cache_capabilities


async def test_capabilities_advertise_split_splice_and_the_recommended_fastcdc_parameters(stubs) -> None:
    cache = await capabilities(stubs)
    assert cache.split_blob_support and cache.splice_blob_support
    assert cache.fast_cdc_2020_params.avg_chunk_size_bytes == AVG
    assert cache.fast_cdc_2020_params.seed == 0


async def test_chunking_off_advertises_nothing_and_answers_unimplemented(buildvault_server_factory) -> None:
    server = buildvault_server_factory(extra_args=["--chunking", "false"])
    async with grpc.aio.insecure_channel(server.grpc_address) as channel:
        from reapi_client import make_stubs

        stubs = make_stubs(channel)
        cache = await capabilities(stubs)
        assert not cache.split_blob_support and not cache.splice_blob_support
        assert not cache.HasField("fast_cdc_2020_params")
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stubs.cas.SplitBlob(re_pb2.SplitBlobRequest(blob_digest=digest(b"x")))
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED


def client_chunks(data: bytes, cache: re_pb2.CacheCapabilities) -> list[bytes]:
    params = ChunkingParams(avg_size=cache.fast_cdc_2020_params.avg_chunk_size_bytes)
    return [bytes(v) for v in cut(data, params)]


async def upload(stubs, chunks: list[bytes]) -> None:
    """Small chunks in batches under the advertised limit, large ones over ByteStream."""
    batch: list[bytes] = []
    for c in chunks:
        if len(c) > 1 << 20:
            await write(stubs, c)
            continue
        if sum(map(len, batch)) + len(c) > 3 << 20:
            await batch_update(stubs, batch)
            batch = []
        batch.append(c)
    if batch:
        await batch_update(stubs, batch)


@pytest.mark.parametrize("size", SIZES)
async def test_splice_then_split_round_trips_at_every_boundary(stubs, size: int) -> None:
    data = random.Random(size).randbytes(size)
    cache = await capabilities(stubs)
    chunks = client_chunks(data, cache)
    await upload(stubs, chunks)
    blob = digest(data)
    reply = await stubs.cas.SpliceBlob(
        re_pb2.SpliceBlobRequest(
            blob_digest=blob,
            chunk_digests=[digest(c) for c in chunks],
            chunking_function=re_pb2.ChunkingFunction.FAST_CDC_2020,
        )
    )
    assert reply.blob_digest == blob
    assert await read(stubs, blob) == data
    split = await stubs.cas.SplitBlob(re_pb2.SplitBlobRequest(blob_digest=blob))
    # The server chunks with the parameters it advertises: the same boundaries as the client's.
    assert [(d.hash, d.size_bytes) for d in split.chunk_digests] == [(digest(c).hash, len(c)) for c in chunks]
    assert split.chunking_function == re_pb2.ChunkingFunction.FAST_CDC_2020
    assert await missing(stubs, split.chunk_digests) == set()


async def test_split_of_a_blob_uploaded_whole_returns_readable_chunks(stubs) -> None:
    data = random.Random(99).randbytes(5 * MAX)
    await write(stubs, data, chunk=1 << 20)
    split = await stubs.cas.SplitBlob(re_pb2.SplitBlobRequest(blob_digest=digest(data)))
    pieces = [await read(stubs, d) for d in split.chunk_digests]
    assert b"".join(pieces) == data
    assert all(hashlib.sha256(p).hexdigest() == d.hash for p, d in zip(pieces, split.chunk_digests, strict=True))


async def test_a_blob_sharing_chunks_with_a_stored_one_needs_only_the_changed_chunks(
    stubs, shared_buildvault_server
) -> None:
    base = random.Random(7).randbytes(8 * MAX)
    changed = bytearray(base)
    changed[4 * MAX : 4 * MAX + 100] = bytes(100)
    cache = await capabilities(stubs)
    await write(stubs, base, chunk=1 << 20)
    await asyncio.to_thread(shared_buildvault_server.wait_chunked)  # chunked after the write
    chunks = client_chunks(bytes(changed), cache)
    absent = await missing(stubs, [digest(c) for c in chunks])
    # Only the chunks around the edit are new to the server.
    assert 1 <= len(absent) <= 3
    assert sum(s for _, s in absent) < 3 * MAX


async def expect(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call
    assert error.value.code() == code, error.value.details()
    return error.value.details() or ""


async def test_hostile_split_and_splice_requests_get_precise_errors_and_store_nothing(stubs) -> None:
    cas = stubs.cas
    a, b = random.randbytes(1000), random.randbytes(2000)
    await batch_update(stubs, [a])
    whole = digest(a + b)
    # A chunk the server does not hold: NOT_FOUND naming it.
    details = await expect(
        cas.SpliceBlob(re_pb2.SpliceBlobRequest(blob_digest=whole, chunk_digests=[digest(a), digest(b)])),
        grpc.StatusCode.NOT_FOUND,
    )
    assert digest(b).hash in details
    await batch_update(stubs, [b])
    # Chunks whose concatenation hashes to something else.
    wrong = re_pb2.Digest(hash=hashlib.sha256(b"other").hexdigest(), size_bytes=3000)
    await expect(
        cas.SpliceBlob(re_pb2.SpliceBlobRequest(blob_digest=wrong, chunk_digests=[digest(a), digest(b)])),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    # Sizes that do not add up.
    await expect(
        cas.SpliceBlob(re_pb2.SpliceBlobRequest(blob_digest=whole, chunk_digests=[digest(a)])),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    # 100,000 tiny chunks.
    tiny = digest(b"t")
    await expect(
        cas.SpliceBlob(
            re_pb2.SpliceBlobRequest(
                blob_digest=re_pb2.Digest(hash=whole.hash, size_bytes=100_000), chunk_digests=[tiny] * 100_000
            )
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    # An unknown chunking function, a malformed digest.
    await expect(
        cas.SpliceBlob(
            re_pb2.SpliceBlobRequest(blob_digest=whole, chunk_digests=[digest(a), digest(b)], chunking_function=42)
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    await expect(
        cas.SplitBlob(re_pb2.SplitBlobRequest(blob_digest=re_pb2.Digest(hash="xyz", size_bytes=1))),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    # Split of an absent blob.
    await expect(cas.SplitBlob(re_pb2.SplitBlobRequest(blob_digest=wrong)), grpc.StatusCode.NOT_FOUND)
    assert await missing(stubs, [wrong, whole]) == {(wrong.hash, 3000), (whole.hash, 3000)}


async def test_blobs_kept_as_chunks_are_still_served_after_chunking_is_turned_off(buildvault_server_factory) -> None:
    from reapi_client import make_stubs

    server = buildvault_server_factory()
    data = random.Random(5).randbytes(3 * MAX)
    async with grpc.aio.insecure_channel(server.grpc_address) as channel:
        await write(make_stubs(channel), data, chunk=1 << 20)
    server.stop()
    server.extra_args = ["--chunking", "false"]
    server.start()
    async with grpc.aio.insecure_channel(server.grpc_address) as channel:
        stubs = make_stubs(channel)
        assert not (await capabilities(stubs)).split_blob_support
        assert await missing(stubs, [digest(data)]) == set()
        assert await read(stubs, digest(data)) == data
        # New large blobs now go whole: one file of their own, as before chunking.
        other = random.Random(6).randbytes(3 * MAX)
        await write(stubs, other, chunk=1 << 20)
        assert await read(stubs, digest(other)) == other
    whole = digest(other)
    assert (server.data_dir / "cas" / "sha256" / whole.hash[:2] / f"{whole.hash}-{whole.size_bytes}").is_file()
