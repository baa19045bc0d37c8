"""The one way the server's background tasks (history samples, heap trims, metrics relay) end."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

__all__ = ["cancel_and_wait"]


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` (None: nothing to do) and wait until it has ended."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
