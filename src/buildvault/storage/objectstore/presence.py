"""A bounded presence cache in front of a slow tier (the object store).

Why a decorator: without it FindMissingBlobs costs one HEAD per digest per request, and a build
asks about the same digests again and again. The cache answers what it learned from earlier
checks, uploads, reads and lookups (positive entries for an hour, negative ones for 30 s: a blob
another server uploads is found soon), and only digests it does not know reach the inner store,
in one call per request. Concurrent requests share the checks in flight: each unknown digest is
asked once. Like bb-storage's ExistenceCachingBlobAccess, but negative answers are kept too.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence

from buildvault.digest import Digest, DigestFunction
from buildvault.storage import BlobStore, ForwardingBlobStore, NotFound, Unavailable


class PresenceIndex:
    """What the slow tier is known to hold (or lack): an LRU of digest -> expiry, bounded.

    Roughly 200 bytes per entry (the default 262,144 entries: ~50 MB)."""

    def __init__(
        self,
        max_entries: int = 1 << 18,
        positive_ttl: float = 3600.0,
        negative_ttl: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._entries: OrderedDict[bytes, float] = OrderedDict()  # expiry; negative value: known missing
        self._max_entries = max(1, max_entries)
        self.positive_ttl = positive_ttl
        self.negative_ttl = negative_ttl
        self._clock = clock

    @staticmethod
    def _key(digest: Digest) -> bytes:
        return bytes.fromhex(digest.hash) + bytes((digest.function.wire,)) + digest.size_bytes.to_bytes(8, "big")

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, digest: Digest) -> bool | None:
        """True: in the slow tier; False: recently found missing; None: unknown or expired."""
        return self.get_many(digest.function, [digest.hash], [digest.size_bytes])[0]

    def get_many(self, function: DigestFunction, hashes: Sequence[str], sizes: Sequence[int]) -> list[bool | None]:
        """`get` of each digest, without building Digest objects (FindMissingBlobs' hot path).

        Only positive answers count as uses (moved to the newest end): a negative one expires
        within `negative_ttl` anyway, and most of a FindMissingBlobs' unknowns locally are
        negatives (blobs about to be uploaded), so touching them would double the loop's cost."""
        entries = self._entries
        get = entries.get
        now = self._clock()
        wire = bytes((function.wire,))
        fromhex = bytes.fromhex
        states: list[bool | None] = []
        state = states.append
        for hash_, size in zip(hashes, sizes, strict=True):
            key = fromhex(hash_) + wire + size.to_bytes(8, "big")
            value = get(key)
            if value is None:
                state(None)
            elif value > now:  # positive, not expired
                entries.move_to_end(key)
                state(True)
            elif value < -now:  # negative, not expired
                state(False)
            else:
                del entries[key]
                state(None)
        return states

    def set(self, digest: Digest, present: bool) -> None:
        key = self._key(digest)
        now = self._clock()
        self._entries[key] = now + self.positive_ttl if present else -(now + self.negative_ttl)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()


class ExistenceCache(ForwardingBlobStore):
    """`inner` with its existence answers cached in `index`; every other call forwarded (and learnt from)."""

    def __init__(self, inner: BlobStore, index: PresenceIndex | None = None) -> None:
        super().__init__(inner)
        self.index = index if index is not None else PresenceIndex()
        self._in_flight: dict[Digest, asyncio.Future[bool | None]] = {}
        self._checks: set[asyncio.Task[None]] = set()  # running checks (kept referenced until done)

    def known_present(self, digest: Digest) -> bool:
        """True if the inner store is known to hold the blob (no request made)."""
        return self.index.get(digest) is True

    async def find_missing(self, digests: Sequence[Digest]) -> list[Digest]:
        unique = list(dict.fromkeys(digests))
        unknown = [d for d in unique if self.index.get(d) is None]
        if unknown:
            await self._check(unknown)
        return [d for d in unique if self.index.get(d) is not True]

    async def find_missing_indices(
        self, function: DigestFunction, hashes: Sequence[str], sizes: Sequence[int]
    ) -> list[int]:
        states = self.index.get_many(function, hashes, sizes)
        unknown_at = [i for i, state in enumerate(states) if state is None]
        if unknown_at:
            await self._check(list(dict.fromkeys(Digest(hashes[i], sizes[i], function) for i in unknown_at)))
            learnt = self.index.get_many(function, [hashes[i] for i in unknown_at], [sizes[i] for i in unknown_at])
            for i, state in zip(unknown_at, learnt, strict=True):
                states[i] = state
        if len(set(hashes)) == len(hashes):  # the usual case: no digest asked twice
            return [i for i, state in enumerate(states) if state is not True]
        seen: set[tuple[str, int]] = set()
        out: list[int] = []
        for i, state in enumerate(states):
            if state is not True:
                key = (hashes[i], sizes[i])
                if key not in seen:  # a digest asked twice is reported once, at its first index
                    seen.add(key)
                    out.append(i)
        return out

    async def _check(self, digests: list[Digest]) -> None:
        """Ask the inner store about `digests` in one call, sharing checks already in flight.

        The call runs as a task of its own: a caller that gives up (the request path's time
        budget, a client gone) leaves it running, so what it learns is cached and the next request
        about the same digests is answered at once instead of asking the slow tier again."""
        loop = asyncio.get_running_loop()
        mine: list[Digest] = []
        waits: list[asyncio.Future[bool | None]] = []
        for digest in digests:
            future = self._in_flight.get(digest)
            if future is None:
                future = self._in_flight[digest] = loop.create_future()
                mine.append(digest)
            waits.append(future)
        if mine:
            task = asyncio.create_task(self._ask(mine), name="existence check")
            self._checks.add(task)
            task.add_done_callback(self._checked)
            await asyncio.shield(task)  # its failure is this caller's (others see None below)
        # Shielded: a caller giving up must not cancel futures that concurrent callers share.
        if None in await asyncio.shield(asyncio.gather(*waits)):
            raise Unavailable("a concurrent existence check of the same blobs failed")

    async def _ask(self, digests: list[Digest]) -> None:
        try:
            absent = set(await self.inner.find_missing(digests))
            for digest in digests:
                present = digest not in absent
                self.index.set(digest, present)
                self._resolve(digest, present)
        finally:
            for digest in digests:  # failed or cancelled: never leave concurrent callers waiting
                self._resolve(digest, None)

    def _checked(self, task: asyncio.Task[None]) -> None:
        self._checks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a caller that gave up is not there to see it

    async def aclose(self) -> None:
        """Cancel the checks still running (shutdown)."""
        checks = list(self._checks)
        for task in checks:
            task.cancel()
        await asyncio.gather(*checks, return_exceptions=True)

    def _resolve(self, digest: Digest, present: bool | None) -> None:
        future = self._in_flight.pop(digest, None)
        if future is not None and not future.done():
            future.set_result(present)

    async def read(self, digest: Digest, offset: int = 0, limit: int = 0) -> AsyncIterator[bytes]:
        try:
            chunks = await self.inner.read(digest, offset, limit)
        except NotFound:
            self.index.set(digest, False)
            raise
        self.index.set(digest, True)
        return self._learning(digest, chunks)

    async def _learning(self, digest: Digest, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        except NotFound:  # corrupt in the slow tier: report it missing so clients upload it again
            self.index.set(digest, False)
            raise

    async def read_blobs(self, digests: Sequence[Digest]) -> list[bytes | Exception]:
        results = await self.inner.read_blobs(digests)
        for digest, result in zip(digests, results, strict=True):
            if isinstance(result, bytes):
                self.index.set(digest, True)
            elif isinstance(result, NotFound):
                self.index.set(digest, False)
        return results

    async def write(self, digest: Digest, chunks: AsyncIterable[bytes]) -> None:
        await self.inner.write(digest, chunks)
        self.index.set(digest, True)

    async def write_blobs(self, items: Sequence[tuple[Digest, bytes]]) -> list[Exception | None]:
        outcomes = await self.inner.write_blobs(items)
        for (digest, _), outcome in zip(items, outcomes, strict=True):
            if outcome is None:
                self.index.set(digest, True)
        return outcomes

    async def lookup(self, function: DigestFunction, hash: str) -> Digest:
        digest = await self.inner.lookup(function, hash)
        self.index.set(digest, True)
        return digest
