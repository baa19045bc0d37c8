"""`buildvault serve --processes 2`: one store, two processes sharing the gRPC port (SO_REUSEPORT).

Every test talks to the server through many channels (one TCP connection each, spread over the
processes by the kernel), writes through one and reads through the others at once, and proves
from /metrics that both the primary and the secondary served requests.
"""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.request
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from polling import wait_for
from prometheus_client.parser import text_string_to_metric_families
from reapi_client import (
    CLIENT_OPTIONS,
    Stubs,
    batch_update,
    blob,
    digest,
    iterate,
    make_stubs,
    missing,
    read,
    read_name,
    upload_name,
    write,
    write_requests,
)

from buildvault.remote_apis import bs_pb2, re_pb2

MiB = 1 << 20
CHANNELS = 16
SECONDARY = "buildvault.server.processes.secondary"


def args(processes: int, max_size: str = "24MiB") -> list[str]:
    return ["--processes", str(processes), "--local-workers", "0", "--max-size", max_size, "--eviction-hold", "0"]


# -- processes ----------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(p) for p in (task / "children").read_text().split()]
    return out


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited


def secondaries(server) -> list[int]:
    found = []
    for pid in children(server.pid):
        try:
            if SECONDARY.encode() in Path(f"/proc/{pid}/cmdline").read_bytes() and alive(pid):
                found.append(pid)
        except FileNotFoundError:
            pass
    return found


# -- metrics ------------------------------------------------------------------------------


def samples(server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://{server.http_address}/metrics", timeout=10) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def served(server) -> tuple[float, float]:
    """(gRPC cache requests the primary served itself, requests the secondary served)."""
    m = samples(server)
    total = sum(
        v for (name, labels), v in m.items()
        if name == "buildvault_requests_total" and ("protocol", "grpc") in labels and ("kind", "health") not in labels
    )  # fmt: skip
    secondary = sum(v for (name, _), v in m.items() if name == "buildvault_secondary_requests_total")
    return total - secondary, secondary


# -- clients ------------------------------------------------------------------------------


@asynccontextmanager
async def many(address: str, n: int = CHANNELS):
    # A local subchannel pool each: channels of one target otherwise share one connection.
    options = [*CLIENT_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(n)]
    try:
        await asyncio.gather(*(c.channel_ready() for c in channels))
        yield [make_stubs(c) for c in channels]
    finally:
        await asyncio.gather(*(c.close() for c in channels))


async def batch_read(stubs: Stubs, digests: list[re_pb2.Digest]) -> list[bytes]:
    reply = await stubs.cas.BatchReadBlobs(re_pb2.BatchReadBlobsRequest(digests=digests))
    assert all(r.status.code == 0 for r in reply.responses), reply
    return [r.data for r in reply.responses]


async def code_of(awaitable) -> grpc.StatusCode:
    try:
        await awaitable
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


@pytest.fixture
def two(buildvault_server_factory):
    server = buildvault_server_factory("two", extra_args=args(2))
    assert len(secondaries(server)) == 1, server.output()
    return server


# -- coherence ----------------------------------------------------------------------------


async def test_what_one_connection_writes_every_other_sees_at_once(two):
    async with many(two.grpc_address) as clients:
        for i, writer in enumerate(clients):
            blobs = [blob(100 + j) for j in range(20)]
            digests = [digest(b) for b in blobs]
            await batch_update(writer, blobs)
            others = clients[i + 1 :] + clients[:i]
            assert all(m == set() for m in await asyncio.gather(*(missing(c, digests) for c in others)))
            for data in await asyncio.gather(*(batch_read(c, digests) for c in others)):
                assert data == blobs

        # ActionCache: update through one connection, get through every other
        outputs = [blob(300) for _ in range(3)]
        await batch_update(clients[0], outputs)
        for i, writer in enumerate(clients):
            action = digest(os.urandom(32))
            result = re_pb2.ActionResult(
                exit_code=i,
                output_files=[re_pb2.OutputFile(path=f"out/{n}", digest=digest(o)) for n, o in enumerate(outputs)],
            )
            update = re_pb2.UpdateActionResultRequest(action_digest=action, action_result=result)
            await writer.ac.UpdateActionResult(update)
            others = clients[i + 1 :] + clients[:i]
            got = await asyncio.gather(
                *(c.ac.GetActionResult(re_pb2.GetActionResultRequest(action_digest=action)) for c in others)
            )
            assert all(g.exit_code == i and list(g.output_files) == list(result.output_files) for g in got)

        # ByteStream: a multi-MiB blob written in chunks through one, read back byte-identical through all
        big = blob(5 * MiB + 12345)
        assert await write(clients[3], big, chunk=256 << 10) == len(big)
        for data in await asyncio.gather(*(read(c, digest(big)) for c in clients)):
            assert data == big
        # ...and a ranged read through each
        ranges = await asyncio.gather(*(read(c, digest(big), offset=MiB + 7, limit=3 * MiB) for c in clients))
        assert all(r == big[MiB + 7 : 4 * MiB + 7] for r in ranges)

    # Both processes served: the secondary's requests reach the primary's /metrics (relayed each second).
    primary, secondary = wait_for(lambda: (s := served(two))[1] > 0 and s, 30, "the secondary's relayed requests")
    assert primary > 0 and secondary > 0, (primary, secondary)
    store_calls = samples(two).get(("buildvault_store_ipc_requests_total", (("process", "1"),)), 0)
    assert store_calls > 0


async def test_the_empty_blob_and_the_ac_hits_hold_in_every_process(two):
    """The empty-blob rule and the hit count live in the primary's store stack and in each
    process's ActionCache: a secondary follows both, and its hits reach the primary's /metrics."""
    empty = digest(b"")
    async with many(two.grpc_address) as clients:
        action = digest(os.urandom(32))
        result = re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="e", digest=empty)], stdout_digest=empty)
        await clients[0].ac.UpdateActionResult(
            re_pb2.UpdateActionResultRequest(action_digest=action, action_result=result)
        )
        for client in clients:
            assert await missing(client, [empty]) == set()
            assert await write(client, b"") == 0
            assert await read(client, empty) == b""
            got = await client.ac.GetActionResult(re_pb2.GetActionResultRequest(action_digest=action))
            assert list(got.output_files) == list(result.output_files)
    hits = ("buildvault_ac_hits_total", (("protocol", "grpc"),))
    wait_for(lambda: samples(two).get(hits, 0) == CHANNELS, 30, "every process's hits at the primary")
    primary, secondary = served(two)
    assert primary > 0 and secondary > 0, (primary, secondary)


async def test_the_size_cap_holds_for_the_whole_store(two):
    cap = 24 * MiB
    async with many(two.grpc_address) as clients:
        written = []

        async def fill(stubs: Stubs) -> None:
            for _ in range(3):
                data = blob(MiB)
                assert await write(stubs, data, chunk=128 << 10) == len(data)
                written.append(digest(data))

        await asyncio.gather(*(fill(c) for c in clients))  # 48 MiB into a 24 MiB store
        status = two.status()
        assert status["max_size_bytes"] == cap
        assert 0 < status["current_size_bytes"] <= cap, status
        assert status["evictions"] > 0
        # what every connection reports missing agrees: one store, one answer
        answers = await asyncio.gather(*(missing(c, written) for c in clients))
        assert all(a == answers[0] for a in answers)
        assert 0 < len(answers[0]) < len(written)


# -- the same error codes as one process ---------------------------------------------------


@pytest.mark.parametrize("processes", [1, 2])
async def test_error_codes_are_those_of_one_process(buildvault_server_factory, processes):
    server = buildvault_server_factory(f"errors{processes}", extra_args=args(processes, max_size="4MiB"))
    assert len(secondaries(server)) == processes - 1
    absent = digest(os.urandom(64))
    data = blob(1000)
    async with many(server.grpc_address) as clients:
        for stubs in clients:  # each connection, whichever process it landed on
            read_absent = read(stubs, absent)
            assert await code_of(read_absent) == grpc.StatusCode.NOT_FOUND
            get_absent = stubs.ac.GetActionResult(re_pb2.GetActionResultRequest(action_digest=absent))
            assert await code_of(get_absent) == grpc.StatusCode.NOT_FOUND
            bad = re_pb2.FindMissingBlobsRequest(blob_digests=[re_pb2.Digest(hash="zz", size_bytes=1)])
            assert await code_of(stubs.cas.FindMissingBlobs(bad)) == grpc.StatusCode.INVALID_ARGUMENT
            flipped = data[:-1] + bytes([data[-1] ^ 1])
            wrong = re_pb2.BatchUpdateBlobsRequest(
                requests=[re_pb2.BatchUpdateBlobsRequest.Request(digest=digest(data), data=flipped)]
            )
            reply = await stubs.cas.BatchUpdateBlobs(wrong)
            assert reply.responses[0].status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            mismatched = write_requests(upload_name(digest(data)), data[::-1], 256)
            assert await code_of(stubs.bytestream.Write(iterate(mismatched))) == grpc.StatusCode.INVALID_ARGUMENT
            too_big = blob(5 * MiB)  # larger than the whole 4 MiB store; one message (the refusal comes
            over = write_requests(upload_name(digest(too_big)), too_big, len(too_big))  # before a client's next)
            assert await code_of(stubs.bytestream.Write(iterate(over))) == grpc.StatusCode.RESOURCE_EXHAUSTED
            past_end = bs_pb2.ReadRequest(resource_name=read_name(digest(data)), read_offset=5000)
            assert await code_of(read_all(stubs.bytestream.Read(past_end))) == grpc.StatusCode.OUT_OF_RANGE
    if processes == 2:
        wait_for(lambda: served(server)[1] > 0, 30, "the secondary's relayed requests")
        assert served(server)[0] > 0


async def read_all(call) -> bytes:
    return b"".join([r.data async for r in call])


# -- lifecycle ----------------------------------------------------------------------------


async def test_a_killed_secondary_is_replaced_and_service_continues(two):
    (first,) = secondaries(two)
    os.kill(first, signal.SIGKILL)
    # the primary logs the restart once the new secondary listens
    wait_for(lambda: "restarted as pid" in two.output(), 60, "a new secondary to listen")
    replaced = [p for p in secondaries(two) if p != first]
    assert not alive(first) and len(replaced) == 1 and f"restarted as pid {replaced[0]}" in two.output()
    async with many(two.grpc_address) as clients:
        blobs = [blob(2000) for _ in clients]
        await asyncio.gather(*(batch_update(c, [b]) for c, b in zip(clients, blobs, strict=True)))
        digests = [digest(b) for b in blobs]
        for data in await asyncio.gather(*(batch_read(c, digests) for c in clients)):
            assert data == blobs
    assert "exited with -9; starting it again" in two.output()
    wait_for(lambda: samples(two).get(("buildvault_secondary_requests_total", (("process", "1"),)), 0) > 0, 30,
             "the new secondary's relayed requests")  # fmt: skip


def test_sigterm_of_the_primary_leaves_no_process_behind(two):
    pids = secondaries(two)
    assert pids
    assert two.stop(sig=signal.SIGTERM) == 0
    assert not [p for p in pids if alive(p)]
    assert not alive(two.pid)


def test_secondaries_end_when_the_primary_is_killed(two):
    pids = secondaries(two)
    assert pids
    os.kill(two.pid, signal.SIGKILL)
    two.process.wait(10)
    wait_for(lambda: not any(alive(p) for p in pids), 30, "the secondaries to end with their primary")


def test_several_processes_and_execution_do_not_mix(buildvault_server_factory):
    with pytest.raises(Exception) as error:
        buildvault_server_factory("exec", extra_args=["--processes", "2", "--local-workers", "1"])
    assert "--processes 2" in str(error.value) and "--local-workers 0" in str(error.value)


# -- access control -----------------------------------------------------------------------


async def test_access_control_and_its_reload_reach_every_process(buildvault_server_factory, tmp_path):
    from auth_setup import bearer, new_token

    tokens = tmp_path / "tokens"
    old = new_token(tokens, "ci")
    server = buildvault_server_factory("auth", extra_args=[*args(2), "--token-file", str(tokens)])
    assert len(secondaries(server)) == 1
    request = re_pb2.FindMissingBlobsRequest(blob_digests=[digest(b"x")])

    async def codes(clients: list[Stubs], token: str | None) -> set[grpc.StatusCode]:
        metadata = (("authorization", bearer(token)),) if token else None
        calls = [c.cas.FindMissingBlobs(request, metadata=metadata) for c in clients]
        return set(await asyncio.gather(*(code_of(call) for call in calls)))

    async with many(server.grpc_address) as clients:
        assert await codes(clients, old) == {grpc.StatusCode.OK}
        assert await codes(clients, None) == {grpc.StatusCode.UNAUTHENTICATED}
        tokens.write_text("")
        fresh = new_token(tokens, "ci2")
        server.process.send_signal(signal.SIGHUP)  # the primary forwards it
        wait_for(lambda: server.output().count("reloaded access control") == 2, 20, "both processes to reload")
        assert await codes(clients, fresh) == {grpc.StatusCode.OK}
        assert await codes(clients, old) == {grpc.StatusCode.UNAUTHENTICATED}
