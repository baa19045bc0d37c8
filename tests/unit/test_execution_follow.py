"""Executor.follow when its caller goes away: the task awaiting the next message ends with the
stream and its outcome is read (issue: `Task exception was never retrieved ...
StopAsyncIteration` on stderr after a client cancelled its Execute stream).

The race, made exact: the caller is cancelled in the same loop turn the watch ends (its last
message was sent), so the task that awaited the next message holds StopAsyncIteration while the
caller is already gone.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from buildvault.actions import ActionCache
from buildvault.config import Settings
from buildvault.digest import Digest
from buildvault.execution.executor import ExecutionConfig, Executor
from buildvault.execution.local.queue import LocalQueue
from buildvault.execution.platform import MatchRules
from buildvault.remote_apis import re_pb2
from buildvault.storage.memory import MemoryActionStore, MemoryBlobStore


@pytest.fixture
async def executor():
    blobs = MemoryBlobStore()
    rules = MatchRules.from_settings(Settings())
    executor = Executor(
        ExecutionConfig(rules=rules),
        blobs,
        ActionCache(blobs, MemoryActionStore()),
        lambda operations, finished: LocalQueue([], rules, operations, finished),
    )
    await executor.start()
    yield executor
    await executor.close()


@pytest.fixture
async def loop_reports():
    """What the loop would print on stderr (its exception handler's calls)."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda loop, context: reported.append(context))
    yield reported
    loop.set_exception_handler(previous)


async def test_caller_cancelled_as_the_watch_ends_leaves_nothing_unread(executor, loop_reports):
    loop = asyncio.get_running_loop()
    created: list[asyncio.Task[Any]] = []
    caller: asyncio.Task[Any] | None = None

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        created.append(task)
        if caller is not None:
            # Registered before follow() waits on it: when the watch ends, the caller is
            # cancelled before follow() is woken.
            task.add_done_callback(lambda _: caller.cancel())
        return task

    done = re_pb2.ExecuteResponse(cached_result=True)
    operation = executor.operations.create(None, Digest.of(b"action"), done)
    previous = loop.get_task_factory()
    loop.set_task_factory(factory)
    try:
        stream = executor.follow(operation)
        first = await anext(stream)
        assert first.done and operation.watchers == 1
        caller = asyncio.ensure_future(anext(stream))  # waits for the message after the last
        await asyncio.wait({caller})
        assert caller.cancelled()
    finally:
        loop.set_task_factory(previous)

    # follow()'s own tasks (the closing watch, one per message awaited) all ended with it.
    assert len(created) >= 4
    assert all(task.done() for task in created)
    assert operation.watchers == 0
    # Nothing the test holds keeps a task alive: collected, an unread exception would be reported.
    created.clear()
    caller = None
    del stream
    gc.collect()  # a task whose exception nobody read is reported when it is collected
    assert [context.get("message") for context in loop_reports] == []
