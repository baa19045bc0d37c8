"""The empty blob is always present and readable, stored or not.

Why a decorator: the REAPI lets clients assume the empty blob exists without uploading it
(Bazel never uploads it). Every answer about it (FindMissingBlobs, reads, batch reads, lookups by
hash) is given here, once, instead of by each front end; a write of it stores nothing. Like
bb-storage's EmptyBlobInjectingBlobAccess. Calls that involve no empty blob reach the inner
store unchanged: the batch paths check `0 in sizes` first, so a batch without one costs nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Sequence

from buildvault.digest import Digest, DigestFunction
from buildvault.storage import DigestMismatch, InvalidRange
from buildvault.storage.decorator import ForwardingBlobStore

EMPTY_HASHES: dict[DigestFunction, str] = {function: Digest.of(b"", function).hash for function in DigestFunction}


def is_empty_blob(digest: Digest) -> bool:
    """True for the empty blob of the digest's function (size 0 and the hash of no bytes)."""
    return digest.size_bytes == 0 and digest.hash == EMPTY_HASHES[digest.function]


async def _no_chunks() -> AsyncIterator[bytes]:
    return
    yield  # pragma: no cover - makes this an async generator


class EmptyBlobStore(ForwardingBlobStore):
    """A BlobStore on which the empty blob is always present; everything else is forwarded."""

    async def find_missing(self, digests: Sequence[Digest]) -> list[Digest]:
        if not any(d.size_bytes == 0 for d in digests):
            return await self.inner.find_missing(digests)
        return await self.inner.find_missing([d for d in digests if not is_empty_blob(d)])

    async def find_missing_indices(
        self, function: DigestFunction, hashes: Sequence[str], sizes: Sequence[int]
    ) -> list[int]:
        absent = await self.inner.find_missing_indices(function, hashes, sizes)
        if absent and 0 in sizes:
            empty = EMPTY_HASHES[function]
            absent = [i for i in absent if sizes[i] != 0 or hashes[i] != empty]
        return absent

    async def read(self, digest: Digest, offset: int = 0, limit: int = 0) -> AsyncIterator[bytes]:
        if not is_empty_blob(digest):
            return await self.inner.read(digest, offset, limit)
        if offset != 0 or limit < 0:
            raise InvalidRange(f"read offset {offset}/limit {limit} out of range for the empty blob")
        return _no_chunks()

    async def read_blobs(self, digests: Sequence[Digest]) -> list[bytes | Exception]:
        if not any(d.size_bytes == 0 for d in digests):
            return await self.inner.read_blobs(digests)
        stored = [i for i, d in enumerate(digests) if not is_empty_blob(d)]
        results: list[bytes | Exception] = [b""] * len(digests)
        if stored:
            for i, result in zip(stored, await self.inner.read_blobs([digests[i] for i in stored]), strict=True):
                results[i] = result
        return results

    async def write(self, digest: Digest, chunks: AsyncIterable[bytes]) -> None:
        if not is_empty_blob(digest):
            await self.inner.write(digest, chunks)
            return
        async for chunk in chunks:
            if chunk:
                raise DigestMismatch(f"blob {digest}: declared empty, got bytes")

    async def write_blobs(self, items: Sequence[tuple[Digest, bytes]]) -> list[Exception | None]:
        if not any(d.size_bytes == 0 for d, _ in items):
            return await self.inner.write_blobs(items)
        outcomes: list[Exception | None] = [None] * len(items)
        stored = [i for i, (d, _) in enumerate(items) if not is_empty_blob(d)]
        for i, (d, data) in enumerate(items):
            if is_empty_blob(d) and data:
                outcomes[i] = DigestMismatch(f"blob {d}: declared empty, got {len(data)} bytes")
        if stored:
            for i, outcome in zip(stored, await self.inner.write_blobs([items[i] for i in stored]), strict=True):
                outcomes[i] = outcome
        return outcomes

    async def lookup(self, function: DigestFunction, hash: str) -> Digest:
        if hash == EMPTY_HASHES[function]:
            return Digest(hash, 0, function)
        return await self.inner.lookup(function, hash)
