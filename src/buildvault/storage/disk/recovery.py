"""Records at start-up: re-verification after a reboot, the index reconciled with LMDB, small
files moved into records. Runs in a worker thread, inside startup.rebuild_index.

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

import logging
import time

import lmdb

from buildvault.digest import Digest
from buildvault.storage.disk import durability, fileops, records
from buildvault.storage.disk.layout import AC_TAG, FN_BY_BYTE, cas_size, kind_of
from buildvault.storage.disk.records import Records, charge, held

log = logging.getLogger("buildvault.storage.disk")

MIGRATE_BATCH = 512  # files moved into records per LMDB transaction


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
        for key, size, path in files[start : start + MIGRATE_BATCH]:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as e:
                log.warning("cannot read %s (%s): left out", path, e)
                continue
            digest = None
            if key[0] != AC_TAG:
                digest = Digest(key[1:33].hex(), cas_size(key), FN_BY_BYTE[key[0]])
                if len(data) != size or not fileops.content_matches(data, digest):
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
