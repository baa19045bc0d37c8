"""Capabilities and CAS over a real `buildvault serve` (disk store, loopback gRPC)."""

from __future__ import annotations

import os

import grpc
import pytest
import zstandard
from reapi_client import BLAKE3, SHA256, batch_update, blob, digest, key, missing

from buildvault.remote_apis import re_pb2

Req = re_pb2.BatchUpdateBlobsRequest.Request
ZSTD = re_pb2.Compressor.ZSTD
IDENTITY = re_pb2.Compressor.IDENTITY
INVALID_ARGUMENT = 3
NOT_FOUND = 5


async def test_capabilities(stubs):
    caps = await stubs.capabilities.GetCapabilities(re_pb2.GetCapabilitiesRequest())
    cache = caps.cache_capabilities
    assert set(cache.digest_functions) == {SHA256, BLAKE3}
    assert ZSTD in cache.supported_compressors and ZSTD in cache.supported_batch_update_compressors
    assert cache.action_cache_update_capabilities.update_enabled
    assert cache.symlink_absolute_path_strategy == re_pb2.SymlinkAbsolutePathStrategy.ALLOWED
    assert 0 < cache.max_batch_total_size_bytes <= 4 << 20
    assert cache.max_cas_blob_size_bytes >= 0
    assert (caps.low_api_version.major, caps.low_api_version.minor) == (2, 0)
    assert (caps.high_api_version.major, caps.high_api_version.minor) >= (2, 3)
    # remote execution is on by default (local workers, loopback listener): see test_execution_protocol.py
    assert caps.execution_capabilities.exec_enabled


async def test_capabilities_rejects_bad_instance(stubs):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stubs.capabilities.GetCapabilities(re_pb2.GetCapabilitiesRequest(instance_name="../etc"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_find_missing_and_batch_roundtrip(stubs):
    present, absent = [blob(100), blob(2000)], [blob(300)]
    await batch_update(stubs, present)
    digests = [digest(b) for b in present + absent]
    assert await missing(stubs, digests) == {key(digest(absent[0]))}
    reply = await stubs.cas.BatchReadBlobs(re_pb2.BatchReadBlobsRequest(digests=digests))
    assert [r.status.code for r in reply.responses] == [0, 0, NOT_FOUND]
    assert [r.data for r in reply.responses[:2]] == present
    assert reply.responses[2].digest == digests[2]


async def test_find_missing_many_with_duplicates(stubs):
    blobs = [blob(64 + i) for i in range(200)]
    await batch_update(stubs, blobs[:100])
    digests = [digest(b) for b in blobs] + [digest(b) for b in blobs[150:]]
    reply = await stubs.cas.FindMissingBlobs(re_pb2.FindMissingBlobsRequest(blob_digests=digests))
    got = [key(d) for d in reply.missing_blob_digests]
    assert set(got) == {key(digest(b)) for b in blobs[100:]}
    assert len(got) == len(set(got)) == 100


async def test_empty_blob_always_present(stubs):
    empty = digest(b"")
    assert await missing(stubs, [empty]) == set()
    reply = await stubs.cas.BatchReadBlobs(re_pb2.BatchReadBlobsRequest(digests=[empty]))
    assert reply.responses[0].status.code == 0 and reply.responses[0].data == b""
    assert await missing(stubs, [digest(b"", BLAKE3)], BLAKE3) == set()


async def test_blake3_is_a_separate_namespace(stubs):
    data = blob(500)
    await batch_update(stubs, [data], function=BLAKE3)
    assert await missing(stubs, [digest(data, BLAKE3)], BLAKE3) == set()
    # the same bytes under SHA-256 were never stored
    assert await missing(stubs, [digest(data)]) == {key(digest(data))}
    reply = await stubs.cas.BatchReadBlobs(
        re_pb2.BatchReadBlobsRequest(digests=[digest(data, BLAKE3)], digest_function=BLAKE3)
    )
    assert reply.responses[0].data == data


async def test_blake3_digest_with_sha256_function_fails_only_that_blob(stubs):
    data = blob(10)
    reply = await stubs.cas.BatchUpdateBlobs(
        re_pb2.BatchUpdateBlobsRequest(requests=[Req(digest=digest(data, BLAKE3), data=data)])
    )
    assert reply.responses[0].status.code == INVALID_ARGUMENT


@pytest.mark.parametrize("function", [2, 3, 7, 8, 10, 99])
async def test_unknown_digest_function_is_invalid_argument(stubs, function):
    calls = [
        stubs.cas.FindMissingBlobs(
            re_pb2.FindMissingBlobsRequest(blob_digests=[digest(b"x")], digest_function=function)
        ),
        stubs.cas.BatchReadBlobs(re_pb2.BatchReadBlobsRequest(digests=[digest(b"x")], digest_function=function)),
        stubs.cas.BatchUpdateBlobs(
            re_pb2.BatchUpdateBlobsRequest(requests=[Req(digest=digest(b"x"), data=b"x")], digest_function=function)
        ),
        stubs.ac.GetActionResult(re_pb2.GetActionResultRequest(action_digest=digest(b"x"), digest_function=function)),
    ]
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()


@pytest.mark.parametrize(
    "bad",
    [
        re_pb2.Digest(hash="abc", size_bytes=3),
        re_pb2.Digest(hash="A" * 64, size_bytes=3),
        re_pb2.Digest(hash="g" * 64, size_bytes=3),
        re_pb2.Digest(hash="a" * 64, size_bytes=-1),
        re_pb2.Digest(hash="", size_bytes=0),
        re_pb2.Digest(hash="a" * 63 + "/", size_bytes=1),
    ],
)
async def test_find_missing_malformed_digest(stubs, bad):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stubs.cas.FindMissingBlobs(re_pb2.FindMissingBlobsRequest(blob_digests=[digest(b"ok"), bad]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_batch_update_per_blob_failures(stubs):
    good, other = blob(100), blob(100)
    requests = [
        Req(digest=digest(good), data=good),
        Req(digest=digest(good), data=other),  # hash mismatch
        Req(digest=re_pb2.Digest(hash=digest(other).hash, size_bytes=99), data=other),  # size mismatch
        Req(digest=re_pb2.Digest(hash="nothex", size_bytes=1), data=b"x"),  # malformed
        Req(digest=digest(other), data=other, compressor=re_pb2.Compressor.BROTLI),  # unsupported
        Req(digest=digest(other), data=b"not zstd", compressor=ZSTD),  # corrupt zstd
    ]
    reply = await stubs.cas.BatchUpdateBlobs(re_pb2.BatchUpdateBlobsRequest(requests=requests))
    assert [r.status.code for r in reply.responses] == [0] + [INVALID_ARGUMENT] * 5
    assert [r.digest for r in reply.responses] == [r.digest for r in requests]
    assert await missing(stubs, [digest(good), digest(other)]) == {key(digest(other))}


async def test_batch_update_zstd(stubs):
    data = b"compressible " * 5000
    compressed = zstandard.ZstdCompressor().compress(data)
    reply = await stubs.cas.BatchUpdateBlobs(
        re_pb2.BatchUpdateBlobsRequest(requests=[Req(digest=digest(data), data=compressed, compressor=ZSTD)])
    )
    assert reply.responses[0].status.code == 0
    reply = await stubs.cas.BatchReadBlobs(re_pb2.BatchReadBlobsRequest(digests=[digest(data)]))
    assert reply.responses[0].data == data and reply.responses[0].compressor == IDENTITY


async def test_batch_update_zstd_that_expands_past_declared_size(stubs):
    data = b"a" * 10_000
    compressed = zstandard.ZstdCompressor().compress(data)
    lie = re_pb2.Digest(hash=digest(data[:100]).hash, size_bytes=100)
    reply = await stubs.cas.BatchUpdateBlobs(
        re_pb2.BatchUpdateBlobsRequest(requests=[Req(digest=lie, data=compressed, compressor=ZSTD)])
    )
    assert reply.responses[0].status.code == INVALID_ARGUMENT


async def test_batch_update_zstd_decoder_seams(stubs):
    """The shared zstd decoder through BatchUpdateBlobs: several frames are one blob; truncated,
    trailing garbage or more bytes than declared is INVALID_ARGUMENT for that blob alone."""
    data = blob(40_000) + b"q" * 100_000
    c = zstandard.ZstdCompressor(write_content_size=False)
    frames = c.compress(data[:10]) + c.compress(data[10:60_000]) + c.compress(data[60_000:])
    others = [blob(30_000) for _ in range(3)]
    requests = [
        Req(digest=digest(data), data=frames, compressor=ZSTD),
        Req(digest=digest(others[0]), data=zstandard.ZstdCompressor().compress(others[0])[:-2], compressor=ZSTD),
        Req(digest=digest(others[1]), data=zstandard.ZstdCompressor().compress(others[1]) + b"junk", compressor=ZSTD),
        Req(digest=digest(others[2]), data=zstandard.ZstdCompressor().compress(others[2] + b"+"), compressor=ZSTD),
    ]
    reply = await stubs.cas.BatchUpdateBlobs(re_pb2.BatchUpdateBlobsRequest(requests=requests))
    assert [r.status.code for r in reply.responses] == [0] + [INVALID_ARGUMENT] * 3
    assert await missing(stubs, [digest(data), *map(digest, others)]) == {key(digest(d)) for d in others}
    reply = await stubs.cas.BatchReadBlobs(re_pb2.BatchReadBlobsRequest(digests=[digest(data)]))
    assert reply.responses[0].data == data


async def test_batch_read_zstd_when_acceptable(stubs):
    data = b"compressible " * 5000
    await batch_update(stubs, [data, b""])
    reply = await stubs.cas.BatchReadBlobs(
        re_pb2.BatchReadBlobsRequest(digests=[digest(data), digest(b"")], acceptable_compressors=[ZSTD])
    )
    for response, original in zip(reply.responses, [data, b""], strict=True):
        assert response.status.code == 0 and response.compressor == ZSTD
        assert zstandard.ZstdDecompressor().decompress(response.data, max_output_size=len(original) + 1) == original
    assert len(reply.responses[0].data) < len(data) // 10


async def test_batch_limits(stubs):
    caps = await stubs.capabilities.GetCapabilities(re_pb2.GetCapabilitiesRequest())
    limit = caps.cache_capabilities.max_batch_total_size_bytes
    # exactly the limit, in many blobs, is accepted (the server's message limit has headroom)
    blobs = [blob(limit // 64) for _ in range(64)]
    reply = await stubs.cas.BatchUpdateBlobs(
        re_pb2.BatchUpdateBlobsRequest(requests=[Req(digest=digest(b), data=b) for b in blobs])
    )
    assert all(r.status.code == 0 for r in reply.responses)
    reply = await stubs.cas.BatchReadBlobs(re_pb2.BatchReadBlobsRequest(digests=[digest(b) for b in blobs]))
    assert [r.data for r in reply.responses] == blobs
    # one byte over is refused as a whole
    over = blobs + [b"x"]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stubs.cas.BatchUpdateBlobs(
            re_pb2.BatchUpdateBlobsRequest(requests=[Req(digest=digest(b), data=b) for b in over])
        )
    assert e.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stubs.cas.BatchReadBlobs(re_pb2.BatchReadBlobsRequest(digests=[digest(b) for b in over]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # a message far over the transport limit
    huge = blob(3 * limit)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stubs.cas.BatchUpdateBlobs(re_pb2.BatchUpdateBlobsRequest(requests=[Req(digest=digest(huge), data=huge)]))
    assert e.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


async def test_batch_read_malformed_digest_is_per_blob(stubs):
    reply = await stubs.cas.BatchReadBlobs(
        re_pb2.BatchReadBlobsRequest(digests=[re_pb2.Digest(hash="zz", size_bytes=1), digest(b"")])
    )
    assert [r.status.code for r in reply.responses] == [INVALID_ARGUMENT, 0]


# -- GetTree ------------------------------------------------------------------------------------


def _directory(
    files: dict[str, bytes] | None = None, dirs: dict[str, re_pb2.Directory] | None = None
) -> re_pb2.Directory:
    files, dirs = files or {}, dirs or {}
    return re_pb2.Directory(
        files=[re_pb2.FileNode(name=n, digest=digest(d)) for n, d in sorted(files.items())],
        directories=[
            re_pb2.DirectoryNode(name=n, digest=digest(d.SerializeToString())) for n, d in sorted(dirs.items())
        ],
    )


def _tree():
    """root -> a, b; a -> a1, a2; b -> b1; a2 -> deep (7 directories), plus a shared child."""
    salt = os.urandom(8).hex().encode()  # unique per test: the server is shared
    deep = _directory({"f": b"deep" + salt})
    a1 = _directory({"x": b"a1"})
    a2 = _directory({"y": b"a2"}, {"deep": deep})
    b1 = _directory({"z": b"b1"})
    a = _directory({}, {"a1": a1, "a2": a2})
    b = _directory({"w": b"b"}, {"b1": b1, "again": a1})  # a1 appears twice
    root = _directory({"top": b"top"}, {"a": a, "b": b})
    return root, [root, a, b, a1, a2, b1, deep]


async def _store_dirs(stubs, dirs):
    await batch_update(stubs, [d.SerializeToString() for d in dirs])


async def _get_tree(stubs, root_digest, page_size=0, token=""):
    pages = []
    async for response in stubs.cas.GetTree(
        re_pb2.GetTreeRequest(root_digest=root_digest, page_size=page_size, page_token=token)
    ):
        pages.append(response)
    return pages


async def test_get_tree_whole(stubs):
    root, dirs = _tree()
    await _store_dirs(stubs, dirs)
    pages = await _get_tree(stubs, digest(root.SerializeToString()))
    assert len(pages) == 1 and pages[0].next_page_token == ""
    got = [d.SerializeToString() for d in pages[0].directories]
    assert sorted(got) == sorted(d.SerializeToString() for d in dirs)
    assert got[0] == root.SerializeToString()  # breadth first: the root comes first


async def test_get_tree_paging_and_resume(stubs):
    root, dirs = _tree()
    await _store_dirs(stubs, dirs)
    root_digest = digest(root.SerializeToString())
    pages = await _get_tree(stubs, root_digest, page_size=2)
    assert len(pages) == 4
    assert all(len(p.directories) <= 2 for p in pages)
    assert all(p.next_page_token for p in pages[:-1]) and pages[-1].next_page_token == ""
    everything = [d.SerializeToString() for p in pages for d in p.directories]
    assert sorted(everything) == sorted(d.SerializeToString() for d in dirs)
    # resuming from the first page's token yields exactly the rest
    rest = await _get_tree(stubs, root_digest, page_size=3, token=pages[0].next_page_token)
    resumed = [d.SerializeToString() for p in rest for d in p.directories]
    assert sorted(resumed) == sorted(everything[2:])


async def test_get_tree_errors(stubs):
    root, dirs = _tree()
    root_digest = digest(root.SerializeToString())
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _get_tree(stubs, root_digest)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    await _store_dirs(stubs, dirs)
    for bad in ["garbage", "t1.!!!", "t1." + "A" * 40]:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _get_tree(stubs, root_digest, token=bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # a token for another root is refused
    other = _directory({"q": os.urandom(8)})
    await _store_dirs(stubs, [other])
    pages = await _get_tree(stubs, root_digest, page_size=1)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _get_tree(stubs, digest(other.SerializeToString()), token=pages[0].next_page_token)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _get_tree(stubs, root_digest, page_size=-1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_get_tree_missing_subtree_is_omitted(stubs):
    root, dirs = _tree()
    await _store_dirs(stubs, [d for d in dirs if d is not dirs[1]])  # "a" (and so a1 via a, a2, deep) missing
    pages = await _get_tree(stubs, digest(root.SerializeToString()))
    got = {d.SerializeToString() for p in pages for d in p.directories}
    assert dirs[1].SerializeToString() not in got
    assert {root.SerializeToString(), dirs[2].SerializeToString(), dirs[5].SerializeToString()} <= got


async def test_get_tree_page_bytes_and_sizes(stubs):
    """Many directories: the default page size and the per-page byte cap both hold."""
    leaves = [_directory({f"f{i}": os.urandom(8)}) for i in range(1500)]
    root = re_pb2.Directory(
        directories=[
            re_pb2.DirectoryNode(name=f"d{i:04}", digest=digest(d.SerializeToString())) for i, d in enumerate(leaves)
        ]
    )
    await _store_dirs(stubs, [root, *leaves])
    pages = await _get_tree(stubs, digest(root.SerializeToString()))
    assert sum(len(p.directories) for p in pages) == 1501
    assert len(pages) >= 2 and all(len(p.directories) <= 1000 for p in pages)


async def test_get_tree_empty_root(stubs):
    empty = re_pb2.Directory()
    pages = await _get_tree(stubs, digest(empty.SerializeToString()))
    assert len(pages) == 1 and len(pages[0].directories) == 1
