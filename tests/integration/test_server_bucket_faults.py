"""Bucket faults are invisible to builds: a real `buildvault serve` whose bucket sits behind a
fault-injecting proxy (latency, 5xx, connection resets mid-reply, truncated bodies, outage).

For each fault, a build's requests (GetActionResult, FindMissingBlobs, BatchUpdateBlobs,
ByteStream Write, UpdateActionResult, reads) get no error a client would see, none waits on
the bucket, nothing written is lost, and once the fault ends the upload backlog drains and
what the bucket held is served again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import TypeVar

import grpc
import pytest
from fault_proxy import FAULTS, FaultProxy
from polling import wait_for, wait_until
from reapi_client import CLIENT_OPTIONS, Stubs, batch_update, digest, make_stubs, missing, read, write
from s3_server import (  # noqa: F401 - fixtures
    aws_env,
    bucket_keys,
    create_bucket,
    metric,
    moto_server,
    put_objects,
    raw_client,
    s3,
    tier_args,
    wait_drained,
)

from buildvault.remote_apis import re_pb2

pytestmark = pytest.mark.timeout(300)

MiB = 1 << 20
# Large blobs stay whole objects, so the tests can name their bucket keys (chunked blobs are
# their chunks' objects plus a list: tests/integration/test_grpc_chunking.py).
WHOLE = ("--chunking-threshold", "1GiB")
T = TypeVar("T")
# Longest a request may take while the bucket is slow or failing: the request budget (0.3 s by
# default) plus local work on a loaded machine, well under the injected 2 s latency.
REQUEST_LIMIT = 1.5


@pytest.fixture
def proxy(s3) -> Iterator[FaultProxy]:  # noqa: F811 - the imported fixture
    p = FaultProxy(("127.0.0.1", s3.port), latency=2.0).start()
    try:
        yield p
    finally:
        p.stop()


@contextlib.asynccontextmanager
async def connect(address: str) -> AsyncIterator[Stubs]:
    async with grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
        await channel.channel_ready()
        yield make_stubs(channel)


def cas_key(data: bytes) -> str:
    return f"cas/sha256/{hashlib.sha256(data).hexdigest()}"


def ac_key(action: re_pb2.Digest) -> str:
    return f"ac/ac/sha256/{action.hash}"


class Timed:
    """Runs each request and keeps the slowest duration."""

    def __init__(self) -> None:
        self.slowest = 0.0
        self.slowest_step = ""

    async def __call__(self, step: str, request: Awaitable[T]) -> T:
        started = time.monotonic()
        try:
            return await request
        finally:
            took = time.monotonic() - started
            if took > self.slowest:
                self.slowest, self.slowest_step = took, step


def action_result(outputs: list[bytes]) -> re_pb2.ActionResult:
    return re_pb2.ActionResult(
        output_files=[re_pb2.OutputFile(path=f"out/{i}", digest=digest(d)) for i, d in enumerate(outputs)]
    )


def new_action() -> re_pb2.Digest:
    return digest(re_pb2.Action(salt=os.urandom(16)).SerializeToString())


async def get_action(stubs: Stubs, action: re_pb2.Digest) -> re_pb2.ActionResult | None:
    """The entry, or None on NOT_FOUND (a miss); any other status fails the test."""
    try:
        return await stubs.ac.GetActionResult(re_pb2.GetActionResultRequest(action_digest=action))
    except grpc.aio.AioRpcError as e:
        assert e.code() is grpc.StatusCode.NOT_FOUND, (e.code(), e.details())
        return None


@pytest.mark.parametrize("fault", FAULTS)
async def test_bucket_fault_is_invisible_to_a_build(fault, s3, proxy, buildvault_server_factory):  # noqa: F811
    bucket = create_bucket(s3.endpoint)
    # What another server uploaded earlier: outputs and their action entry, in the bucket only.
    earlier = [os.urandom(300) for _ in range(5)]
    put_objects(s3.endpoint, bucket, {cas_key(d): d for d in earlier})
    earlier_action, earlier_result = new_action(), action_result(earlier)
    entry = earlier_result.SerializeToString()
    raw_client(s3.endpoint).put_object(Bucket=bucket, Key=ac_key(earlier_action), Body=entry)

    budget = "0.3"  # the default: what this test is about
    server = buildvault_server_factory(
        "b", extra_args=tier_args(proxy.endpoint, bucket, "--s3-request-budget", budget, *WHOLE)
    )
    built = [os.urandom(1000 + i) for i in range(20)]
    big = os.urandom(2 * MiB + 7)
    timed = Timed()
    async with connect(server.grpc_address) as stubs:
        proxy.inject(fault)
        # A build: look up the actions, ask what is missing, upload it, record the new result.
        assert await timed("GetActionResult (nowhere)", get_action(stubs, new_action())) is None  # an error reply
        await timed("GetActionResult (bucket only)", get_action(stubs, earlier_action))
        wanted = [digest(d) for d in [*earlier, *built, big]]
        absent = await timed("FindMissingBlobs", missing(stubs, wanted))
        assert {(d.hash, d.size_bytes) for d in map(digest, [*built, big])} <= absent
        uploads = [d for d in [*earlier, *built] if (digest(d).hash, len(d)) in absent]
        await timed("BatchUpdateBlobs", batch_update(stubs, uploads))
        assert await timed("ByteStream Write", write(stubs, big)) == len(big)
        action = new_action()
        update = re_pb2.UpdateActionResultRequest(action_digest=action, action_result=action_result([*built[:3], big]))
        await timed("UpdateActionResult", stubs.ac.UpdateActionResult(update))
        assert await timed("GetActionResult (local)", get_action(stubs, action)) == action_result([*built[:3], big])
        assert await timed("FindMissingBlobs (after upload)", missing(stubs, wanted)) == set()
        for data in built[:5]:
            assert await timed("ByteStream Read", read(stubs, digest(data))) == data
        assert proxy.faults_injected > 0, "the fault never reached the bucket"
        assert timed.slowest < REQUEST_LIMIT, f"{timed.slowest_step} took {timed.slowest:.2f}s with the bucket at fault"

        proxy.inject(None)
        wait_drained(server.http_address, timeout=120)
        keys = bucket_keys(s3.endpoint, bucket)
        assert {cas_key(d) for d in [*built, big]} <= keys, "a write made during the fault never reached the bucket"
        assert ac_key(action) in keys
        s3_client = raw_client(s3.endpoint)
        assert s3_client.get_object(Bucket=bucket, Key=cas_key(big))["Body"].read() == big
        # The bucket's own entry is served again once the tier is back (on a loaded machine a
        # first lookup may still miss its budget: a miss, and the tier is probed again).
        wait_for(lambda: metric(server.http_address, "buildvault_object_store_up") == 1, 60, "the tier to be up")

        async def served() -> bool:
            return await get_action(stubs, earlier_action) == earlier_result

        await wait_until(served, 60, "the bucket's action entry to be served again")
    output = server.output()
    assert "is unavailable" in output, "the fault never marked the tier unavailable"
    assert "internal error" not in output.lower() and "Traceback" not in output
