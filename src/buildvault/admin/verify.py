"""`buildvault verify --dir DIR [--repair] [--json]`: re-hash every blob of a disk store and
check every action entry.

Reported: corrupt blobs (content does not match the `<hash>-<size>` name), broken action
entries (empty, zero-filled, or kind `ac` not an ActionResult) and dangling ones (an
ActionResult naming a blob the store does not hold intact). `--repair` removes them: entries
first, then blobs, so an interrupted repair never leaves an entry pointing at a removed blob.
With a bucket configured (`--s3-bucket`, as the server's settings), `--repair` first fetches a
damaged or missing blob again from the bucket (admin/refetch.py: kept only if it matches its
digest); a dangling entry whose blobs all come back is kept, whole.

Chunk lists (kind `chunks`, storage/chunks: a blob kept as FastCDC chunks) are checked before
the entries that may name their blobs: every chunk must be present and intact, and the chunks in
order must hash to the blob the list is for. A list that does not parse, or whose chunks hash to
another blob, is broken; one naming a missing or damaged chunk is dangling (its blob is missing:
the server reports it so). An intact list makes its blob present for the ActionResults naming it.

Small blobs and entries are records in LMDB (storage/disk/records.py): they are checked the same
way, through admin/records.py, and reported by the path their file would have under records/.

Safe beside a running server: it only reads, files are replaced by atomic renames (a file read
half-way through a replacement is the old inode, whole), a file that vanishes meanwhile
(evicted) is skipped, and records are read in short LMDB transactions beside the server's.
Before removing anything it checks the file or record is still the one it read.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from buildvault.actions import entry_is_intact
from buildvault.admin.bucket import Bucket, BucketError
from buildvault.admin.records import AdminRecords, Record
from buildvault.admin.refetch import Refetcher, unchanged
from buildvault.admin.report import emit, human_bytes, progress
from buildvault.admin.verify_files import BlobFile, Checked, blob_files, blob_is_intact, check_blobs, entry_files
from buildvault.config import Settings
from buildvault.digest import DigestFunction, new_hasher
from buildvault.remote_apis import re_pb2

BATCH = 256  # blobs per thread-pool trip
_HEX64 = re.compile(r"[0-9a-f]{64}")
CHUNK_LISTS = "chunks"  # the kind of storage/chunks' lists (its namespace's first segment)
HASH_THREADS = max(1, min(4, os.cpu_count() or 1))  # hashlib and blake3 release the GIL


class VerifyError(ValueError):
    """The store cannot be verified; the message names the setting."""


@dataclass
class Findings:
    blobs: int = 0
    bytes: int = 0
    entries: int = 0
    chunk_lists: int = 0  # of the entries: lists of blobs kept as chunks
    corrupt_blobs: list[str] = field(default_factory=list)
    broken_entries: list[str] = field(default_factory=list)
    dangling_entries: list[str] = field(default_factory=list)
    restored_blobs: list[str] = field(default_factory=list)  # damaged blobs replaced from the bucket
    restored_entries: list[str] = field(default_factory=list)  # entries made whole from the bucket
    refetched: int = 0
    vanished: int = 0
    removed: int = 0
    seconds: float = 0.0

    @property
    def problems(self) -> int:
        return len(self.corrupt_blobs) + len(self.broken_entries) + len(self.dangling_entries)

    @property
    def unrepaired(self) -> int:
        return self.problems - self.removed - len(self.restored_blobs)

    def document(self) -> dict[str, Any]:
        return {
            "blobs": self.blobs,
            "bytes": self.bytes,
            "action_entries": self.entries,
            "chunk_lists": self.chunk_lists,
            "corrupt_blobs": self.corrupt_blobs,
            "broken_entries": self.broken_entries,
            "dangling_entries": self.dangling_entries,
            "restored_blobs": self.restored_blobs,
            "restored_entries": self.restored_entries,
            "refetched": self.refetched,
            "vanished": self.vanished,
            "removed": self.removed,
            "seconds": round(self.seconds, 3),
            "mb_per_second": round(self.bytes / 1e6 / self.seconds, 1) if self.seconds else None,
        }


def referenced(result: re_pb2.ActionResult, read_blob: Any) -> set[str]:
    """`<hash>-<size>` names of the blobs an ActionResult needs (Tree contents included)."""
    names: set[str] = set()

    def add(digest: re_pb2.Digest) -> None:
        if digest.hash and digest.size_bytes:
            names.add(f"{digest.hash}-{digest.size_bytes}")

    for output in result.output_files:
        add(output.digest)
    for directory in result.output_directories:
        if directory.tree_digest.hash:
            add(directory.tree_digest)
            data = read_blob(directory.tree_digest)
            if data is not None:
                tree = re_pb2.Tree.FromString(data)
                for node in [tree.root, *tree.children]:
                    for file_node in node.files:
                        add(file_node.digest)
        if directory.root_directory_digest.hash:
            add(directory.root_directory_digest)
    add(result.stdout_digest)
    add(result.stderr_digest)
    return names


def _remove_if_unchanged(path: str, seen: os.stat_result) -> bool:
    """Unlink `path` only if it is still the file that was checked (a server may have replaced it)."""
    if not unchanged(path, seen):
        return False
    os.unlink(path)
    return True


def check_root(root: Path) -> None:
    if not root.is_dir():
        raise VerifyError(f"--dir: {root} does not exist or is not a directory")
    if not (root / "cas").is_dir():
        raise VerifyError(f"--dir: {root} is not a buildvault data directory (no cas/)")


def verify(root: Path, repair: bool = False, show_progress: bool = True, source: Refetcher | None = None) -> Findings:
    """Check (and with `repair`, clean) the store at `root`; with `source` too, a repair refetches
    from the bucket first. Raises VerifyError for a wrong --dir, BucketError if the bucket fails."""
    check_root(root)
    recs = AdminRecords(root)
    try:
        return _verify(root, recs, repair, show_progress, source)
    finally:
        recs.close()


def _verify(root: Path, recs: AdminRecords, repair: bool, show_progress: bool, source: Refetcher | None) -> Findings:
    started = time.perf_counter()
    findings = Findings()
    refetch = source if repair else None
    blobs = list(blob_files(root))
    stats: dict[str, os.stat_result] = {}
    intact: dict[tuple[DigestFunction, str], None] = {}
    batches = [blobs[i : i + BATCH] for i in range(0, len(blobs), BATCH)]
    with progress("blobs", len(blobs), show_progress) as advance, ThreadPoolExecutor(HASH_THREADS) as pool:
        for batch, results in zip(batches, pool.map(check_blobs, batches), strict=True):
            advance(len(batch))
            for blob, ok in zip(batch, results, strict=True):
                _tally(findings, blob, ok, stats, intact, refetch)
    bad_records: dict[str, Record] = {}
    for record, function, hash_, size, good in recs.blobs():  # small blobs: records (admin/records.py)
        findings.blobs += 1
        findings.bytes += size
        if good:
            intact[(function, f"{hash_}-{size}")] = None
            continue
        label = recs.label(record.key)
        findings.corrupt_blobs.append(label)
        bad_records[label] = record
        if refetch is not None and refetch.restore_record(recs, function, hash_, size, record.value):
            findings.restored_blobs.append(label)
            intact[(function, f"{hash_}-{size}")] = None

    def blob_path(function: DigestFunction, name: str) -> Path:
        return root / "cas" / function.label / name[:2] / name

    # Blobs kept as chunks whose list checked out: `<hash>-<size>` -> the chunks, in order.
    chunked: dict[tuple[DigestFunction, str], list[re_pb2.Digest]] = {}

    def read_blob(function: DigestFunction, digest: re_pb2.Digest) -> bytes | None:
        key = f"{digest.hash}-{digest.size_bytes}"
        if (function, key) not in intact or not _HEX64.fullmatch(digest.hash):
            return None
        if (function, key) in chunked:
            parts = [read_blob(function, chunk) for chunk in chunked[(function, key)]]
            return None if any(part is None for part in parts) else b"".join(parts)  # type: ignore[arg-type]
        if recs.holds(digest.size_bytes):
            return recs.blob(function, digest.hash, digest.size_bytes)
        try:
            data: bytes = blob_path(function, key).read_bytes()
            return data
        except FileNotFoundError:
            return None

    def present(function: DigestFunction, name: str) -> bool:
        """Intact now: seen so, written (by a server) since the listing, or fetched back from the bucket."""
        if (function, name) in intact:
            return True
        hash_, _, size_text = name.partition("-")
        if not _HEX64.fullmatch(hash_):  # a hostile entry names no path outside cas/
            return False
        size = int(size_text)
        if recs.holds(size):
            found = recs.blob(function, hash_, size) is not None
            found = found or (refetch is not None and refetch.restore_record(recs, function, hash_, size, None))
        else:
            found = blob_is_intact(BlobFile(str(blob_path(function, name)), function, hash_, size)) or (
                refetch is not None and refetch.restore(function, hash_, size, None)
            )
        if found:
            intact[(function, name)] = None
        return bool(found)

    def missing_blobs(result: re_pb2.ActionResult, function: DigestFunction) -> bool:
        # A Tree fetched back names more blobs: ask again until nothing new comes back.
        checked: set[str] = set()
        while True:
            needed = referenced(result, lambda d: read_blob(function, d))
            if needed <= checked:
                return any((function, name) not in intact for name in needed)
            if not all([present(function, name) for name in sorted(needed - checked)]):
                return True
            checked |= needed

    def check_chunk_list(function: DigestFunction, blob_hash: str, data: bytes) -> str | None:
        """None if the list is intact (its blob is then present); else "broken" or "dangling"."""
        try:
            chunks = list(re_pb2.SplitBlobResponse.FromString(data).chunk_digests)
        except DecodeError:
            return "broken"
        if not chunks or not _HEX64.fullmatch(blob_hash):
            return "broken"
        hasher = new_hasher(function)
        for chunk in chunks:
            name = f"{chunk.hash}-{chunk.size_bytes}"
            if chunk.size_bytes <= 0 or not _HEX64.fullmatch(chunk.hash) or not present(function, name):
                return "dangling"
            part = read_blob(function, chunk)
            if part is None:  # removed since it was checked
                return "dangling"
            hasher.update(part)
        if hasher.hexdigest() != blob_hash:
            return "broken"
        name = f"{blob_hash}-{sum(chunk.size_bytes for chunk in chunks)}"
        chunked[(function, name)] = chunks
        intact[(function, name)] = None
        return None

    entries = list(entry_files(root))
    bad_entries: list[Callable[[], bool]] = []  # each removes one bad entry if it is unchanged

    def check_entry(
        label: str, kind: str, function: DigestFunction, key_hash: str, data: bytes, remove: Callable[[], bool]
    ) -> None:
        findings.entries += 1
        if not entry_is_intact(kind, data):
            findings.broken_entries.append(label)
            bad_entries.append(remove)
            return
        if kind == CHUNK_LISTS:
            findings.chunk_lists += 1
            verdict = check_chunk_list(function, key_hash, data)
            if verdict is not None:
                (findings.broken_entries if verdict == "broken" else findings.dangling_entries).append(label)
                bad_entries.append(remove)
            return
        if kind != "ac":
            return
        try:
            result = re_pb2.ActionResult.FromString(data)
            fetched_before = refetch.fetched if refetch is not None else 0
            dangling = missing_blobs(result, function)
        except DecodeError:
            findings.broken_entries.append(label)
            bad_entries.append(remove)
            return
        if dangling:
            findings.dangling_entries.append(label)
            bad_entries.append(remove)
        elif refetch is not None and refetch.fetched > fetched_before:
            findings.restored_entries.append(label)

    # Chunk lists first: an ActionResult naming a blob kept as chunks finds it present.
    for lists in (True, False):
        with progress("chunk lists" if lists else "action entries", len(entries), show_progress) as advance:
            for path, kind, function in entries:
                advance()
                if (kind == CHUNK_LISTS) != lists:
                    continue
                try:
                    stat = os.stat(path)
                    with open(path, "rb") as stream:
                        data = stream.read()
                except FileNotFoundError:
                    findings.vanished += 1
                    continue
                remove_file = functools.partial(_remove_if_unchanged, path, stat)
                check_entry(path, kind, function, os.path.basename(path), data, remove_file)
        for record, kind, function, crc_ok in recs.entries():
            if (kind == CHUNK_LISTS) != lists:
                continue
            data = record.data if crc_ok else b""  # a record failing its CRC is broken whatever its bytes
            remove_record = functools.partial(recs.remove_if_unchanged, record)
            check_entry(recs.label(record.key), kind, function, record.key[-32:].hex(), data, remove_record)
    if repair:
        # Entries before blobs: an interrupted repair leaves no entry pointing at a removed blob.
        for remove in bad_entries:
            findings.removed += remove()
        restored = set(findings.restored_blobs)
        for path in findings.corrupt_blobs:
            if path in restored:
                continue
            if path in bad_records:
                findings.removed += recs.remove_if_unchanged(bad_records[path])
            else:
                findings.removed += _remove_if_unchanged(path, stats[path])
    findings.refetched = refetch.fetched if refetch is not None else 0
    findings.seconds = time.perf_counter() - started
    return findings


def _tally(
    findings: Findings,
    blob: BlobFile,
    checked: Checked,
    stats: dict[str, os.stat_result],
    intact: dict[tuple[DigestFunction, str], None],
    refetch: Refetcher | None,
) -> None:
    if checked is None:
        findings.vanished += 1
        return
    verdict, stat = checked
    findings.blobs += 1
    findings.bytes += blob.size
    if verdict or stat is None:
        intact[(blob.function, f"{blob.hash}-{blob.size}")] = None
        return
    findings.corrupt_blobs.append(blob.path)
    stats[blob.path] = stat
    if refetch is not None and refetch.restore(blob.function, blob.hash, blob.size, stat):
        findings.restored_blobs.append(blob.path)
        intact[(blob.function, f"{blob.hash}-{blob.size}")] = None


def summary(findings: Findings, repair: bool) -> str:
    doc = findings.document()
    rate = f", {doc['mb_per_second']} MB/s" if doc["mb_per_second"] is not None else ""
    line = (
        f"verified {findings.blobs} blobs ({human_bytes(findings.bytes)}{rate}) and {findings.entries} action entries "
        f"({findings.chunk_lists} chunk lists): "
        f"{len(findings.corrupt_blobs)} corrupt blobs, {len(findings.broken_entries)} broken entries, "
        f"{len(findings.dangling_entries)} dangling entries"
    )
    if repair:
        line += f"; removed {findings.removed}"
        if findings.refetched or findings.restored_entries:
            line += (
                f"; refetched {findings.refetched} blobs from the bucket ({len(findings.restored_blobs)} damaged "
                f"ones replaced, {len(findings.restored_entries)} entries made whole)"
            )
    return line


def run(directory: str, repair: bool, as_json: bool, settings: Settings | None = None) -> int:
    """Exit 0: nothing wrong (or everything found was repaired); 1: problems left; 2: bad --dir or bucket.

    With `repair` and a bucket in `settings`, the bucket is checked before anything changes."""
    try:
        check_root(Path(directory))
        source = None
        if repair and settings is not None and settings.s3_bucket:
            bucket = Bucket(settings, threads=2)
            bucket.probe()
            source = Refetcher(Path(directory), bucket)
        findings = verify(Path(directory), repair=repair, show_progress=not as_json, source=source)
    except (VerifyError, BucketError) as e:
        print(f"buildvault verify: {e}", file=sys.stderr)
        return 2
    emit(summary(findings, repair), findings.document(), as_json)
    if findings.problems and not (repair and findings.unrepaired <= 0):
        return 1
    return 0
