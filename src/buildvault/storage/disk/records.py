"""Small entries as records in one LMDB environment (`<root>/records/`) instead of a file each.

CAS blobs up to the store's record limit (RECORD_LIMIT by default) and action entries up to it
are records; larger ones stay files (layout.py). Where an entry lives is a function of its key
and size alone (core.held), so no map of locations is kept.

Record: key = the index key (layout.py: function byte, raw hash, size for CAS; b"A", namespace,
NUL, function byte, raw hash for AC), value = CRC-32 of the data (4 bytes, little-endian) + the
data. Every read checks it: a CAS record by size and hash against its key (the CRC is checked
too, and is what `verify_all` uses for action entries), an AC record by its CRC. A damaged record
is reported DAMAGED, never returned.

Durability (docs/architecture.md): the environment is opened with sync=False, so a commit is
acknowledged once LMDB has written its pages to the kernel; a killed process loses nothing and
cannot tear a committed transaction (copy-on-write B-tree, two meta pages). The store's syncer
makes the pages durable with syncfs every sync interval and records LMDB's last transaction id
with the sync point. An OS crash can leave pages written after that sync point half on disk:
start-up then re-verifies every record (`verify_all`), and drops the environment if LMDB itself
reports it damaged.

Space: LMDB reuses the pages of deleted records and never shrinks its file, so the disk used is
the high-water mark of live pages plus the free ones it could not reuse (pages freed by the last
two transactions are kept for crash safety; a value over about half a page needs a run of
contiguous overflow pages, and the free runs fragment). `charge` is what a record costs in the
store's size cap: 1.5 times its overflow pages, or twice its node for a value that fits in a
leaf page (leaf pages may be half full), so the cap holds on disk: measured under a 4 MiB cap
with 4 KiB blobs, sizes random up to 4 or 16 KiB, and mixes of 4 KiB with 8, 12 or 16 KiB, the
data file stayed at 0.74-0.87 of the cap (bench/RESULTS.md). The map is sized from the cap with
headroom; a full map or a full disk is ENOSPC (StorageFull).

Every function here runs in a worker thread; they are looked up through this module at call
time, so a test can inject a fault.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import shutil
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import lmdb

from buildvault.digest import Digest, raw_hash
from buildvault.storage.disk import fileops, filereads
from buildvault.storage.disk.fileops import DAMAGED, FAILED, MISSING, OK
from buildvault.storage.disk.layout import AC_TAG, FN_BY_BYTE, SIZE_BYTES

log = logging.getLogger("buildvault.storage.disk")

# Entries up to this many bytes are records. Larger values need longer runs of contiguous
# overflow pages, and with a mix of sizes the free runs fragment: at 40 KiB LMDB grew its file
# past the cap (see `charge`); up to 16 KiB it stayed within (bench/RESULTS.md, issue 15).
RECORD_LIMIT = 16 << 10
PAGE = mmap.PAGESIZE  # LMDB's page size is the OS page size
_PAGE_HEADER = 16
_NODE_HEADER = 8
# A node (header + key + value) larger than this goes to overflow pages (LMDB's me_nodemax).
_NODE_MAX = (((PAGE - _PAGE_HEADER) // 2) & ~1) - 2
_CRC = 4
# Map size: the cap plus a quarter (pages freed by transactions still read, branch pages) plus 64 MiB.
_MAP_HEADROOM = 64 << 20
_MAP_MAX = 1 << 46


# What LMDB raises for an environment whose pages are not what they should be.
DAMAGED_ENV = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.PanicError)


def charge(key: bytes, size: int) -> int:
    """The bytes a record of `size` data bytes is counted for in the size cap (see the module docstring)."""
    node = _NODE_HEADER + len(key) + _CRC + size
    if node <= _NODE_MAX:
        return 2 * (node + 2)
    pages = -(-(_PAGE_HEADER + _CRC + size) // PAGE)
    return pages * PAGE * 3 // 2 + 2 * (_NODE_HEADER + len(key) + 8 + 2)


def crc_of(data: bytes | memoryview) -> bytes:
    return zlib.crc32(data).to_bytes(4, "little")


def as_oserror(e: lmdb.Error, what: str) -> OSError:
    """A full map or disk is ENOSPC (StorageFull upstream); anything else is EIO."""
    if isinstance(e, lmdb.MapFullError | lmdb.DiskError):
        return OSError(errno.ENOSPC, f"{what}: the record store is full ({e})")
    return OSError(errno.EIO, f"{what}: {e}")


class Records:
    """The LMDB environment of one store root. Opened and used in worker threads."""

    def __init__(self, path: str, max_size: int, limit: int) -> None:
        self.path = path
        self.limit = limit
        self.map_size = min(max_size + max_size // 4 + _MAP_HEADROOM, _MAP_MAX)
        self.env: lmdb.Environment | None = None

    def open(self) -> None:
        """Open (or create) the environment; one LMDB reports damaged is dropped and made anew."""
        try:
            self._open()
        except DAMAGED_ENV as e:
            log.error("the record store %s is damaged (%s): starting it empty", self.path, e)
            shutil.rmtree(self.path, ignore_errors=True)
            self._open()

    def _open(self) -> None:
        os.makedirs(self.path, exist_ok=True)
        self.env = lmdb.open(
            self.path,
            map_size=self.map_size,
            sync=False,  # the syncer's syncfs makes commits durable (see the module docstring)
            metasync=False,
            readahead=False,
            max_readers=256,
            lock=True,
        )
        self.env.reader_check()  # slots left by a killed process

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None

    def discard(self) -> None:
        """Drop the environment and everything in it (LMDB reported it damaged)."""
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)
        self._open()

    @property
    def live(self) -> lmdb.Environment:
        env = self.env
        if env is None:
            raise OSError(errno.EIO, "the record store is closed")
        return env

    def txnid(self) -> int:
        """The last committed transaction (a snapshot or sync point names the state it covers)."""
        return int(self.live.info()["last_txnid"])

    def disk_bytes(self) -> int:
        """The bytes the environment's data file takes on disk."""
        try:
            return os.stat(os.path.join(self.path, "data.mdb")).st_blocks * 512
        except FileNotFoundError:
            return 0


PutItem = tuple[bytes, bytes, Digest | None]


def put_many(records: Records, items: list[PutItem], stale_files: list[str] | None = None) -> list[Exception | None]:
    """Verify each CAS item against its digest, then commit every good one in one transaction:
    None or the exception, each. `stale_files`: files of replaced action entries, removed once
    the records are committed."""
    outcomes: list[Exception | None] = [None] * len(items)
    good: list[tuple[bytes, bytes]] = []
    for i, (key, data, digest) in enumerate(items):
        if digest is not None:
            try:
                fileops.check_hash(data, digest)
            except Exception as e:  # that item's outcome
                outcomes[i] = e
                continue
        good.append((key, crc_of(data) + data))
    if good:
        try:
            commit(records, good)
        except lmdb.Error as e:
            error = as_oserror(e, "writing records")
            return [error if outcome is None else outcome for outcome in outcomes]
    for path in stale_files or ():
        fileops.unlink_quiet(path)
    return outcomes


def commit(records: Records, pairs: list[tuple[bytes, bytes]]) -> None:
    """Put (key, value) pairs in one write transaction (lmdb.Error on failure: nothing is written)."""
    with records.live.begin(write=True) as txn:
        for key, value in pairs:
            txn.put(key, value)


def put_one(records: Records, key: bytes, data: bytes, digest: Digest | None, stale_file: str | None) -> None:
    """One small entry (an action entry, a single blob), as `put_many`; raises its error."""
    error = put_many(records, [(key, data, digest)], [stale_file] if stale_file else None)[0]
    if error is not None:
        raise error


def check_record(key: bytes, value: bytes | memoryview) -> bool:
    """Whether a stored value is intact: its CRC, and for CAS the size and hash its key names."""
    if len(value) < _CRC:
        return False
    data = value[_CRC:]
    if zlib.crc32(data) != int.from_bytes(value[:_CRC], "little"):
        return False
    if key[0] == AC_TAG:
        return True
    size = int.from_bytes(key[33:], "big")  # the size a CAS key carries (core.cas_size, which imports this module)
    return len(data) == size and raw_hash(FN_BY_BYTE[key[0]], data) == key[1:33]


def get_many(records: Records, keys: list[bytes]) -> list[tuple[int, bytes | OSError]]:
    """Records in one read transaction, each checked (check_record): (OK, data), (MISSING, b""),
    (DAMAGED, b"") or (FAILED, the OSError)."""
    results: list[tuple[int, bytes | OSError]] = []
    try:
        with records.live.begin(buffers=True) as txn:
            for key in keys:
                value = txn.get(key)
                if value is None:
                    results.append((MISSING, b""))
                elif check_record(key, value):
                    results.append((OK, bytes(value[_CRC:])))
                else:
                    results.append((DAMAGED, b""))
    except lmdb.Error as e:
        error = as_oserror(e, "reading records")
        return [(FAILED, error)] * len(keys)
    except OSError as e:
        return [(FAILED, e)] * len(keys)
    return results


def get_one(records: Records, key: bytes, offset: int = 0, end: int | None = None) -> tuple[int, bytes]:
    """One record, as get_many; bytes [offset, end) of it when OK. Raises the OSError of a failure."""
    status, data = get_many(records, [key])[0]
    if isinstance(data, OSError):
        raise data
    return status, data[offset:end]


def delete_many(records: Records, keys: list[bytes]) -> None:
    """Delete records (evicted, damaged, replaced by a file); failures are only logged (the space
    leaks until the entry is written again)."""
    try:
        with records.live.begin(write=True) as txn:
            for key in keys:
                txn.delete(key)
    except (lmdb.Error, OSError) as e:
        log.warning("could not delete %d records: %s", len(keys), e)


def present(records: Records, keys: list[bytes]) -> list[bool]:
    """Whether each key has a record (a re-check: core.py)."""
    try:
        with records.live.begin(buffers=True) as txn:
            return [txn.get(key) is not None for key in keys]
    except lmdb.Error as e:
        raise as_oserror(e, "looking up records") from e


def sizes_of(recs: Records, paths: list[str], keys: list[bytes], in_records: list[bool]) -> list[int | None]:
    """The size of each file (None: gone) and each record (its key's size, or None: gone), in order
    (the re-check of suspects: core.py)."""
    file_sizes = iter([filereads.stat_size(path) for path in paths])
    found = iter(present(recs, keys) if keys else [])
    key_sizes = iter([int.from_bytes(key[33:], "big") for key in keys])
    out: list[int | None] = []
    for record in in_records:
        if record:
            size = next(key_sizes)
            out.append(size if next(found) else None)
        else:
            out.append(next(file_sizes))
    return out


def sizes_with_prefix(records: Records, prefix: bytes) -> list[int]:
    """Sizes of the CAS records whose key starts with `prefix` (function byte + raw hash): a
    lookup by hash alone (keys are sorted, so one cursor seek)."""
    sizes = []
    try:
        with records.live.begin(buffers=True) as txn:
            cursor = txn.cursor()
            if cursor.set_range(prefix):
                for key in cursor.iternext(keys=True, values=False):
                    if bytes(key[: len(prefix)]) != prefix:
                        break
                    if len(key) == len(prefix) + SIZE_BYTES:
                        sizes.append(int.from_bytes(key[len(prefix) :], "big"))
    except lmdb.Error as e:
        raise as_oserror(e, "looking up records") from e
    return sizes


def namespaces(records: Records) -> list[str]:
    """The namespaces of the action entry records, one cursor seek per namespace."""
    found: list[str] = []
    with records.live.begin(buffers=True) as txn:
        cursor = txn.cursor()
        at = bytes([AC_TAG])
        while cursor.set_range(at):
            key = bytes(cursor.key())
            if key[0] != AC_TAG:
                break
            end = key.index(b"\x00")
            found.append(key[1:end].decode())
            at = key[:end] + b"\x01"  # past every key of this namespace
    return found


def keys_and_sizes(records: Records) -> Iterator[tuple[bytes, int]]:
    """Every record's key and data size, in key order (start-up reconciles the index with them;
    the values' pages are not read)."""
    with records.live.begin() as txn:
        cursor = txn.cursor()
        for key, value in cursor.iternext(keys=True, values=True):
            yield bytes(key), len(value) - _CRC


def verify_all(records: Records, validate: Callable[[bytes, bytes], bool]) -> tuple[int, int]:
    """Check every record (check_record, and `validate(key, data)` for action entries); delete the
    bad ones. Returns (checked, removed). If LMDB reports the environment itself damaged, it is
    dropped whole: (checked, -1)."""
    checked = 0
    bad: list[bytes] = []
    try:
        with records.live.begin(buffers=True) as txn:
            for key_view, value in txn.cursor().iternext(keys=True, values=True):
                key = bytes(key_view)
                checked += 1
                good = check_record(key, value)
                if good and key[0] == AC_TAG:
                    good = validate(key, bytes(value[_CRC:]))
                if not good:
                    bad.append(key)
        if bad:
            log.error("%d records were damaged by an unclean shutdown: deleting them", len(bad))
            with records.live.begin(write=True) as txn:
                for key in bad:
                    txn.delete(key)
    except lmdb.Error as e:
        log.error("the record store %s is damaged (%s): starting it empty", records.path, e)
        records.discard()
        return checked, -1
    return checked, len(bad)


def stat(records: Records) -> dict[str, Any]:
    """LMDB's own figures (pages, entries) for checks and the bench."""
    env = records.live
    return {**env.stat(), **env.info(), "disk_bytes": records.disk_bytes()}
