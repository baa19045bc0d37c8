"""In-memory stores: for tests and tiny deployments. Same contracts as the disk store."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence

from buildvault.digest import Digest, DigestFunction, new_hasher
from buildvault.storage import (
    CHUNK_SIZE,
    CapacityExceeded,
    DigestMismatch,
    InvalidRange,
    NotFound,
    OneByOneBatches,
    check_content,
)


async def collect_verified(digest: Digest, chunks: AsyncIterable[bytes], limit: int | None = None) -> bytes:
    """Read a whole blob from `chunks`, checking size and hash; raise DigestMismatch otherwise."""
    hasher = new_hasher(digest.function)
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > digest.size_bytes:
            raise DigestMismatch(f"blob {digest}: more than the declared {digest.size_bytes} bytes")
        if limit is not None and size > limit:
            raise CapacityExceeded(f"blob {digest} is larger than the store's {limit} bytes")
        hasher.update(chunk)
        parts.append(chunk)
    check_content(digest, size, hasher)
    return b"".join(parts)


def slice_chunks(data: bytes, offset: int, limit: int) -> AsyncIterator[bytes]:
    end = len(data) if limit == 0 else min(len(data), offset + limit)

    async def chunks() -> AsyncIterator[bytes]:
        view = memoryview(data)
        for start in range(offset, end, CHUNK_SIZE):
            yield bytes(view[start : min(end, start + CHUNK_SIZE)])

    return chunks()


class MemoryBlobStore(OneByOneBatches):
    """A dict of blobs, optionally capped (no eviction: a full store refuses writes)."""

    def __init__(self, max_size: int | None = None) -> None:
        self._blobs: dict[str, bytes] = {}
        self._max_size = max_size

    async def find_missing(self, digests: Sequence[Digest]) -> list[Digest]:
        seen: set[Digest] = set()
        missing = []
        for digest in digests:
            if digest not in seen and digest.key not in self._blobs:
                missing.append(digest)
            seen.add(digest)
        return missing

    async def read(self, digest: Digest, offset: int = 0, limit: int = 0) -> AsyncIterator[bytes]:
        data = self._blobs.get(digest.key)
        if data is None:
            raise NotFound(f"blob {digest} not found")
        if offset < 0 or offset > len(data) or limit < 0:
            raise InvalidRange(f"read offset {offset}/limit {limit} out of range for blob {digest}")
        return slice_chunks(data, offset, limit)

    async def write(self, digest: Digest, chunks: AsyncIterable[bytes]) -> None:
        if self._max_size is not None and digest.size_bytes > self._max_size:
            raise CapacityExceeded(f"blob {digest} is larger than the store's {self._max_size} bytes")
        self._blobs[digest.key] = await collect_verified(digest, chunks)

    async def lookup(self, function: DigestFunction, hash: str) -> Digest:
        data = self._blobs.get(f"{function.label}/{hash}")
        if data is None:
            raise NotFound(f"blob {function.label}:{hash} not found")
        return Digest(hash, len(data), function)

    def evict(self, digests: Iterable[Digest] | None = None) -> int:
        """Drop the given blobs (all of them when None), as a disk store's eviction would;
        returns how many were held. Blobs not held are ignored."""
        if digests is None:
            count = len(self._blobs)
            self._blobs.clear()
            return count
        return sum(self._blobs.pop(digest.key, None) is not None for digest in digests)


class MemoryActionStore:
    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], bytes] = {}

    async def get(self, namespace: str, digest: Digest) -> bytes:
        try:
            return self._entries[(namespace, digest.key)]
        except KeyError:
            raise NotFound(f"no entry for {digest} in {namespace!r}") from None

    async def put(self, namespace: str, digest: Digest, data: bytes) -> None:
        self._entries[(namespace, digest.key)] = bytes(data)

    def namespaces(self) -> list[str]:
        """The namespace of every stored entry, in insertion order (one per entry)."""
        return [namespace for namespace, _ in self._entries]
