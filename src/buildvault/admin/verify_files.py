"""`buildvault verify`'s view of blob and entry files: listing them and re-hashing a blob file
(digest.file_matches, the check start-up makes after a crash too)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from buildvault.digest import Digest, DigestFunction, file_matches


class BlobFile(NamedTuple):  # a tuple: hundreds of thousands are made, cheaply
    path: str
    function: DigestFunction
    hash: str
    size: int


def blob_files(root: Path) -> Iterator[BlobFile]:
    """Every `cas/<fn>/<hh>/<hash>-<size>` file (names that are no blob's are not listed)."""
    for function in DigestFunction:
        base = root / "cas" / function.label
        if not base.is_dir():
            continue
        for shard in sorted(os.listdir(base)):
            shard_dir = base / shard
            try:
                names = os.listdir(shard_dir)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for name in names:
                hex_hash, _, size_text = name.partition("-")
                if len(hex_hash) == 64 and size_text.isdigit() and hex_hash.startswith(shard):
                    yield BlobFile(f"{shard_dir}/{name}", function, hex_hash, int(size_text))


def entry_files(root: Path) -> Iterator[tuple[str, str, DigestFunction]]:
    """(path, kind, digest function) of every action entry under `ac/<kind>/<instance...>/@<fn>/<hh>/`."""
    ac_dir = root / "ac"
    if not ac_dir.is_dir():
        return
    for directory, subdirs, files in os.walk(ac_dir):
        relative = Path(directory).relative_to(ac_dir).parts
        if len(relative) >= 3 and relative[-2].startswith("@"):
            try:
                function = DigestFunction.from_label(relative[-2][1:])
            except ValueError:
                continue
            for name in files:
                if len(name) == 64:
                    yield f"{directory}/{name}", relative[0], function
            subdirs.clear()


def blob_is_intact(blob: BlobFile) -> bool | None:
    """True if the content matches its name, False if not, None if the file vanished."""
    checked = check_blob(blob)
    return None if checked is None else checked[0]


Checked = tuple[bool, os.stat_result | None] | None


def check_blob(blob: BlobFile) -> Checked:
    """(True, None) if intact; (False, the stat of the file read) if not, taken on the open file
    (fstat: the stat of the bytes hashed, no second path lookup); None if the file vanished."""
    try:
        fd = os.open(blob.path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        return (True, None) if file_matches(fd, Digest(blob.hash, blob.size, blob.function)) else (False, os.fstat(fd))
    finally:
        os.close(fd)


def check_blobs(batch: list[BlobFile]) -> list[Checked]:
    """`check_blob` of each: one thread-pool trip per batch, not per file (small blobs cost
    little more than that trip)."""
    return [check_blob(blob) for blob in batch]
