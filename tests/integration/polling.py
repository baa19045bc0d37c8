"""How the tests wait: for an observable condition, with a deadline. Never for "long enough".

    wait_for(lambda: metric(address, "buildvault_upload_journal_backlog") == 0, 60, "the journal to drain")
    await wait_until(lambda: len(uploads) == 0, 10, "the abandoned upload to expire")       # in a coroutine

Both call `predicate()` until it returns something truthy and return that value; past the deadline
they fail the test, naming what they waited for. `wait_until` also awaits what the predicate
returns when it is awaitable (a coroutine that asks the server).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll `predicate()` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


async def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """`wait_for` in a coroutine: the event loop runs on between polls."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(interval)
