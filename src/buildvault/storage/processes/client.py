"""The BlobStore and ActionStore of a secondary server process: every call goes to the primary's
one store over a private Unix socket (frames: storage/processes/wire.py; server:
storage/processes/store_server.py).

    client = RemoteStoreClient("/run/.../store.sock", process=1)
    client.blobs, client.actions      the two protocols, batch paths included
    await client.aclose()

Coherence comes from there being one store: a blob written through any process is visible to
every other at once, the size cap is the whole store's, and eviction's hold sees every read.

Connections are pooled; each carries one call at a time, so a stream's back-pressure is the
socket's own (a read's next chunk is read only when the consumer asks; a write sends a chunk
only once the previous one was taken). A connection left mid-stream (a consumer gone, an early
error) is closed, never reused. A primary that cannot be reached is `Unavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from array import array
from collections.abc import AsyncIterable, AsyncIterator, Sequence

from buildvault.digest import Digest, DigestFunction
from buildvault.storage import Unavailable, Verified, as_pairs, close_chunks
from buildvault.storage.processes import wire
from buildvault.storage.processes.wire import Kind

__all__ = ["RemoteActionStore", "RemoteBlobStore", "RemoteStoreClient"]

STREAM_LIMIT = 256 << 10  # asyncio StreamReader: reading pauses past twice this (a larger frame still arrives)
MAX_IDLE = 64  # idle connections kept per process


class _Connection:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def exchange(self, kind: int, *parts: bytes) -> tuple[int, bytes]:
        """One request frame, the first answer frame; a broken connection is closed and Unavailable."""
        try:
            await wire.write_frame(self.writer, kind, *parts)
            return await wire.read_frame(self.reader)
        except BaseException as e:
            self.close()
            if isinstance(e, (OSError, asyncio.IncompleteReadError, ValueError)):
                raise Unavailable(f"the primary server process's store went away: {e!r}") from None
            raise

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class RemoteStoreClient:
    """The connection pool to the primary's store server, and the two stores over it."""

    def __init__(self, path: str, process: int = 0) -> None:
        self.path = path
        self.process = process
        self._idle: list[_Connection] = []
        self._closed = False
        self.blobs = RemoteBlobStore(self)
        self.actions = RemoteActionStore(self)

    async def acquire(self) -> _Connection:
        if self._idle:
            return self._idle.pop()
        if self._closed:
            raise Unavailable("the store client is closed")
        try:
            reader, writer = await asyncio.open_unix_connection(self.path, limit=STREAM_LIMIT)
        except OSError as e:
            raise Unavailable(f"the primary server process's store is unreachable: {e}") from None
        connection = _Connection(reader, writer)
        writer.write(wire.frame(Kind.HELLO, struct.pack("<I", self.process)))
        return connection

    def release(self, connection: _Connection) -> None:
        if self._closed or len(self._idle) >= MAX_IDLE:
            connection.close()
        else:
            self._idle.append(connection)

    async def call(self, kind: int, *parts: bytes) -> bytes:
        """One request, its OK body; an ERROR frame raises its exception."""
        connection = await self.acquire()
        answer, body = await connection.exchange(kind, *parts)
        self.release(connection)
        if answer == Kind.ERROR:
            raise wire.error_from(body)
        if answer != Kind.OK:
            raise Unavailable(f"unexpected frame {answer} from the store server")
        return body

    async def send(self, kind: int, *parts: bytes) -> None:
        """A frame with no answer (the metrics relay)."""
        connection = await self.acquire()
        try:
            await wire.write_frame(connection.writer, kind, *parts)
        except BaseException:
            connection.close()
            raise
        self.release(connection)

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


class _RemoteChunks:
    """A read's chunks: DATA frames read one at a time as the consumer asks, until END."""

    def __init__(self, client: RemoteStoreClient, connection: _Connection) -> None:
        self._client = client
        self._connection: _Connection | None = connection

    def __aiter__(self) -> _RemoteChunks:
        return self

    async def __anext__(self) -> bytes:
        connection = self._connection
        if connection is None:
            raise StopAsyncIteration
        try:
            kind, body = await wire.read_frame(connection.reader)
        except BaseException as e:
            await self.aclose()
            if isinstance(e, (OSError, asyncio.IncompleteReadError, ValueError)):
                raise Unavailable(f"the primary server process's store went away mid-read: {e!r}") from None
            raise
        if kind == Kind.DATA:
            return body
        self._connection = None  # the stream is over: the connection is clean again
        self._client.release(connection)
        if kind == Kind.END:
            raise StopAsyncIteration
        if kind == Kind.ERROR:
            raise wire.error_from(body)
        connection.close()
        raise Unavailable(f"unexpected frame {kind} in a read stream")

    async def aclose(self) -> None:
        """Stop early: the rest of the stream is never read, so the connection is closed."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def __del__(self) -> None:
        if self._connection is not None:
            self._connection.close()


class RemoteBlobStore:
    """BlobStore over the primary's store server."""

    def __init__(self, client: RemoteStoreClient) -> None:
        self.client = client

    async def find_missing(self, digests: Sequence[Digest]) -> list[Digest]:
        body = await self.client.call(Kind.FIND_MISSING, wire.pack_digests(digests))
        return wire.unpack_digests(body)[0]

    async def find_missing_indices(
        self, function: DigestFunction, hashes: Sequence[str], sizes: Sequence[int]
    ) -> list[int]:
        body = await self.client.call(Kind.FIND_MISSING_INDICES, wire.pack_columns(function, hashes, sizes))
        indices = array("I")
        indices.frombytes(body)
        return indices.tolist()

    async def read(self, digest: Digest, offset: int = 0, limit: int = 0) -> AsyncIterator[bytes]:
        client = self.client
        connection = await client.acquire()
        request = (struct.pack("<qq", offset, limit), wire.pack_digests([digest]))
        kind, body = await connection.exchange(Kind.READ, *request)
        if kind == Kind.ERROR:  # NotFound, InvalidRange...: before any byte, and nothing follows
            client.release(connection)
            raise wire.error_from(body)
        if kind != Kind.OK:
            connection.close()
            raise Unavailable(f"unexpected frame {kind} answering a read")
        return _RemoteChunks(client, connection)

    async def read_blobs(self, digests: Sequence[Digest]) -> list[bytes | Exception]:
        body = await self.client.call(Kind.READ_BLOBS, wire.pack_digests(digests))
        items = wire.unpack_items(body)[0]
        return [item if item is not None else b"" for item in items]

    async def write(self, digest: Digest, chunks: AsyncIterable[bytes]) -> None:
        client = self.client
        connection = await client.acquire()
        reply: asyncio.Task[tuple[int, bytes]] | None = None
        clean = False
        try:
            await wire.write_frame(connection.writer, Kind.WRITE, wire.pack_digests([digest]))
            reply = asyncio.ensure_future(wire.read_frame(connection.reader))
            early = False
            iterator = chunks.__aiter__()
            while not early:
                try:
                    chunk = await iterator.__anext__()  # the source's own errors reach the caller as they are
                except StopAsyncIteration:
                    chunk = None
                early = reply.done()  # refused (or already stored) before the end: stop sending
                if early:
                    break
                try:
                    if chunk is None:
                        await wire.write_frame(connection.writer, Kind.END)
                        break
                    await wire.write_frame(connection.writer, Kind.DATA, chunk)
                except OSError:  # the server stopped reading: its answer says why
                    early = True
            ended = not early
            if early:  # the server reads on to our END (its answer stays readable): the connection stays usable
                await close_chunks(chunks)
                with contextlib.suppress(OSError):
                    await wire.write_frame(connection.writer, Kind.END)
                    ended = True
            try:
                kind, body = await reply
            except (OSError, asyncio.IncompleteReadError, ValueError) as e:
                raise Unavailable(f"the primary server process's store went away during a write: {e!r}") from None
            clean = ended
        finally:
            if reply is not None and not reply.done():
                reply.cancel()
            if clean:
                client.release(connection)
            else:
                connection.close()
        if kind == Kind.ERROR:
            raise wire.error_from(body)
        if kind != Kind.OK:
            raise Unavailable(f"unexpected frame {kind} answering a write")

    async def write_blobs(self, items: Sequence[tuple[Digest, bytes]]) -> list[Exception | None]:
        body = await self.client.call(
            Kind.WRITE_BLOBS, wire.pack_digests([d for d, _ in items]), wire.pack_items([data for _, data in items])
        )
        outcomes = wire.unpack_items(body)[0]
        return [item if isinstance(item, Exception) else None for item in outcomes]

    async def store_verified(self, items: Sequence[Verified]) -> list[Exception | None]:
        return await self.write_blobs(as_pairs(items))  # across processes: verified by the primary like any write

    async def lookup(self, function: DigestFunction, hash: str) -> Digest:
        body = await self.client.call(Kind.LOOKUP, bytes([function.wire]), hash.encode("utf-8", "replace"))
        return wire.unpack_digests(body)[0][0]


class RemoteActionStore:
    """ActionStore over the primary's store server."""

    def __init__(self, client: RemoteStoreClient) -> None:
        self.client = client

    async def get(self, namespace: str, digest: Digest) -> bytes:
        return await self.client.call(Kind.AC_GET, wire.pack_namespace(namespace), wire.pack_digests([digest]))

    async def put(self, namespace: str, digest: Digest, data: bytes) -> None:
        await self.client.call(Kind.AC_PUT, wire.pack_namespace(namespace), wire.pack_digests([digest]), data)

