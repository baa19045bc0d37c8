"""Forwarding bases for store decorators.

Like a bb-storage BlobAccess decorator that embeds the interface it wraps, a decorator derives
from `ForwardingBlobStore` / `ForwardingActionStore` and overrides only the methods whose
behaviour it changes; every other method, batch paths included, reaches the inner store as it
is. The one exception is `store_verified` (bytes the caller hashed itself): it goes through the
decorator's own `write_blobs`, verified, unless the decorator forwards it on purpose, so a
decorator that changes writes never has them bypass it. Nothing is found by probing for
attributes, so no fast path is silently lost under a wrapper.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Sequence

from buildvault.digest import Digest, DigestFunction
from buildvault.storage import ActionStore, BlobStore, Verified, as_pairs


class ForwardingBlobStore:
    """A BlobStore that forwards every call to `inner`."""

    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner

    async def find_missing(self, digests: Sequence[Digest]) -> list[Digest]:
        return await self.inner.find_missing(digests)

    async def find_missing_indices(
        self, function: DigestFunction, hashes: Sequence[str], sizes: Sequence[int]
    ) -> list[int]:
        return await self.inner.find_missing_indices(function, hashes, sizes)

    async def read(self, digest: Digest, offset: int = 0, limit: int = 0) -> AsyncIterator[bytes]:
        return await self.inner.read(digest, offset, limit)

    async def read_blobs(self, digests: Sequence[Digest]) -> list[bytes | Exception]:
        return await self.inner.read_blobs(digests)

    async def write(self, digest: Digest, chunks: AsyncIterable[bytes]) -> None:
        await self.inner.write(digest, chunks)

    async def write_blobs(self, items: Sequence[tuple[Digest, bytes]]) -> list[Exception | None]:
        return await self.inner.write_blobs(items)

    async def store_verified(self, items: Sequence[Verified]) -> list[Exception | None]:
        return await self.write_blobs(as_pairs(items))  # see the module docstring: verified unless overridden

    async def lookup(self, function: DigestFunction, hash: str) -> Digest:
        return await self.inner.lookup(function, hash)


class ForwardingActionStore:
    """An ActionStore that forwards every call to `inner`."""

    def __init__(self, inner: ActionStore) -> None:
        self.inner = inner

    async def get(self, namespace: str, digest: Digest) -> bytes:
        return await self.inner.get(namespace, digest)

    async def put(self, namespace: str, digest: Digest, data: bytes) -> None:
        await self.inner.put(namespace, digest, data)
