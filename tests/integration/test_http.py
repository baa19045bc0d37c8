"""The bazel-remote HTTP protocol, /status, /metrics, over real HTTP on loopback.

Most tests run against a real `buildvault serve` subprocess (disk store, gRPC and HTTP in one
process), so cross-protocol behaviour is checked end to end; a few use the HTTP app in-process
with a fake store to provoke errors a real disk will not produce on demand (507).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import re
from dataclasses import dataclass

import aiohttp
import grpc
import pytest
import zstandard
from conftest import CLIENT_OPTIONS, make_stubs
from prometheus_client.parser import text_string_to_metric_families
from reapi_client import batch_update, digest, read, write
from yarl import URL

from buildvault.digest import InvalidDigest
from buildvault.remote_apis import re_pb2
from buildvault.server.http import HttpListener, ccache_key_to_hash, create_app, parse_cache_path
from buildvault.server.metrics import Metrics
from buildvault.storage import StorageFull
from buildvault.storage.memory import MemoryActionStore, MemoryBlobStore

EMPTY = hashlib.sha256(b"").hexdigest()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def session_for(server) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        f"http://{server.http_address}", auto_decompress=False, skip_auto_headers=["Accept-Encoding"]
    )


@pytest.fixture
async def http(shared_buildvault_server):
    """An HTTP client for the module's shared server (the one `stubs` talks to)."""
    async with session_for(shared_buildvault_server) as session:
        yield session


@dataclass
class Fresh:
    server: object
    http: aiohttp.ClientSession
    stubs: object


@pytest.fixture
async def fresh(buildvault_server):
    """A server of the test's own (exact counts, restarts): its HTTP client and gRPC stubs."""
    async with (
        session_for(buildvault_server) as session,
        grpc.aio.insecure_channel(buildvault_server.grpc_address, options=CLIENT_OPTIONS) as channel,
    ):
        await channel.channel_ready()
        yield Fresh(buildvault_server, session, make_stubs(channel))


async def put(session: aiohttp.ClientSession, path: str, data: bytes, **kwargs) -> aiohttp.ClientResponse:
    async with session.put(path, data=data, **kwargs) as response:
        await response.read()
        return response


async def get(session: aiohttp.ClientSession, path: str, **kwargs) -> tuple[int, bytes, aiohttp.ClientResponse]:
    async with session.get(path, **kwargs) as response:
        return response.status, await response.read(), response


def action_result(*outputs: tuple[str, bytes], exit_code: int = 0) -> re_pb2.ActionResult:
    return re_pb2.ActionResult(
        output_files=[re_pb2.OutputFile(path=path, digest=digest(data)) for path, data in outputs],
        exit_code=exit_code,
    )


# -- CAS ------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["", "/inst", "/a/b-c_d.e"])
async def test_cas_put_get_head(http, prefix):
    data = os.urandom(3 * (1 << 20) + 17)  # several chunks
    h = sha(data)
    status, _, _ = await get(http, f"{prefix}/cas/{h}")
    assert status == 404
    response = await put(http, f"{prefix}/cas/{h}", data)  # aiohttp sends Content-Length
    assert response.status == 200
    status, body, response = await get(http, f"{prefix}/cas/{h}")
    assert status == 200 and body == data
    assert response.headers["Content-Length"] == str(len(data))
    assert "Content-Encoding" not in response.headers
    async with http.head(f"{prefix}/cas/{h}") as response:
        assert response.status == 200
        assert response.headers["Content-Length"] == str(len(data))


async def test_cas_is_shared_across_instance_prefixes(http):
    """Like gRPC, the CAS is one content-addressed pool; instance names separate action entries."""
    data = b"shared blob"
    assert (await put(http, f"/one/cas/{sha(data)}", data)).status == 200
    status, body, _ = await get(http, f"/two/cas/{sha(data)}")
    assert (status, body) == (200, data)


async def test_cas_put_hash_mismatch_stores_nothing(http, stubs):
    data, other = b"the body", b"what the hash names"
    response = await put(http, f"/cas/{sha(other)}", data)
    assert response.status == 400
    assert (await get(http, f"/cas/{sha(other)}"))[0] == 404
    assert (await get(http, f"/cas/{sha(data)}"))[0] == 404
    missing = await stubs.cas.FindMissingBlobs(
        re_pb2.FindMissingBlobsRequest(blob_digests=[digest(data), digest(other)])
    )
    assert len(missing.missing_blob_digests) == 2


async def test_empty_blob_always_present(http):
    status, body, _ = await get(http, f"/cas/{EMPTY}")
    assert (status, body) == (200, b"")
    async with http.head(f"/cas/{EMPTY}") as response:
        assert response.status == 200
    assert (await put(http, f"/cas/{EMPTY}", b"")).status == 200


async def test_put_without_content_length_is_411(http):
    async def chunks():
        yield b"chunked "
        yield b"body"

    h = sha(b"chunked body")
    async with http.put(f"/cas/{h}", data=chunks()) as response:  # Transfer-Encoding: chunked
        assert response.status == 411
    assert (await get(http, f"/cas/{h}"))[0] == 404
    async with http.put(f"/ac/{h}", data=chunks()) as response:
        assert response.status == 411


async def test_put_over_the_size_limit_is_413(buildvault_server_factory):
    server = buildvault_server_factory("small", extra_args=["--max-size", "1MiB"])
    data = os.urandom(2 << 20)
    async with aiohttp.ClientSession(f"http://{server.http_address}") as session:
        response = await put(session, f"/cas/{sha(data)}", data)
        assert response.status == 413
        assert (await get(session, f"/cas/{sha(data)}"))[0] == 404


async def test_storage_full_is_507():
    class FullStore(MemoryBlobStore):
        async def write(self, digest, chunks):
            async for _ in chunks:
                pass
            raise StorageFull("no space left on device")

    listener = HttpListener("127.0.0.1:0", create_app(FullStore(), MemoryActionStore()))
    await listener.start()
    try:
        async with aiohttp.ClientSession(f"http://{listener.address}") as session:
            response = await put(session, f"/cas/{sha(b'x')}", b"x")
            assert response.status == 507
    finally:
        await listener.stop(1)


@pytest.mark.parametrize(
    "path",
    [
        "/cas/" + "A" * 64,  # uppercase
        "/cas/" + "0" * 63,  # short
        "/cas/" + "0" * 65,
        "/cas/" + "g" * 64,
        "/ac/xyz",
        "/../cas/" + "0" * 64,
        "/%2e%2e/cas/" + "0" * 64,
        "/a//cas/" + "0" * 64,
        "/uploads/cas/" + "0" * 64,  # reserved instance segment
        "/cas/" + "0" * 64 + "/",
        "/cas",
        "/nothing-here",
        "/ab/" + "x" * 31,  # not base32hex
    ],
)
async def test_bad_paths_are_400(http, path):
    url = URL(str(http._base_url) + path, encoded=True)  # as written: no client-side normalising
    for method in ("GET", "HEAD", "PUT"):
        async with http.request(method, url, data=b"x" if method == "PUT" else None) as response:
            assert response.status == 400, (method, path)


@pytest.mark.parametrize("method", ["DELETE", "POST", "PATCH", "OPTIONS"])
async def test_other_methods_are_405(http, method):
    data = b"keep me"
    await put(http, f"/cas/{sha(data)}", data)
    for path in (f"/cas/{sha(data)}", f"/ac/{sha(data)}", "/status", "/metrics"):
        async with http.request(method, path) as response:
            assert response.status == 405, (method, path)
            assert "GET" in response.headers["Allow"]
    assert (await get(http, f"/cas/{sha(data)}"))[1] == data


# -- zstd -----------------------------------------------------------------------------------


async def test_get_with_accept_encoding_zstd(http):
    data = b"compressible " * 200_000  # 2.6 MB: several chunks
    await put(http, f"/cas/{sha(data)}", data)
    status, body, response = await get(http, f"/cas/{sha(data)}", headers={"Accept-Encoding": "gzip, zstd"})
    assert status == 200
    assert response.headers["Content-Encoding"] == "zstd"
    assert len(body) < len(data) // 10
    assert zstandard.ZstdDecompressor().decompressobj().decompress(body) == data
    # q=0 refuses zstd; identity then
    status, body, response = await get(http, f"/cas/{sha(data)}", headers={"Accept-Encoding": "zstd;q=0"})
    assert body == data and "Content-Encoding" not in response.headers


async def test_put_with_content_encoding_zstd(http, stubs):
    data = os.urandom(100_000) + b"\0" * 3_000_000
    compressed = zstandard.ZstdCompressor().compress(data)  # frame declares its size
    response = await put(http, f"/cas/{sha(data)}", compressed, headers={"Content-Encoding": "zstd"})
    assert response.status == 200
    assert await read(stubs, digest(data)) == data

    # bazel-remote style: X-Digest-SizeBytes, streamed frames without a declared size
    data2 = os.urandom(50_000) * 20
    chunker = zstandard.ZstdCompressor(write_content_size=False)
    compressed2 = chunker.compress(data2[:400_000]) + chunker.compress(data2[400_000:])  # two frames
    response = await put(
        http,
        f"/cas/{sha(data2)}",
        compressed2,
        headers={"Content-Encoding": "zstd", "X-Digest-SizeBytes": str(len(data2))},
    )
    assert response.status == 200
    assert (await get(http, f"/cas/{sha(data2)}"))[1] == data2


async def test_put_zstd_errors(http):
    data = b"payload " * 1000
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(data)
    response = await put(http, f"/cas/{sha(data)}", no_size, headers={"Content-Encoding": "zstd"})
    assert response.status == 400  # neither X-Digest-SizeBytes nor a declared frame size
    wrong = zstandard.ZstdCompressor().compress(b"other " * 1000)
    response = await put(http, f"/cas/{sha(data)}", wrong, headers={"Content-Encoding": "zstd"})
    assert response.status == 400  # the uncompressed bytes are verified
    truncated = zstandard.ZstdCompressor().compress(data)[:-5]
    response = await put(http, f"/cas/{sha(data)}", truncated, headers={"Content-Encoding": "zstd"})
    assert response.status == 400
    response = await put(http, f"/cas/{sha(data)}", b"not zstd at all", headers={"Content-Encoding": "zstd",
                                                                                 "X-Digest-SizeBytes": "8000"})
    assert response.status == 400
    response = await put(http, f"/cas/{sha(data)}", data, headers={"Content-Encoding": "gzip"})
    assert response.status == 415
    assert (await get(http, f"/cas/{sha(data)}"))[0] == 404


async def test_put_zstd_cas_decoder_seams(http):
    """The shared zstd decoder through HTTP: frames, truncation, trailing garbage, output past the size."""
    data = os.urandom(70_000) + b"x" * 500_000
    sized = {"Content-Encoding": "zstd", "X-Digest-SizeBytes": str(len(data))}
    c = zstandard.ZstdCompressor(write_content_size=False)
    three_frames = c.compress(data[:1000]) + c.compress(data[1000:300_000]) + c.compress(data[300_000:])
    for bad in (
        three_frames[:-3],  # ends inside the last frame
        three_frames + b"trailing junk",  # garbage after complete frames
        zstandard.ZstdCompressor().compress(data + b"one byte more"),  # decodes past X-Digest-SizeBytes
    ):
        assert (await put(http, f"/cas/{sha(data)}", bad, headers=sized)).status == 400
        assert (await get(http, f"/cas/{sha(data)}"))[0] == 404  # nothing stored
    assert (await put(http, f"/cas/{sha(data)}", three_frames, headers=sized)).status == 200
    assert (await get(http, f"/cas/{sha(data)}"))[1] == data


async def test_put_zstd_ac_decoder_seams():
    """zstd action entries: several frames are one entry; truncated or garbage is 400; past the
    entry limit once decoded is 413; a refused PUT stores nothing."""
    limit = 64 << 10
    listener = HttpListener("127.0.0.1:0", create_app(MemoryBlobStore(), MemoryActionStore(), max_entry_size=limit))
    await listener.start()
    zstd = {"Content-Encoding": "zstd"}
    entry = b"\xff" + os.urandom(20_000)  # not an ActionResult: a raw entry
    c = zstandard.ZstdCompressor()
    try:
        async with aiohttp.ClientSession(f"http://{listener.address}", auto_decompress=False) as session:
            for bad, status in (
                (c.compress(entry)[:-4], 400),  # truncated
                (b"not zstd" * 100, 400),  # garbage
                (c.compress(entry) + b"junk", 400),  # trailing garbage
                (c.compress(b"\0" * (limit + 1)), 413),  # tiny on the wire, over the limit decoded
            ):
                assert (await put(session, f"/ac/{sha(b'key')}", bad, headers=zstd)).status == status, bad[:20]
                assert (await get(session, f"/ac/{sha(b'key')}"))[0] == 404
            two_frames = c.compress(entry[:5000]) + c.compress(entry[5000:])
            assert (await put(session, f"/ac/{sha(b'key')}", two_frames, headers=zstd)).status == 200
            assert (await get(session, f"/ac/{sha(b'key')}"))[1] == entry
            exactly = c.compress(b"\xff" * limit)  # at the limit is fine
            assert (await put(session, f"/ac/{sha(b'max')}", exactly, headers=zstd)).status == 200
    finally:
        await listener.stop(1)


# -- action entries ----------------------------------------------------------------------------


async def test_http_action_result_is_a_real_ac_entry(http, stubs):
    out = os.urandom(5000)
    await put(http, f"/inst/cas/{sha(out)}", out)
    result = action_result(("out/a.o", out))
    key = sha(b"action")
    body = result.SerializeToString()
    assert (await put(http, f"/inst/ac/{key}", body)).status == 200
    assert (await get(http, f"/inst/ac/{key}"))[1] == body  # byte-identical
    got = await stubs.ac.GetActionResult(
        re_pb2.GetActionResultRequest(instance_name="inst", action_digest=re_pb2.Digest(hash=key, size_bytes=6))
    )
    assert got.output_files[0].digest == digest(out)
    # Another instance does not see it, over either protocol.
    assert (await get(http, f"/other/ac/{key}"))[0] == 404
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stubs.ac.GetActionResult(
            re_pb2.GetActionResultRequest(instance_name="other", action_digest=re_pb2.Digest(hash=key, size_bytes=6))
        )
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_grpc_action_result_is_served_over_http(http, stubs):
    out = os.urandom(700)
    await batch_update(stubs, [out])
    result = action_result(("x.o", out), exit_code=0)
    key = re_pb2.Digest(hash=sha(b"grpc action"), size_bytes=11)
    await stubs.ac.UpdateActionResult(re_pb2.UpdateActionResultRequest(action_digest=key, action_result=result))
    status, body, _ = await get(http, f"/ac/{key.hash}")
    assert status == 200
    assert re_pb2.ActionResult.FromString(body).output_files[0].digest == digest(out)


async def test_opaque_entries_go_to_raw_and_never_reach_grpc(http, stubs):
    key = sha(b"ccache key")
    entry = b"cCrS\x00\x01" + os.urandom(300)  # ccache's own format, not an ActionResult
    assert (await put(http, f"/ccache/ac/{key}", entry)).status == 200
    assert (await get(http, f"/ccache/ac/{key}"))[1] == entry
    async with http.head(f"/ccache/ac/{key}") as response:
        assert response.status == 200 and response.headers["Content-Length"] == str(len(entry))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stubs.ac.GetActionResult(
            re_pb2.GetActionResultRequest(instance_name="ccache", action_digest=re_pb2.Digest(hash=key, size_bytes=1))
        )
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    # Replacing it works (ccache overwrites on recache).
    assert (await put(http, f"/ccache/ac/{key}", b"newer")).status == 200
    assert (await get(http, f"/ccache/ac/{key}"))[1] == b"newer"


async def test_incomplete_action_result_is_not_served_until_complete(http, stubs):
    out = os.urandom(999)
    key = sha(b"incomplete action")
    body = action_result(("late.o", out)).SerializeToString()
    assert (await put(http, f"/ac/{key}", body)).status == 200  # kept (raw), blob not there yet
    assert (await get(http, f"/ac/{key}"))[0] == 404
    async with http.head(f"/ac/{key}") as response:
        assert response.status == 404
    with pytest.raises(grpc.aio.AioRpcError):
        await stubs.ac.GetActionResult(
            re_pb2.GetActionResultRequest(action_digest=re_pb2.Digest(hash=key, size_bytes=1))
        )
    await put(http, f"/cas/{sha(out)}", out)
    assert (await get(http, f"/ac/{key}"))[1] == body


async def test_real_ac_entry_whose_blob_is_gone_is_a_miss():
    """A real entry whose blob disappeared (evicted) is a miss, never a hit a client cannot use."""
    blobs, actions = MemoryBlobStore(), MemoryActionStore()
    listener = HttpListener("127.0.0.1:0", create_app(blobs, actions))
    await listener.start()
    try:
        async with aiohttp.ClientSession(f"http://{listener.address}") as session:
            out = os.urandom(20_000)
            await put(session, f"/cas/{sha(out)}", out)
            key = sha(b"evictable")
            body = action_result(("o", out)).SerializeToString()
            await put(session, f"/i/ac/{key}", body)
            assert actions.namespaces() == ["ac/i"]  # a real entry, not a raw one
            assert (await get(session, f"/i/ac/{key}"))[1] == body
            assert blobs.evict() == 1  # what eviction does
            assert (await get(session, f"/i/ac/{key}"))[0] == 404
            async with session.head(f"/i/ac/{key}") as response:
                assert response.status == 404
            await put(session, f"/cas/{sha(out)}", out)  # uploaded again: a hit again
            assert (await get(session, f"/i/ac/{key}"))[1] == body
    finally:
        await listener.stop(1)


async def test_ac_zstd_put_and_get(http):
    key = sha(b"zstd entry")
    entry = os.urandom(100) * 50
    response = await put(http, f"/ac/{key}", zstandard.ZstdCompressor().compress(entry),
                         headers={"Content-Encoding": "zstd"})
    assert response.status == 200
    status, body, response = await get(http, f"/ac/{key}", headers={"Accept-Encoding": "zstd"})
    assert response.headers["Content-Encoding"] == "zstd"
    assert zstandard.ZstdDecompressor().decompressobj().decompress(body) == entry


# -- ccache layouts -------------------------------------------------------------------------


def ccache_key(raw: bytes) -> str:
    return raw[:2].hex() + base64.b32hexencode(raw[2:]).decode().rstrip("=").lower()


def test_ccache_key_mapping_matches_ccache_log():
    # From ccache 4.7.5's debug log: "Translated key 1e734oh1... to Bazel layout ac/1e7326..."
    assert ccache_key_to_hash("1e734oh1tmsldntvrimp0slrpcr6f5eli") == (
        "1e7326221edb956dfbfdcad9072bbcb366795d591e7326221edb956dfbfdcad9"
    )
    raw = os.urandom(20)
    assert ccache_key_to_hash(ccache_key(raw)) == raw.hex() + raw.hex()[:24]
    subdirs = parse_cache_path(f"/p/q/{ccache_key(raw)[:2]}/{ccache_key(raw)[2:]}")
    assert (subdirs.instance, subdirs.kind, subdirs.layout) == ("p/q", "ac", "ccache-subdirs")
    flat = parse_cache_path(f"/{ccache_key(raw)}")
    assert (flat.instance, flat.hash, flat.layout) == ("", subdirs.hash, "ccache-flat")
    # "ac" is also a valid first byte of a ccache key: length tells the layouts apart.
    ac_key = ccache_key(b"\xac" + raw[1:])
    assert parse_cache_path(f"/ac/{ac_key[2:]}").layout == "ccache-subdirs"


def test_ccache_4_8_hex_keys_map_to_the_bazel_key():
    # From ccache 4.14.2's debug log: "Translated key 358c7194... to Bazel layout ac/358c7194..."
    key = "358c719474255ef6cd798939bf315e5b6c266613"
    assert ccache_key_to_hash(key) == "358c719474255ef6cd798939bf315e5b6c266613358c719474255ef6cd798939"
    subdirs = parse_cache_path(f"/p/q/{key[:2]}/{key[2:]}")
    flat = parse_cache_path(f"/p/q/{key}")
    assert (subdirs.instance, subdirs.kind, subdirs.layout) == ("p/q", "ac", "ccache-subdirs")
    assert (flat.instance, flat.kind, flat.layout) == ("p/q", "ac", "ccache-flat")
    assert subdirs.hash == flat.hash == ccache_key_to_hash(key)
    # The same 20 bytes in 4.7's spelling name the same entry.
    raw = bytes.fromhex(key)
    assert parse_cache_path(f"/p/q/{ccache_key(raw)}").hash == flat.hash
    # A first byte of 0xac under subdirs, and no prefix at all.
    assert parse_cache_path(f"/ac/{key[2:]}").hash == ccache_key_to_hash("ac" + key[2:])
    assert parse_cache_path(f"/{key}").instance == ""
    # Near misses name nothing: uppercase, one digit short or long, a non-hex digit.
    for bad in (f"/p/{key.upper()}", f"/p/{key[:-1]}", f"/p/{key}0", f"/p/{key[:2]}/{key[2:-1]}",
                f"/p/{key[:2]}/{key[2:-1]}g", f"/p/{key[:-1]}w"):
        with pytest.raises(InvalidDigest):
            parse_cache_path(bad)
    with pytest.raises(InvalidDigest):
        ccache_key_to_hash(key[:-1] + "x")


async def test_ccache_layouts_share_one_entry(http):
    raw = os.urandom(20)
    key = ccache_key(raw)
    entry = b"ccache result " + os.urandom(64)
    assert (await put(http, f"/cc/{key[:2]}/{key[2:]}", entry)).status == 200  # layout=subdirs
    assert (await get(http, f"/cc/{key}"))[1] == entry  # layout=flat
    assert (await get(http, f"/cc/ac/{raw.hex()}{raw.hex()[:24]}"))[1] == entry  # layout=bazel
    assert (await get(http, f"/elsewhere/{key}"))[0] == 404
    # Non-canonical base32hex (last digit with stray low bits) names no key.
    bad = key[:-1] + ("v" if key[-1] != "v" else "u")
    assert (await get(http, f"/cc/{bad}"))[0] in (400, 404)
    # ccache 4.8+ spells the same 20 bytes as 40 hex digits: the same entry, in both its layouts.
    hex_key = raw.hex()
    assert (await get(http, f"/cc/{hex_key}"))[1] == entry  # layout=flat
    assert (await get(http, f"/cc/{hex_key[:2]}/{hex_key[2:]}"))[1] == entry  # layout=subdirs
    other = os.urandom(20).hex()
    assert (await put(http, f"/cc/{other}", b"flat entry")).status == 200
    assert (await get(http, f"/cc/ac/{other}{other[:24]}"))[1] == b"flat entry"
    assert (await get(http, f"/cc/{other[:2]}/{other[2:]}"))[1] == b"flat entry"
    assert (await get(http, f"/cc/{other[:-1]}"))[0] == 400


# -- cross-protocol CAS -------------------------------------------------------------------------


async def test_http_put_then_bytestream_read(http, stubs):
    data = os.urandom(1_500_000)
    await put(http, f"/cas/{sha(data)}", data)
    assert await read(stubs, digest(data)) == data


async def test_grpc_write_then_http_get(http, stubs):
    data = os.urandom(2_000_000)
    await write(stubs, data)
    status, body, response = await get(http, f"/cas/{sha(data)}")
    assert status == 200 and body == data
    small = os.urandom(100)
    await batch_update(stubs, [small])
    assert (await get(http, f"/cas/{sha(small)}"))[1] == small


async def test_grpc_written_blob_readable_over_http_after_restart(fresh):
    """GET /cas/{hash} finds the size in the store's own index, also for blobs stored before a restart."""
    out, other = os.urandom(4096), os.urandom(3 << 20)
    await write(fresh.stubs, out)
    await write(fresh.stubs, other)
    key = sha(b"restart action")
    await put(fresh.http, f"/ac/{key}", action_result(("r.o", out)).SerializeToString())
    fresh.server.restart()
    async with session_for(fresh.server) as session:
        assert (await get(session, f"/cas/{sha(other)}"))[1] == other  # never seen since the restart
        async with session.head(f"/cas/{sha(other)}") as response:
            assert response.status == 200 and response.headers["Content-Length"] == str(len(other))
        assert (await get(session, f"/ac/{key}"))[0] == 200  # what Bazel does first
        assert (await get(session, f"/cas/{sha(out)}"))[1] == out
        assert (await get(session, f"/cas/{sha(b'never stored')}"))[0] == 404


# -- status and metrics -------------------------------------------------------------------------


async def test_status_json_and_html(fresh):
    http = fresh.http
    data = os.urandom(1000)
    await put(http, f"/cas/{sha(data)}", data)
    await put(http, f"/ac/{sha(b'k')}", b"raw entry")
    await get(http, f"/ac/{sha(b'k')}")
    await get(http, f"/ac/{sha(b'missing')}")
    status, body, response = await get(http, "/status")
    assert status == 200 and response.headers["Content-Type"].startswith("application/json")
    doc = json.loads(body)
    assert doc["blob_count"] == 1 and doc["ac_entries"] == 1
    assert doc["current_size_bytes"] >= 1000 and doc["max_size_bytes"] == 10 << 30
    assert doc["ac_hits"] == 1 and doc["ac_misses"] == 1
    assert doc["uptime_seconds"] >= 0 and doc["version"]
    for path in ("/", "/status.html"):
        status, page, response = await get(http, path)
        assert status == 200 and response.headers["Content-Type"].startswith("text/html")
        text = page.decode()
        assert "<table>" in text and "AC hits" in text and doc["version"] in text
        assert not re.search(r"""(src|href)=["']?(https?:)?//""", text)  # self-contained
    async with http.head("/status") as response:
        assert response.status == 200


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_exact_counts(fresh):
    http, stubs = fresh.http, fresh.stubs
    a, b = os.urandom(1000), os.urandom(2345)
    # HTTP: 2 CAS PUTs, 2 CAS GETs (one 404), AC: 1 PUT, 2 GET hits... exactly:
    assert (await put(http, f"/secret-instance/cas/{sha(a)}", a)).status == 200
    assert (await put(http, f"/cas/{sha(b)}", b)).status == 200
    assert (await get(http, f"/cas/{sha(a)}"))[0] == 200
    assert (await get(http, f"/cas/{sha(b'nope')}"))[0] == 404
    assert (await put(http, f"/secret-instance/ac/{sha(b'k1')}", b"entry")).status == 200
    assert (await get(http, f"/secret-instance/ac/{sha(b'k1')}"))[0] == 200
    assert (await get(http, f"/secret-instance/ac/{sha(b'k1')}"))[0] == 200
    assert (await get(http, f"/ac/{sha(b'k2')}"))[0] == 404
    async with http.delete(f"/cas/{sha(a)}") as response:
        assert response.status == 405
    assert (await get(http, "/status"))[0] == 200
    # gRPC: one GetActionResult miss, one hit, one ByteStream read of b, one FindMissingBlobs.
    with pytest.raises(grpc.aio.AioRpcError):
        await stubs.ac.GetActionResult(
            re_pb2.GetActionResultRequest(action_digest=re_pb2.Digest(hash=sha(b"k3"), size_bytes=2))
        )
    await stubs.ac.UpdateActionResult(
        re_pb2.UpdateActionResultRequest(
            action_digest=re_pb2.Digest(hash=sha(b"k4"), size_bytes=2), action_result=action_result(("b", b))
        )
    )
    await stubs.ac.GetActionResult(
        re_pb2.GetActionResultRequest(action_digest=re_pb2.Digest(hash=sha(b"k4"), size_bytes=2))
    )
    assert await read(stubs, digest(b)) == b
    await stubs.cas.FindMissingBlobs(re_pb2.FindMissingBlobsRequest(blob_digests=[digest(a)]))

    status, body, response = await get(http, "/metrics")
    assert status == 200 and response.headers["Content-Type"].startswith("text/plain")
    text = body.decode()
    s = scrape(text)
    req = "buildvault_requests_total"
    expected_http = {
        ("PUT", "cas", "200"): 2,
        ("GET", "cas", "200"): 1,
        ("GET", "cas", "404"): 1,
        ("PUT", "ac", "200"): 1,
        ("GET", "ac", "200"): 2,
        ("GET", "ac", "404"): 1,
        ("DELETE", "cas", "405"): 1,
        ("GET", "status", "200"): 1,
    }
    http_samples = {
        (dict(labels)["method"], dict(labels)["kind"], dict(labels)["status"]): v
        for (name, labels), v in s.items()
        if name == req and dict(labels)["protocol"] == "http"
    }
    assert http_samples == expected_http
    grpc_samples = {
        (dict(labels)["method"], dict(labels)["kind"], dict(labels)["status"]): v
        for (name, labels), v in s.items()
        if name == req and dict(labels)["protocol"] == "grpc"
    }
    assert grpc_samples == {
        ("GetActionResult", "ac", "NOT_FOUND"): 1,
        ("GetActionResult", "ac", "OK"): 1,
        ("UpdateActionResult", "ac", "OK"): 1,
        ("Read", "cas", "OK"): 1,
        ("FindMissingBlobs", "cas", "OK"): 1,
    }
    assert value(s, "buildvault_ac_hits_total", protocol="http") == 2
    assert value(s, "buildvault_ac_misses_total", protocol="http") == 1
    assert value(s, "buildvault_ac_hits_total", protocol="grpc") == 1
    assert value(s, "buildvault_ac_misses_total", protocol="grpc") == 1
    assert value(s, "buildvault_cas_written_bytes_total", protocol="http") == len(a) + len(b)
    assert value(s, "buildvault_cas_read_bytes_total", protocol="http") == len(a)
    assert value(s, "buildvault_cas_read_bytes_total", protocol="grpc") == len(b)
    assert value(s, "buildvault_request_duration_seconds_count", protocol="http", method="GET", kind="ac") == 3
    assert value(s, "buildvault_request_duration_seconds_count", protocol="grpc", method="Read", kind="cas") == 1
    # Storage gauges: 2 blobs (a, b), 2 action entries (raw k1, real k4), the configured cap.
    assert value(s, "buildvault_cas_blobs") == 2
    assert value(s, "buildvault_ac_entries") == 2
    assert value(s, "buildvault_disk_max_bytes") == 10 << 30
    assert value(s, "buildvault_disk_used_bytes") >= len(a) + len(b)
    assert value(s, "buildvault_evictions_total") == 0
    assert ("buildvault_oldest_item_age_seconds", ()) in s
    # Bounded cardinality: no digest, no instance name, no path in any label value.
    for (_, labels), _ in s.items():
        for _, label_value in labels:
            assert not re.search(r"[0-9a-f]{16}", label_value) and "secret" not in label_value, label_value


async def test_two_servers_in_one_process_count_apart():
    async def start():
        metrics = Metrics(version="test")
        listener = HttpListener(
            "127.0.0.1:0", create_app(MemoryBlobStore(), MemoryActionStore(), metrics)
        )
        await listener.start()
        return listener, metrics

    (one, m1), (two, m2) = await asyncio.gather(start(), start())
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(3):
                await get(session, f"http://{one.address}/ac/{sha(b'x')}")
            status, body, _ = await get(session, f"http://{two.address}/metrics")
        assert m1.ac_counts()["misses"]["http"] == 3 and m2.ac_counts()["misses"]["http"] == 0
        assert value(scrape(body.decode()), "buildvault_ac_misses_total", protocol="http") == 0
    finally:
        await asyncio.gather(one.stop(1), two.stop(1))


async def test_bytestream_write_counts_written_bytes(fresh):
    data = os.urandom(300_000)
    await write(fresh.stubs, data)
    _, body, _ = await get(fresh.http, "/metrics")
    s = scrape(body.decode())
    assert value(s, "buildvault_cas_written_bytes_total", protocol="grpc") == len(data)
    assert value(s, "buildvault_requests_total", protocol="grpc", method="Write", kind="cas", status="OK") == 1
