"""Re-checking entries a lookup by hash alone found no file for (core.suspects).

A read that finds a file gone or damaged drops its entry at once (reads.py). A lookup by hash
alone (bazel-remote's GET /cas/{hash}) knows no size, so it cannot name the entry; it records the
hash instead, and the next FindMissingBlobs or write naming a digest of that hash stats the file
(one coalesced trip) before answering: gone or of the wrong size, the entry leaves the index, so
the blob is reported missing and the next upload stores it. A record (records.py) is looked up
in the same trip instead: its size is in its key, and its content is checked when it is read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from buildvault.digest import Digest, InvalidDigest
from buildvault.storage.disk import fileops, records
from buildvault.storage.disk.core import Core
from buildvault.storage.disk.layout import cas_key


def named(core: Core, digests: Iterable[Digest]) -> list[Digest]:
    """The digests whose hash is a suspect (call only when core.suspects is not empty)."""
    suspects = core.suspects
    return [d for d in digests if d.hash in suspects]


async def recheck(core: Core, digests: list[Digest]) -> None:
    """Stat the files of the suspect `digests` the index holds; drop those gone or damaged."""
    held: list[tuple[bytes, int]] = []
    in_records: list[bool] = []
    for digest in digests:
        core.suspects.pop(digest.hash, None)
        with contextlib.suppress(InvalidDigest):
            key = cas_key(digest)
            if key in core.index.entries and key not in core.publishing:
                held.append((key, digest.size_bytes))
                in_records.append(core.index.in_records(key))
    if not held:
        return
    files = [core.layout.path(key) for (key, _), record in zip(held, in_records, strict=True) if not record]
    keys = [key for (key, _), record in zip(held, in_records, strict=True) if record]
    try:
        sizes = await core.ops.submit(_sizes, (core.records, files, keys, in_records))
    except OSError as e:
        raise fileops.storage_error(e, "re-checking blobs a lookup did not find") from e
    for (key, size), found in zip(held, sizes, strict=True):
        if found is None:
            core.drop_missing(key)
        elif found != size:
            core.drop_damaged(key)


def _sizes(recs: records.Records, paths: list[str], keys: list[bytes], in_records: list[bool]) -> list[int | None]:
    """The size of each file (None: gone) and each record (its key's size, or None: gone), in order."""
    file_sizes = iter([fileops.stat_size(path) for path in paths])
    present = iter(records.present(recs, keys) if keys else [])
    key_sizes = iter([int.from_bytes(key[33:], "big") for key in keys])
    out: list[int | None] = []
    for record in in_records:
        if record:
            size = next(key_sizes)
            out.append(size if next(present) else None)
        else:
            out.append(next(file_sizes))
    return out
