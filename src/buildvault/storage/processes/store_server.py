"""The primary's store, served to its secondary server processes over a private Unix socket.

    server = StoreServer(blobs, actions, recorder, "/tmp/buildvault-XXXX/store.sock")
    await server.start()
    await server.stop()

The other end is storage/processes/client.py; the frames are storage/processes/wire.py's. Every call is
served by the one store stack the primary's own listeners use (the metered client tier, the empty
blob, the bucket tier, the disk index with its eviction hold), so what any process writes, every
process sees at once. A connection carries one call at a time; a stream that ends early (the
client went away, a write refused before its end) ends the connection.

Requests are counted by process (`buildvault_store_ipc_requests_total{process}`), and the
secondaries' own RPC observations (METRICS frames) are added to the primary's /metrics, both
through a `ProcessRecorder` (server/processes/relay.py's `RelayReceiver`: storage knows no
Prometheus metric).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import struct
from array import array
from collections.abc import AsyncGenerator
from typing import Any, Protocol

from buildvault.storage import ActionStore, BlobStore, close_chunks
from buildvault.storage.processes import wire
from buildvault.storage.processes.client import STREAM_LIMIT
from buildvault.storage.processes.wire import Kind

__all__ = ["StoreServer"]

log = logging.getLogger("buildvault.store_server")

_PEER_GONE = (ConnectionError, asyncio.IncompleteReadError, OSError)


class ProcessRecorder(Protocol):
    """Where the store server's counts go (the primary's /metrics)."""

    def ipc_request(self, process: str) -> None:
        """One store call served to secondary `process`."""

    def relayed(self, process: str, events: list[list[Any]]) -> None:
        """Observations secondary `process` relayed; ValueError, TypeError or KeyError if malformed."""


class _PeerGone(Exception):
    """The secondary closed the connection in the middle of a write stream."""


class StoreServer:
    def __init__(self, blobs: BlobStore, actions: ActionStore, metrics: ProcessRecorder | None, path: str) -> None:
        self.blobs = blobs
        self.actions = actions
        self.metrics = metrics
        self.path = path
        self._server: asyncio.AbstractServer | None = None
        self._connections: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=self.path, limit=STREAM_LIMIT)
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            connections = dict(self._connections)
            for writer in connections.values():
                writer.close()  # a connection waiting for its next call ends at once
            if connections:  # one in the middle of a call (a stream) is cancelled
                _, pending = await asyncio.wait(connections, timeout=1.0)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    # -- one connection -------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        process = "0"
        try:
            while True:
                kind, body = await wire.read_frame(reader)
                if kind == Kind.HELLO:
                    process = str(struct.unpack("<I", body)[0])
                    continue
                if kind == Kind.METRICS:
                    self._relayed(process, body)
                    continue
                if self.metrics is not None:
                    self.metrics.ipc_request(process)
                if not await self._dispatch(kind, body, reader, writer):
                    break
        except (*_PEER_GONE, ValueError):
            pass  # the secondary went away (or sent garbage): its connection ends
        except Exception:
            log.exception("store server: unexpected error on a connection")
        finally:
            self._connections.pop(task, None)
            writer.close()

    async def _dispatch(
        self, kind: int, body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Serve one call; False when the connection cannot carry another (a stream left midway)."""
        if kind == Kind.READ:
            return await self._read(body, writer)
        if kind == Kind.WRITE:
            return await self._write(body, reader, writer)
        try:
            answer = await self._unary(kind, body)
        except Exception as exc:  # that call's outcome, as the same class on the other side
            await wire.write_frame(writer, Kind.ERROR, wire.pack_error(exc))
            return True
        await wire.write_frame(writer, Kind.OK, answer)
        return True

    async def _unary(self, kind: int, body: bytes) -> bytes:
        if kind == Kind.FIND_MISSING_INDICES:
            functions, sizes, hashes, _ = wire.unpack_columns(body)
            if not hashes:
                return b""
            function = wire.function_of(functions[0])
            return array("I", await self.blobs.find_missing_indices(function, hashes, sizes)).tobytes()
        if kind == Kind.FIND_MISSING:
            return wire.pack_digests(await self.blobs.find_missing(wire.unpack_digests(body)[0]))
        if kind == Kind.READ_BLOBS:
            return wire.pack_items(await self.blobs.read_blobs(wire.unpack_digests(body)[0]))
        if kind == Kind.WRITE_BLOBS:
            digests, at = wire.unpack_digests(body)
            items = wire.unpack_items(body, at)[0]
            pairs = [(d, data) for d, data in zip(digests, items, strict=True) if isinstance(data, bytes)]
            if len(pairs) != len(digests):
                raise ValueError("a write_blobs item without bytes")
            return wire.pack_items(await self.blobs.write_blobs(pairs))
        if kind == Kind.LOOKUP:
            function = wire.function_of(body[0])
            return wire.pack_digests([await self.blobs.lookup(function, body[1:].decode("utf-8", "replace"))])
        if kind == Kind.AC_GET:
            namespace, at = wire.unpack_namespace(body)
            return await self.actions.get(namespace, wire.unpack_digests(body, at)[0][0])
        if kind == Kind.AC_PUT:
            namespace, at = wire.unpack_namespace(body)
            digests, at = wire.unpack_digests(body, at)
            await self.actions.put(namespace, digests[0], body[at:])
            return b""
        raise ValueError(f"unknown store call {kind}")

    async def _read(self, body: bytes, writer: asyncio.StreamWriter) -> bool:
        offset, limit = struct.unpack_from("<qq", body)
        try:
            digest = wire.unpack_digests(body, 16)[0][0]
            chunks = await self.blobs.read(digest, offset, limit)
        except Exception as exc:  # NotFound, InvalidRange, ...: before any byte
            await wire.write_frame(writer, Kind.ERROR, wire.pack_error(exc))
            return True
        try:
            await wire.write_frame(writer, Kind.OK)
            iterator = chunks.__aiter__()
            while True:
                try:
                    chunk = await iterator.__anext__()
                except StopAsyncIteration:
                    break
                except Exception as exc:  # a blob found damaged mid-stream, a tier gone: the consumer's error
                    await wire.write_frame(writer, Kind.ERROR, wire.pack_error(exc))
                    return True
                await wire.write_frame(writer, Kind.DATA, chunk)  # the peer gone: ends the connection
        finally:
            await close_chunks(chunks)
        await wire.write_frame(writer, Kind.END)
        return True

    async def _write(self, body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        digest = wire.unpack_digests(body)[0][0]
        ended = False

        async def source() -> AsyncGenerator[bytes, None]:
            nonlocal ended
            while True:
                try:
                    kind, data = await wire.read_frame(reader)
                except (*_PEER_GONE, ValueError) as e:
                    raise _PeerGone(str(e)) from None  # the store drops the partial write
                if kind == Kind.DATA:
                    yield data
                elif kind == Kind.END:
                    ended = True
                    return
                else:
                    raise _PeerGone(f"unexpected frame {kind} in a write stream")

        chunks = source()
        answer: tuple[int, bytes] = (Kind.OK, b"")
        try:
            await self.blobs.write(digest, chunks)
        except _PeerGone:
            return False
        except Exception as exc:
            answer = (Kind.ERROR, wire.pack_error(exc))
        finally:
            await chunks.aclose()
        await wire.write_frame(writer, *answer)
        # Answered before the end (refused early, or already stored): the client stops at its next
        # chunk and sends END. Reading on to it keeps the answer readable on the other side (closing
        # with unread bytes would reset the connection under it) and the connection usable.
        while not ended:
            kind, _ = await wire.read_frame(reader)
            if kind == Kind.END:
                ended = True
            elif kind != Kind.DATA:
                return False
        return True

    # -- the secondaries' request observations ----------------------------------------------

    def _relayed(self, process: str, body: bytes) -> None:
        if self.metrics is None:
            return
        try:
            self.metrics.relayed(process, json.loads(body))
        except (ValueError, TypeError, KeyError):
            log.warning("store server: a malformed metrics frame was ignored")
