"""`verify --repair` with a bucket configured: a damaged or missing local blob is fetched again
from the bucket instead of being given up.

A fetched blob is kept only if its size and hash match its name. It is written to a temp file
in the store's `tmp/` and renamed into place (the way the server publishes), and a damaged file
is replaced only if it is still the file verify read (a server may have rewritten it meanwhile).
A running server does not index a restored blob that it had dropped until its next start; a
request for it before then reads it through from the bucket, as it would without verify. A blob
the store keeps as a record (admin/records.py) is written back as its record, only if the record
still holds the damaged bytes that were checked (or is still absent).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from buildvault.admin.bucket import Bucket
from buildvault.admin.records import AdminRecords
from buildvault.digest import DigestFunction, new_hasher


def unchanged(path: str, seen: os.stat_result) -> bool:
    """True if `path` is still the file that was checked (same inode, same mtime)."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    return (now.st_ino, now.st_mtime_ns) == (seen.st_ino, seen.st_mtime_ns)


class Refetcher:
    def __init__(self, root: Path, bucket: Bucket) -> None:
        self.root = root
        self.bucket = bucket
        self.fetched = 0  # blobs written from the bucket
        self.unusable: set[tuple[DigestFunction, str]] = set()  # not in the bucket, or wrong there

    def fetch(self, function: DigestFunction, hash_: str, size: int) -> bytes | None:
        """Blob `hash_`/`size` from the bucket, if it has a good copy. BucketError if unreachable."""
        name = f"{hash_}-{size}"
        if (function, name) in self.unusable:
            return None
        data = self.bucket.get(self.bucket.blob_key(function.label, hash_))
        hasher = new_hasher(function)
        if data is not None:
            hasher.update(data)
        if data is None or len(data) != size or hasher.hexdigest() != hash_:
            self.unusable.add((function, name))
            return None
        return data

    def restore_record(
        self, records: AdminRecords, function: DigestFunction, hash_: str, size: int, replacing: bytes | None
    ) -> bool:
        """Fetch the blob and write it as its record, if that still holds `replacing` (None: absent)."""
        data = self.fetch(function, hash_, size)
        if data is None or not records.restore(function, hash_, size, data, replacing):
            return False
        self.fetched += 1
        return True

    def restore(self, function: DigestFunction, hash_: str, size: int, replacing: os.stat_result | None) -> bool:
        """Fetch blob `hash_`/`size` and put it in place; `replacing`: the damaged file's stat, if any.
        False if the bucket has no good copy or the damaged file changed meanwhile. BucketError
        if the bucket cannot be reached."""
        name = f"{hash_}-{size}"
        data = self.fetch(function, hash_, size)
        if data is None:
            return False
        shard = self.root / "cas" / function.label / hash_[:2]
        shard.mkdir(parents=True, exist_ok=True)
        scratch = self.root / "tmp"
        scratch.mkdir(exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=scratch, prefix="verify-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as stream:
                stream.write(data)
            path = str(shard / name)
            if replacing is not None and not unchanged(path, replacing):
                return False
            os.replace(temp, path)
        finally:
            if os.path.exists(temp):
                os.unlink(temp)
        self.fetched += 1
        return True
