"""`pagecache.Residency` and `pagecache.holds_whole`: which ranges of a file the kernel's page
cache holds, asked of the real kernel. Bytes just written are cached on every filesystem; a hole
never written or read is not (no page exists for it, on a disk filesystem or tmpfs alike).
`pagecache.open_cached`: a file opened only from cached directory entries (a path just written
is cached)."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

import pytest

from buildvault.storage.disk import pagecache

MiB = 1 << 20
PAGE = pagecache.PAGE


def test_this_platform_can_ask() -> None:
    assert pagecache.AVAILABLE, "no mincore here: every streamed read would go to the worker threads"


def test_bytes_just_written_are_cached_and_a_hole_is_not(tmp_path: Path) -> None:
    path = tmp_path / "sparse"
    with open(path, "wb") as f:
        f.write(os.urandom(MiB))  # [0, 1 MiB): written
        f.seek(3 * MiB)
        f.write(os.urandom(PAGE))  # [1 MiB, 3 MiB): a hole
    fd = os.open(path, os.O_RDONLY)
    try:
        residency = pagecache.Residency(fd, 3 * MiB + PAGE)
    finally:
        os.close(fd)  # the mapping keeps the file
    try:
        assert residency.holds(0, MiB)
        assert residency.holds(10, 5000)  # not page-aligned: the pages it touches
        assert residency.holds(3 * MiB, PAGE)
        assert not residency.holds(MiB, PAGE)
        assert not residency.holds(MiB - 10, 20)  # one cached page, one not
        assert not residency.holds(0, 3 * MiB + PAGE)  # the hole in the middle
        assert not residency.holds(2 * MiB, MiB + PAGE)
    finally:
        residency.close()


def test_outside_the_mapped_size_or_after_close_nothing_is_held(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(2 * PAGE))
    fd = os.open(path, os.O_RDONLY)
    try:
        residency = pagecache.Residency(fd, 2 * PAGE)
        assert residency.holds(0, 2 * PAGE)
        assert not residency.holds(PAGE, 2 * PAGE)  # past the size it was made for
        assert not residency.holds(-1, 10)
        assert not residency.holds(0, 0)
        residency.close()
        assert not residency.holds(0, PAGE)
        residency.close()  # twice: nothing more happens
    finally:
        os.close(fd)


def test_a_file_that_cannot_be_mapped_answers_not_cached(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY)  # a directory: mmap refuses it
    try:
        residency = pagecache.Residency(fd, PAGE)
        assert not residency.holds(0, PAGE)
        residency.close()
    finally:
        os.close(fd)


def test_a_path_just_written_is_opened_from_the_cache_and_a_missing_one_is_not(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"content")
    fd = pagecache.open_cached(str(path))
    assert fd is not None, "openat2(RESOLVE_CACHED) refused here: no whole-file batch is read on the loop"
    try:
        assert os.read(fd, 100) == b"content"
        assert os.get_inheritable(fd) is False  # O_CLOEXEC
    finally:
        os.close(fd)
    assert pagecache.open_cached(str(tmp_path / "missing")) is None
    again = pagecache.open_cached(str(path))  # a miss changes nothing
    assert again is not None
    os.close(again)


def _sparse(path: Path) -> int:
    """A file with 1 MiB written, then a 2 MiB hole, then one page: its size."""
    with open(path, "wb") as f:
        f.write(os.urandom(MiB))
        f.seek(3 * MiB)
        f.write(os.urandom(PAGE))
    return 3 * MiB + PAGE


def test_this_kernel_answers_with_cachestat() -> None:
    assert pagecache._cachestat_works, "no cachestat(2) here: each chunk file is asked through a mapping"


@pytest.mark.parametrize("cachestat", [True, False], ids=["cachestat", "mapping"])
def test_a_whole_file_is_held_only_when_every_page_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cachestat: bool
) -> None:
    monkeypatch.setattr(pagecache, "_cachestat_works", cachestat)
    size = _sparse(tmp_path / "sparse")
    fd = os.open(tmp_path / "sparse", os.O_RDONLY)
    try:
        assert pagecache.holds_whole(fd, MiB)
        assert pagecache.holds_whole(fd, MiB - 10)  # not page-aligned: the pages it touches
        assert not pagecache.holds_whole(fd, size)  # the hole in the middle
        assert not pagecache.holds_whole(fd, MiB + 1)  # one page past the written MiB
        assert not pagecache.holds_whole(fd, 0)
    finally:
        os.close(fd)
    assert pagecache._cachestat_works is cachestat  # nothing was refused


class RefusingLibc:
    """libc whose syscall fails as a kernel without the call (or a seccomp filter) fails it; every
    other function is `real`'s."""

    def __init__(self, error: int, real: object = None) -> None:
        self.real = real
        self.error = error
        self.calls = 0

    def syscall(self, *args: object) -> int:
        self.calls += 1
        ctypes.set_errno(self.error)
        return -1

    def __getattr__(self, name: str) -> object:
        if self.real is None:
            raise AttributeError(name)
        return getattr(self.real, name)


@pytest.mark.parametrize("error", [errno.ENOSYS, errno.EINVAL, errno.EPERM])
def test_a_kernel_that_refuses_openat2_is_not_asked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int
) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"content")
    refusing = RefusingLibc(error)
    monkeypatch.setattr(pagecache, "_LIBC", refusing)
    monkeypatch.setattr(pagecache, "_open_cached_works", True)
    assert pagecache.open_cached(str(path)) is None
    assert pagecache.open_cached(str(path)) is None
    assert refusing.calls == 1


def test_a_lookup_that_would_wait_for_the_disk_is_asked_again_next_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refusing = RefusingLibc(errno.EAGAIN)  # RESOLVE_CACHED: the path is not all in the dentry cache
    monkeypatch.setattr(pagecache, "_LIBC", refusing)
    monkeypatch.setattr(pagecache, "_open_cached_works", True)
    assert pagecache.open_cached(str(tmp_path / "blob")) is None
    assert pagecache.open_cached(str(tmp_path / "blob")) is None
    assert refusing.calls == 2


@pytest.mark.parametrize("error", [errno.ENOSYS, errno.EPERM])
def test_a_kernel_that_refuses_cachestat_is_asked_through_a_mapping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int
) -> None:
    size = _sparse(tmp_path / "sparse")
    refusing = RefusingLibc(error, pagecache._LIBC)
    monkeypatch.setattr(pagecache, "_LIBC", refusing)
    monkeypatch.setattr(pagecache, "_cachestat_works", True)
    fd = os.open(tmp_path / "sparse", os.O_RDONLY)
    try:
        assert pagecache.holds_whole(fd, MiB)
        assert not pagecache.holds_whole(fd, size)
    finally:
        os.close(fd)
    assert refusing.calls == 1
    assert pagecache._cachestat_works is False


def test_a_bad_descriptor_is_not_held_and_cachestat_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pagecache, "_cachestat_works", True)
    assert not pagecache.holds_whole(-1, PAGE)  # EBADF
    assert ctypes.get_errno() == errno.EBADF
    assert pagecache._cachestat_works  # one call's error is not the kernel refusing cachestat
