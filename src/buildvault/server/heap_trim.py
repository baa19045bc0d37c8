"""Hand freed heap memory back to the kernel, so the resident size falls again after a burst of load.

glibc keeps what the process frees inside its malloc arenas (one per thread that allocated, and
gRPC's core allocates from many threads), and it returns only the free space at the very top of
each heap on its own: after a burst of uploads the resident size stays near its peak for good.
`malloc_trim(0)` gives back every free page of every arena. The server calls it once every
`TRIM_INTERVAL` seconds in a worker thread (it takes each arena's lock for a moment and must not
stall the event loop); measured in bench/RESULTS.md ("Memory after the load").

Some of what a burst leaves is not free yet: gRPC's request receivers (and other per-request
objects) sit in reference cycles that only Python's cyclic GC frees, and its oldest generation
runs rarely. So on the first quiet interval after a busy one (the process spent under
`QUIET_SHARE` of a core), the trimmer runs one full `gc.collect()` before the trim. Never on a
timer while busy: a full collection holds the event loop for tens of milliseconds (RESULTS.md,
"Abandoned uploads left reference cycles"). It runs on the loop's thread, where finalizers of
asyncio objects expect to run.

Where malloc_trim does not exist (a libc other than glibc), the task is not started.

`configure_malloc()`, called before the server starts its threads, sets glibc's malloc for the
server; each setting is skipped where its MALLOC_* variable already chose:
- at most `ARENA_MAX` arenas (M_ARENA_MAX). Each arena keeps its own free memory and each thread
  its own cache, so fewer arenas leave less behind after a burst; interleaved, it also did not
  cost throughput (bench/RESULTS.md, "Memory after the load");
- large buffers reused, not mapped and unmapped each time: blocks under `MMAP_THRESHOLD` come from
  the heap (M_MMAP_THRESHOLD), and free() gives the top of a heap back only past `TRIM_THRESHOLD`
  (M_TRIM_THRESHOLD); this task gives back the rest. glibc's own defaults adapt (the mmap
  threshold rises to the largest block freed, the trim threshold is twice it), and a stream of
  1 MiB network reads and batches kept giving the top of the heap back and faulting it in again:
  about a page fault per 4 KiB received, each a costly one on a virtual machine whose free pages
  go back to the host (bench/notes/2026-12-06-asset-download.md).
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from buildvault.server.background import cancel_and_wait

__all__ = [
    "ARENA_MAX",
    "MMAP_THRESHOLD",
    "QUIET_SHARE",
    "TRIM_INTERVAL",
    "TRIM_THRESHOLD",
    "HeapTrimmer",
    "configure_malloc",
    "limit_arenas",
]

TRIM_INTERVAL = 10.0  # seconds; a trim costs a few milliseconds of one worker thread
QUIET_SHARE = 0.02  # of one core over an interval; an idle server uses well under it
ARENA_MAX = 2
MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its adaptive threshold
TRIM_THRESHOLD = 64 << 20  # about the streamed uploads' buffer budget (storage/disk/writes.py)
# glibc's mallopt parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

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


def _mallopt(parameter: int, value: int, variable: str) -> bool:
    """glibc's mallopt; False where there is none (not glibc) or where the `variable` of the
    environment already chose."""
    mallopt = _glibc("mallopt", ctypes.c_int, ctypes.c_int)
    if mallopt is None or variable in os.environ:
        return False
    return bool(mallopt(parameter, value))


def limit_arenas(arenas: int = ARENA_MAX) -> bool:
    """Cap glibc's malloc arenas for threads started from now on; False where that is not possible
    (not glibc) or where MALLOC_ARENA_MAX already chose."""
    return _mallopt(_M_ARENA_MAX, arenas, "MALLOC_ARENA_MAX")


def reuse_large_blocks(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Blocks under `mmap_threshold` from the heap, and the top of a heap given back by free() only
    past `trim_threshold` (the module docstring); False where not set (see `_mallopt`)."""
    mapped = _mallopt(_M_MMAP_THRESHOLD, mmap_threshold, "MALLOC_MMAP_THRESHOLD_")
    trimmed = _mallopt(_M_TRIM_THRESHOLD, trim_threshold, "MALLOC_TRIM_THRESHOLD_")
    return mapped and trimmed


def configure_malloc() -> None:
    """The server's malloc settings (the module docstring): call before any server thread exists."""
    limit_arenas()
    reuse_large_blocks()


class HeapTrimmer:
    """The task that trims the heap every `interval` seconds while the server runs, after one full
    garbage collection when the process has gone quiet after being busy.

    `cpu_clock` is the process's CPU time (tests pass their own)."""

    def __init__(
        self, interval: float = TRIM_INTERVAL, cpu_clock: Callable[[], float] = time.process_time
    ) -> None:
        self.interval = interval
        self.trims = 0  # completed calls, for tests
        self.collections = 0
        self._cpu_clock = cpu_clock
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
        busy = False  # some interval since the last collection was not quiet
        cpu = self._cpu_clock()
        while True:
            await asyncio.sleep(self.interval)
            quiet = self._cpu_clock() - cpu < self.interval * QUIET_SHARE
            start = time.perf_counter()
            if not quiet:
                busy = True
            elif busy:
                busy = False
                found = gc.collect()
                self.collections += 1
                log.debug("quiet: collected %d objects in %.1f ms", found, (time.perf_counter() - start) * 1000)
            await asyncio.to_thread(trim, 0)
            self.trims += 1
            log.debug("heap trimmed in %.1f ms", (time.perf_counter() - start) * 1000)
            cpu = self._cpu_clock()  # the collection and the trim are not the next interval's load

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
