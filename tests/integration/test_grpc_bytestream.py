"""ByteStream over a real `buildvault serve`: reads, writes, resumable uploads, zstd, bad input."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import zstandard
from reapi_client import (
    BLAKE3,
    blob,
    digest,
    iterate,
    key,
    missing,
    query,
    read,
    read_name,
    start_and_break,
    upload_name,
    write,
    write_compressed,
    write_requests,
)

from buildvault.remote_apis import bs_pb2
from buildvault.server.grpc import READ_CHUNK_SIZE
from buildvault.server.grpc.bytestream import read_response
from buildvault.storage import CHUNK_SIZE

MiB = 1 << 20


# -- Read ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("size,chunk", [(1, 1), (100_000, 7_000), (3 * MiB + 5, MiB), (5 * MiB, 64 << 10)])
async def test_write_read_roundtrip(stubs, size, chunk):
    data = blob(size)
    assert await write(stubs, data, chunk=chunk) == size
    assert await read(stubs, digest(data)) == data
    assert await missing(stubs, [digest(data)]) == set()


async def test_read_messages_fit_a_default_client(stubs):
    """Every ReadResponse, framed, stays under the 4 MiB inbound limit gRPC clients have by default."""
    data = blob(3 * READ_CHUNK_SIZE + 17)
    await write(stubs, data, chunk=MiB)
    request = bs_pb2.ReadRequest(resource_name=read_name(digest(data)))
    sizes = [r.ByteSize() async for r in stubs.bytestream.Read(request)]
    assert len(sizes) == 4 and max(sizes) < 4 * MiB
    assert sum(sizes) > len(data)  # framed sizes: the data and each message's few header bytes


@pytest.mark.parametrize("offset", [0, 1000])
async def test_the_first_read_message_goes_at_once_and_the_rest_are_full(stubs, offset):
    """The first message carries the store's first piece as soon as it is read (at most
    CHUNK_SIZE: the client starts receiving sooner); then, whatever pieces the store yields (a blob
    kept as chunks, the server's default from 2 MiB: chunks of 128 KiB to 2 MiB), every message
    but the last carries READ_CHUNK_SIZE bytes."""
    data = blob(9 * MiB + 5)
    await write(stubs, data, chunk=MiB)
    request = bs_pb2.ReadRequest(resource_name=read_name(digest(data)), read_offset=offset)
    pieces = [r.data async for r in stubs.bytestream.Read(request)]
    assert b"".join(pieces) == data[offset:]
    assert len(pieces) > 3
    assert 0 < len(pieces[0]) <= CHUNK_SIZE <= READ_CHUNK_SIZE
    assert [len(p) for p in pieces[1:-1]] == [READ_CHUNK_SIZE] * (len(pieces) - 2)
    assert 0 < len(pieces[-1]) <= READ_CHUNK_SIZE


async def test_read_offset_and_limit(stubs):
    data = blob(2 * MiB + 100)
    await write(stubs, data)
    d = digest(data)
    assert await read(stubs, d, offset=10) == data[10:]
    assert await read(stubs, d, offset=MiB + 3, limit=1000) == data[MiB + 3 : MiB + 1003]
    assert await read(stubs, d, limit=5) == data[:5]
    assert await read(stubs, d, offset=len(data)) == b""
    assert await read(stubs, d, offset=len(data) - 1, limit=100) == data[-1:]


@pytest.mark.parametrize(
    "offset,limit,code",
    [
        (-1, 0, grpc.StatusCode.OUT_OF_RANGE),  # google.bytestream: negative read_offset is OUT_OF_RANGE
        (0, -1, grpc.StatusCode.INVALID_ARGUMENT),
        (101, 0, grpc.StatusCode.OUT_OF_RANGE),
    ],
)
async def test_read_bad_ranges(stubs, offset, limit, code):
    data = blob(100)
    await write(stubs, data)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await read(stubs, digest(data), offset=offset, limit=limit)
    assert e.value.code() == code


async def test_read_missing_and_empty(stubs):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await read(stubs, digest(blob(10)))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert await read(stubs, digest(b"")) == b""  # never uploaded, always there


HOSTILE_READ_NAMES = [
    "",
    "/blobs/" + "a" * 64 + "/1",
    "../blobs/" + "a" * 64 + "/1",
    "x/../blobs/" + "a" * 64 + "/1",
    "./blobs/" + "a" * 64 + "/1",
    "blobs/" + "a" * 64,
    "blobs/" + "a" * 64 + "/-1",
    "blobs/" + "a" * 64 + "/01",
    "blobs/" + "a" * 64 + "/1e3",
    "blobs/" + "a" * 64 + "/99999999999999999999",
    "blobs/" + "A" * 64 + "/1",
    "blobs/../../etc/passwd/1",
    "blobs/md5/" + "a" * 32 + "/1",
    "compressed-blobs/gzip/" + "a" * 64 + "/1",
    "compressed-blobs/zstd",
    "instance with space/blobs/" + "a" * 64 + "/1",
    "in\x00st/blobs/" + "a" * 64 + "/1",
    "uploads/blobs/" + "a" * 64 + "/1",
    "actions/blobs/" + "a" * 64 + "/1",
    "x" * 5000 + "/blobs/" + "a" * 64 + "/1",
    "/".join(["seg"] * 300) + "/blobs/" + "a" * 64 + "/1",
    "nothing-here",
]


@pytest.mark.parametrize("name", HOSTILE_READ_NAMES)
async def test_read_hostile_names(stubs, name):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await read(stubs, digest(b"x"), name=name)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()


@pytest.mark.parametrize(
    "name",
    [
        "",
        "blobs/" + "a" * 64 + "/1",  # a read name, not an upload name
        "uploads/blobs/" + "a" * 64 + "/1",
        "uploads/../blobs/" + "a" * 64 + "/1",
        "/uploads/x/blobs/" + "a" * 64 + "/1",
        "../uploads/x/blobs/" + "a" * 64 + "/1",
        "uploads/x/y/blobs/" + "a" * 64 + "/1",
        "uploads/x/compressed-blobs/brotli/" + "a" * 64 + "/1",
        "uploads/x/blobs/" + "a" * 64 + "/-1",
        "x" * 5000 + "/uploads/u/blobs/" + "a" * 64 + "/1",
    ],
)
async def test_write_and_query_hostile_names(stubs, name):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stubs.bytestream.Write(iterate([bs_pb2.WriteRequest(resource_name=name, data=b"x", finish_write=True)]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await query(stubs, name)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- Write: verification ----------------------------------------------------------------------


async def test_write_hash_mismatch_stores_nothing(stubs):
    data, other = blob(200_000), blob(200_000)
    name = upload_name(digest(data))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stubs.bytestream.Write(iterate(write_requests(name, other)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await missing(stubs, [digest(data), digest(other)]) == {key(digest(data)), key(digest(other))}


@pytest.mark.parametrize("send", [99, 101])
async def test_write_size_mismatch(stubs, send):
    data = blob(100)
    payload = (data + b"!")[:send]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stubs.bytestream.Write(iterate(write_requests(upload_name(digest(data)), payload, chunk=10)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await missing(stubs, [digest(data)]) == {key(digest(data))}


async def test_write_bad_offsets(stubs):
    data = blob(1000)
    name = upload_name(digest(data))
    # Each bad stream ends at its bad request: a client still sending when the server refuses
    # may see grpc's own failed send (INTERNAL) instead of the server's status.
    requests = write_requests(name, data, chunk=100)
    requests[3].write_offset += 1  # a gap
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stubs.bytestream.Write(iterate(requests[:4]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # a fresh upload must start at 0
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stubs.bytestream.Write(iterate(write_requests(upload_name(digest(data)), data, start=100)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # a negative offset
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stubs.bytestream.Write(
            iterate([bs_pb2.WriteRequest(resource_name=upload_name(digest(data)), write_offset=-5, data=data)])
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # another resource name mid-stream
    requests = write_requests(upload_name(digest(data)), data, chunk=100)
    requests[2].resource_name = upload_name(digest(data))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stubs.bytestream.Write(iterate(requests[:3]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await missing(stubs, [digest(data)]) == {key(digest(data))}


async def test_write_empty_stream(stubs):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stubs.bytestream.Write(iterate([]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_write_empty_blob(stubs):
    reply = await stubs.bytestream.Write(iterate(write_requests(upload_name(digest(b"")), b"")))
    assert reply.committed_size == 0


async def test_write_blake3_and_instance(stubs):
    data = blob(300_000)
    assert await write(stubs, data, instance="team/a", function=BLAKE3) == len(data)
    d = digest(data, BLAKE3)
    assert await read(stubs, d, name=read_name(d, "team/a", fn="blake3")) == data
    assert await missing(stubs, [d], BLAKE3) == set()
    assert await missing(stubs, [digest(data)]) == {key(digest(data))}


# -- Write: existing blobs, concurrency ---------------------------------------------------------


async def test_write_existing_blob_completes_early(stubs):
    data = blob(3 * MiB)
    await write(stubs, data)
    requests = write_requests(upload_name(digest(data)), data, chunk=MiB)
    # only the first chunk and then a stream that never finishes: the server answers at once
    hold = asyncio.Event()

    async def stream():
        yield requests[0]
        await hold.wait()

    reply = await asyncio.wait_for(stubs.bytestream.Write(stream()), 20)
    assert reply.committed_size == len(data)
    compressed = zstandard.ZstdCompressor().compress(data)
    name = upload_name(digest(data), compressed=True)
    reply = await stubs.bytestream.Write(iterate(write_requests(name, compressed, chunk=MiB)))
    assert reply.committed_size == -1


async def test_concurrent_writers_of_one_blob(stubs):
    data = blob(4 * MiB + 3)
    results = await asyncio.gather(*(write(stubs, data, chunk=256 << 10) for _ in range(6)))
    assert results == [len(data)] * 6
    assert await read(stubs, digest(data)) == data


async def test_concurrent_writers_one_lying(stubs):
    data, other = blob(2 * MiB), blob(2 * MiB)
    d = digest(data)

    async def liar():
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stubs.bytestream.Write(iterate(write_requests(upload_name(d), other)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    await asyncio.gather(liar(), write(stubs, data), liar(), write(stubs, data))
    assert await read(stubs, d) == data


# -- Write: resumable ------------------------------------------------------------------------------


async def test_resume_after_half_close(stubs):
    data = blob(MiB + 333)
    d = digest(data)
    name = upload_name(d)
    half = 512 << 10
    reply = await stubs.bytestream.Write(iterate(write_requests(name, data[:half], chunk=100_000, finish=False)))
    assert reply.committed_size == half
    status = await query(stubs, name)
    assert (status.committed_size, status.complete) == (half, False)
    assert await missing(stubs, [d]) == {key(d)}
    # a wrong continuation offset is refused and does not kill the upload (the first request only:
    # a client still sending when the server refuses may see grpc's INTERNAL, not the status)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stubs.bytestream.Write(iterate(write_requests(name, data, start=half - 10)[:1]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (await query(stubs, name)).committed_size == half
    reply = await stubs.bytestream.Write(iterate(write_requests(name, data, start=half)))
    assert reply.committed_size == len(data)
    status = await query(stubs, name)
    assert status.complete and status.committed_size == len(data)
    assert await read(stubs, d) == data


async def test_uploads_waiting_to_be_resumed_are_bounded(stubs):
    # Clients abandoning uploads in a loop must not grow the server's memory without bound: past
    # MAX_DETACHED (32) uploads waiting for a stream, the oldest is aborted and starts over.
    datas = [blob(64 << 10) for _ in range(64)]
    names = [upload_name(digest(d)) for d in datas]
    for name, data in zip(names, datas, strict=True):
        reply = await stubs.bytestream.Write(iterate(write_requests(name, data[:1000], finish=False)))
        assert reply.committed_size == 1000
    statuses = [await query(stubs, name) for name in names]
    # Whatever other tests left waiting is older: the 32 newest are these, the rest were aborted.
    assert [(q.committed_size, q.complete) for q in statuses[32:]] == [(1000, False)] * 32
    assert [(q.committed_size, q.complete) for q in statuses[:32]] == [(0, False)] * 32
    # An aborted upload starts over at 0 and completes; a kept one resumes where it was.
    assert (await stubs.bytestream.Write(iterate(write_requests(names[0], datas[0])))).committed_size == 64 << 10
    rest = write_requests(names[-1], datas[-1], start=1000)
    assert (await stubs.bytestream.Write(iterate(rest))).committed_size == 64 << 10
    assert await read(stubs, digest(datas[0])) == datas[0] and await read(stubs, digest(datas[-1])) == datas[-1]


async def test_resume_after_broken_stream(stubs):
    data = blob(2 * MiB)
    d = digest(data)
    name = upload_name(d)
    requests = write_requests(name, data, chunk=128 << 10)
    sent = 5 * (128 << 10)
    await start_and_break(stubs, requests[:5], name)
    status = await query(stubs, name)
    assert (status.committed_size, status.complete) == (sent, False)
    assert await missing(stubs, [d]) == {key(d)}
    rest = write_requests(name, data, chunk=300_000, start=status.committed_size)
    reply = await stubs.bytestream.Write(iterate(rest))
    assert reply.committed_size == len(data)
    assert await read(stubs, d) == data


async def test_restart_from_zero(stubs):
    data = blob(500_000)
    name = upload_name(digest(data))
    await stubs.bytestream.Write(iterate(write_requests(name, data[:100_000], finish=False)))
    reply = await stubs.bytestream.Write(iterate(write_requests(name, data)))
    assert reply.committed_size == len(data)
    assert await read(stubs, digest(data)) == data


async def test_query_unknown_and_existing(stubs):
    data = blob(1000)
    status = await query(stubs, upload_name(digest(data)))
    assert (status.committed_size, status.complete) == (0, False)
    await write(stubs, data)
    status = await query(stubs, upload_name(digest(data)))
    assert (status.committed_size, status.complete) == (len(data), True)


async def test_write_dying_halfway_leaves_nothing(stubs):
    data = blob(3 * MiB)
    d = digest(data)
    name = upload_name(d)
    requests = write_requests(name, data, chunk=MiB)
    await start_and_break(stubs, requests[:2], name)
    assert await missing(stubs, [d]) == {key(d)}
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await read(stubs, d)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


# -- zstd ---------------------------------------------------------------------------------------


async def test_zstd_write_then_plain_and_compressed_read(stubs):
    data = b"".join(b"line %d of a very compressible text\n" % i for i in range(100_000))
    compressed = zstandard.ZstdCompressor().compress(data)
    committed = await write_compressed(stubs, data)
    assert committed == len(compressed)  # offsets of compressed uploads count compressed bytes
    d = digest(data)
    assert await read(stubs, d) == data
    packed = await read(stubs, d, name=read_name(d, compressed=True))
    assert len(packed) < len(data) // 5
    assert zstandard.ZstdDecompressor().decompress(packed, max_output_size=len(data)) == data
    tail = await read(stubs, d, offset=1000, name=read_name(d, compressed=True))
    assert zstandard.ZstdDecompressor().decompress(tail, max_output_size=len(data)) == data[1000:]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await read(stubs, d, limit=10, name=read_name(d, compressed=True))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_zstd_read_of_uncompressed_upload_and_empty(stubs):
    data = blob(2 * MiB + 1)
    await write(stubs, data)
    d = digest(data)
    packed = await read(stubs, d, name=read_name(d, compressed=True))
    assert zstandard.ZstdDecompressor().decompress(packed, max_output_size=len(data)) == data
    empty = await read(stubs, digest(b""), name=read_name(digest(b""), compressed=True))
    assert zstandard.ZstdDecompressor().decompress(empty, max_output_size=1) == b""


async def test_zstd_multiframe_upload(stubs):
    data = blob(100_000) + b"z" * 200_000
    c = zstandard.ZstdCompressor()
    compressed = c.compress(data[:150_000]) + c.compress(data[150_000:])
    name = upload_name(digest(data), compressed=True)
    reply = await stubs.bytestream.Write(iterate(write_requests(name, compressed, chunk=7777)))
    assert reply.committed_size == len(compressed)
    assert await read(stubs, digest(data)) == data


async def test_zstd_bad_uploads(stubs):
    data, other = blob(50_000), blob(50_000)
    d = digest(data)
    for payload in [
        zstandard.ZstdCompressor().compress(other),  # valid zstd, wrong content
        b"definitely not zstd" * 100,  # not zstd
        zstandard.ZstdCompressor().compress(data)[:-20],  # truncated
        zstandard.ZstdCompressor().compress(data + b"more"),  # expands past the declared size
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stubs.bytestream.Write(iterate(write_requests(upload_name(d, compressed=True), payload)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert await missing(stubs, [d]) == {key(d)}


async def test_zstd_decoder_seams_on_write(stubs):
    """The shared zstd decoder through ByteStream.Write: a frame cut in the middle of the last
    of several frames, or garbage after complete frames, is INVALID_ARGUMENT and stores nothing."""
    data = blob(60_000) + b"r" * 200_000
    d = digest(data)
    c = zstandard.ZstdCompressor(write_content_size=False)
    frames = c.compress(data[:100_000]) + c.compress(data[100_000:])
    for payload in (frames[:-6], frames + b"garbage after the frames"):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stubs.bytestream.Write(iterate(write_requests(upload_name(d, compressed=True), payload, chunk=5000)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert await missing(stubs, [d]) == {key(d)}


async def test_zstd_resumable_upload(stubs):
    data = b"resumable compressed payload " * 50_000
    d = digest(data)
    compressed = zstandard.ZstdCompressor(level=1).compress(data)
    name = upload_name(d, compressed=True)
    cut = len(compressed) // 2
    reply = await stubs.bytestream.Write(iterate(write_requests(name, compressed[:cut], chunk=4096, finish=False)))
    assert reply.committed_size == cut
    assert (await query(stubs, name)).committed_size == cut
    reply = await stubs.bytestream.Write(iterate(write_requests(name, compressed, chunk=4096, start=cut)))
    assert reply.committed_size == len(compressed)
    assert await read(stubs, d) == data


async def test_zstd_bomb_is_bounded(stubs):
    """A tiny payload claiming a small size but expanding enormously is refused, not buffered."""
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (256 * MiB))
    assert len(bomb) < 64 << 10
    lie = digest(b"\0" * 1000)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stubs.bytestream.Write(iterate(write_requests(upload_name(lie, compressed=True), bomb)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16_383, 16_384, 2_097_151, 2_097_152, 1 << 20])
def test_read_responses_framed_by_hand_are_what_protobuf_serializes(size):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    framed = read_response(data)
    assert framed == bs_pb2.ReadResponse(data=data).SerializeToString()
    assert read_response(memoryview(data)) == framed
    assert bs_pb2.ReadResponse.FromString(framed).data == data
