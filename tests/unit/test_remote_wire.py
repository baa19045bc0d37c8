"""The frames between a secondary server process and the primary's store (storage/processes/wire.py),
and the errors that cross them: the same classes, so the same gRPC and HTTP codes."""

from __future__ import annotations

import asyncio
import os
import struct

import pytest

from buildvault.digest import Digest, DigestFunction, InvalidDigest
from buildvault.server import errors
from buildvault.server.grpc.bytestream import UploadAborted
from buildvault.storage import (
    CapacityExceeded,
    DigestMismatch,
    InvalidRange,
    NotFound,
    StorageError,
    StorageFull,
    Unavailable,
)
from buildvault.storage.processes import wire
from buildvault.storage.processes.wire import Kind, RemoteError


def digests(n: int) -> list[Digest]:
    functions = list(DigestFunction)
    return [Digest.of(os.urandom(20 + i), functions[i % len(functions)]) for i in range(n)]


def test_digests_round_trip_by_column() -> None:
    original = digests(1000) + [Digest.of(b"")]
    packed = wire.pack_digests(original)
    # u32 count, then 1 + 8 + 32 bytes per digest: no per-digest framing
    assert len(packed) == 4 + 41 * len(original)
    decoded, end = wire.unpack_digests(packed)
    assert decoded == original and end == len(packed)
    assert [d.function for d in decoded] == [d.function for d in original]


def test_columns_of_one_function_pack_like_digests() -> None:
    original = [Digest.of(os.urandom(30), DigestFunction.BLAKE3) for _ in range(10)]
    packed = wire.pack_columns(DigestFunction.BLAKE3, [d.hash for d in original], [d.size_bytes for d in original])
    assert packed == wire.pack_digests(original)
    functions, sizes, hashes, _ = wire.unpack_columns(packed)
    assert set(functions) == {DigestFunction.BLAKE3.wire}
    assert list(sizes) == [d.size_bytes for d in original] and hashes == [d.hash for d in original]


def test_truncated_or_unknown_digest_lists_are_refused() -> None:
    packed = wire.pack_digests(digests(3))
    with pytest.raises(ValueError):
        wire.unpack_digests(packed[:-1])
    bad = bytearray(packed)
    bad[4] = 77  # no such digest function
    with pytest.raises(ValueError):
        wire.unpack_digests(bytes(bad))


ERRORS = [
    NotFound("blob sha256:ab/3 is not stored"),
    DigestMismatch("size 3, declared 4"),
    CapacityExceeded("larger than the whole store"),
    StorageFull("no room right now"),
    InvalidRange("offset 9 past the end"),
    Unavailable("the bucket is down"),
    InvalidDigest("bad hash"),
    StorageError("plain storage error"),
]


@pytest.mark.parametrize("exc", ERRORS, ids=lambda e: type(e).__name__)
def test_errors_cross_as_the_same_class_and_status(exc: Exception) -> None:
    back = wire.error_from(wire.pack_error(exc))
    assert type(back) is type(exc) and str(back) == str(exc)
    assert errors.map_exception(back).code == errors.map_exception(exc).code
    assert errors.map_exception(back).http == errors.map_exception(exc).http


def test_a_subclass_crosses_as_its_nearest_known_class() -> None:
    back = wire.error_from(wire.pack_error(UploadAborted("gone")))
    assert type(back) is StorageError


def test_an_unknown_error_is_internal_and_named() -> None:
    back = wire.error_from(wire.pack_error(KeyError("boom")))
    assert isinstance(back, RemoteError) and "KeyError" in str(back)
    assert errors.is_internal(back)


def test_items_carry_bytes_errors_and_nothing() -> None:
    items: list[bytes | Exception | None] = [b"abc", b"", NotFound("x"), None, StorageFull("y"), os.urandom(5000)]
    decoded, end = wire.unpack_items(wire.pack_items(items))
    assert decoded[0] == b"abc" and decoded[1] == b"" and decoded[3] is None and decoded[5] == items[5]
    assert isinstance(decoded[2], NotFound) and isinstance(decoded[4], StorageFull)
    assert str(decoded[4]) == "y"


def test_namespace_round_trip() -> None:
    packed = wire.pack_namespace("ac/some-instance") + b"tail"
    assert wire.unpack_namespace(packed) == ("ac/some-instance", len(packed) - 4)


async def test_frames_round_trip_through_a_stream() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(wire.frame(Kind.OK, b"abc", b"def") + wire.frame(Kind.END) + wire.frame(Kind.DATA, b"x" * 70000))
    reader.feed_eof()
    assert await wire.read_frame(reader) == (Kind.OK, b"abcdef")
    assert await wire.read_frame(reader) == (Kind.END, b"")
    assert await wire.read_frame(reader) == (Kind.DATA, b"x" * 70000)
    with pytest.raises(asyncio.IncompleteReadError):
        await wire.read_frame(reader)


@pytest.mark.parametrize("length", [0, wire.MAX_FRAME + 1])
async def test_a_bad_frame_length_is_refused(length: int) -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(struct.pack("<IB", length, Kind.OK))
    with pytest.raises(ValueError):
        await wire.read_frame(reader)


async def test_a_truncated_frame_is_the_end_of_the_stream() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(wire.frame(Kind.DATA, b"y" * 100)[:50])
    reader.feed_eof()
    with pytest.raises(asyncio.IncompleteReadError):
        await wire.read_frame(reader)
