"""The S3/OBS tier at the server level: real `buildvault serve` processes on one real S3 server.

A `moto_server` subprocess is the bucket (killed and started again on the same port for the
outages; a restarted moto is empty, so the bucket is created again and everything still in a
journal must be uploaded again). Clients speak gRPC; what the tier does is read from /metrics
(object-store requests by operation, journal backlog) and from the bucket itself (boto3).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import selectors
import socket
import threading
import time

import grpc
import pytest
import s3_server
from polling import wait_for
from reapi_client import CLIENT_OPTIONS, batch_update, digest, make_stubs, missing, read, read_name, write
from s3_server import bucket_keys, create_bucket, metric, raw_client, s3_requests, tier_args, wait_drained

from buildvault.remote_apis import bs_pb2, re_pb2

# Fixtures from s3_server (bound by name so pytest finds them in this module).
aws_env = s3_server.aws_env
moto_server = s3_server.moto_server
s3 = s3_server.s3

pytestmark = pytest.mark.timeout(240)

MiB = 1 << 20
# Large blobs stay whole objects, so the tests can name their bucket keys (chunked blobs are
# their chunks' objects plus a list: tests/integration/test_grpc_chunking.py).
WHOLE = ("--chunking-threshold", "1GiB")


@contextlib.asynccontextmanager
async def connect(server):
    async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
        await channel.channel_ready()
        yield make_stubs(channel)


def cas_key(data: bytes) -> str:
    return f"cas/sha256/{hashlib.sha256(data).hexdigest()}"


def ac_key(action: re_pb2.Digest, instance: str = "") -> str:
    namespace = f"ac/{instance}" if instance else "ac"
    return f"ac/{namespace}/sha256/{action.hash}"


def blobs(n: int, size: int = 200) -> list[bytes]:
    return [os.urandom(size) for _ in range(n)]


async def store_action(stubs, outputs: list[bytes]) -> re_pb2.Digest:
    """UpdateActionResult for a new action whose output files are `outputs` (already uploaded)."""
    action = digest(re_pb2.Action(salt=os.urandom(16)).SerializeToString())
    result = re_pb2.ActionResult(
        output_files=[re_pb2.OutputFile(path=f"out/{i}", digest=digest(d)) for i, d in enumerate(outputs)]
    )
    stored = await stubs.ac.UpdateActionResult(
        re_pb2.UpdateActionResultRequest(action_digest=action, action_result=result)
    )
    assert stored == result
    return action


async def get_action(stubs, action: re_pb2.Digest) -> re_pb2.ActionResult:
    return await stubs.ac.GetActionResult(re_pb2.GetActionResultRequest(action_digest=action))


def assert_in_bucket(endpoint: str, bucket: str, datas: list[bytes]) -> None:
    """Every blob is in the bucket under its key, with exactly its bytes."""
    s3 = raw_client(endpoint)
    keys = bucket_keys(endpoint, bucket)
    absent = [cas_key(d) for d in datas if cas_key(d) not in keys]
    assert not absent, f"{len(absent)} of {len(datas)} blobs are not in the bucket, e.g. {absent[:3]}"
    for data in datas:
        assert s3.get_object(Bucket=bucket, Key=cas_key(data))["Body"].read() == data


def start_tier_server(factory, name, s3, bucket, *extra):
    return factory(name, extra_args=tier_args(s3.endpoint, bucket, *WHOLE, *extra))


async def test_bucket_outage_writes_succeed_and_journal_drains_after_restart(s3, buildvault_server_factory):
    bucket = create_bucket(s3.endpoint)
    server = start_tier_server(buildvault_server_factory, "a", s3, bucket)
    before, during = blobs(5), blobs(30)
    big = os.urandom(3 * MiB + 12345)  # ByteStream, several chunks
    async with connect(server) as stubs:
        await batch_update(stubs, before)
        wait_drained(server.http_address)
        assert_in_bucket(s3.endpoint, bucket, before)

        s3.kill()  # mid-run: every connection to the bucket is cut, nothing answers
        # Writes through every gRPC write path succeed while the bucket is down.
        await batch_update(stubs, during)
        assert await write(stubs, big) == len(big)
        action = await store_action(stubs, [*during[:3], big])
        assert await missing(stubs, [digest(d) for d in [*during, big]]) == set()
        assert (await get_action(stubs, action)).output_files[3].digest == digest(big)
        pending = len(during) + 2
        wait_for(lambda: (metric(server.http_address, "buildvault_upload_journal_backlog") or 0) >= pending,
                 30, "the backlog to hold every write")  # fmt: skip
        wait_for(lambda: metric(server.http_address, "buildvault_object_store_up") == 0, 30, "the tier to be down")
        failed = metric(server.http_address, "buildvault_object_store_uploads_total", result="failed")
        assert failed and failed >= 1
        assert metric(server.http_address, "buildvault_upload_journal_oldest_pending_age_seconds") > 0
        # Still serving everything from the local tier.
        assert await read(stubs, digest(big)) == big

        s3.start()  # same port, empty: the bucket comes back (empty) too
        create_bucket(s3.endpoint, bucket)
        wait_drained(server.http_address, timeout=90)
        assert metric(server.http_address, "buildvault_object_store_up") == 1
        assert_in_bucket(s3.endpoint, bucket, [*during, big])
        assert ac_key(action) in bucket_keys(s3.endpoint, bucket)
        assert metric(server.http_address, "buildvault_upload_journal_oldest_pending_age_seconds") == 0
    assert "Traceback" not in server.output()


async def test_kill_9_with_pending_journal_then_restart_drains(s3, buildvault_server_factory):
    bucket = create_bucket(s3.endpoint)
    server = start_tier_server(buildvault_server_factory, "a", s3, bucket)
    s3.kill()
    data, big = blobs(40), os.urandom(2 * MiB + 7)
    async with connect(server) as stubs:
        await batch_update(stubs, data)
        assert await write(stubs, big) == len(big)
        action = await store_action(stubs, data[:2])
    assert (metric(server.http_address, "buildvault_upload_journal_backlog") or 0) >= len(data) + 2
    server.kill()  # kill -9 with everything still in the journal

    s3.start()
    create_bucket(s3.endpoint, bucket)
    server.start()
    assert "entries pending" in server.output()  # the journal came back non-empty
    wait_drained(server.http_address, timeout=90)
    assert_in_bucket(s3.endpoint, bucket, [*data, big])
    assert ac_key(action) in bucket_keys(s3.endpoint, bucket)
    assert metric(server.http_address, "buildvault_object_tier_events_total", store="cas", event="lost_uploads") == 0


async def test_corrupt_object_in_bucket_is_never_served(s3, buildvault_server_factory):
    bucket = create_bucket(s3.endpoint)
    producer = start_tier_server(buildvault_server_factory, "producer", s3, bucket)
    small, big, short = os.urandom(1000), os.urandom(3 * MiB + 1), os.urandom(5000)
    entry = os.urandom(300)
    async with connect(producer) as stubs:
        await batch_update(stubs, [small, short, entry])
        assert await write(stubs, big) == len(big)
        action = await store_action(stubs, [entry])
    wait_drained(producer.http_address)

    s3_client = raw_client(s3.endpoint)
    wrong = {cas_key(small): os.urandom(len(small)), cas_key(big): os.urandom(len(big)), cas_key(short): b"x" * 10}
    for key, body in wrong.items():
        s3_client.put_object(Bucket=bucket, Key=key, Body=body)
    # An action entry rotted in place: same checksum metadata, other bytes.
    original = s3_client.get_object(Bucket=bucket, Key=ac_key(action))
    body = original["Body"].read()
    s3_client.put_object(Bucket=bucket, Key=ac_key(action), Body=body[:-1] + bytes([body[-1] ^ 1]),
                         Metadata=original["Metadata"])  # fmt: skip

    consumer = start_tier_server(buildvault_server_factory, "consumer", s3, bucket)  # empty disk
    async with connect(consumer) as stubs:
        reply = await stubs.cas.BatchReadBlobs(re_pb2.BatchReadBlobsRequest(digests=[digest(small), digest(short)]))
        assert [r.status.code for r in reply.responses] == [grpc.StatusCode.NOT_FOUND.value[0]] * 2
        assert all(r.data == b"" for r in reply.responses)
        for data in (big, small, short):
            received = bytearray()
            with pytest.raises(grpc.aio.AioRpcError) as error:
                request = bs_pb2.ReadRequest(resource_name=read_name(digest(data)))
                async for response in stubs.bytestream.Read(request):
                    received += response.data
            assert error.value.code() == grpc.StatusCode.NOT_FOUND, error.value
            assert len(received) < len(data)  # never the whole (wrong) blob
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await get_action(stubs, action)
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        # Nothing corrupt was kept locally, and the blobs count as missing: a client uploads
        # them again, which repairs the bucket.
        assert await missing(stubs, [digest(small), digest(big)]) == {
            (digest(small).hash, len(small)),
            (digest(big).hash, len(big)),
        }
        await batch_update(stubs, [small])
        assert await read(stubs, digest(small)) == small
    assert metric(consumer.http_address, "buildvault_object_store_corrupt_objects_total") >= 4
    wait_drained(consumer.http_address)
    assert s3_client.get_object(Bucket=bucket, Key=cas_key(small))["Body"].read() == small


async def test_read_only_consumer_serves_the_bucket_and_never_writes(s3, buildvault_server_factory):
    bucket = create_bucket(s3.endpoint)
    producer = start_tier_server(buildvault_server_factory, "producer", s3, bucket)
    outputs, big = blobs(10), os.urandom(2 * MiB)
    async with connect(producer) as stubs:
        await batch_update(stubs, outputs)
        await write(stubs, big)
        action = await store_action(stubs, [*outputs, big])
    wait_drained(producer.http_address)
    keys = bucket_keys(s3.endpoint, bucket)

    reader = start_tier_server(buildvault_server_factory, "reader", s3, bucket, "--s3-read-only")
    async with connect(reader) as stubs:
        assert len((await get_action(stubs, action)).output_files) == len(outputs) + 1
        assert await missing(stubs, [digest(d) for d in [*outputs, big]]) == set()
        assert await read(stubs, digest(big)) == big
        reply = await stubs.cas.BatchReadBlobs(re_pb2.BatchReadBlobsRequest(digests=[digest(d) for d in outputs]))
        assert [r.data for r in reply.responses] == outputs
        # Its own builds' results stay local: written fine, never uploaded.
        local = blobs(5)
        await batch_update(stubs, local)
        await write(stubs, os.urandom(MiB))
        mine = await store_action(stubs, local)
        assert (await get_action(stubs, mine)).output_files[0].digest == digest(local[0])
        assert await read(stubs, digest(local[0])) == local[0]
    requests = s3_requests(reader.http_address)
    assert requests["get"] >= 2 and requests["put"] == 0, requests
    assert not any(requests[op] for op in requests if op.startswith("multipart") or op == "delete"), requests
    assert metric(reader.http_address, "buildvault_upload_journal_backlog") is None  # no journal at all
    assert not (reader.data_dir / "upload-journal").exists()
    assert bucket_keys(s3.endpoint, bucket) == keys


async def test_warm_find_missing_of_1000_blobs_makes_no_head_requests(s3, buildvault_server_factory):
    bucket = create_bucket(s3.endpoint)
    producer = start_tier_server(buildvault_server_factory, "producer", s3, bucket)
    data = blobs(1000, size=64)
    digests = [digest(d) for d in data]
    async with connect(producer) as stubs:
        await batch_update(stubs, data)
        wait_drained(producer.http_address)
        before = s3_requests(producer.http_address)
        assert await missing(stubs, digests) == set()
        assert s3_requests(producer.http_address) == before  # all local

    consumer = start_tier_server(buildvault_server_factory, "consumer", s3, bucket)  # empty disk
    async with connect(consumer) as stubs:
        cold = s3_requests(consumer.http_address)
        # Two clients asking at once share the HEADs: each digest is asked about once.
        first = await asyncio.gather(missing(stubs, digests), missing(stubs, digests[:500]))
        assert first == [set(), set()]
        warm = s3_requests(consumer.http_address)
        assert warm["head"] - cold["head"] == len(digests), (cold, warm)

        assert await missing(stubs, digests) == set()
        after = s3_requests(consumer.http_address)
        assert after == warm, (warm, after)  # no HEAD (nor anything else) per digest
        assert metric(consumer.http_address, "buildvault_object_store_presence_entries") >= len(digests)


class HungEndpoint:
    """An "S3 endpoint" that accepts connections, takes requests in and never answers (a hung or
    black-holed bucket). `held` counts the open connections on which a request arrived."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._closing = threading.Event()
        self.held = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def __enter__(self) -> HungEndpoint:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.set()
        self._thread.join(10)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()
        self._selector.close()

    def _serve(self) -> None:
        # The timeout only bounds how late __exit__ is noticed.
        while not self._closing.is_set():
            for key, _ in self._selector.select(timeout=0.1):
                if key.fileobj is self._listener:
                    with contextlib.suppress(BlockingIOError):
                        connection = self._listener.accept()[0]
                        connection.setblocking(False)
                        self._selector.register(connection, selectors.EVENT_READ, data=False)
                    continue
                connection = key.fileobj
                try:
                    received = connection.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    received = b""
                if not received:  # the client gave up on this connection
                    self._selector.unregister(connection)
                    connection.close()
                    self.held -= key.data
                elif not key.data:
                    self._selector.modify(connection, selectors.EVENT_READ, data=True)
                    self.held += 1


def server_metric(server, name: str) -> float:
    return metric(server.http_address, name) or 0


@pytest.mark.parametrize("when", ["from the start", "mid-run"])
async def test_hung_bucket_holds_up_neither_writes_nor_shutdown(s3, buildvault_server_factory, when):
    """A bucket that takes requests in and never answers. From the start: the server's first
    bucket call (the pin index, at start-up) runs out of its budget and marks the bucket down, so
    writes wait in the journal while the health probe hangs. Mid-run: the bucket was healthy, so
    the uploads of the writes are what hang. Either way writes finish at local speed and
    shutdown does not wait for the calls stuck on the bucket (boto3 threads blocked in a read)."""
    bucket = create_bucket(s3.endpoint)
    data = blobs(20)
    with contextlib.ExitStack() as outage:
        if when == "from the start":
            hung = outage.enter_context(HungEndpoint())
            args = tier_args(hung.endpoint, bucket, "--s3-request-budget", "1", *WHOLE)  # start-up waits on it
            server = buildvault_server_factory("a", extra_args=args)
        else:
            server = buildvault_server_factory("a", extra_args=tier_args(s3.endpoint, bucket, *WHOLE))
            assert server_metric(server, "buildvault_object_store_up") == 1
            s3.freeze()
            outage.callback(s3.thaw)
        async with connect(server) as stubs:
            started = time.monotonic()
            await batch_update(stubs, data)
            action = await store_action(stubs, data[:1])
            assert time.monotonic() - started < 5
        if when == "from the start":
            wait_for(lambda: server_metric(server, "buildvault_upload_journal_backlog") >= len(data) + 1
                     and server_metric(server, "buildvault_object_store_up") == 0 and hung.held >= 1,
                     60, "the writes journaled, the bucket marked down and a call stuck on it")  # fmt: skip
        else:
            wait_for(lambda: server_metric(server, "buildvault_upload_journal_in_flight") >= 1, 30,
                     "uploads stuck on the hung bucket")  # fmt: skip
        started = time.monotonic()
        assert server.stop(timeout=60) == 0
        assert time.monotonic() - started < 15, "shutdown waited for calls stuck on the bucket"

    server.extra_args = tier_args(s3.endpoint, bucket, *WHOLE)  # the bucket is back: nothing was lost
    server.start()
    wait_drained(server.http_address)
    assert_in_bucket(s3.endpoint, bucket, data)
    assert ac_key(action) in bucket_keys(s3.endpoint, bucket)
