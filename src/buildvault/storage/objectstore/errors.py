"""How a boto3/botocore failure becomes a storage error (NotFound, InvalidRange, Unavailable).

Why apart from the store: the table is the one place that decides what a bucket answer means,
and the transport errors are many. A connection reset or truncated reply can surface from
botocore as a `BotoCoreError`, from urllib3 as a `ProtocolError` (botocore lets it escape while
reading an error body) or from http.client as `IncompleteRead`: every one of them says the tier
is unreachable, never that the request was wrong.
"""

from __future__ import annotations

import http.client

import botocore.exceptions
import urllib3.exceptions

from buildvault.storage import InvalidRange, NotFound, StorageError, Unavailable

_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_UNAVAILABLE_CODES = frozenset(
    {
        "NoSuchBucket",
        "SlowDown",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "ServiceUnavailable",
        "InternalError",
        "503",
        "500",
    }
)


# Failures of the connection itself, whatever layer reports them.
_TRANSPORT_ERRORS = (
    botocore.exceptions.BotoCoreError,
    urllib3.exceptions.HTTPError,
    http.client.HTTPException,
    OSError,
    TimeoutError,
    ConnectionError,
)


def _error_code(exc: botocore.exceptions.ClientError) -> tuple[str, int]:
    error = exc.response.get("Error", {}) or {}
    status = (exc.response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode", 0) or 0
    return str(error.get("Code", "")), int(status)


def map_error(exc: BaseException, what: str) -> StorageError:
    """Map a boto/botocore exception to a storage error (NotFound, InvalidRange, Unavailable)."""
    if isinstance(exc, StorageError):
        return exc
    if isinstance(exc, botocore.exceptions.ClientError):
        code, status = _error_code(exc)
        if code in _NOT_FOUND_CODES or (status == 404 and code != "NoSuchBucket"):
            return NotFound(f"{what}: not in the bucket")
        if code == "InvalidRange" or status == 416:
            return InvalidRange(f"{what}: range not satisfiable")
        if code in _UNAVAILABLE_CODES or status >= 500 or status == 429:
            return Unavailable(f"{what}: object store error {code or status}: {exc}")
        return StorageError(f"{what}: object store error {code or status}: {exc}")
    if isinstance(exc, _TRANSPORT_ERRORS):
        return Unavailable(f"{what}: object store unreachable: {type(exc).__name__}: {exc}")
    return StorageError(f"{what}: {type(exc).__name__}: {exc}")
