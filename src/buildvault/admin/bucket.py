"""The bucket as `buildvault gc` and `buildvault verify --repair` see it: plain boto3 calls
(these commands are not servers: no event loop), every failure a BucketError naming the
setting to fix (bucket, endpoint, credentials)."""

from __future__ import annotations

import datetime
import email.utils
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import botocore.exceptions
import botocore.session
import botocore.utils

from buildvault.config import Settings
from buildvault.storage.objectstore import normalize_prefix
from buildvault.storage.objectstore_client import make_s3_client


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
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=self.prefix + under)
            for page in pages:
                for item in page.get("Contents", []):
                    yield Obj(item["Key"], int(item["Size"]), item["LastModified"].timestamp())
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            raise self._fail(e) from None

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
