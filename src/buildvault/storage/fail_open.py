"""Fail-open of a slow, optional tier (the object store): its health and its time budget.

Why a decorator: the bucket being slow or down must never fail or stall a build (architecture
rule 3), and this rule used to be repeated at every call site of the tiered store. Here it is
applied once, around the slow tier:

- Every failure other than a clean answer (NotFound, InvalidRange, a DigestMismatch of the bytes
  we sent) means "the tier is unavailable": it is raised as `Unavailable` and marks the tier
  down. That includes transport errors that escape botocore mid-reply (a connection reset while
  reading a body), so a client never sees INTERNAL because of the bucket.
- While down, calls raise `Unavailable` at once, without touching the tier; a background probe
  (with capped backoff) marks it up again. State changes are logged once.
- Questions asked on a request path (existence, lookups, action entries) get a time budget
  (`budget`, a few hundred ms; each wave of `parallel` existence checks gets it once): past it
  the call raises `Unavailable` and the tier is marked down, as on an error. The caller (the
  tiered store) then answers from local state. Uploads and reads get the longer `timeout`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

from buildvault.digest import Digest, DigestFunction
from buildvault.storage import (
    ActionStore,
    BlobStore,
    DigestMismatch,
    ForwardingActionStore,
    ForwardingBlobStore,
    InvalidRange,
    NotFound,
    Unavailable,
    close_chunks,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
MiB = 1 << 20
# Answers that say something about the data, not about the tier's health: passed through.
CLEAN_ANSWERS = (NotFound, InvalidRange, DigestMismatch)


class _SourceFailed(Exception):
    """The caller's own chunk stream failed during a write: its error, not the tier's."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


async def _tagged(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:  # re-raised as itself by _Guard.call
        raise _SourceFailed(exc) from exc


class SlowTierHealth:
    """Up/down state of a slow tier. Logs once per change; probes with capped backoff while down."""

    def __init__(
        self,
        probe: Callable[[], Awaitable[object]],
        *,
        name: str = "object store",
        initial_backoff: float = 0.5,
        max_backoff: float = 30.0,
        probe_timeout: float = 10.0,
    ) -> None:
        self._probe = probe
        self.name = name
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self._probe_timeout = probe_timeout
        self._healthy = True
        self._up = asyncio.Event()
        self._up.set()
        self._down_since = 0.0
        self._prober: asyncio.Task[None] | None = None
        self.transitions = 0
        self._closed = False

    @property
    def healthy(self) -> bool:
        return self._healthy

    def ok(self) -> None:
        if self._healthy:
            return
        self._healthy = True
        self.transitions += 1
        self._up.set()
        logger.warning("%s is reachable again after %.1fs", self.name, time.monotonic() - self._down_since)

    def failure(self, exc: BaseException) -> None:
        if not self._healthy or self._closed:
            return
        self._healthy = False
        self.transitions += 1
        self._down_since = time.monotonic()
        self._up.clear()
        reason = str(exc) or type(exc).__name__  # a timeout's str() is empty
        logger.error("%s is unavailable, serving from the local tier only: %s", self.name, reason)
        if self._prober is None or self._prober.done():
            self._prober = asyncio.get_running_loop().create_task(self._probe_loop())

    async def wait_healthy(self) -> None:
        await self._up.wait()

    async def _probe_loop(self) -> None:
        delay = self._initial_backoff
        while not self._healthy and not self._closed:
            await asyncio.sleep(delay)  # backoff between probes, not synchronisation
            try:
                async with asyncio.timeout(self._probe_timeout):
                    await self._probe()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # still down, whatever the reason
                logger.debug("%s probe failed: %s", self.name, exc)
                delay = min(delay * 2, self._max_backoff)
            else:
                self.ok()

    async def close(self) -> None:
        self._closed = True
        if self._prober is not None:
            self._prober.cancel()
            await asyncio.gather(self._prober, return_exceptions=True)


class _Guard:
    """The shared rule: fail fast while down, bound the call, classify its failure."""

    def __init__(self, health: SlowTierHealth, budget: float, timeout: float, parallel: int) -> None:
        self.health = health
        self.budget = budget
        self.timeout = timeout
        self.parallel = max(1, parallel)

    def existence_budget(self, count: int) -> float:
        return self.budget * max(1, math.ceil(count / self.parallel))

    def upload_timeout(self, size: int) -> float:
        # Bounded, but a big upload may take a while: allow at least 1 MiB/s on top.
        return self.timeout * 3 + size / MiB

    async def call(self, start: Callable[[], Awaitable[T]], seconds: float, what: str) -> T:
        if not self.health.healthy:
            raise Unavailable(f"{what}: {self.health.name} is unavailable")
        try:
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation of the caller.
            async with asyncio.timeout(seconds):
                result = await start()
        except CLEAN_ANSWERS:
            self.health.ok()
            raise
        except _SourceFailed as exc:
            raise exc.error from None
        except Exception as exc:  # any other failure: the tier is unavailable
            raise self.unavailable(exc, what) from exc
        self.health.ok()
        return result

    def unavailable(self, exc: BaseException, what: str) -> Unavailable:
        self.health.failure(exc)
        if isinstance(exc, TimeoutError):
            return Unavailable(f"{what}: {self.health.name} did not answer in time")
        return Unavailable(f"{what}: {self.health.name} failed: {type(exc).__name__}: {exc}")

    def outcome(self, outcome: T, what: str) -> T | Unavailable:
        """One item of a batch: a failure that is not a clean answer becomes Unavailable."""
        if isinstance(outcome, Exception) and not isinstance(outcome, CLEAN_ANSWERS + (Unavailable,)):
            return self.unavailable(outcome, what)
        if isinstance(outcome, Unavailable):
            self.health.failure(outcome)
        return outcome

    async def stream(self, chunks: AsyncIterator[bytes], what: str) -> AsyncIterator[bytes]:
        """The chunks of a read, each bounded by `timeout`, failures classified."""
        try:
            while True:
                try:
                    async with asyncio.timeout(self.timeout):
                        chunk = await anext(chunks)
                except StopAsyncIteration:
                    return
                except CLEAN_ANSWERS:
                    raise
                except Exception as exc:  # a mid-stream failure of the tier
                    raise self.unavailable(exc, f"{what} (mid-stream)") from exc
                yield chunk
        finally:
            await close_chunks(chunks)


class FailOpenBlobStore(ForwardingBlobStore):
    """A slow BlobStore that fails fast and cleanly: see the module docstring."""

    def __init__(
        self, inner: BlobStore, health: SlowTierHealth, *, budget: float, timeout: float, parallel: int = 32
    ) -> None:
        super().__init__(inner)
        self.health = health
        self._guard = _Guard(health, budget, timeout, parallel)

    async def find_missing(self, digests: Sequence[Digest]) -> list[Digest]:
        if not digests:
            return []
        seconds = self._guard.existence_budget(len(digests))
        return await self._guard.call(lambda: self.inner.find_missing(digests), seconds, "existence check")

    async def find_missing_indices(
        self, function: DigestFunction, hashes: Sequence[str], sizes: Sequence[int]
    ) -> list[int]:
        if not hashes:
            return []
        seconds = self._guard.existence_budget(len(hashes))
        return await self._guard.call(
            lambda: self.inner.find_missing_indices(function, hashes, sizes), seconds, "existence check"
        )

    async def lookup(self, function: DigestFunction, hash: str) -> Digest:
        what = f"blob {function.label}:{hash[:64]}"
        return await self._guard.call(lambda: self.inner.lookup(function, hash), self._guard.budget, what)

    async def read(self, digest: Digest, offset: int = 0, limit: int = 0) -> AsyncIterator[bytes]:
        what = f"blob {digest}"
        chunks = await self._guard.call(lambda: self.inner.read(digest, offset, limit), self._guard.timeout, what)
        return self._guard.stream(chunks, what)

    async def read_blobs(self, digests: Sequence[Digest]) -> list[bytes | Exception]:
        results = await self._guard.call(lambda: self.inner.read_blobs(digests), self._guard.timeout, "batch read")
        return [self._guard.outcome(r, f"blob {d}") for d, r in zip(digests, results, strict=True)]

    async def write(self, digest: Digest, chunks: AsyncIterable[bytes]) -> None:
        seconds = self._guard.upload_timeout(digest.size_bytes)
        await self._guard.call(lambda: self.inner.write(digest, _tagged(chunks)), seconds, f"upload of blob {digest}")

    async def write_blobs(self, items: Sequence[tuple[Digest, bytes]]) -> list[Exception | None]:
        seconds = self._guard.upload_timeout(sum(d.size_bytes for d, _ in items))
        outcomes = await self._guard.call(lambda: self.inner.write_blobs(items), seconds, "batch upload")
        return [self._guard.outcome(o, f"upload of blob {d}") for (d, _), o in zip(items, outcomes, strict=True)]


class FailOpenActionStore(ForwardingActionStore):
    """A slow ActionStore that fails fast and cleanly: lookups within the budget, puts within the timeout."""

    def __init__(self, inner: ActionStore, health: SlowTierHealth, *, budget: float, timeout: float) -> None:
        super().__init__(inner)
        self.health = health
        self._guard = _Guard(health, budget, timeout, 1)

    async def get(self, namespace: str, digest: Digest) -> bytes:
        what = f"entry {digest} in {namespace!r}"
        return await self._guard.call(lambda: self.inner.get(namespace, digest), self._guard.budget, what)

    async def put(self, namespace: str, digest: Digest, data: bytes) -> None:
        what = f"upload of entry {digest} in {namespace!r}"
        await self._guard.call(lambda: self.inner.put(namespace, digest, data), self._guard.timeout * 6, what)
