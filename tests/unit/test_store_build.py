"""storage/build.py turns Settings into the disk tier's behaviour: the eviction hold setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from buildvault.config import ConfigError, Settings
from buildvault.digest import Digest
from buildvault.server.metrics import Metrics
from buildvault.storage import StorageFull
from buildvault.storage.build import open_store_stack

A, B = b"a" * 3072, b"b" * 3072  # an 8 KiB cap holds one of them (a record of 3 KiB counts for 4,210 bytes)


async def present_after_writing_a_then_b(tmp_path: Path, hold: int) -> tuple[bool, bool]:
    stack = await open_store_stack(Settings(dir=tmp_path, max_size=8192, eviction_hold=hold), Metrics())
    try:
        await stack.blobs.write(Digest.of(A), A)
        if hold:  # A was just written: B is refused rather than evicting it
            with pytest.raises(StorageFull):
                await stack.blobs.write(Digest.of(B), B)
        else:
            await stack.blobs.write(Digest.of(B), B)
        missing = set(await stack.blobs.find_missing([Digest.of(A), Digest.of(B)]))
        return Digest.of(A) not in missing, Digest.of(B) not in missing
    finally:
        await stack.aclose()


async def test_the_default_eviction_hold_keeps_a_just_written_blob(tmp_path: Path) -> None:
    assert Settings().eviction_hold == 2
    assert await present_after_writing_a_then_b(tmp_path, 2) == (True, False)


async def test_eviction_hold_zero_is_plain_lru(tmp_path: Path) -> None:
    assert await present_after_writing_a_then_b(tmp_path, 0) == (False, True)


def test_negative_eviction_hold_is_refused() -> None:
    with pytest.raises(ConfigError, match="eviction_hold"):
        Settings(eviction_hold=-1)
