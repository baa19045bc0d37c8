"""The frame format between a secondary server process and the primary's store (storage/processes/client.py
is the client, storage/processes/store_server.py the server).

A connection carries one call at a time, as a sequence of frames:

    frame   = u32 length (of kind + body) | u8 kind | body

A call is one request frame (an operation kind); the answer is an `OK` frame (its body the
result) or an `ERROR` frame (u8 error code | utf-8 message). Streamed blob bytes travel as
`DATA` frames ended by `END`, one chunk (at most CHUNK_SIZE) each, so neither side holds more
than a chunk or two of a stream: the sender waits for the socket to drain after each frame, the
receiver reads the next frame only when its consumer asks for the next chunk.

    READ   request(digest, offset, limit) -> OK | ERROR, then DATA* (END | ERROR)
    WRITE  request(digest), then DATA* END -> OK | ERROR (ERROR may come early: stop sending)

Digests are packed by column: u32 count | count u8 digest-function wire numbers | count i64
sizes | count 32-byte raw hashes (every supported function's hash is 32 bytes), so a
FindMissingBlobs of 1,000 digests is a few C calls each way, not a loop of struct.pack.

Errors cross as the same classes (`error_code` / `error_from`): the gRPC and HTTP adapters of
a secondary answer the codes the primary's would. An exception the table does not know arrives
as `RemoteError` (a StorageError: INTERNAL, like any unknown error).
"""

from __future__ import annotations

import asyncio
import struct
from array import array
from collections.abc import Sequence

from buildvault.digest import Digest, DigestFunction, InvalidDigest
from buildvault.storage import (
    CapacityExceeded,
    DigestMismatch,
    InvalidRange,
    NotFound,
    StorageError,
    StorageFull,
    Unavailable,
)

__all__ = [
    "MAX_FRAME",
    "Kind",
    "RemoteError",
    "error_code",
    "error_from",
    "pack_digests",
    "pack_error",
    "read_frame",
    "unpack_digests",
    "write_frame",
]

# The largest frame either side accepts: a batch (under 4 MiB of blobs) or an action entry (the
# gRPC message limit, ~8 MiB) plus framing. A larger length is a broken peer: the connection ends.
MAX_FRAME = 64 << 20
_HEADER = struct.Struct("<IB")
_HASH_BYTES = 32
_FUNCTIONS = {function.wire: function for function in DigestFunction}


class Kind:
    """Frame kinds: the operations, then the frames of answers and streams."""

    HELLO = 1  # body: u32 process index (for the per-process request counts)
    FIND_MISSING = 2  # digests -> OK digests
    FIND_MISSING_INDICES = 3  # digests (one function) -> OK u32 indices
    READ = 4  # u64 offset | u64 limit | digests(1) -> OK, DATA*, END
    READ_BLOBS = 5  # digests -> OK items
    WRITE = 6  # digests(1), then DATA* END -> OK
    WRITE_BLOBS = 7  # digests | items -> OK items (errors only)
    LOOKUP = 8  # u8 function | the hash as text (unvalidated: the store answers NotFound) -> OK digests(1)
    AC_GET = 9  # u16 namespace length | namespace | digests(1) -> OK bytes
    AC_PUT = 10  # u16 namespace length | namespace | digests(1) | bytes -> OK
    METRICS = 11  # a secondary's request observations (storage/processes/store_server.py); no answer
    OK = 100
    ERROR = 101
    DATA = 102
    END = 103


class RemoteError(StorageError):
    """An error of the primary's store this table has no class for (a bug there: INTERNAL)."""


# code <-> class; order matters when encoding (subclasses before their bases).
_ERRORS: tuple[tuple[int, type[Exception]], ...] = (
    (1, NotFound),
    (2, DigestMismatch),
    (3, CapacityExceeded),
    (4, StorageFull),
    (5, InvalidRange),
    (6, Unavailable),
    (7, InvalidDigest),
    (8, RemoteError),
    (9, StorageError),
)
_BY_CODE = dict(_ERRORS)
_UNKNOWN = 8


def error_code(exc: BaseException) -> int:
    for code, cls in _ERRORS:
        if isinstance(exc, cls):
            return code
    return _UNKNOWN


def pack_error(exc: BaseException) -> bytes:
    text = str(exc)
    if error_code(exc) == _UNKNOWN and not isinstance(exc, RemoteError):
        text = f"{type(exc).__name__}: {text}"
    return bytes([error_code(exc)]) + text.encode("utf-8", "replace")[:4096]


def error_from(body: bytes | memoryview) -> Exception:
    """The exception an ERROR frame's body stands for."""
    body = bytes(body)
    cls = _BY_CODE.get(body[0] if body else _UNKNOWN, RemoteError)
    return cls(body[1:].decode("utf-8", "replace"))


def pack_digests(digests: Sequence[Digest]) -> bytes:
    n = len(digests)
    functions = bytes(d.function.wire for d in digests)
    sizes = array("q", [d.size_bytes for d in digests])
    hashes = bytes.fromhex("".join([d.hash for d in digests]))
    return b"".join((struct.pack("<I", n), functions, sizes.tobytes(), hashes))


def pack_columns(function: DigestFunction, hashes: Sequence[str], sizes: Sequence[int]) -> bytes:
    """`pack_digests` of digests that share one function, from their columns (no Digest objects)."""
    n = len(hashes)
    return b"".join(
        (struct.pack("<I", n), bytes([function.wire]) * n, array("q", sizes).tobytes(), bytes.fromhex("".join(hashes)))
    )


def unpack_columns(body: bytes | memoryview, at: int = 0) -> tuple[bytes, array[int], list[str], int]:
    """(function wire numbers, sizes, hashes, offset after them) of packed digests at `at`."""
    (n,) = struct.unpack_from("<I", body, at)
    at += 4
    end = at + n + 8 * n + _HASH_BYTES * n
    if end > len(body):
        raise ValueError("truncated digest list")
    functions = bytes(body[at : at + n])
    at += n
    sizes = array("q")
    sizes.frombytes(body[at : at + 8 * n])
    at += 8 * n
    text = bytes(body[at:end]).hex()
    step = 2 * _HASH_BYTES
    return functions, sizes, [text[i : i + step] for i in range(0, len(text), step)], end


def unpack_digests(body: bytes | memoryview, at: int = 0) -> tuple[list[Digest], int]:
    functions, sizes, hashes, end = unpack_columns(body, at)
    try:
        table = [_FUNCTIONS[w] for w in functions]
    except KeyError:
        raise ValueError("unknown digest function in a digest list") from None
    return [Digest(h, s, f) for h, s, f in zip(hashes, sizes, table, strict=True)], end


def function_of(wire: int) -> DigestFunction:
    try:
        return _FUNCTIONS[wire]
    except KeyError:
        raise ValueError(f"unknown digest function {wire}") from None


def pack_items(items: Sequence[bytes | Exception | None]) -> bytes:
    """Per-item outcomes: u32 count, then per item u8 code (0: bytes, 255: None, else an error
    code) | u32 length | bytes (the data, or the error's message)."""
    parts = [struct.pack("<I", len(items))]
    for item in items:
        if item is None:
            parts.append(b"\xff\x00\x00\x00\x00")
        elif isinstance(item, (bytes, bytearray, memoryview)):
            parts.append(struct.pack("<BI", 0, len(item)))
            parts.append(bytes(item))
        else:
            packed = pack_error(item)
            parts.append(struct.pack("<BI", packed[0], len(packed) - 1))
            parts.append(packed[1:])
    return b"".join(parts)


def unpack_items(body: bytes | memoryview, at: int = 0) -> tuple[list[bytes | Exception | None], int]:
    view = memoryview(body)
    (n,) = struct.unpack_from("<I", view, at)
    at += 4
    out: list[bytes | Exception | None] = []
    for _ in range(n):
        code, length = struct.unpack_from("<BI", view, at)
        at += 5
        if at + length > len(view):
            raise ValueError("truncated item list")
        if code == 0:
            out.append(bytes(view[at : at + length]))
        elif code == 0xFF:
            out.append(None)
        else:
            out.append(error_from(bytes([code]) + bytes(view[at : at + length])))
        at += length
    return out, at


def pack_namespace(namespace: str) -> bytes:
    raw = namespace.encode("utf-8")
    return struct.pack("<H", len(raw)) + raw


def unpack_namespace(body: bytes | memoryview, at: int = 0) -> tuple[str, int]:
    (length,) = struct.unpack_from("<H", body, at)
    at += 2
    return bytes(body[at : at + length]).decode("utf-8"), at + length


def frame(kind: int, *parts: bytes) -> bytes:
    """One frame, ready to write."""
    length = 1 + sum(len(p) for p in parts)
    return b"".join((_HEADER.pack(length, kind), *parts))


async def write_frame(writer: asyncio.StreamWriter, kind: int, *parts: bytes) -> None:
    """Write one frame and wait until the socket takes it (the back-pressure of every stream)."""
    writer.write(frame(kind, *parts))
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The next (kind, body); IncompleteReadError at end of stream, ValueError on a bad length."""
    header = await reader.readexactly(_HEADER.size)
    length, kind = _HEADER.unpack(header)
    if not 1 <= length <= MAX_FRAME:
        raise ValueError(f"bad frame length {length}")
    body = await reader.readexactly(length - 1) if length > 1 else b""
    return kind, body
