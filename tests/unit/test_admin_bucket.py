"""admin/bucket.py: the fast timestamp parser reads what botocore's does, the same way."""

from __future__ import annotations

import datetime

import pytest
from botocore.utils import parse_timestamp

from buildvault.admin.bucket import fast_timestamp


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
