"""The server process: restart persistence, clean shutdown with uploads in flight, start-up errors,
abandoned uploads, request logs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import grpc
import pytest
from polling import wait_until
from reapi_client import (
    CLIENT_OPTIONS,
    batch_update,
    blob,
    digest,
    iterate,
    key,
    make_stubs,
    missing,
    query,
    read,
    start_and_break,
    upload_name,
    write,
    write_held_open,
    write_requests,
)
from server_process import ServerProcess

from buildvault.remote_apis import bs_pb2, re_pb2

MiB = 1 << 20


async def connect(address: str):
    channel = grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS)
    await channel.channel_ready()
    return channel, make_stubs(channel)


def tmp_files(server: ServerProcess) -> list[str]:
    tmp = server.data_dir / "tmp"
    return sorted(os.listdir(tmp)) if tmp.exists() else []


def refuses_connections(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


async def wait_draining(server: ServerProcess, timeout: float = 20.0) -> None:
    """Until the server has taken the SIGTERM: it said "shutting down" and its gRPC port refuses
    new connections (stop() closed the listener; in-flight calls go on)."""

    def draining() -> bool:
        assert server.running, f"the server exited instead of draining:\n{server.output()}"
        return "shutting down" in server.output() and refuses_connections(server.grpc_address)

    await wait_until(draining, timeout, "the server to drain", interval=0.01)
    assert server.running, f"the server exited instead of draining:\n{server.output()}"


async def assert_missing_after_start(server: ServerProcess, d) -> None:
    """Start the server again: `d` is not in the CAS (nothing half-published)."""
    server.start()
    channel, stubs = await connect(server.grpc_address)
    async with channel:
        assert await missing(stubs, [d]) == {key(d)}


async def test_restart_keeps_blobs_and_action_results(buildvault_server):
    small, large = blob(1000), blob(3 * MiB)
    channel, stubs = await connect(buildvault_server.grpc_address)
    async with channel:
        await batch_update(stubs, [small])
        await write(stubs, large)
        action = digest(b"action " + os.urandom(8))
        result = re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="out", digest=digest(large))])
        await stubs.ac.UpdateActionResult(re_pb2.UpdateActionResultRequest(action_digest=action, action_result=result))
    address = buildvault_server.grpc_address
    buildvault_server.restart()
    assert buildvault_server.grpc_address == address  # same port again
    channel, stubs = await connect(buildvault_server.grpc_address)
    async with channel:
        assert await missing(stubs, [digest(small), digest(large)]) == set()
        assert await read(stubs, digest(large)) == large
        got = await stubs.ac.GetActionResult(re_pb2.GetActionResultRequest(action_digest=action))
        assert got == result


async def test_sigterm_lets_inflight_upload_finish(buildvault_server):
    data = blob(4 * MiB)
    d = digest(data)
    name = upload_name(d)
    proceed = asyncio.Event()
    channel, stubs = await connect(buildvault_server.grpc_address)
    async with channel:
        requests = write_requests(name, data, chunk=MiB)
        call = await write_held_open(stubs, name, requests[:2], proceed, rest=requests[2:])
        buildvault_server.process.send_signal(15)
        await wait_draining(buildvault_server)  # no new connections; the upload goes on
        proceed.set()
        reply = await call
        assert reply.committed_size == len(data)
    assert buildvault_server.process.wait(30) == 0
    assert "shutting down" in buildvault_server.output()
    buildvault_server.start()
    channel, stubs = await connect(buildvault_server.grpc_address)
    async with channel:
        assert await read(stubs, d) == data


async def test_shutdown_aborts_unfinished_uploads(buildvault_server):
    data = blob(3 * MiB)
    d = digest(data)
    name = upload_name(d)
    channel, stubs = await connect(buildvault_server.grpc_address)
    async with channel:
        # a broken stream: resumable for the grace period, but a shutdown abandons it
        await start_and_break(stubs, write_requests(name, data, chunk=MiB)[:2], name)
        assert (await query(stubs, name)).committed_size == 2 * MiB
    started = time.monotonic()
    assert buildvault_server.stop() == 0
    assert time.monotonic() - started < 15
    assert tmp_files(buildvault_server) == []
    buildvault_server.start()
    channel, stubs = await connect(buildvault_server.grpc_address)
    async with channel:
        assert await missing(stubs, [d]) == {key(d)}
        assert (await query(stubs, name)).committed_size == 0


@contextlib.asynccontextmanager
async def upload_in_flight(server: ServerProcess):
    """An upload of a 3 MiB blob whose server has taken two 1 MiB requests, its stream held open:
    yields (digest, call)."""
    data = blob(3 * MiB)
    d = digest(data)
    name = upload_name(d)
    hold = asyncio.Event()
    channel, stubs = await connect(server.grpc_address)
    async with channel:
        call = await write_held_open(stubs, name, write_requests(name, data, chunk=MiB)[:2], hold)
        try:
            yield d, call
        finally:
            hold.set()


async def test_second_signal_cancels_inflight_uploads(buildvault_server):
    async with upload_in_flight(buildvault_server) as (d, call):
        buildvault_server.process.send_signal(15)
        await wait_draining(buildvault_server)  # the first signal's grace period has begun
        started = time.monotonic()
        buildvault_server.process.send_signal(15)
        assert buildvault_server.process.wait(15) == 0
        assert time.monotonic() - started < 10
        with pytest.raises(grpc.aio.AioRpcError):
            await call
    assert tmp_files(buildvault_server) == []
    await assert_missing_after_start(buildvault_server, d)


async def test_killed_server_publishes_nothing_partial(buildvault_server):
    async with upload_in_flight(buildvault_server) as (d, call):
        buildvault_server.kill()
        with pytest.raises(grpc.aio.AioRpcError):
            await call
    await assert_missing_after_start(buildvault_server, d)
    assert tmp_files(buildvault_server) == []  # start-up clears leftovers


def test_port_in_use_and_locked_dir_fail_cleanly(buildvault_server, buildvault_server_factory, tmp_path):
    busy = ServerProcess(tmp_path / "other" / "data", grpc_address=buildvault_server.grpc_address, name="busy")
    with pytest.raises(Exception, match="did not become ready"):
        busy.start(timeout=30)
    assert busy.process.returncode == 1 and "cannot listen" in busy.output()
    locked = ServerProcess(buildvault_server.data_dir, name="locked")
    with pytest.raises(Exception, match="did not become ready"):
        locked.start(timeout=30)
    assert locked.process.returncode == 1 and "data directory" in locked.output()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--max-size", "banana"], "max_size"),
        (["--grpc-address", "nowhere"], "grpc_address"),
        (["--log-level", "chatty"], "log_level"),
        (["--config", "/nonexistent/buildvault.toml"], "config file"),
    ],
)
def test_bad_settings_exit_2(tmp_path, args, message):
    result = subprocess.run(
        [sys.executable, "-m", "buildvault.cli", "serve", "--dir", str(tmp_path / "d"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


async def test_debug_logs_one_json_line_per_request(buildvault_server_factory):
    server = buildvault_server_factory("debug", log_level="debug")
    channel, stubs = await connect(server.grpc_address)
    async with channel:
        await stubs.capabilities.GetCapabilities(re_pb2.GetCapabilitiesRequest())
        await missing(stubs, [digest(b"x")])
        with pytest.raises(grpc.aio.AioRpcError):
            await read(stubs, digest(b"nope"))
    server.stop()
    lines = [json.loads(line) for line in server.output().splitlines() if line.startswith("{")]
    requests = [line for line in lines if line.get("logger") == "buildvault.request"]
    assert [(r["rpc"], r["code"]) for r in requests] == [
        ("GetCapabilities", "OK"),
        ("FindMissingBlobs", "OK"),
        ("Read", "NOT_FOUND"),
    ]
    assert requests[1]["digests"] == 1 and requests[1]["missing"] == 1
    assert all("ms" in r and "ts" in r for r in requests)
    assert server.output().startswith("buildvault ready:") or "buildvault ready:" in server.output()


async def test_info_logs_no_request_lines(buildvault_server):
    channel, stubs = await connect(buildvault_server.grpc_address)
    async with channel:
        await missing(stubs, [digest(b"x")])
    buildvault_server.stop()
    assert '"buildvault.request"' not in buildvault_server.output()


# -- in-process: abandoned uploads expire ----------------------------------------------------------


async def test_abandoned_upload_expires(app_server):
    stubs = app_server.stubs
    data = blob(MiB)
    d = digest(data)
    name = upload_name(d)
    reply = await stubs.bytestream.Write(iterate(write_requests(name, data[:300_000], finish=False)))
    assert reply.committed_size == 300_000
    uploads = app_server.app.services.uploads
    assert len(uploads) == 1
    await wait_until(lambda: len(uploads) == 0, 10, "the abandoned upload to expire (0.5 s grace)", interval=0.05)
    assert (await query(stubs, name)).committed_size == 0
    with pytest.raises(grpc.aio.AioRpcError) as e:
        # The first request only: a client still sending when the server refuses may see grpc's
        # own failed send (INTERNAL) instead of the server's status.
        await stubs.bytestream.Write(iterate(write_requests(name, data, start=300_000)[:1]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await missing(stubs, [d]) == {key(d)}
    # starting over works
    assert (await stubs.bytestream.Write(iterate(write_requests(name, data)))).committed_size == len(data)


async def test_second_stream_on_an_attached_upload_is_aborted(app_server):
    stubs = app_server.stubs
    data = blob(MiB)
    name = upload_name(digest(data))
    hold = asyncio.Event()

    async def second():
        # Only the first request: had the client more to send when the server aborts, grpc could
        # report its own failed send (INTERNAL) instead of the server's status.
        yield write_requests(name, data, start=64 << 10)[0]
        await asyncio.Event().wait()

    call = await write_held_open(stubs, name, write_requests(name, data, finish=False)[:1], hold)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stubs.bytestream.Write(second())
    assert e.value.code() == grpc.StatusCode.ABORTED
    hold.set()
    reply = await call
    assert reply.committed_size == 64 << 10
    reply = await stubs.bytestream.Write(iterate(write_requests(name, data, start=64 << 10)))
    assert reply.committed_size == len(data)


async def test_unimplemented_methods(app_server):
    stubs = app_server.stubs
    # SplitBlob is served (REAPI v2.12 chunking, tests/integration/test_grpc_chunking.py): an absent blob is NOT_FOUND.
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stubs.cas.SplitBlob(re_pb2.SplitBlobRequest(blob_digest=digest(b"x")))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    # A method no service offers is UNIMPLEMENTED.
    async with grpc.aio.insecure_channel(app_server.grpc_address) as channel:
        call = channel.unary_unary("/build.bazel.remote.execution.v2.ContentAddressableStorage/NoSuchMethod")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call(b"")
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_in_process_read_write(app_server):
    data = blob(2 * MiB)
    assert await write(app_server.stubs, data) == len(data)
    assert await read(app_server.stubs, digest(data)) == data
    request = bs_pb2.ReadRequest(resource_name=f"blobs/{digest(data).hash}/{len(data)}", read_offset=5)
    assert b"".join([r.data async for r in app_server.stubs.bytestream.Read(request)]) == data[5:]
