"""Disk-store restarts: the index snapshot, start-up scans, sync points and crash re-verification."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from disk_helpers import (
    assert_consistent,
    blob_path,
    chunked,
    either_layout,
    file_clock_passes,
    files_only,
    fill,
    fill_one,
    read_all,
    wait_until,
)

from buildvault.actions import entry_is_intact
from buildvault.digest import Digest, DigestFunction
from buildvault.remote_apis import re_pb2
from buildvault.storage import NotFound, StorageError, ac_namespace
from buildvault.storage.disk import DiskStorage, durability, layout, startup

# Tests that work on files directly (remove, damage, count them) run with the file layout
# (files_only); the others with both layouts (either_layout). test_disk_records.py covers records.
__all__ = ["either_layout", "files_only"]  # fixtures


def sync_marker(root: Path) -> tuple[bool, int] | None:
    return durability.read_sync_marker(str(root / "SYNC"))


# -- sync points and crash re-verification ---------------------------------------------------


@pytest.mark.usefixtures("either_layout")
async def test_writes_are_not_fsynced_one_by_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Durability comes from sync points, not from an fsync per entry."""
    storage = await DiskStorage.open(tmp_path, 1 << 30)
    events: list[str] = []
    fsync, syncfs = os.fsync, durability.syncfs

    def logged_fsync(fd: int) -> None:
        events.append("fsync")
        fsync(fd)

    def logged_syncfs(fd: int) -> None:
        events.append("syncfs")
        syncfs(fd)

    monkeypatch.setattr(os, "fsync", logged_fsync)
    monkeypatch.setattr(durability, "syncfs", logged_syncfs)
    await storage.cas.write(Digest.of(b"durable"), chunked(b"durable"))
    big = os.urandom(2 << 20)
    await storage.cas.write(Digest.of(big), chunked(big))
    await storage.ac.put("ac", Digest.of(b"durable"), b"result")
    assert events == []
    before = time.time_ns()
    await storage.sync()
    assert events[0] == "syncfs"  # then the SYNC file itself is fsync'ed
    marker = sync_marker(tmp_path)
    assert marker is not None
    clean, point = marker
    assert not clean and before <= point <= time.time_ns()
    assert storage.synced_at == point
    await storage.close()


@pytest.mark.usefixtures("either_layout")
async def test_the_syncer_runs_only_after_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    syncfs = durability.syncfs

    def logged_syncfs(fd: int) -> None:
        calls.append(fd)
        syncfs(fd)

    monkeypatch.setattr(durability, "syncfs", logged_syncfs)
    storage = await DiskStorage.open(tmp_path, 1 << 20, sync_interval=0.02)
    calls.clear()  # open() makes one sync point
    rounds = storage.sync_rounds
    await wait_until(lambda: storage.sync_rounds >= rounds + 5, 10, "five rounds of the syncer")
    assert calls == []
    await fill_one(storage, b"changed")
    await wait_until(lambda: calls, 10, "a sync after the change")
    rounds = storage.sync_rounds
    await wait_until(lambda: storage.sync_rounds >= rounds + 3, 10, "three more rounds of the syncer")
    assert len(calls) == 1
    await storage.close()
    marker = sync_marker(tmp_path)
    assert marker is not None and marker[0]  # closed cleanly


@pytest.mark.usefixtures("files_only")
async def test_unclean_restart_deletes_entries_torn_since_the_sync_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A power loss can leave files written after the last sync point torn or zero-filled:
    after an unclean shutdown they are verified and the bad ones removed, never served."""
    monkeypatch.setattr(durability, "SYNC_MARGIN_NS", 0)
    storage = await DiskStorage.open(tmp_path, 1 << 20, sync_interval=None)
    old = await fill_one(storage, b"synced before the crash")
    await file_clock_passes(tmp_path, blob_path(tmp_path, old).stat().st_ctime_ns)
    await storage.sync()
    assert storage.synced_at is not None
    await file_clock_passes(tmp_path, storage.synced_at)  # what follows is changed after the sync point
    torn, zeroed, fine = [await fill_one(storage, bytes([n]) * 5000) for n in (1, 2, 3)]
    action = Digest.of(b"action")
    await storage.ac.put("ac", action, re_pb2.ActionResult(exit_code=1).SerializeToString())
    await storage.ac.put("raw", action, b"opaque ccache entry")
    storage.abandon()
    with open(blob_path(tmp_path, torn), "r+b") as f:
        f.truncate(100)
        f.truncate(torn.size_bytes)  # same size, zeros past 100: only the hash can tell
    blob_path(tmp_path, zeroed).write_bytes(bytes(zeroed.size_bytes))
    ac_file = tmp_path / "ac" / "ac" / "@sha256" / action.hash[:2] / action.hash
    ac_file.write_bytes(bytes(7))

    storage = await DiskStorage.open(tmp_path, 1 << 20, sync_interval=None, validate_entry=entry_is_intact)
    assert storage.load_info["clean_shutdown"] is False
    assert storage.load_info["verified"] == 5  # the entries written after the sync point
    assert storage.load_info["damaged"] == 3
    assert await storage.cas.find_missing([old, torn, zeroed, fine]) == [torn, zeroed]
    assert not blob_path(tmp_path, torn).exists() and not ac_file.exists()
    with pytest.raises(NotFound):
        await read_all(storage, torn)
    with pytest.raises(NotFound):
        await storage.ac.get("ac", action)
    assert await storage.ac.get("raw", action) == b"opaque ccache entry"
    assert await read_all(storage, fine) == bytes([3]) * 5000
    assert_consistent(storage)
    await storage.close()


@pytest.mark.parametrize(
    ("validator", "kept"),
    [(None, ["ac/ci", "raw/ci"]), (entry_is_intact, ["raw/ci"])],
    ids=["opaque-rule-only", "actions.entry_is_intact"],
)
@pytest.mark.usefixtures("files_only")
async def test_action_entries_are_checked_by_the_validator_handed_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, validator: durability.EntryValidator | None, kept: list[str]
) -> None:
    """Entries changed since the sync point: the validator gets (kind, bytes); without one, only
    "not empty, not zero-filled" is checked, for every kind."""
    monkeypatch.setattr(durability, "SYNC_MARGIN_NS", 0)
    storage = await DiskStorage.open(tmp_path, 1 << 20, sync_interval=None)
    seen: list[tuple[str, bytes]] = []
    action = Digest.of(b"action")
    not_a_result = b"\xff\xff\xff not a protobuf"
    await file_clock_passes(tmp_path, storage.synced_at or 0)
    for namespace in ("ac/ci", "raw/ci"):
        await storage.ac.put(namespace, action, not_a_result)
    storage.abandon()

    def recording(kind: str, data: bytes) -> bool:
        seen.append((kind, data))
        assert validator is not None
        return validator(kind, data)

    storage = await DiskStorage.open(
        tmp_path, 1 << 20, sync_interval=None, validate_entry=recording if validator is not None else None
    )
    assert sorted(seen) == ([("ac", not_a_result), ("raw", not_a_result)] if validator is not None else [])
    assert storage.load_info["damaged"] == 2 - len(kept)
    present = []
    for namespace in ("ac/ci", "raw/ci"):
        try:
            assert await storage.ac.get(namespace, action) == not_a_result
            present.append(namespace)
        except NotFound:
            pass
    assert present == kept
    await storage.close()


@pytest.mark.usefixtures("either_layout")
def test_entry_is_intact_keeps_the_rules_of_each_kind() -> None:
    result = re_pb2.ActionResult(exit_code=3).SerializeToString()
    assert entry_is_intact("ac", result)
    assert not entry_is_intact("ac", b"\xff\xff garbage")
    assert not entry_is_intact("ac", b"") and not entry_is_intact("raw", b"")
    assert not entry_is_intact("raw", bytes(40)) and not entry_is_intact("ac", bytes(40))
    assert entry_is_intact("raw", b"\xff\xff garbage")  # opaque: not parsed


@pytest.mark.usefixtures("either_layout")
def test_the_disk_store_parses_no_reapi_message() -> None:
    """The ActionResult check is handed in (actions.entry_is_intact); the store itself loads no protobuf."""
    code = (
        "import sys, buildvault.storage.disk\n"
        "print(sorted(m for m in sys.modules if m.startswith(('buildvault.remote_apis', 'google.protobuf'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


@pytest.mark.usefixtures("either_layout")
async def test_clean_restart_verifies_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(durability, "SYNC_MARGIN_NS", 0)
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    digest = await fill_one(storage, b"x" * 3000)
    await storage.close()
    await file_clock_passes(tmp_path, blob_path(tmp_path, digest).parent.stat().st_mtime_ns)
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    assert storage.load_info["clean_shutdown"] is True
    assert storage.load_info["verified"] == 0
    assert await storage.cas.find_missing([digest]) == []
    storage.abandon()
    storage = await DiskStorage.open(tmp_path, 1 << 20)  # unclean, but nothing changed since open's sync point
    assert storage.load_info["clean_shutdown"] is False
    assert storage.load_info["verified"] == 0
    await storage.close()


# -- restart -------------------------------------------------------------------------------


@pytest.mark.usefixtures("either_layout")
async def test_stale_temp_files_are_removed_at_start_up(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    await storage.close()
    (tmp_path / "tmp" / "deadbeef.tmp").write_bytes(b"half a blob")
    (tmp_path / "tmp" / "other").write_bytes(b"x")
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    assert os.listdir(tmp_path / "tmp") == []
    assert storage.load_info["stale_temp_files"] == 2
    assert storage.stats().used_bytes == 0
    await storage.close()


@pytest.mark.usefixtures("either_layout")
async def test_index_survives_restart(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1 << 30)
    digests = await fill(storage, 20, 1000)
    blake = Digest.of(b"blake", DigestFunction.BLAKE3)
    await storage.cas.write(blake, chunked(b"blake"))
    await storage.ac.put(ac_namespace("ci"), digests[0], b"action result")
    before = storage.stats()
    await storage.close()

    storage = await DiskStorage.open(tmp_path, 1 << 30)
    after = storage.stats()
    assert (after.used_bytes, after.blob_count, after.ac_entries) == (before.used_bytes, 21, 1)
    assert storage.load_info["stat_calls"] == 0  # the snapshot gave the order: no stat per blob
    assert storage.load_info["scanned_dirs"] == 0  # and no directory changed: none was listed
    assert await storage.cas.find_missing([*digests, blake]) == []
    assert await read_all(storage, digests[7]) == (7).to_bytes(4, "big") * 250
    assert await storage.ac.get(ac_namespace("ci"), digests[0]) == b"action result"
    assert_consistent(storage)
    await storage.close()


@pytest.mark.usefixtures("files_only")
async def test_lru_order_survives_restart(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1000, hold_seconds=0)
    digests = await fill(storage, 10, 100)
    await read_all(storage, digests[0])  # 0 is now the most recently used
    await storage.close()
    storage = await DiskStorage.open(tmp_path, 1000, hold_seconds=0)
    await fill_one(storage, b"x" * 100)
    assert await storage.cas.find_missing(digests) == [digests[1]]
    await storage.close()


@pytest.mark.usefixtures("files_only")
async def test_after_a_crash_the_order_comes_from_mtimes(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 300)
    a, b, c = [await fill_one(storage, bytes([n]) * 100) for n in range(3)]
    storage.abandon()
    assert not (tmp_path / "index.lru").exists()
    now = time.time()
    for digest, age in ((a, 100), (b, 300), (c, 200)):
        os.utime(blob_path(tmp_path, digest), (now - age, now - age))
    storage = await DiskStorage.open(tmp_path, 300)
    assert storage.load_info["stat_calls"] == 3
    await fill_one(storage, b"new" * 33 + b"!")
    assert await storage.cas.find_missing([a, b, c]) == [b]  # the oldest mtime went first
    assert_consistent(storage)
    await storage.close()


@pytest.mark.usefixtures("files_only")
async def test_stale_snapshot_is_merged_with_the_disk(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    a = await fill_one(storage, b"a" * 10)
    b = await fill_one(storage, b"b" * 10)
    await storage.checkpoint()
    c = await fill_one(storage, b"c" * 10)  # after the snapshot
    storage.abandon()
    blob_path(tmp_path, b).unlink()  # in the snapshot, gone from disk
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    assert storage.load_info["from_snapshot"] == 1
    assert storage.load_info["stat_calls"] == 1
    assert await storage.cas.find_missing([a, b, c]) == [b]
    assert storage.entry_paths() == [str(blob_path(tmp_path, a)), str(blob_path(tmp_path, c))]
    assert_consistent(storage)
    await storage.close()


@pytest.mark.usefixtures("files_only")
async def test_changes_made_while_stopped_are_found(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    kept, removed = await fill(storage, 2, 64)
    await storage.ac.put("ac", kept, b"entry")
    await storage.close()
    await file_clock_passes(tmp_path, (tmp_path / "SYNC").stat().st_mtime_ns)  # close's last change
    blob_path(tmp_path, removed).unlink()
    added_data = b"copied in by hand"
    added = Digest.of(added_data)
    blob_path(tmp_path, added).write_bytes(added_data)
    (blob_path(tmp_path, kept).parent / "notes.txt").write_text("stray")
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    assert 1 <= storage.load_info["scanned_dirs"] <= 3  # only the directories that changed
    assert storage.load_info["stray_files"] == 1
    assert await storage.cas.find_missing([kept, removed, added]) == [removed]
    assert await read_all(storage, added) == added_data
    assert await storage.ac.get("ac", kept) == b"entry"
    assert storage.stats().used_bytes == 64 + len(added_data) + 5
    await storage.close()


@pytest.mark.usefixtures("files_only")
async def test_checkpoint_then_crash_rescans_only_changed_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layout, "RACY_NS", 0)
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    before = await fill(storage, 30, 64)
    await storage.checkpoint()
    await file_clock_passes(tmp_path, (tmp_path / "index.lru").stat().st_mtime_ns)
    after = await fill_one(storage, b"written after the checkpoint")
    storage.abandon()
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    assert storage.load_info["scanned_dirs"] == 1
    assert storage.load_info["stat_calls"] == 1
    assert await storage.cas.find_missing([*before, after]) == []
    assert_consistent(storage)
    await storage.close()


@pytest.mark.usefixtures("either_layout")
async def test_recently_changed_dirs_are_not_trusted(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    digests = await fill(storage, 3, 64)
    await storage.checkpoint()  # taken within RACY_NS of the writes
    storage.abandon()
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    assert storage.load_info["scanned_dirs"] >= 1
    assert await storage.cas.find_missing(digests) == []
    await storage.close()


@pytest.mark.usefixtures("files_only")
async def test_changes_during_a_checkpoint_mark_their_dirs_untrusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keys are copied first, the directory times read later: whatever changed in between
    (here a write and the eviction it causes) must not be trusted at the next start."""
    monkeypatch.setattr(layout, "RACY_NS", 0)
    storage = await DiskStorage.open(tmp_path, 300, hold_seconds=0)
    a, b, c = [await fill_one(storage, bytes([n]) * 100) for n in range(3)]
    await file_clock_passes(tmp_path, max(blob_path(tmp_path, d).parent.stat().st_mtime_ns for d in (a, b, c)))
    entered, proceed = threading.Event(), threading.Event()
    leaf_dirs = layout.leaf_dirs

    def paused(cas_dir: str, ac_dir: str, racy_ns: int) -> layout.LeafDirs:
        entered.set()
        proceed.wait(10)
        return leaf_dirs(cas_dir, ac_dir, racy_ns)

    monkeypatch.setattr(layout, "leaf_dirs", paused)
    checkpoint = asyncio.create_task(storage.checkpoint())
    await wait_until(entered.is_set, 10, "the checkpoint to read the directory times")
    d = await fill_one(storage, b"d" * 100)  # evicts a
    assert not blob_path(tmp_path, a).exists()
    proceed.set()
    await checkpoint
    monkeypatch.setattr(layout, "leaf_dirs", leaf_dirs)
    storage.abandon()
    storage = await DiskStorage.open(tmp_path, 300, hold_seconds=0)
    assert await storage.cas.find_missing([a, b, c, d]) == [a]
    assert_consistent(storage)
    await storage.close()


@pytest.mark.usefixtures("either_layout")
async def test_without_a_snapshot_a_big_store_skips_the_stats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(startup, "STAT_ORDER_LIMIT", 3)
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    digests = await fill(storage, 4, 64)
    storage.abandon()
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    assert storage.load_info["stat_calls"] == 0
    assert await storage.cas.find_missing(digests) == []
    assert_consistent(storage)
    await storage.close()


@pytest.mark.usefixtures("files_only")
@pytest.mark.parametrize("garbage", [b"", b"BVLRU\x00\x00\x01" + b"\xff" * 40, os.urandom(100)])
async def test_corrupt_snapshot_falls_back_to_mtimes(tmp_path: Path, garbage: bytes) -> None:
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    digests = await fill(storage, 5, 64)
    await storage.close()
    (tmp_path / "index.lru").write_bytes(garbage)
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    assert storage.load_info["stat_calls"] == 5
    assert await storage.cas.find_missing(digests) == []
    assert_consistent(storage)
    await storage.close()


@pytest.mark.usefixtures("either_layout")
async def test_truncated_snapshot_is_ignored(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    digests = await fill(storage, 5, 64)
    await storage.close()
    snapshot = tmp_path / "index.lru"
    snapshot.write_bytes(snapshot.read_bytes()[:-3])
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    assert storage.load_info["from_snapshot"] == 0
    assert await storage.cas.find_missing(digests) == []
    await storage.close()


@pytest.mark.usefixtures("files_only")
async def test_lowering_max_size_evicts_at_open(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1000)
    digests = await fill(storage, 10, 100)
    await storage.close()
    storage = await DiskStorage.open(tmp_path, 500)
    assert storage.stats().used_bytes <= 500
    assert await storage.cas.find_missing(digests) == digests[:5]
    assert_consistent(storage)
    await storage.close()


@pytest.mark.usefixtures("either_layout")
async def test_a_root_is_used_by_one_store_at_a_time(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    with pytest.raises(StorageError, match="in use"):
        await DiskStorage.open(tmp_path, 1 << 20)
    await storage.close()
    again = await DiskStorage.open(tmp_path, 1 << 20)  # released by close()
    await again.close()


@pytest.mark.usefixtures("either_layout")
async def test_reopen_after_close(tmp_path: Path) -> None:
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    await storage.close()
    storage = await DiskStorage.open(tmp_path, 1 << 20)
    await storage.close()
    with pytest.raises(StorageError):
        await storage.cas.write(Digest.of(b"x"), chunked(b"x"))
