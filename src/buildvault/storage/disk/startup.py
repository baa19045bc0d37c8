"""Start-up: lock the root, clear leftover temp files, re-verify after a crash, rebuild the index.

The index comes from the snapshot plus the leaf directories that changed since it was taken
(none after a clean close; after a crash, those written since the last checkpoint). The size is
in CAS file names, so those listings rebuild entries without a stat; only files unknown to the
snapshot are stat'ed, to place them by mtime (up to STAT_ORDER_LIMIT of them). A crash thus
costs the recency of recent reads only. Everything here runs in a worker thread.

Records (records.py) at start-up: re-verification after a reboot, the index reconciled with LMDB,
small files moved into records:

- After an unclean stop followed by a reboot (durability.records_need_verifying) every record is
  checked (records.verify_all); a damaged one is deleted, an environment LMDB reports damaged is
  dropped whole.
- The snapshot's record keys are used as they are when it names LMDB's current transaction (a
  clean close, nothing written since); otherwise the keys are walked (no value pages are read):
  records the snapshot does not know are added as the most recent entries, those it knows but
  LMDB lost leave the index.
- A file no larger than the record limit (a store written before records, or with a lower limit)
  is moved into a record, verified first; a record larger than the limit is deleted.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

import lmdb

from buildvault.digest import Digest
from buildvault.storage import StorageError
from buildvault.storage.disk import durability, fileops, layout, records
from buildvault.storage.disk.core import Layout, cas_size, held
from buildvault.storage.disk.layout import AC_TAG, FN_BY_BYTE, dir_id, kind_of, scan_ac_dir, scan_cas_dir
from buildvault.storage.disk.records import Records, charge
from buildvault.storage.disk.snapshot import read_snapshot

log = logging.getLogger("buildvault.storage.disk")

# Files the snapshot does not know are stat'ed to order them by mtime, up to this many: beyond it
# (a lost snapshot of a big store) a cold stat per file would keep the cache down for minutes.
STAT_ORDER_LIMIT = 100_000
MIGRATE_BATCH = 512  # files moved into records per LMDB transaction


@dataclass
class Loaded:
    """The rebuilt index, and what it took (DiskStorage.load_info)."""

    entries: dict[bytes, int]
    ac_sizes: dict[bytes, int]
    used: int
    info: dict[str, Any] = field(default_factory=dict)


def lock_root(where: Layout) -> int:
    """Make the directories and take the root's flock; the fd holds it. StorageError if taken."""
    for directory in (str(where.root), where.cas_dir, where.ac_dir, where.tmp_dir):
        os.makedirs(directory, exist_ok=True)
    fd = os.open(where.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StorageError(f"{where.root} is in use by another buildvault process") from None
    return fd


def clear_temp_files(where: Layout) -> int:
    """Remove what writes in progress left in tmp/; return how many there were."""
    stale = 0
    for entry in os.scandir(where.tmp_dir):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            fileops.unlink_quiet(entry.path)
        stale += 1
    return stale


def rebuild_index(where: Layout, validate: durability.EntryValidator, recs: Records) -> Loaded:
    """Verify what an unclean shutdown may have torn, then rebuild the index (see the module docstring)."""
    started = time.perf_counter()
    stale = clear_temp_files(where)
    dirs = layout.leaf_dirs(where.cas_dir, where.ac_dir, 0)
    marker = durability.read_sync_point(where.sync_path)
    verified = damaged = 0
    if marker is not None and not marker[0]:
        verified, damaged = durability.verify_since(dirs, marker[1] - durability.SYNC_MARGIN_NS, validate)
        if damaged:
            dirs = layout.leaf_dirs(where.cas_dir, where.ac_dir, 0)
    recs.open()
    limit = recs.limit
    records_verified, records_damaged = verify_if_needed(recs, marker, validate)
    interned: dict[int, int] = {}
    index: dict[bytes, int] = {}
    ac_sizes: dict[bytes, int] = {}
    used = snapshot_txnid = 0
    snapshot = read_snapshot(where.snapshot_path)
    if snapshot is not None:
        keys, ticks, ac_pairs, used, recorded, snapshot_txnid = snapshot
        index = dict(zip(keys, map(interned.setdefault, ticks, ticks), strict=True))
        ac_sizes = dict(ac_pairs)
        del keys, ticks, ac_pairs, snapshot
        trusted = {d for d, (_path, mtime) in dirs.items() if mtime != -1 and recorded.get(d) == mtime}
        fast = len(trusted) == len(dirs) and recorded.keys() <= dirs.keys()
    else:
        trusted, fast = set(), False
    from_snapshot = len(index)
    extras: list[tuple[bytes, int, str]] = []  # (key, size, path): on disk, not in the snapshot
    strays = stat_calls = 0
    scanned = [d for d in dirs if d not in trusted]
    if not fast:
        # Entries of untrusted directories stay in place (keeping their LRU position) only if found.
        suspects = {
            key
            for key in index
            if dir_id(key) not in trusted and not held(limit, key, ac_sizes[key] if key[0] == AC_TAG else cas_size(key))
        }
        for leaf in scanned:
            path = dirs[leaf][0]
            if leaf[0] == AC_TAG:
                found, bad = scan_ac_dir(path, leaf[:-1])
            else:
                found, bad = scan_cas_dir(path, leaf[:1], leaf[1:].hex())
            strays += bad
            for key, size, name in found:
                if key in suspects:
                    suspects.discard(key)
                    if key[0] == AC_TAG:
                        used += size - ac_sizes[key]
                        ac_sizes[key] = size
                elif key not in index:
                    extras.append((key, size, path + "/" + name))
        for key in suspects:  # in the snapshot, gone from disk
            del index[key]
            used -= ac_sizes.pop(key) if key[0] == AC_TAG else cas_size(key)
        small = [extra for extra in extras if held(limit, extra[0], extra[1])]
        if small:  # files a record would hold now: moved into records
            extras = [extra for extra in extras if not held(limit, extra[0], extra[1])]
            for key, size in migrate(recs, small):
                index[key] = int(time.time())
                used += charge(key, size)
                if key[0] == AC_TAG:
                    ac_sizes[key] = size
            snapshot_txnid = 0  # records changed: compare the keys below
        from_snapshot = len(index)
        if len(extras) <= STAT_ORDER_LIMIT:
            stat_calls = len(extras)
            timed = sorted((os.stat(file).st_mtime_ns, key, size) for key, size, file in extras)
        else:
            log.warning(
                "%s: no usable LRU snapshot for %d files; they start in directory order", where.root, len(extras)
            )
            now_ns = time.time_ns()
            timed = [(now_ns, key, size) for key, size, _file in extras]
        for mtime_ns, key, size in timed:
            tick = mtime_ns // 1_000_000_000
            index[key] = interned.setdefault(tick, tick)
            used += size
            if key[0] == AC_TAG:
                ac_sizes[key] = size
    used, records_walked = reconcile(recs, index, ac_sizes, used, snapshot_txnid, limit)
    if strays:
        log.warning("%s: ignored %d files that are not store entries", where.root, strays)
    info = {
        "seconds": time.perf_counter() - started,
        "entries": len(index),
        "from_snapshot": from_snapshot,
        "dirs": len(dirs),
        "scanned_dirs": 0 if fast else len(scanned),
        "stat_calls": stat_calls,
        "stale_temp_files": stale,
        "stray_files": strays,
        "clean_shutdown": marker is None or marker[0],
        "verified": verified,
        "damaged": damaged,
        "records_walked": records_walked,
        "records_verified": records_verified,
        "records_damaged": records_damaged,
    }
    return Loaded(index, ac_sizes, used, info)


def verify_if_needed(
    recs: Records, point: tuple[bool, int, int, bytes] | None, validate: durability.EntryValidator
) -> tuple[int, int]:
    """Re-verify every record if the last stop may have torn some; (checked, removed: -1 if the
    environment was dropped)."""
    if not durability.records_need_verifying(point, recs.txnid()):
        return 0, 0
    return records.verify_all(recs, lambda key, data: validate(kind_of(key), data))


def reconcile(
    recs: Records,
    index: dict[bytes, int],
    ac_sizes: dict[bytes, int],
    used: int,
    snapshot_txnid: int,
    limit: int,
) -> tuple[int, int]:
    """Bring the index's record keys in line with LMDB (see the module docstring); returns (used, records walked)."""
    if snapshot_txnid and snapshot_txnid == recs.txnid():
        return used, 0

    def size_of(key: bytes) -> int:
        return ac_sizes[key] if key[0] == AC_TAG else cas_size(key)

    expected = {key for key in index if held(limit, key, size_of(key))}
    tick = int(time.time())
    walked = 0
    stale: list[bytes] = []
    try:
        for key, size in records.keys_and_sizes(recs):
            walked += 1
            if not held(limit, key, size):
                stale.append(key)
                continue
            if key in expected:
                expected.discard(key)
                if key[0] == AC_TAG and ac_sizes[key] != size:  # replaced after the snapshot
                    used += charge(key, size) - charge(key, ac_sizes[key])
                    ac_sizes[key] = size
                continue
            if key in index:  # the snapshot has it as a file of another size: the record is newer
                used -= index_cost(limit, key, size_of(key))
                del index[key]
            index[key] = tick
            if key[0] == AC_TAG:
                ac_sizes[key] = size
            used += charge(key, size)
    except records.DAMAGED_ENV as e:
        log.error("the record store %s is damaged (%s): starting it empty", recs.path, e)
        recs.discard()
        for key in [key for key in index if held(limit, key, size_of(key))]:
            used -= charge(key, size_of(key))
            del index[key]
            ac_sizes.pop(key, None)
        return used, walked
    for key in expected:  # in the snapshot, not in LMDB
        used -= charge(key, size_of(key))
        del index[key]
        ac_sizes.pop(key, None)
    if stale:
        log.warning("%s: deleting %d records over the record limit", recs.path, len(stale))
        records.delete_many(recs, stale)
    return used, walked


def index_cost(limit: int, key: bytes, size: int) -> int:
    return charge(key, size) if held(limit, key, size) else size


def migrate(recs: Records, files: list[tuple[bytes, int, str]]) -> list[tuple[bytes, int]]:
    """Move small files (key, size, path) into records, each verified; return the (key, size) moved.
    A damaged file is deleted; one that cannot be read is left as it is (and not indexed)."""
    moved: list[tuple[bytes, int]] = []
    for start in range(0, len(files), MIGRATE_BATCH):
        batch: list[records.PutItem] = []
        paths: list[str] = []
        for key, _size, path in files[start : start + MIGRATE_BATCH]:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as e:
                log.warning("cannot read %s (%s): left out", path, e)
                continue
            digest = None
            if key[0] != AC_TAG:
                digest = Digest(key[1:33].hex(), cas_size(key), FN_BY_BYTE[key[0]])
                if Digest.of(data, digest.function) != digest:
                    log.error("%s is damaged: deleting it", path)
                    fileops.unlink_quiet(path)
                    continue
            batch.append((key, data, digest))
            paths.append(path)
        try:
            outcomes = records.put_many(recs, batch)
        except lmdb.Error as e:
            log.warning("cannot move files into records (%s): left out", e)
            continue
        for (key, data, _digest), path, error in zip(batch, paths, outcomes, strict=True):
            if error is None:
                moved.append((key, len(data)))
                fileops.unlink_quiet(path)
    if files:
        log.info("%s: moved %d small files into records", recs.path, len(moved))
    return moved
