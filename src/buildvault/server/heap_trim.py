"""Hand freed heap memory back to the kernel, so the resident size falls again after a burst of load.

glibc keeps what the process frees inside its malloc arenas (one per thread that allocated, and
gRPC's core allocates from many threads), and it returns only the free space at the very top of
each heap on its own: after a burst of uploads the resident size stays near its peak for good.
`malloc_trim(0)` gives back every free page of every arena. The server calls it once every
`TRIM_INTERVAL` seconds in a worker thread (it takes each arena's lock for a moment and must not
stall the event loop); measured in bench/RESULTS.md ("Memory after the load").

Where malloc_trim does not exist (a libc other than glibc), the task is not started.

`limit_arenas()`, called before the server starts its threads, caps glibc at `ARENA_MAX` arenas
(M_ARENA_MAX, as the MALLOC_ARENA_MAX variable would). Each arena keeps its own free memory and
each thread its own cache, so fewer arenas leave less behind after a burst; interleaved, it also
did not cost throughput (bench/RESULTS.md, "Memory after the load").
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from buildvault.server.background import cancel_and_wait

__all__ = ["ARENA_MAX", "TRIM_INTERVAL", "HeapTrimmer", "limit_arenas"]

TRIM_INTERVAL = 10.0  # seconds; a trim costs a few milliseconds of one worker thread
ARENA_MAX = 2
_M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)

log = logging.getLogger("buildvault.heap_trim")


def _glibc(name: str, *argtypes: Any) -> Callable[..., int] | None:
    """The C library's function `name` returning int, or None where this libc has none."""
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError):
        return None
    function.argtypes = list(argtypes)
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


def limit_arenas(arenas: int = ARENA_MAX) -> bool:
    """Cap glibc's malloc arenas for threads started from now on; False where that is not possible
    (not glibc) or where MALLOC_ARENA_MAX already chose."""
    mallopt = _glibc("mallopt", ctypes.c_int, ctypes.c_int)
    if mallopt is None or "MALLOC_ARENA_MAX" in os.environ:
        return False
    return bool(mallopt(_M_ARENA_MAX, arenas))


class HeapTrimmer:
    """The task that trims the heap every `interval` seconds while the server runs."""

    def __init__(self, interval: float = TRIM_INTERVAL) -> None:
        self.interval = interval
        self.trims = 0  # completed calls, for tests
        self._trim = _glibc("malloc_trim", ctypes.c_size_t)
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self._trim is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="buildvault-heap-trim")

    async def _run(self) -> None:
        trim = self._trim
        assert trim is not None
        while True:
            await asyncio.sleep(self.interval)
            start = time.perf_counter()
            await asyncio.to_thread(trim, 0)
            self.trims += 1
            log.debug("heap trimmed in %.1f ms", (time.perf_counter() - start) * 1000)

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
