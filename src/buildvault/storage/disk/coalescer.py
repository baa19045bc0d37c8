"""One pool trip per event-loop iteration for small file operations.

Every small operation (a whole small blob or entry written, read or unlinked) is queued on the
event loop; everything queued by the next loop iteration goes to the worker threads as one work
item and its results come back in one loop wakeup, so a BatchUpdateBlobs of 100 blobs is one
trip, not 100.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

from buildvault.storage import StorageError

TRIP_OPS = 128  # operations per coalesced trip, at most
TRIP_BYTES = 8 << 20  # bytes written per coalesced trip, at most
OWN_TRIP_BYTES = 256 << 10  # an operation on this many bytes gets a trip of its own (no head-of-line wait)

_Op = tuple[Callable[..., Any], tuple[Any, ...], "asyncio.Future[Any]"]


def _run_ops(ops: list[_Op]) -> list[tuple[bool, Any]]:
    """A coalesced trip: run each operation, keeping its result or its exception."""
    results: list[tuple[bool, Any]] = []
    for fn, args, _future in ops:
        try:
            results.append((True, fn(*args)))
        except Exception as e:  # delivered to that operation's caller
            results.append((False, e))
    return results


def _deliver(ops: list[_Op], cf: concurrent.futures.Future[Any]) -> None:
    try:
        results = cf.result()
    except BaseException as e:  # _run_ops itself failed (MemoryError...)
        results = [(False, e)] * len(ops)
    for (_fn, _args, future), (ok, value) in zip(ops, results, strict=True):
        if future.done():
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)


class Coalescer:
    """Small file operations queued on the event loop, run in batches in the worker threads.

    Each `submit` returns an asyncio future. The first operation queued in a loop iteration
    schedules a flush for the next one; whatever is queued by then (up to TRIP_OPS operations
    or TRIP_BYTES bytes per trip) goes to the pool as one work item. Operations of one trip run
    in order; trips run concurrently. An operation on OWN_TRIP_BYTES or more (a whole batch, a
    large blob) goes at once, in a trip of its own, so small ones never wait behind it. Once the
    pool is shut down, every operation fails with StorageError.
    """

    __slots__ = ("_executor", "_pending", "_bytes")

    def __init__(self, executor: concurrent.futures.Executor) -> None:
        self._executor = executor
        self._pending: list[_Op] = []
        self._bytes = 0

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...], nbytes: int = 0) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if nbytes >= OWN_TRIP_BYTES:  # hashing and writing it takes a while: others need not wait for it
            self._run([(fn, args, future)], loop)
            return future
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((fn, args, future))
        self._bytes += nbytes
        if len(self._pending) >= TRIP_OPS or self._bytes >= TRIP_BYTES:
            self._flush()
        return future

    def _flush(self) -> None:
        ops, self._pending, self._bytes = self._pending, [], 0
        if ops:
            self._run(ops, asyncio.get_running_loop())

    def _run(self, ops: list[_Op], loop: asyncio.AbstractEventLoop) -> None:
        try:
            cf = self._executor.submit(_run_ops, ops)
        except RuntimeError as e:  # the pool is shut down: the store is closing
            for _fn, _args, future in ops:
                if not future.done():
                    future.set_exception(StorageError(f"disk store is closed ({e})"))
            return
        cf.add_done_callback(lambda cf: loop.call_soon_threadsafe(_deliver, ops, cf))
