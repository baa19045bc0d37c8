"""The bucket as `buildvault gc` and `buildvault verify --repair` see it: plain boto3 calls
(these commands are not servers: no event loop), every failure a BucketError naming the
setting to fix (bucket, endpoint, credentials)."""

from __future__ import annotations

import datetime
import email.utils
import os
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Executor, as_completed
from dataclasses import dataclass
from typing import Any

import boto3
import botocore.exceptions
import botocore.session
import botocore.utils

from buildvault.config import Settings
from buildvault.storage.objectstore.client import make_s3_client
from buildvault.storage.objectstore.store import normalize_prefix


def fast_timestamp(value: Any) -> datetime.datetime:
    """botocore's timestamp parser, fast for what listings carry (`2026-12-01T23:08:01.000Z`) and
    what a GET's Last-Modified header carries (`Tue, 01 Dec 2026 23:08:01 GMT`).

    botocore parses every timestamp with dateutil, about 100-250 µs each: most of gc's own time
    on a 100,000-object listing, and a tenth of each GET's. Anything else goes to botocore's parser."""
    if isinstance(value, str):
        try:
            parsed = datetime.datetime.fromisoformat(value)
        except ValueError:
            if value.endswith(" GMT"):
                try:
                    return email.utils.parsedate_to_datetime(value)
                except (TypeError, ValueError):
                    pass
        else:
            return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=datetime.UTC)
    return botocore.utils.parse_timestamp(value)


def _session() -> boto3.session.Session:
    core = botocore.session.get_session()
    core.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=fast_timestamp)
    return boto3.session.Session(botocore_session=core)


# Where a bucket's keys mostly are (storage/objectstore/store.py's layout): content-addressed, so the
# first hex digit after each of these splits its keys into 16 shards of about equal size.
SHARDED = ("ac/ac/sha256/", "cas/sha256/")
HEX = "0123456789abcdef"
GAP_FIRST_PAGE = 100  # a gap between shards is mostly empty: a small first page, then full ones
PAGE = 1000  # ListObjectsV2's largest page


@dataclass(frozen=True, slots=True)
class KeyRange:
    """The keys k that start with `prefix` and have start <= k < end (None: unbounded that way)."""

    prefix: str
    start: str | None = None
    end: str | None = None

    def holds(self, key: str) -> bool:
        return (
            key.startswith(self.prefix)
            and (self.start is None or key >= self.start)
            and (self.end is None or key < self.end)
        )


def _after(prefix: str) -> str:
    """The least string above every string that starts with `prefix` (its last character bumped)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def _below(start: str) -> str:
    """A StartAfter for a listing from `start`: less than `start`, and above every key in the
    shard before it that the layout makes (hex digits), so no shard is listed twice."""
    return start[:-1] + chr(ord(start[-1]) - 1) + "~" if ord(start[-1]) > 0 else start[:-1]


def partition(container: str, shards: Iterable[str]) -> list[KeyRange]:
    """Ranges holding every key that starts with `container` exactly once: each shard (a prefix that
    starts with `container` and is longer; none a prefix of another) and the gaps around them.

    A shard is listed by its prefix; a gap (keys of other digest functions, instances, kinds, or
    no layout at all) from the key after the previous shard's last possible one, up to the next
    shard, under the two bounds' common prefix."""
    ranges: list[KeyRange] = []
    cursor: str | None = None  # where the next gap starts; None: at the container's first key
    for shard in sorted(set(shards)):
        if not shard.startswith(container) or len(shard) <= len(container):
            raise ValueError(f"shard {shard!r} is not under {container!r}")
        if cursor is not None and shard < cursor:
            raise ValueError(f"shard {shard!r} is inside the shard before it")
        if cursor != shard:
            ranges.append(KeyRange(os.path.commonprefix([cursor or container, shard]), cursor, shard))
        ranges.append(KeyRange(shard))
        cursor = _after(shard)
    ranges.append(KeyRange(container, cursor, None))
    return ranges


def layout_ranges(prefix: str, under: str = "") -> list[KeyRange]:
    """`partition` of the keys under `prefix + under` by the layout's shards (SHARDED x HEX)."""
    container = prefix + under
    shards = [prefix + base + h for base in SHARDED for h in HEX]
    return partition(container, [s for s in shards if s.startswith(container) and len(s) > len(container)])


class BucketError(RuntimeError):
    """The bucket cannot be used; the message names the setting."""


@dataclass(frozen=True, slots=True)
class Obj:
    key: str
    size: int
    modified: float  # seconds since the epoch


class Bucket:
    """The few S3 calls the admin commands make, each mapping failures to a BucketError naming the setting."""

    DELETE_BATCH = 1000  # DeleteObjects' limit

    def __init__(self, settings: Settings, threads: int = 16) -> None:
        if not settings.s3_bucket:
            raise BucketError("--s3-bucket: no bucket given")
        self.name = settings.s3_bucket
        self.prefix = normalize_prefix(settings.s3_prefix)
        self.endpoint = settings.s3_endpoint or "the AWS default endpoint"
        self.client = make_s3_client(settings, max_pool_connections=threads, max_attempts=2, session=_session())

    def _fail(self, e: Exception) -> BucketError:
        if isinstance(e, botocore.exceptions.ClientError):
            code = e.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchBucket",):
                return BucketError(f"--s3-bucket: bucket {self.name!r} does not exist at {self.endpoint}")
            if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
                where = "credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
                return BucketError(f"{where}: {code} for bucket {self.name!r}")
            return BucketError(f"--s3-bucket {self.name!r}: {code or e}")
        if isinstance(e, botocore.exceptions.NoCredentialsError):
            return BucketError("credentials: none found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile)")
        return BucketError(f"--s3-endpoint: {self.endpoint} unreachable: {e}")

    def objects(self, under: str) -> Iterator[Obj]:
        """Every object under `under`, in key order (one listing)."""
        for page in self.objects_in(KeyRange(self.prefix + under)):
            yield from page

    def objects_in(self, key_range: KeyRange) -> Iterator[list[Obj]]:
        """The objects of one range, a listing page at a time, in key order."""
        request: dict[str, Any] = {"Bucket": self.name, "Prefix": key_range.prefix}
        if key_range.start is not None and key_range.start > key_range.prefix:
            request["StartAfter"] = _below(key_range.start)
        gap = key_range.start is not None or key_range.end is not None
        request["MaxKeys"] = GAP_FIRST_PAGE if gap else PAGE
        try:
            while True:
                response = self.client.list_objects_v2(**request)
                page: list[Obj] = []
                for item in response.get("Contents", []):
                    key = item["Key"]
                    if key_range.end is not None and key >= key_range.end:
                        yield page
                        return
                    if key_range.start is None or key >= key_range.start:
                        page.append(Obj(key, int(item["Size"]), item["LastModified"].timestamp()))
                yield page
                token = response.get("NextContinuationToken")
                if not response.get("IsTruncated") or not token:
                    return
                request.update(ContinuationToken=token, MaxKeys=PAGE)
                request.pop("StartAfter", None)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            raise self._fail(e) from None

    def _range_objects(self, key_range: KeyRange) -> list[Obj]:
        return [obj for page in self.objects_in(key_range) for obj in page]

    def objects_split(
        self, under: str, pool: Executor, ranges: Sequence[KeyRange] | None = None
    ) -> Iterator[list[Obj]]:
        """Every object under `under`, exactly once, listed range by range in parallel on `pool`
        (by default the layout's ranges: `layout_ranges`); a range's objects at a time, ranges in no
        particular order."""
        ranges = layout_ranges(self.prefix, under) if ranges is None else ranges
        futures = [pool.submit(self._range_objects, r) for r in ranges]
        try:
            for future in as_completed(futures):
                yield future.result()
        finally:
            for future in futures:
                future.cancel()

    def probe(self) -> None:
        """One listing call: raises BucketError unless the bucket exists and the credentials may list it."""
        try:
            self.client.list_objects_v2(Bucket=self.name, Prefix=self.prefix, MaxKeys=1)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            raise self._fail(e) from None

    def blob_key(self, function: str, hash_: str) -> str:
        return f"{self.prefix}cas/{function}/{hash_}"

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None if it is gone (deleted meanwhile)."""
        try:
            body: bytes = self.client.get_object(Bucket=self.name, Key=key)["Body"].read()
            return body
        except botocore.exceptions.ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise self._fail(e) from None
        except botocore.exceptions.BotoCoreError as e:
            raise self._fail(e) from None

    def delete(self, keys: list[str]) -> int:
        try:
            response = self.client.delete_objects(
                Bucket=self.name, Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True}
            )
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            raise self._fail(e) from None
        errors = response.get("Errors", [])
        if errors:
            first = errors[0]
            raise BucketError(f"--s3-bucket {self.name!r}: delete refused: {first.get('Code')} {first.get('Key')}")
        return len(keys)
