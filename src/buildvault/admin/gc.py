"""`buildvault gc --s3-bucket NAME [--max-age 30d] [--max-size SIZE] [--grace 1h] [--dry-run]`:
bound the object store that bazel-remote-style caches never clean.

In order, so that an interrupted run leaves every remaining action entry complete:

1. list the bucket (under the prefix): action entries `ac/...` and blobs `cas/<fn>/<hash>`, as
   37 key ranges listed 4 at a time (admin/bucket.py `layout_ranges`: a shard per first hex
   digit of the content-addressed keys, and the gaps between shards, so every object is listed
   exactly once; on a bucket of only the layout, one request per range and page);
2. delete the action entries whose last use (the object's LastModified) is older than
   `--max-age`, except what a pin holds (admin/gc_pins.py: every instance's pin index and the
   artifact entries it names; their blobs are then kept as referenced ones);
3. read the remaining `ac` entries (ActionResults, Tree blobs they name) for the blobs they
   reference, list the action entries once more and read the ones written since step 1 (a
   build running beside gc), then delete the blobs no remaining entry references that are older
   than `--grace` (uploads in flight are never touched), oldest first, until the bucket is under
   `--max-size` (without it: all of them).

Remote Asset entries (kind `asset`, buildvault.assets.index) are ActionResults too: their blobs
are kept like an `ac` entry's. Entries of other kinds (`raw`: ccache's opaque entries) reference
no blob and only age out. Chunk lists (kind `chunks`, storage/chunks) never age out: a list is
kept, with every chunk it names, while its blob is referenced, and goes like an unreferenced blob
otherwise.
`--dry-run` deletes nothing and reports what would go.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from google.protobuf.message import DecodeError, Message

from buildvault.admin.bucket import Bucket, BucketError, Obj
from buildvault.admin.gc_pins import is_pin_index, pinned_entries
from buildvault.admin.report import Advance, emit, human_bytes, progress
from buildvault.config import Settings, parse_duration
from buildvault.remote_apis import re_pb2

READ_THREADS = 16
# Listings in flight at once. A listing page is the server's heaviest request (moto: ~0.6 s of CPU
# for 1,000 keys), and a server that answers one request at a time takes each of N at once N
# times as long: 16 at once made pages run past the read timeout on a loaded machine.
LIST_THREADS = 4
GcError = BucketError  # gc cannot run; the message names the setting
# Chunk lists of blobs kept as chunks (storage/chunks): not aged out, kept while their blob is.
CHUNK_LISTS = "ac/chunks/"
@dataclass
class Plan:
    """What gc decided (and, unless a dry run, did)."""

    objects: int = 0
    total_bytes: int = 0
    expired_entries: list[Obj] = field(default_factory=list)
    blobs_removed: list[Obj] = field(default_factory=list)
    referenced_blobs: int = 0
    pinned_entries: int = 0
    unreferenced_in_grace: int = 0
    deleted: int = 0
    list_seconds: float = 0.0  # the first listing (mostly the S3 server's time)
    read_seconds: float = 0.0  # reading the entries for their references, and the second listing
    decide_seconds: float = 0.0
    seconds: float = 0.0

    def document(self, dry_run: bool) -> dict[str, Any]:
        freed = sum(o.size for o in self.expired_entries) + sum(o.size for o in self.blobs_removed)
        return {
            "dry_run": dry_run,
            "objects": self.objects,
            "bytes": self.total_bytes,
            "expired_entries": len(self.expired_entries),
            "blobs_removed": len(self.blobs_removed),
            "referenced_blobs": self.referenced_blobs,
            "pinned_entries": self.pinned_entries,
            "unreferenced_in_grace": self.unreferenced_in_grace,
            "bytes_freed": freed,
            "bytes_after": self.total_bytes - freed,
            "deleted": self.deleted,
            "list_seconds": round(self.list_seconds, 3),
            "read_seconds": round(self.read_seconds, 3),
            "decide_seconds": round(self.decide_seconds, 3),
            "seconds": round(self.seconds, 3),
            "keys": [o.key for o in self.expired_entries + self.blobs_removed] if dry_run else [],
        }


_M = TypeVar("_M", bound=Message)


def _blob_key(prefix: str, function: str, digest: re_pb2.Digest) -> str | None:
    return f"{prefix}cas/{function}/{digest.hash}" if digest.hash and digest.size_bytes else None


def _message(bucket: Bucket, key: str | None, message_type: type[_M]) -> _M | None:
    """The message stored under `key`; None when it is gone or does not parse."""
    data = bucket.get(key) if key else None
    if data is None:
        return None
    try:
        return message_type.FromString(data)
    except DecodeError:
        return None


def entry_references(bucket: Bucket, entry: Obj) -> set[str]:
    """Blob keys an `ac`-kind entry needs (its Tree blobs' files included); empty for other kinds."""
    relative = entry.key[len(bucket.prefix) :].split("/")
    # ac/<namespace...>/<fn>/<hash>; the namespace's first segment is the kind
    if len(relative) < 4 or relative[1] not in ("ac", "asset"):  # asset entries are ActionResults too
        return set()
    function = relative[-2]
    result = _message(bucket, entry.key, re_pb2.ActionResult)
    if result is None:
        return set()
    keys: set[str | None] = {_blob_key(bucket.prefix, function, f.digest) for f in result.output_files}
    keys.add(_blob_key(bucket.prefix, function, result.stdout_digest))
    keys.add(_blob_key(bucket.prefix, function, result.stderr_digest))
    for directory in result.output_directories:
        keys.add(_blob_key(bucket.prefix, function, directory.root_directory_digest))
        tree_key = _blob_key(bucket.prefix, function, directory.tree_digest)
        keys.add(tree_key)
        tree = _message(bucket, tree_key, re_pb2.Tree)
        if tree is not None:
            for node in [tree.root, *tree.children]:
                keys.update(_blob_key(bucket.prefix, function, f.digest) for f in node.files)
    keys.discard(None)
    return {k for k in keys if k is not None}


def _listed_blob_key(prefix: str, chunk_list: Obj) -> str:
    """`ac/chunks/<fn>/<hash>` -> `cas/<fn>/<hash>`: the blob the list makes."""
    function, hash = chunk_list.key[len(prefix) :].split("/")[-2:]
    return f"{prefix}cas/{function}/{hash}"


def chunk_references(bucket: Bucket, chunk_list: Obj) -> set[str]:
    """Blob keys of the chunks a chunk list (storage/chunks: a SplitBlobResponse) names."""
    function = chunk_list.key[len(bucket.prefix) :].split("/")[-2]
    message = _message(bucket, chunk_list.key, re_pb2.SplitBlobResponse)
    if message is None:
        return set()
    return {k for k in (_blob_key(bucket.prefix, function, d) for d in message.chunk_digests) if k is not None}


def _references(bucket: Bucket, entries: Iterable[Obj], pool: ThreadPoolExecutor, advance: Advance) -> set[str]:
    found: set[str] = set()
    for keys in pool.map(lambda e: entry_references(bucket, e), entries):
        found |= keys
        advance()
    return found


def collect(
    settings: Settings,
    max_age: float | None,
    max_size: int | None,
    grace: float,
    dry_run: bool,
    show_progress: bool = True,
    now: Callable[[], float] = time.time,
) -> Plan:
    started = time.perf_counter()
    bucket = Bucket(settings, threads=READ_THREADS)
    plan = Plan()
    with ThreadPoolExecutor(READ_THREADS) as pool, ThreadPoolExecutor(LIST_THREADS) as lister:
        with progress("listing", None, show_progress) as advance:
            entries, blobs, lists = [], [], []
            for objects in bucket.objects_split("", lister):
                advance(len(objects))
                for obj in objects:
                    relative = obj.key[len(bucket.prefix) :]
                    if relative.startswith(CHUNK_LISTS):
                        lists.append(obj)
                    elif relative.startswith("ac/"):
                        entries.append(obj)
                    elif relative.startswith("cas/"):
                        blobs.append(obj)
        plan.list_seconds = time.perf_counter() - started
        plan.objects = len(entries) + len(blobs) + len(lists)
        plan.total_bytes = sum(o.size for o in entries) + sum(o.size for o in blobs) + sum(o.size for o in lists)
        listed_at = now()
        cutoff = listed_at - max_age if max_age is not None else None
        indexes = [e.key for e in entries if is_pin_index(e.key[len(bucket.prefix) :])]
        held = pinned_entries(bucket.prefix, indexes, bucket.get)
        plan.pinned_entries = sum(1 for e in entries if e.key in held)
        plan.expired_entries = [e for e in entries if cutoff is not None and e.modified < cutoff and e.key not in held]
        expired = {e.key for e in plan.expired_entries}
        kept = [e for e in entries if e.key not in expired]
        if not dry_run:
            plan.deleted += _delete(bucket, [e.key for e in plan.expired_entries], show_progress, "expired entries")
        reading = time.perf_counter()
        with progress("reading entries", len(kept), show_progress) as advance:
            referenced = _references(bucket, kept, pool, advance)
        # A build beside gc writes entries after our listing: read those too before any blob goes.
        seen = {e.key: e.modified for e in entries}
        fresh = [e for objects in bucket.objects_split("ac/", lister) for e in objects if seen.get(e.key) != e.modified]
        with progress("reading new entries", len(fresh), show_progress) as advance:
            referenced |= _references(bucket, fresh, pool, advance)
        # A blob kept as chunks: its list is kept, and so is every chunk the list names. A list
        # whose blob nothing references goes like an unreferenced blob.
        needed = [c for c in lists if _listed_blob_key(bucket.prefix, c) in referenced]
        referenced |= {c.key for c in needed}
        referenced |= {k for keys in pool.map(lambda c: chunk_references(bucket, c), needed) for k in keys}
        blobs += lists
    plan.read_seconds = time.perf_counter() - reading
    plan.referenced_blobs = sum(1 for b in blobs if b.key in referenced)
    young = listed_at - grace
    unreferenced = sorted((b for b in blobs if b.key not in referenced), key=lambda b: b.modified)
    candidates = [b for b in unreferenced if b.modified < young]
    plan.unreferenced_in_grace = len(unreferenced) - len(candidates)
    remaining = plan.total_bytes - sum(e.size for e in plan.expired_entries)
    for blob in candidates:
        if max_size is not None and remaining <= max_size:
            break
        plan.blobs_removed.append(blob)
        remaining -= blob.size
    plan.decide_seconds = time.perf_counter() - started
    if not dry_run:
        plan.deleted += _delete(bucket, [b.key for b in plan.blobs_removed], show_progress, "unreferenced blobs")
    plan.seconds = time.perf_counter() - started
    return plan


def _delete(bucket: Bucket, keys: list[str], show_progress: bool, label: str) -> int:
    deleted = 0
    with progress(f"deleting {label}", len(keys), show_progress) as advance:
        for start in range(0, len(keys), bucket.DELETE_BATCH):
            batch = keys[start : start + bucket.DELETE_BATCH]
            deleted += bucket.delete(batch)
            advance(len(batch))
    return deleted


def summary(plan: Plan, dry_run: bool) -> str:
    doc = plan.document(dry_run)
    verb = "would delete" if dry_run else "deleted"
    return (
        f"{plan.objects} objects ({human_bytes(plan.total_bytes)}) listed and decided in {doc['decide_seconds']}s: "
        f"{verb} {len(plan.expired_entries)} expired action entries and {len(plan.blobs_removed)} unreferenced "
        f"blobs ({human_bytes(doc['bytes_freed'])}); kept {plan.referenced_blobs} referenced blobs and "
        f"{plan.unreferenced_in_grace} in their grace period, {plan.pinned_entries} pinned entries; "
        f"{human_bytes(doc['bytes_after'])} remain"
    )


def run(
    settings: Settings, max_age: str | None, max_size: str | None, grace: str, dry_run: bool, as_json: bool
) -> int:
    """Exit 0 done, 1 the bucket refused or could not be reached, 2 bad input."""
    from buildvault.config import parse_size

    try:
        age = parse_duration(max_age) if max_age is not None else None
        size = parse_size(max_size) if max_size is not None else None
        grace_seconds = parse_duration(grace)
    except ValueError as e:
        print(f"buildvault gc: {e}", file=sys.stderr)
        return 2
    try:
        plan = collect(settings, age, size, grace_seconds, dry_run, show_progress=not as_json)
    except GcError as e:
        print(f"buildvault gc: {e}", file=sys.stderr)
        return 1 if settings.s3_bucket else 2
    emit(summary(plan, dry_run), plan.document(dry_run), as_json)
    return 0
