"""What the disk-store tests share: streams, paths, consistency checks, and waits with deadlines."""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from buildvault.digest import Digest
from buildvault.storage.disk import DiskStorage, records
from buildvault.storage.disk.core import held

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from polling import wait_until

__all__ = [
    "assert_consistent",
    "blob_path",
    "chunked",
    "file_clock_passes",
    "files_under",
    "fill",
    "files_only",
    "fill_one",
    "read_all",
    "wait_until",
]

_probes = itertools.count()


async def chunked(data: bytes, size: int = 16 * 1024) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def read_all(storage: DiskStorage, digest: Digest) -> bytes:
    return b"".join([chunk async for chunk in await storage.cas.read(digest)])


def blob_path(root: Path, digest: Digest) -> Path:
    return root / "cas" / digest.function.label / digest.hash[:2] / f"{digest.hash}-{digest.size_bytes}"


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def assert_consistent(storage: DiskStorage) -> None:
    """Index and disk agree (files and records), and the accounting matches them."""
    on_disk = {str(p): p.stat().st_size for p in files_under(storage.root / "cas") + files_under(storage.root / "ac")}
    assert set(on_disk) == set(storage.entry_paths())
    stored = storage.stored_records()
    assert set(stored) == set(storage.record_keys())
    in_records = sum(records.charge(key, size) for key, size in stored.items())
    assert storage.stats().used_bytes == sum(on_disk.values()) + in_records <= storage.max_size
    assert os.listdir(storage.root / "tmp") == [] or storage.reserved_bytes


async def fill(storage: DiskStorage, count: int, size: int) -> list[Digest]:
    digests = []
    for i in range(count):
        data = i.to_bytes(4, "big") * (size // 4)
        digest = Digest.of(data)
        await storage.cas.write(digest, chunked(data))
        digests.append(digest)
    return digests


async def fill_one(storage: DiskStorage, data: bytes) -> Digest:
    digest = Digest.of(data)
    await storage.cas.write(digest, chunked(data))
    return digest


async def file_clock_passes(root: Path, ns: int) -> None:
    """Until a file changed now gets a time later than `ns` (file times come from a coarse kernel
    clock: a change in the same tick as an earlier one may carry the same time). The probe file
    is made beside the store root `root`, on its filesystem but outside the store."""
    probe = root.parent / f".clock-probe-{os.getpid()}-{next(_probes)}"

    def ticked() -> bool:
        probe.write_bytes(b"")
        return probe.stat().st_mtime_ns > ns

    try:
        await wait_until(ticked, 5, "the file clock to pass a change", interval=0.001)
    finally:
        probe.unlink(missing_ok=True)


@pytest.fixture
def files_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every entry a file (record limit 0): the file layout large blobs and entries use, where a
    test works on files directly (removes, damages or counts them)."""
    monkeypatch.setattr(records, "RECORD_LIMIT", 0)


@pytest.fixture(params=["files", "records"])
def either_layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with every entry a file, then with every entry up to 1 MiB a record."""
    monkeypatch.setattr(records, "RECORD_LIMIT", 0 if request.param == "files" else 1 << 20)
    return str(request.param)


def entry_cost(size: int) -> int:
    """What a blob of `size` bytes counts for in the cap under the current record limit."""
    key = b"\x01" * 39  # a CAS key's length
    return records.charge(key, size) if held(records.RECORD_LIMIT, key, size) else size
