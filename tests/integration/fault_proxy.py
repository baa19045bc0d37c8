"""A fault-injecting TCP proxy for HTTP, in front of the S3 test server.

    proxy = FaultProxy(("127.0.0.1", moto_port)).start()
    proxy.endpoint                    # "http://127.0.0.1:<port>": give this to the server
    proxy.inject("reset")             # from now on, on every connection, open or new
    proxy.inject(None)                # healthy again
    proxy.stop()

Faults (applied per request or per reply, so kept-alive connections are affected too):

- "latency": every request waits `latency` seconds before it is forwarded (a slow bucket).
- "5xx": every request is answered 503 Service Unavailable by the proxy itself.
- "reset": every reply is forwarded up to its first body byte (or half of a body-less reply),
  then the connection is reset (RST): a connection reset mid-reply.
- "truncate": the same, but the connection is closed cleanly (FIN): a truncated body.
- "outage": every connection is reset at once, before anything reaches the bucket.

The proxy runs its own event loop in a thread, so a test's blocking calls never stall it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading

FAULTS = ("latency", "5xx", "reset", "truncate", "outage")
_SERVICE_UNAVAILABLE = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\nContent-Length: 0\r\n"
    b"Connection: close\r\n\r\n"
)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST instead of FIN (SO_LINGER 0)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _cut(reply: bytes) -> int:
    """Where to cut a reply: just after its first body byte, or half way if no body follows."""
    end = reply.find(b"\r\n\r\n")
    if end >= 0 and len(reply) > end + 5:
        return end + 5
    return max(1, len(reply) // 2)


class FaultProxy:
    def __init__(self, target: tuple[str, int], latency: float = 2.0) -> None:
        self.target = target
        self.latency = latency
        self.fault: str | None = None
        self.port = 0
        self.connections = 0
        self.faults_injected = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def inject(self, fault: str | None) -> None:
        assert fault is None or fault in FAULTS, fault
        self.fault = fault

    def start(self) -> FaultProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _listen(self) -> asyncio.Server:
        return await asyncio.start_server(self._connection, "127.0.0.1", 0)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()

    async def _connection(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.fault == "outage":
            self.faults_injected += 1
            _reset(client_w)
            return
        try:
            upstream_r, upstream_w = await asyncio.open_connection(*self.target)
        except OSError:
            _reset(client_w)
            return
        self._writers |= {client_w, upstream_w}
        try:
            await asyncio.gather(
                self._requests(client_r, upstream_w, client_w), self._replies(upstream_r, client_w, upstream_w)
            )
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for writer in (client_w, upstream_w):
                self._writers.discard(writer)
                writer.transport.abort()

    async def _requests(
        self, source: asyncio.StreamReader, upstream: asyncio.StreamWriter, client: asyncio.StreamWriter
    ) -> None:
        while data := await source.read(65536):
            fault = self.fault
            if fault in ("5xx", "outage"):
                self.faults_injected += 1
                if fault == "5xx":
                    client.write(_SERVICE_UNAVAILABLE)
                    with contextlib.suppress(OSError):
                        await client.drain()
                    client.close()
                else:
                    _reset(client)
                upstream.transport.abort()
                return
            if fault == "latency":
                self.faults_injected += 1
                await asyncio.sleep(self.latency)  # the injected fault itself: a slow bucket
            upstream.write(data)
            await upstream.drain()
        upstream.close()

    async def _replies(
        self, source: asyncio.StreamReader, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter
    ) -> None:
        while data := await source.read(65536):
            fault = self.fault
            if fault in ("reset", "truncate", "outage"):
                self.faults_injected += 1
                client.write(data[: _cut(data)])
                with contextlib.suppress(OSError):
                    await client.drain()
                if fault == "truncate":
                    client.close()
                else:
                    _reset(client)
                upstream.transport.abort()
                return
            client.write(data)
            await client.drain()
        client.close()
