"""Hostile credentials: thousands of malformed `authorization` values on gRPC and HTTP.

Every one gets UNAUTHENTICATED / 401 (or 400 from the HTTP parser for bytes no header may
hold), never INTERNAL or a 5xx; the server stays up and stores nothing.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import random
import string

import aiohttp
import grpc
import pytest
from auth_setup import htpasswd, new_token
from grpc_health.v1 import health_pb2, health_pb2_grpc
from reapi_client import CLIENT_OPTIONS, digest, make_stubs
from server_process import ServerProcess

from buildvault.remote_apis import re_pb2

PRINTABLE = string.ascii_letters + string.digits + string.punctuation + " "


def hostile_values(rng: random.Random, count: int) -> list[str]:
    """Printable-ASCII values (what a gRPC client can send as metadata and HTTP as a header)."""

    def text(n: int, alphabet: str = PRINTABLE) -> str:
        return "".join(rng.choice(alphabet) for _ in range(n))

    b64 = base64.b64encode
    makers = [
        lambda: text(rng.randint(1, 200)),
        lambda: (
            rng.choice(["Basic", "Bearer", "basic", "BEARER", "Digest", "Negotiate", "NTLM", "AWS4-HMAC-SHA256"])
            + rng.choice(["", " ", "  "])
            + text(rng.randint(0, 80))
        ),
        lambda: "Basic " + text(rng.randint(1, 60), string.ascii_letters + "+/=!*"),  # not base64
        lambda: "Basic " + b64(text(rng.randint(0, 40), string.ascii_letters).encode()).decode(),  # no colon
        lambda: "Basic " + b64(b":" + text(8).encode()).decode(),  # empty user
        lambda: "Basic " + b64(bytes(rng.randrange(256) for _ in range(20))).decode(),  # not UTF-8 mostly
        lambda: "Basic " + b64(f"alice:{text(rng.randint(0, 30))}".encode()).decode(),  # wrong password
        lambda: "Basic " + b64(f"{text(8)}:{text(8)}".encode()).decode(),  # unknown user
        lambda: "Bearer " + text(rng.randint(1, 100), string.ascii_letters + string.digits + "-_"),
        lambda: "Bearer " + text(10) + " " + text(10),
        lambda: "Bearer " + hashlib.sha256(text(8).encode()).hexdigest(),  # a hash, not a token
        lambda: "Bearer " + "A" * rng.choice([4097, 6000, 7000]),  # over the 4 KiB limit
        lambda: "Basic " + "=" * rng.randint(1, 8),
        lambda: " " * rng.randint(0, 5),
    ]
    values = [rng.choice(makers)() for _ in range(count)]
    return [v for v in values if v.strip() or v == ""] or ["x"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    tokens, users = d / "tokens", d / "htpasswd"
    new_token(tokens, "ci")
    htpasswd(users, "alice", "alice-pw")
    with ServerProcess(d / "data", extra_args=["--token-file", str(tokens), "--htpasswd-file", str(users)]) as process:
        yield process


async def test_grpc_hostile_authorization_values(server):
    rng = random.Random(11)
    values = hostile_values(rng, 2000)
    payload = b"must never be stored"
    codes: dict[str, int] = {}
    async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
        stubs = make_stubs(channel)
        request = re_pb2.BatchUpdateBlobsRequest(
            requests=[re_pb2.BatchUpdateBlobsRequest.Request(digest=digest(payload), data=payload)]
        )
        limit = asyncio.Semaphore(32)

        async def one(value: str) -> None:
            async with limit:
                try:
                    await stubs.cas.BatchUpdateBlobs(request, metadata=(("authorization", value),), timeout=30)
                    name = "OK"
                except grpc.aio.AioRpcError as e:
                    name = e.code().name
            codes[name] = codes.get(name, 0) + 1

        await asyncio.gather(*(one(v) for v in values))
        # Several entries at once, and none at all.
        for metadata in ((("authorization", "Bearer a"), ("authorization", "Bearer b")), ()):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stubs.cas.BatchUpdateBlobs(request, metadata=metadata, timeout=30)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert codes == {"UNAUTHENTICATED": len(values)}, codes
        # gRPC rejects metadata between its 8 KiB soft and 16 KiB hard limit at random, and past
        # the hard limit always, before any service code runs: probe below the one, above the other.
        for size, want in ((6000, grpc.StatusCode.UNAUTHENTICATED), (40000, grpc.StatusCode.RESOURCE_EXHAUSTED)):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stubs.cas.BatchUpdateBlobs(
                    request, metadata=(("authorization", "Bearer " + "A" * size),), timeout=30
                )
            assert caught.value.code() == want, (size, caught.value.code())
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert server.running


async def test_http_hostile_headers(server):
    rng = random.Random(12)
    values = hostile_values(rng, 2000)
    payload = b"must never be stored either"
    path = f"/cas/{hashlib.sha256(payload).hexdigest()}"
    statuses: dict[int, int] = {}
    url = f"http://{server.http_address}"
    async with aiohttp.ClientSession(url) as session:
        limit = asyncio.Semaphore(32)

        async def one(method: str, headers: dict[str, str]) -> None:
            async with (
                limit,
                session.request(method, path, headers=headers, data=payload if method == "PUT" else None) as r,
            ):
                await r.read()
                statuses[r.status] = statuses.get(r.status, 0) + 1

        await asyncio.gather(*(one(rng.choice(["GET", "PUT", "HEAD"]), {"Authorization": v}) for v in values))
        assert set(statuses) == {401}, statuses
        # A huge header and bytes no header may hold: the HTTP parser's 400 (or 431), never a 5xx.
        raw_answers = [await raw_http(server.http_address, line) for line in raw_hostile_lines(rng)]
        assert all(a in (400, 401, 431) for a in raw_answers), raw_answers
        async with session.get("/healthz") as r:
            assert r.status == 200
        async with session.get(
            path, headers={"Authorization": "Basic " + base64.b64encode(b"alice:alice-pw").decode()}
        ) as r:
            assert r.status == 404  # nothing was stored
    assert server.running


def raw_hostile_lines(rng: random.Random) -> list[bytes]:
    lines = [
        b"Authorization: Basic " + b"A" * 20000,
        b"Authorization: " + b"x" * 70000,
        b"Authorization: Bearer \x00\x01\x02",
        b"Authorization: Bearer \xff\xfe\xc3\x28",
        b"Authorization: Basic YWxpY2U6YWxpY2UtcHc=\x7f",
        b"Authorization:",
        b"Authorization",
        b"Authorization: Bearer a\r\nAuthorization: Bearer b",
        b"Authorization: Bearer a\rX-Injected: 1",
    ]
    lines += [b"Authorization: " + bytes(rng.randrange(1, 256) for _ in range(rng.randint(1, 300))).replace(b"\n", b"")
              for _ in range(200)]  # fmt: skip
    return lines


async def raw_http(address: str, header_line: bytes) -> int:
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            b"GET /cas/" + b"0" * 64 + b" HTTP/1.1\r\nHost: x\r\n" + header_line + b"\r\nConnection: close\r\n\r\n"
        )
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 30)
    finally:
        writer.close()
    parts = status_line.split()
    assert len(parts) >= 2, status_line
    return int(parts[1])


async def test_grpc_nothing_stored_after_the_fuzz(server):
    # Runs after the two fuzz tests (same module server): a valid user sees the payload missing.
    value = "Basic " + base64.b64encode(b"alice:alice-pw").decode()
    async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
        reply = await make_stubs(channel).cas.FindMissingBlobs(
            re_pb2.FindMissingBlobsRequest(blob_digests=[digest(b"must never be stored")]),
            metadata=(("authorization", value),),
            timeout=30,
        )
    assert [d.hash for d in reply.missing_blob_digests] == [digest(b"must never be stored").hash]
