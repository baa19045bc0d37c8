"""admin/bucket.py: the fast timestamp parser reads what botocore's does, the same way; a listing
split into ranges (gc's parallel listing) sees every object exactly once, whatever the keys."""

from __future__ import annotations

import datetime
import hashlib
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from botocore.utils import parse_timestamp

from buildvault.admin import bucket as bucket_module
from buildvault.admin.bucket import Bucket, fast_timestamp, layout_ranges, partition
from buildvault.config import Settings


@pytest.mark.parametrize(
    "value",
    ["2026-12-01T23:08:01.000Z", "2026-12-01T23:08:01Z", "2026-12-01T23:08:01.123456+00:00",
     "2026-12-01T23:08:01+02:00", "Tue, 01 Dec 2026 23:08:01 GMT", "Wed, 02 Dec 2026 02:04:05 GMT",
     "Tue, 01 Dec 2026 23:08:01 +0000", "Tuesday, 01-Dec-26 23:08:01 GMT", 1764630481, "1764630481"],
)  # fmt: skip
def test_fast_timestamp_agrees_with_botocore(value: object) -> None:
    parsed = fast_timestamp(value)
    assert parsed == parse_timestamp(value) and parsed.tzinfo is not None


def test_fast_timestamp_keeps_the_instant_of_a_naive_iso_time_as_utc() -> None:
    assert fast_timestamp("2026-12-01T23:08:01") == datetime.datetime(2026, 12, 1, 23, 8, 1, tzinfo=datetime.UTC)


# -- listing split into ranges -----------------------------------------------------------------

PREFIX = "team/"
ODD_KEYS = [
    # outside the shards: other digest functions, instances, kinds, no layout at all
    "", "a", "ac", "ac/", "ac0", "ac/raw/sha256/" + "1" * 64, "ac/ac/team-a/sha256/" + "2" * 64,
    "ac/ac/sha256/", "ac/ac/sha256/Z", "ac/ac/sha256/zz", "cas", "cas/", "cas0", "cas/blake3/" + "3" * 64,
    "cas/sha256/", "cas/sha256/G" + "0" * 63, "cas/sha256/:", "cas/sha256/9~x", "cas/sha256/9\u00ff",
    "cas/sha256/9~", "cas/sha256/f~", "ac/ac/sha256/f~", "cas/sha256/g", "cas/sha256/\U0001f600", "zzz",
    "\u00e9/\u00fc", "\uffff", "\U0010ffff",
    # a shard's own prefix as a key, and keys at the shard edges
    "cas/sha256/a", "cas/sha256/0", "cas/sha256/f" + "f" * 63, "ac/ac/sha256/0" + "0" * 63,
]  # fmt: skip


class FakeS3:
    """ListObjectsV2 as S3 answers it: keys in UTF-8 byte order, Prefix, StartAfter, MaxKeys, tokens."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = sorted(set(keys), key=lambda k: k.encode())
        self.calls = 0

    def list_objects_v2(
        self, Bucket: str, Prefix: str = "", MaxKeys: int = 1000, StartAfter: str = "", ContinuationToken: str = ""
    ) -> dict[str, object]:
        self.calls += 1
        after = (ContinuationToken or StartAfter).encode()
        found = [k for k in self.keys if k.startswith(Prefix) and k.encode() > after]
        page = found[: min(MaxKeys, 1000)]
        stamp = datetime.datetime(2026, 12, 1, tzinfo=datetime.UTC)
        response: dict[str, object] = {
            "Contents": [{"Key": k, "Size": len(k), "LastModified": stamp} for k in page],
            "IsTruncated": len(found) > len(page),
        }
        if len(found) > len(page):
            response["NextContinuationToken"] = page[-1]
        return response


def _bucket_on(keys: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[Bucket, FakeS3]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "unit")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "unit")
    bucket = Bucket(Settings(s3_endpoint="http://127.0.0.1:9", s3_bucket="b", s3_region="us-east-1", s3_prefix=PREFIX))
    fake = FakeS3(keys)
    bucket.client = fake
    return bucket, fake


def _random_keys(rng: random.Random, count: int) -> list[str]:
    alphabet = "0123456789abcdef/:;~gGz\u00e9\U0001f600"
    keys = []
    for _ in range(count):
        base = rng.choice(["", "ac/", "ac/ac/sha256/", "cas/", "cas/sha256/", "cas/sha256/9", "ac/ac/sha256/f"])
        keys.append(base + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4))))
    return keys


def test_layout_ranges_hold_every_key_exactly_once() -> None:
    spread = [f"cas/sha256/{i:064x}" for i in range(0, 1 << 256, 1 << 250)]
    keys = ODD_KEYS + _random_keys(random.Random(14), 3000) + spread
    for under in ("", "ac/", "cas/"):
        ranges = layout_ranges(PREFIX, under)
        for key in (PREFIX + k for k in keys):
            holders = [r for r in ranges if r.holds(key)]
            assert len(holders) == (1 if key.startswith(PREFIX + under) else 0), (key, holders)
    assert sum(1 for r in layout_ranges(PREFIX) if r.start is None and r.end is None) == 32  # the shards


def test_partition_refuses_shards_that_overlap_or_lie_outside() -> None:
    with pytest.raises(ValueError, match="inside"):
        partition("p/", ["p/a", "p/ab"])
    with pytest.raises(ValueError, match="not under"):
        partition("p/", ["q/a"])


@pytest.mark.parametrize("page", [1, 2, 7, 1000])
def test_split_listing_returns_what_one_plain_listing_does(page: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bucket_module, "PAGE", page)
    monkeypatch.setattr(bucket_module, "GAP_FIRST_PAGE", max(1, page // 2))
    hashes = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(300)]
    layout = [f"cas/sha256/{h}" for h in hashes] + [f"ac/ac/sha256/{h}" for h in hashes[:40]]
    outside = ["other/cas/sha256/" + hashes[0], "team", "tea", "teal/x"]  # not under the prefix: never listed
    keys = [PREFIX + k for k in ODD_KEYS + layout + _random_keys(random.Random(page), 500)] + outside
    bucket, fake = _bucket_on(keys, monkeypatch)
    with ThreadPoolExecutor(4) as pool:
        for under in ("", "ac/", "cas/sha256/"):
            plain = [o.key for o in bucket.objects(under)]
            split = [o.key for objects in bucket.objects_split(under, pool) for o in objects]
            assert plain == [k for k in fake.keys if k.startswith(PREFIX + under)]
            assert len(split) == len(set(split)) and set(split) == set(plain), under


def test_split_listing_of_the_layout_lists_no_page_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards read their own keys; gaps cost one small page each when the layout is all there is."""
    keys = [PREFIX + f"cas/sha256/{hashlib.sha256(str(i).encode()).hexdigest()}" for i in range(5000)]
    bucket, fake = _bucket_on(keys, monkeypatch)
    with ThreadPoolExecutor(4) as pool:
        assert sum(len(objects) for objects in bucket.objects_split("", pool)) == 5000
    assert fake.calls == len(layout_ranges(PREFIX))  # ~312 keys a shard: one page each, gaps empty
