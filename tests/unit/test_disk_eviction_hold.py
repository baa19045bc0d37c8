"""Eviction while serving: an ActionResult served keeps its outputs while other blobs are
evicted, and entries used within index.HOLD_SECONDS are not evicted for a write at all (the
write is refused instead), so a client told "hit" or "present" can still fetch the blob."""

from __future__ import annotations

from pathlib import Path

import pytest
from disk_helpers import assert_consistent, chunked, either_layout, entry_cost, read_all

from buildvault.actions import ActionCache
from buildvault.digest import Digest
from buildvault.remote_apis import re_pb2
from buildvault.storage import StorageFull
from buildvault.storage.disk import DiskStorage
from buildvault.storage.disk.core import HOLD_SECONDS

pytestmark = pytest.mark.usefixtures("either_layout")
__all__ = ["either_layout"]  # the fixture: every test runs with files and with records

KiB = 1 << 10
BLOB = 100 * KiB


def blob(n: int) -> tuple[Digest, bytes]:
    data = n.to_bytes(4, "big") * (BLOB // 4)
    return Digest.of(data), data


async def put(storage: DiskStorage, n: int) -> Digest:
    digest, data = blob(n)
    await storage.cas.write(digest, chunked(data))
    return digest


async def test_a_served_action_result_keeps_its_outputs_while_others_are_evicted(tmp_path: Path) -> None:
    clock = [1_000_000.0]
    storage = await DiskStorage.open(tmp_path, 10 * entry_cost(BLOB), clock=lambda: clock[0], sync_interval=None)
    cache = ActionCache(storage.cas, storage.ac)
    output = await put(storage, 0)  # the least recently written blob
    fillers = [await put(storage, n) for n in range(1, 9)]
    action = Digest.of(b"the action")
    result = re_pb2.ActionResult(
        output_files=[re_pb2.OutputFile(path="out", digest=re_pb2.Digest(hash=output.hash, size_bytes=BLOB))]
    )
    await cache.update("", action, result)

    clock[0] += 100
    await cache.get("", action)  # served: its output is touched as bazel-remote does
    newer = [await put(storage, n) for n in range(100, 108)]
    await storage.wait_idle()
    assert await storage.cas.find_missing(fillers) == fillers  # the older blobs made the room
    assert await read_all(storage, output) == blob(0)[1]
    assert await storage.cas.find_missing([output, *newer]) == []
    await cache.get("", action)
    assert_consistent(storage)
    await storage.close()


async def test_entries_used_within_the_hold_are_not_evicted_for_a_write(tmp_path: Path) -> None:
    clock = [1_000_000.0]
    storage = await DiskStorage.open(tmp_path, 10 * entry_cost(BLOB), clock=lambda: clock[0], sync_interval=None)
    held = [await put(storage, n) for n in range(10)]  # the store is full, every entry just written
    with pytest.raises(StorageFull):
        await put(storage, 10)
    assert await storage.cas.find_missing(held) == []
    assert storage.reserved_bytes == 0

    clock[0] += HOLD_SECONDS + 1
    assert await storage.cas.find_missing(held[5:]) == []  # confirmed present: held again
    for n in range(10, 15):  # room comes from the five not confirmed
        await put(storage, n)
    with pytest.raises(StorageFull):
        await put(storage, 15)
    await storage.wait_idle()
    assert await storage.cas.find_missing(held) == held[:5]
    assert_consistent(storage)
    await storage.close()


async def test_a_lowered_cap_at_start_evicts_regardless_of_the_hold(tmp_path: Path) -> None:
    clock = [1_000_000.0]
    storage = await DiskStorage.open(tmp_path, 10 * entry_cost(BLOB), clock=lambda: clock[0], sync_interval=None)
    for n in range(10):
        await put(storage, n)
    await storage.close()
    storage = await DiskStorage.open(tmp_path, 5 * entry_cost(BLOB), clock=lambda: clock[0], sync_interval=None)
    assert storage.stats().used_bytes <= 5 * entry_cost(BLOB)
    assert_consistent(storage)
    await storage.close()


async def test_a_clock_set_back_does_not_hold_every_entry(tmp_path: Path) -> None:
    clock = [1_000_000.0]
    storage = await DiskStorage.open(tmp_path, 10 * entry_cost(BLOB), clock=lambda: clock[0], sync_interval=None)
    for n in range(10):
        await put(storage, n)
    clock[0] -= 3600  # every entry now seems used an hour in the future
    await put(storage, 10)  # evicts the least recently used instead of refusing
    await storage.wait_idle()
    assert await storage.cas.find_missing([blob(0)[0]]) == [blob(0)[0]]
    assert_consistent(storage)
    await storage.close()
