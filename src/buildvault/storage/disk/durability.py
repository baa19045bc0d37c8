"""Durability by sync points instead of an fsync per write, and crash re-verification.

A write is acknowledged once its verified temp file is renamed into place: no fsync per entry
(1-3 ms each on common disks). A killed process loses nothing (the page cache has it); an OS
crash or power loss may lose or tear what was written since the last sync point. The `Syncer`
(its own thread, never the store's pool) calls syncfs every sync interval when anything changed,
then records in SYNC the time at which that sync started: every file changed before it is on
disk. SYNC also says whether the store was closed cleanly. Start-up after an unclean shutdown
runs `verify_since`: every entry changed (ctime) since the last sync point, minus SYNC_MARGIN_NS,
is checked, and the wrong ones are deleted, so a torn or zero-filled file is never served.

Blobs are checked by size and hash. Action entries are checked by the validator the store was
opened with, called with the entry's kind ("ac", "raw": the namespace's first segment) and its
bytes; without one, `opaque_entry_is_intact` (not empty, not zero-filled) applies to every kind.

Records (records.py) are covered by the same syncfs. SYNC also holds LMDB's last transaction id
at the sync point (for diagnosis) and the boot id of the system that wrote it. A killed process
cannot tear a committed LMDB transaction, so after an unclean stop on the same boot the records
need no check; after an unclean stop followed by a reboot (an OS crash or power loss), or with a
SYNC that has no boot id, every record is re-verified (`records_need_verifying`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import os
import time
import zlib
from collections.abc import Callable
from typing import Any

from buildvault.digest import Digest, file_matches
from buildvault.storage import StorageError
from buildvault.storage.disk import fileops
from buildvault.storage.disk.core import Index, Layout, cas_size
from buildvault.storage.disk.layout import FN_BY_BYTE, LeafDirs, is_ac, key_of_name, kind_of
from buildvault.storage.disk.records import Records

log = logging.getLogger("buildvault.storage.disk")

EntryValidator = Callable[[str, bytes], bool]  # (kind, bytes) -> is it intact?

SYNC_INTERVAL = 1.0
# File times come from a coarse kernel clock that may lag the wall clock a little: after an
# unclean shutdown, files changed up to this long before the last sync point are verified too.
SYNC_MARGIN_NS = 2_000_000_000
SYNC_MAGIC_V1 = b"BVSYNC\x00\x01"  # clean, sync point
SYNC_MAGIC = b"BVSYNC\x00\x02"  # clean, sync point, LMDB transaction id, boot id
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def boot_id() -> bytes:
    """16 bytes naming this boot of the system (b"" where unknown): a change means the OS restarted."""
    try:
        with open(_BOOT_ID, encoding="ascii") as f:
            return bytes.fromhex(f.read().strip().replace("-", ""))[:16].ljust(16, b"\x00")
    except (OSError, ValueError):
        return b""


_libc: Any = None


def syncfs(fd: int) -> None:
    """Flush every dirty page and inode of the filesystem holding `fd` (os.sync where syncfs is missing)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.syncfs.argtypes = [ctypes.c_int]
        except (OSError, AttributeError):
            _libc = False
    if _libc is False:
        os.sync()
        return
    if _libc.syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"syncfs: {os.strerror(err)}")


def opaque_entry_is_intact(kind: str, data: bytes) -> bool:
    """The check every action entry gets when no validator is given: not empty, not zero-filled."""
    return bool(data) and bool(data.strip(b"\x00"))


def write_sync_marker(layout: Layout, started_ns: int, clean: bool, records_txnid: int = 0) -> None:
    """syncfs, then durably record `started_ns` (whether this is a clean close, the LMDB
    transaction that sync covers, this boot's id) in SYNC."""
    fd = os.open(layout.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        syncfs(fd)
    finally:
        os.close(fd)
    body = SYNC_MAGIC + bytes([clean]) + started_ns.to_bytes(8, "little") + records_txnid.to_bytes(8, "little")
    body += boot_id().ljust(16, b"\x00")
    fileops.replace_durably(layout.tmp_dir, layout.sync_path, [body, zlib.crc32(body).to_bytes(4, "little")])


def read_sync_point(path: str) -> tuple[bool, int, int, bytes] | None:
    """(clean, sync point in ns, LMDB transaction id, boot id) from the SYNC file at `path`; None
    if there is none (a new store, or one made before sync points existed, when every write was
    fsync'ed); (False, 0, 0, b"") if damaged. A SYNC of the first format has no id (0, b"")."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    body = data[:-4]
    n = len(SYNC_MAGIC)
    if len(data) == n + 13 and data.startswith(SYNC_MAGIC_V1):
        intact, txnid, boot = True, 0, b""
    elif len(data) == n + 37 and data.startswith(SYNC_MAGIC):
        intact, txnid, boot = True, int.from_bytes(body[n + 9 : n + 17], "little"), body[n + 17 :]
    else:
        intact, txnid, boot = False, 0, b""
    if not intact or zlib.crc32(body) != int.from_bytes(data[-4:], "little"):
        log.warning("%s is damaged: verifying every entry", path)
        return False, 0, 0, b""
    return bool(body[n]), int.from_bytes(body[n + 1 : n + 9], "little"), txnid, boot


def read_sync_marker(path: str) -> tuple[bool, int] | None:
    """(clean, sync point in ns) from the SYNC file at `path` (see read_sync_point)."""
    point = read_sync_point(path)
    return None if point is None else (point[0], point[1])


def records_need_verifying(point: tuple[bool, int, int, bytes] | None, txnid: int) -> bool:
    """After an unclean stop: whether the records may be torn (see the module docstring). `txnid`:
    LMDB's last transaction now."""
    if point is None or point[0] or txnid == 0:
        return False  # a new store, a clean close, or no records at all
    _clean, _at, _synced_txnid, boot = point
    # A reboot: pages of transactions after the sync point may be on disk in part, whatever
    # transaction id the meta pages now name (LMDB reuses freed pages). No boot id: assume one.
    return not boot or boot != boot_id()


def verify_entry(path: str, key: bytes, validate: EntryValidator) -> bool:
    """Is this file what its name says? CAS: size and hash; AC: what `validate` says of its bytes."""
    if is_ac(key):
        with open(path, "rb") as f:
            return validate(kind_of(key), f.read())
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return file_matches(fd, Digest(key[1:33].hex(), cas_size(key), FN_BY_BYTE[key[0]]))
    finally:
        os.close(fd)


def verify_since(dirs: LeafDirs, since_ns: int, validate: EntryValidator) -> tuple[int, int]:
    """Verify the entries changed at or after `since_ns` in directories changed since then;
    delete the bad ones. Returns (entries verified, entries deleted). Runs in a worker thread."""
    checked = removed = 0
    for leaf, (path, mtime) in dirs.items():
        if 0 <= mtime < since_ns:
            continue  # no entry was created, replaced or removed in it since
        try:
            entries = list(os.scandir(path))
        except FileNotFoundError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_ctime_ns < since_ns:
                    continue
            except FileNotFoundError:
                continue
            key = key_of_name(leaf, entry.name)
            if key is None:
                continue
            checked += 1
            try:
                good = verify_entry(entry.path, key, validate)
            except OSError as e:
                log.warning("cannot verify %s (%s): deleting it", entry.path, e)
                good = False
            if not good:
                log.error("%s was damaged by an unclean shutdown: deleting it", entry.path)
                fileops.unlink_quiet(entry.path)
                removed += 1
    return checked, removed


class Syncer:
    """Sync points for one store: syncfs and the SYNC record, in a thread of their own (syncfs can
    take seconds under heavy writes). The periodic loop syncs only when the index says something
    was published since the last sync point (`Index.unsynced`)."""

    def __init__(self, layout: Layout, index: Index, records: Records | None = None) -> None:
        self._layout = layout
        self._index = index
        self._records = records
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="buildvault-sync")
        self._task: asyncio.Task[None] | None = None
        self.synced_at: int | None = None  # the last sync point recorded (wall clock ns)
        self.rounds = 0  # wakeups of the periodic loop so far

    def mark(self, started_ns: int, clean: bool) -> None:
        """Thread side: sync and record `started_ns` as the sync point."""
        txnid = self._records.txnid() if self._records is not None and self._records.env is not None else 0
        write_sync_marker(self._layout, started_ns, clean, txnid)
        self.synced_at = started_ns

    def start(self, interval: float) -> None:
        self._task = asyncio.create_task(self._loop(interval))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def abandon(self) -> None:
        """Stop the loop and the thread without a last sync (a killed process)."""
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=True)

    async def sync(self) -> None:
        """Make every write acknowledged so far durable and record the sync point; StorageError on failure."""
        self._index.unsynced = False
        started = time.time_ns()
        try:
            await asyncio.shield(asyncio.wrap_future(self._executor.submit(self.mark, started, False)))
        except OSError as e:
            self._index.unsynced = True
            raise fileops.storage_error(e, "syncing the disk store") from e

    async def mark_clean(self) -> None:
        """The last sync point of a clean close (OSError if it cannot be recorded)."""
        await asyncio.wrap_future(self._executor.submit(self.mark, time.time_ns(), True))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)

    def shutdown_now(self) -> None:
        self._executor.shutdown(wait=False)

    async def _loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.rounds += 1
            if self._index.unsynced:
                try:
                    await self.sync()
                except StorageError as e:
                    log.warning("could not sync the disk store: %s", e)
