"""The index heals itself: blob files removed or damaged under a live `buildvault serve`.

For each kind of damage (removed, truncated, a byte flipped in place) to a small blob (a record
in LMDB: records.py), a medium one (a file read whole) and a large one (a file streamed),
through gRPC and HTTP: the read that meets the damage
never hands out wrong bytes, and from then on FindMissingBlobs reports the blob missing, an
ActionResult naming it misses (gRPC and HTTP /ac/), and the next upload really stores it, after
which the entry is a hit again. With a bucket, a read that meets a gone or damaged local copy is
served from the bucket.
"""

from __future__ import annotations

import contextlib
import http.client as http_client
import os
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from reapi_client import CLIENT_OPTIONS, Stubs, batch_update, digest, make_stubs, missing, read, write
from record_damage import flip_byte_of, remove_record, truncate_record
from s3_server import aws_env, bucket, s3_endpoint, tier_args, wait_drained  # noqa: F401 - fixtures
from server_process import ServerProcess

from buildvault.digest import Digest
from buildvault.remote_apis import re_pb2
from buildvault.storage.disk.records import RECORD_LIMIT

pytestmark = pytest.mark.timeout(300)

SMALL = 3000  # a record
MEDIUM = 200_000  # a file, read whole in one coalesced trip
LARGE = (3 << 20) + 17  # a file, streamed in chunks
# The large blob stays one streamed file: above this the server would keep it as FastCDC chunks,
# each an ordinary file blob like the medium one.
WHOLE_FILES = ["--chunking-threshold", "1GiB"]
DAMAGES = ("removed", "truncated", "flipped")


@contextlib.asynccontextmanager
async def connect(address: str) -> AsyncIterator[Stubs]:
    async with grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
        await channel.channel_ready()
        yield make_stubs(channel)


def http(method: str, url: str, data: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def blob_file(server: ServerProcess, d: re_pb2.Digest) -> Path:
    return server.data_dir / "cas" / "sha256" / d.hash[:2] / f"{d.hash}-{d.size_bytes}"


def damage(server: ServerProcess, data: bytes, how: str) -> None:
    """Damage the stored copy of `data`: its record, or its file."""
    if len(data) > RECORD_LIMIT:
        damage_file(blob_file(server, digest(data)), how)
        return
    d = Digest.of(data)
    if how == "removed":
        remove_record(server.data_dir, d)
    elif how == "truncated":
        truncate_record(server.data_dir, d)
    else:
        flip_byte_of(server.data_dir, data)


def damage_file(path: Path, how: str) -> None:
    if how == "removed":
        path.unlink()
    elif how == "truncated":
        os.truncate(path, path.stat().st_size - 1)
    else:  # same size, one bit changed: only the hash can tell
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))


async def upload(stubs: Stubs, data: bytes) -> None:
    if len(data) <= MEDIUM:
        await batch_update(stubs, [data])
    else:
        assert await write(stubs, data) == len(data)


async def put_action(stubs: Stubs, output: re_pb2.Digest) -> re_pb2.Digest:
    action = digest(os.urandom(32))
    result = re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="out", digest=output)])
    await stubs.ac.UpdateActionResult(re_pb2.UpdateActionResultRequest(action_digest=action, action_result=result))
    return action


async def grpc_ac_hit(stubs: Stubs, action: re_pb2.Digest) -> bool:
    try:
        await stubs.ac.GetActionResult(re_pb2.GetActionResultRequest(action_digest=action))
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.NOT_FOUND, e
        return False
    return True


async def grpc_read(stubs: Stubs, d: re_pb2.Digest) -> bytes | grpc.StatusCode:
    """The bytes, or the status code the read ended with (possibly after some chunks)."""
    try:
        return await read(stubs, d)
    except grpc.aio.AioRpcError as e:
        return e.code()


def http_read(server: ServerProcess, d: re_pb2.Digest) -> bytes | int:
    """The body of GET /cas/{hash}, or the status; -1 when the body was cut short (the server
    found the damage after sending the headers)."""
    try:
        code, body = http("GET", f"http://{server.http_address}/cas/{d.hash}")
    except http_client.IncompleteRead:
        return -1
    return body if code == 200 else code


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ServerProcess:
    with ServerProcess(tmp_path_factory.mktemp("healing") / "data", name="healing", extra_args=WHOLE_FILES) as process:
        yield process


@pytest.mark.parametrize("size", [SMALL, MEDIUM, LARGE], ids=["small", "medium", "large"])
@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("reader", ["grpc", "http"])
async def test_damaged_blob_leaves_the_index_and_is_stored_again(server, size, how, reader):
    data = os.urandom(size)
    d = digest(data)
    async with connect(server.grpc_address) as stubs:
        await upload(stubs, data)
        action = await put_action(stubs, d)
        assert await grpc_ac_hit(stubs, action)
        damage(server, data, how)

        got = await grpc_read(stubs, d) if reader == "grpc" else http_read(server, d)
        assert got != data and not isinstance(got, bytes), f"damaged blob served: {len(got)} bytes"

        assert await missing(stubs, [d]) == {(d.hash, d.size_bytes)}
        assert not await grpc_ac_hit(stubs, action)
        code, _ = http("GET", f"http://{server.http_address}/ac/{action.hash}")
        assert code == 404

        await upload(stubs, data)  # not skipped: the index no longer believes it is there
        if size > RECORD_LIMIT:
            assert blob_file(server, d).read_bytes() == data
        assert await missing(stubs, [d]) == set()
        assert await grpc_read(stubs, d) == data
        assert http_read(server, d) == data
        assert await grpc_ac_hit(stubs, action)


async def test_http_put_after_a_lookup_found_the_file_gone_stores_it(server):
    """GET /cas/{hash} carries no size: the hash is re-checked by the next FindMissing or write."""
    data = os.urandom(SMALL)
    d = digest(data)
    url = f"http://{server.http_address}/cas/{d.hash}"
    async with connect(server.grpc_address) as stubs:
        assert http("PUT", url, data)[0] in (200, 201, 204)
        action = await put_action(stubs, d)
        damage(server, data, "removed")
        assert http("GET", url)[0] == 404
        assert http("HEAD", url)[0] == 404
        assert http("PUT", url, data)[0] in (200, 201, 204)  # stored, not acknowledged blindly
        assert http("GET", url) == (200, data)
        assert await grpc_ac_hit(stubs, action)

        damage(server, data, "removed")
        assert http("GET", url)[0] == 404
        assert await missing(stubs, [d]) == {(d.hash, d.size_bytes)}  # FindMissing re-checks it
        assert not await grpc_ac_hit(stubs, action)


@pytest.mark.parametrize("how", DAMAGES)
async def test_with_a_bucket_a_read_falls_through_to_it(tmp_path, s3_endpoint, bucket, how):  # noqa: F811
    server = ServerProcess(
        tmp_path / "data", name="tiered", extra_args=[*tier_args(s3_endpoint, bucket), *WHOLE_FILES]
    ).start()
    try:
        small, large = os.urandom(SMALL), os.urandom(LARGE)
        async with connect(server.grpc_address) as stubs:
            await upload(stubs, small)
            await upload(stubs, large)
            wait_drained(server.http_address)  # both are in the bucket now
            for data in (small, large):
                damage(server, data, how)
            # Small blobs are verified before any byte goes out: the bucket serves them at once.
            assert await grpc_read(stubs, digest(small)) == small
            # A streamed read finds the damage at its end (flipped) or start (removed, truncated);
            # from then on the bucket serves it and the local copy is filled again.
            first = await grpc_read(stubs, digest(large))
            assert first == large if how != "flipped" else first != large
            assert await grpc_read(stubs, digest(large)) == large
            assert http_read(server, digest(large)) == large
            assert await missing(stubs, [digest(small), digest(large)]) == set()
    finally:
        server.stop()
