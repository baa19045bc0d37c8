"""A client that cancels its Execute or WaitExecution stream leaves nothing behind: at every stage
(queued, executing, completed) no task outlives the request, and nothing reaches stderr outside
the JSON log format (Pants cancels its streams routinely; the issue: `Task exception was never
retrieved ... StopAsyncIteration` printed as plain text).

In process, every task created while a stream was open is recorded (a task factory) and must be
done once the server has let go of the stream (the operation has no watcher left), except the
work the job itself needs (its scheduler task, the worker process's reader). Against a real
`buildvault serve`, every line it prints after the banner must be a JSON object.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import uuid
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from execution_client import ActionSpec, execute, execution_stub, stage
from polling import wait_until
from reapi_client import CLIENT_OPTIONS, make_stubs
from server_process import READY_PREFIX, ServerProcess

from buildvault.remote_apis import re_pb2

QUEUED, EXECUTING = re_pb2.ExecutionStage.QUEUED, re_pb2.ExecutionStage.EXECUTING
STAGES = ("queued", "executing", "completed")
# Tasks a job owns while it runs (the scheduler's, the local worker's reader): they end with the
# job, not with a client's stream.
JOB_TASKS = ("job ", "worker ")
# grpc.aio's server starts one of these per method when a call arrives: it waits for the next call.
GRPC_LISTENING = ("AioServer._request_registered_call",)


def sleeper(seconds: int) -> ActionSpec:
    """An action that runs until cancelled (or `seconds` pass), unique to this test."""
    return ActionSpec(["/bin/sh", "-c", f"sleep {seconds}; echo {uuid.uuid4().hex}"])


def quick() -> ActionSpec:
    return ActionSpec(["/bin/sh", "-c", f"echo {uuid.uuid4().hex}"])


class Streams:
    """Execute and WaitExecution calls whose stream a test cancels at a chosen stage."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self.stubs = make_stubs(channel)
        self.exec = execution_stub(channel)

    async def upload(self, spec: ActionSpec) -> re_pb2.Digest:
        return await spec.upload(self.stubs)

    async def execute_until(self, action_digest: re_pb2.Digest, wanted: Callable[[Any], bool]) -> tuple[Any, Any]:
        """An Execute call read up to the first Operation `wanted` accepts: (call, that Operation)."""
        call = self.exec.Execute(re_pb2.ExecuteRequest(action_digest=action_digest, skip_cache_lookup=True))
        async for operation in call:
            if wanted(operation):
                return call, operation
        raise AssertionError("the stream ended before the wanted stage")

    async def wait_until_stage(self, name: str, wanted: Callable[[Any], bool]) -> Any:
        call = self.exec.WaitExecution(re_pb2.WaitExecutionRequest(name=name))
        async for operation in call:
            if wanted(operation):
                return call
        raise AssertionError("the WaitExecution stream ended before the wanted stage")


def at(stage_name: str) -> Callable[[Any], bool]:
    if stage_name == "queued":
        return lambda op: not op.done and stage(op) == QUEUED
    if stage_name == "executing":
        return lambda op: not op.done and stage(op) == EXECUTING
    return lambda op: op.done


async def cancel_streams_at(streams: Streams, stage_name: str) -> str:
    """Open an Execute stream and a WaitExecution stream on one operation, both read to
    `stage_name`, and cancel both; the operation's name. For `queued` the only worker must be
    busy already."""
    spec = quick() if stage_name == "completed" else sleeper(60)
    action_digest = await streams.upload(spec)
    execute_call, first = await streams.execute_until(action_digest, at(stage_name))
    wait_call = await streams.wait_until_stage(first.name, at(stage_name))
    execute_call.cancel()
    wait_call.cancel()
    return str(first.name)


@pytest.fixture
async def in_process(tmp_path):
    """The App in-process with one local worker, and a record of every task created."""
    from buildvault.config import Settings
    from buildvault.server.app import App
    from buildvault.storage.memory import MemoryActionStore, MemoryBlobStore

    loop = asyncio.get_running_loop()
    created: list[asyncio.Task[Any]] = []
    reported: list[dict[str, Any]] = []  # what asyncio would print (a task's exception never read, ...)

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        created.append(task)
        return task

    settings = Settings(
        dir=tmp_path / "data", grpc_address="127.0.0.1:0", http_address="", local_workers="1", sandbox="none",
        execution_grace=60.0,
    )  # fmt: skip
    app = App(settings, blobs=MemoryBlobStore(), actions=MemoryActionStore())
    await app.start()
    previous = loop.get_task_factory(), loop.get_exception_handler()
    loop.set_task_factory(factory)
    loop.set_exception_handler(lambda loop, context: reported.append(context))
    try:
        async with grpc.aio.insecure_channel(app.grpc_address, options=CLIENT_OPTIONS) as channel:
            await channel.channel_ready()
            yield app, Streams(channel), created
        gc.collect()  # a task whose exception nobody read is reported when it is collected
        assert reported == []
    finally:
        loop.set_task_factory(previous[0])
        loop.set_exception_handler(previous[1])
        await app.stop(grace=1)


def _left_behind(created: list[asyncio.Task[Any]], before: int) -> list[asyncio.Task[Any]]:
    return [
        task for task in created[before:]
        if not task.done() and not task.get_name().startswith(JOB_TASKS)
        and getattr(task.get_coro(), "__qualname__", "") not in GRPC_LISTENING
    ]  # fmt: skip


@pytest.mark.parametrize("stage_name", STAGES)
async def test_a_cancelled_stream_leaves_no_task_in_process(in_process, stage_name):
    app, streams, created = in_process
    executor = app.execution.executor
    if stage_name == "queued":
        # The only worker runs another action, whose client has gone (the grace is long).
        busy_call, busy = await streams.execute_until(await streams.upload(sleeper(60)), at("executing"))
        busy_call.cancel()
        await wait_until(lambda: executor.get(busy.name).watchers == 0, 10, "the busy action's stream to end")
    before = len(created)
    name = await cancel_streams_at(streams, stage_name)
    operation = executor.get(name)
    assert operation is not None

    # The server lets go of both streams (each counted as a watcher while open) ...
    await wait_until(lambda: operation.watchers == 0, 10, "the server to let go of the cancelled streams")
    # ... and then no task created for them is still pending: nothing awaits a next message.
    left = await _settled(lambda: _left_behind(created, before))
    assert left == [], "\n".join(repr(task) for task in left)
    # The operation itself is untouched by a client going away (the grace period decides).
    assert operation.done == (stage_name == "completed")


async def _settled(pending: Callable[[], list[asyncio.Task[Any]]], timeout: float = 5.0) -> list[asyncio.Task[Any]]:
    """`pending()` once it is empty, or as it is after `timeout` seconds (well below the 10 s
    keep-alive that would wake a forgotten task)."""
    with contextlib.suppress(AssertionError):
        await wait_until(lambda: not pending(), timeout, "the streams' tasks to end")
    return pending()


async def _json_only_after_banner(server: ServerProcess) -> list[str]:
    lines = server.output().splitlines()
    ready = next(i for i, line in enumerate(lines) if line.startswith(READY_PREFIX))
    # The banner (the ready line, the indented lines under it) and the plain lines saying the
    # server stops (`buildvault: SIGTERM, shutting down`, `buildvault: stopped`) are the format's
    # documented exceptions.
    body = [line for line in lines[ready + 1 :] if not line.startswith(("  ", "buildvault: "))]
    bad = []
    for line in body:
        try:
            parsed = json.loads(line)
        except ValueError:
            bad.append(line)
            continue
        if not isinstance(parsed, dict) or "level" not in parsed:
            bad.append(line)
    return bad


async def test_cancelled_streams_print_nothing_outside_the_log_format(buildvault_server_factory):
    server = buildvault_server_factory(
        "exec", extra_args=["--local-workers", "1", "--sandbox", "none", "--execution-grace", "1"], log_level="debug"
    )
    async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
        await channel.channel_ready()
        streams = Streams(channel)
        for _ in range(5):  # the lost task shows only when the cancel races the next message
            await cancel_streams_at(streams, "completed")
        # Abandoned, this job is cancelled after the 1 s grace and frees the worker.
        await cancel_streams_at(streams, "executing")
        busy_call, _ = await streams.execute_until(await streams.upload(sleeper(60)), at("executing"))
        await cancel_streams_at(streams, "queued")
        busy_call.cancel()
        # The worker is free again once both abandoned jobs were cancelled: a last action runs.
        messages = await execute(channel, await streams.upload(quick()))
        assert messages[-1].done
    assert server.stop() == 0
    assert await _json_only_after_banner(server) == []
