"""The index snapshot (index.lru): its binary format, read and written in a worker thread.

The snapshot holds the index (keys in LRU order, access seconds, AC sizes, used bytes) and the
mtime of every leaf directory (cas/<fn>/<hh>, ac/.../@<fn>/<hh>) when it was taken. Creating,
renaming or deleting a file changes its directory's mtime, so at start-up a directory whose
mtime still matches holds exactly the snapshot's entries and is not listed at all. Like git's
"racily clean" index entries, a directory modified within RACY_NS (layout.py) of the moment its
mtime was read is recorded as -1: never trusted.

Records (records.py) are in the same index; the snapshot names the LMDB transaction its keys
match (0: writes of records were in flight, so start-up compares the keys with LMDB's).

Format (little-endian): magic, used bytes (u64), LMDB transaction id (u64), keys (count u64, u16 lengths, bytes), access
seconds (u32 each), AC keys (same encoding) and their sizes (u64 each), dir ids (same encoding)
and their mtimes (i64 each), then a CRC-32 of everything before it.
"""

from __future__ import annotations

import logging
import struct
import zlib
from array import array
from collections.abc import Iterable
from itertools import accumulate
from typing import NamedTuple

from buildvault.storage.disk import layout
from buildvault.storage.disk.core import Core
from buildvault.storage.disk.fileops import replace_durably

log = logging.getLogger("buildvault.storage.disk")

MAGIC = b"BVLRU\x00\x00\x03"


class Snapshot(NamedTuple):
    keys: list[bytes]  # LRU order, least recently used first
    ticks: array[int]  # last access, unix seconds, one per key
    ac_sizes: Iterable[tuple[bytes, int]]
    used: int
    dir_mtimes: dict[bytes, int]  # dir id -> mtime ns, or -1: not to be trusted
    records_txnid: int  # the LMDB transaction the record keys match; 0: compare them


def _byte_strings(items: list[bytes]) -> tuple[bytes, bytes, bytes]:
    """Encoding of a list of short byte strings: count, u16 lengths, concatenation."""
    return len(items).to_bytes(8, "little"), array("H", map(len, items)).tobytes(), b"".join(items)


class _Reader:
    """Decodes what write_snapshot wrote; any inconsistency raises ValueError."""

    def __init__(self, data: bytes, offset: int) -> None:
        self.data = data
        self.offset = offset

    def _take(self, size: int) -> bytes:
        chunk = self.data[self.offset : self.offset + size]
        if len(chunk) != size:
            raise ValueError("truncated")
        self.offset += size
        return chunk

    def number(self) -> int:
        return int.from_bytes(self._take(8), "little")

    def numbers(self, code: str, count: int) -> array[int]:
        values = array(code)
        values.frombytes(self._take(values.itemsize * count))
        return values

    def byte_strings(self) -> list[bytes]:
        count = self.number()
        lens = self.numbers("H", count)
        blob = self._take(sum(lens))
        return [blob[end - length : end] for end, length in zip(accumulate(lens), lens, strict=True)]


def read_snapshot(path: str) -> Snapshot | None:
    """The snapshot at `path`; None if there is none or it is unusable (logged: the store rescans)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    try:
        if len(data) < 16 or data[:8] != MAGIC:
            raise ValueError("unknown format")
        if zlib.crc32(memoryview(data)[:-4]) != int.from_bytes(data[-4:], "little"):
            raise ValueError("truncated or corrupt")
        reader = _Reader(data, 8)
        used = reader.number()
        txnid = reader.number()
        keys = reader.byte_strings()
        ticks = reader.numbers("I", len(keys))
        ac_keys = reader.byte_strings()
        ac_sizes = reader.numbers("Q", len(ac_keys))
        dir_ids = reader.byte_strings()
        mtimes = reader.numbers("q", len(dir_ids))
        if reader.offset != len(data) - 4:
            raise ValueError("trailing bytes")
        dir_mtimes = dict(zip(dir_ids, mtimes, strict=True))
        return Snapshot(keys, ticks, zip(ac_keys, ac_sizes, strict=True), used, dir_mtimes, txnid)
    except (ValueError, struct.error, IndexError) as e:
        log.warning("ignoring LRU snapshot %s (%s): rescanning the store", path, e)
        return None


def write_snapshot(
    tmp_dir: str,
    path: str,
    keys: list[bytes],
    ticks: list[int],
    ac_sizes: list[tuple[bytes, int]],
    used: int,
    dirs: dict[bytes, int],
    records_txnid: int = 0,
) -> None:
    """Replace the snapshot at `path` durably (fsync'ed file and directory)."""
    ac_keys = [key for key, _size in ac_sizes]
    parts = [
        MAGIC,
        used.to_bytes(8, "little"),
        records_txnid.to_bytes(8, "little"),
        *_byte_strings(keys),
        array("I", ticks).tobytes(),
        *_byte_strings(ac_keys),
        array("Q", [size for _key, size in ac_sizes]).tobytes(),
        *_byte_strings(list(dirs)),
        array("q", dirs.values()).tobytes(),
    ]
    body = b"".join(parts)
    replace_durably(tmp_dir, path, [body, zlib.crc32(body).to_bytes(4, "little")])


async def take(core: Core, *, quiesced: bool) -> None:
    """Write the snapshot of `core`'s index; copying the keys is the only event-loop work. With
    `quiesced` (close: nothing in flight) no directory is too recent to be trusted."""
    index = core.index
    keys, ticks = list(index.entries), list(index.entries.values())
    ac_sizes, used = list(index.ac_sizes.items()), index.used
    # The keys match LMDB's current transaction only if no record write or delete is under way
    # (their index updates come with their completion): otherwise start-up compares them.
    txnid = 0 if core.publishing or core.deleting else core.records.txnid()
    dirty = core.dirs_in_flight()
    index.tracking = dirty  # index changes from now until the directories are stat'ed
    try:
        racy_ns = 0 if quiesced else layout.RACY_NS
        dirs = await core.io(
            layout.leaf_dirs, core.layout.cas_dir, core.layout.ac_dir, racy_ns, what="reading directory times"
        )
    finally:
        index.tracking = None
    dirty |= core.dirs_in_flight()
    recorded = {dir_id: -1 if dir_id in dirty else mtime for dir_id, (_path, mtime) in dirs.items()}
    where = core.layout
    args = (where.tmp_dir, where.snapshot_path, keys, ticks, ac_sizes, used, recorded, txnid)
    await core.io(write_snapshot, *args, what="writing the LRU snapshot")
