"""The one mapping from storage, digest and request errors to gRPC (and HTTP) status codes.

Adapters raise or let through the exception classes of `buildvault.storage`, `buildvault.digest`
and `buildvault.actions`, or the `RequestError` subclasses below for protocol-level bad input;
nothing else decides a status code. Bad input always maps to a precise code: only a bug (an
exception this table does not know) becomes INTERNAL, and is logged with its traceback.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2  # type: ignore[import-untyped]

from buildvault.actions import InvalidActionResult, MissingBlobs
from buildvault.assets.errors import AssetNotFound, AssetTimeout, InvalidAssetRequest
from buildvault.compression import CompressionError, Reason
from buildvault.digest import Digest, DigestFunction, InvalidDigest
from buildvault.storage import (
    CapacityExceeded,
    DigestMismatch,
    InvalidRange,
    NotFound,
    StorageError,
    StorageFull,
    Unavailable,
)

log = logging.getLogger("buildvault.errors")

# Trailing metadata key of a serialized google.rpc.Status (the gRPC "rich error model").
STATUS_DETAILS_KEY = "grpc-status-details-bin"
# gRPC status messages travel in a header: keep them short.
_MAX_MESSAGE = 1024


class RequestError(Exception):
    """A request that is wrong at the protocol level (not a storage or digest rule).

    A subclass names its status in its class line: `class X(RequestError, code=..., http=...)`."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    http = 400

    def __init_subclass__(cls, *, code: grpc.StatusCode | None = None, http: int | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
        if http is not None:
            cls.http = http


class InvalidArgument(RequestError, code=grpc.StatusCode.INVALID_ARGUMENT, http=400):
    pass


class OutOfRange(RequestError, code=grpc.StatusCode.OUT_OF_RANGE, http=416):
    pass


class FailedPrecondition(RequestError, code=grpc.StatusCode.FAILED_PRECONDITION, http=412):
    pass


class ResourceExhausted(RequestError, code=grpc.StatusCode.RESOURCE_EXHAUSTED, http=413):
    pass


class Aborted(RequestError, code=grpc.StatusCode.ABORTED, http=409):
    pass


class ServiceUnavailable(RequestError, code=grpc.StatusCode.UNAVAILABLE, http=503):
    pass


class Unimplemented(RequestError, code=grpc.StatusCode.UNIMPLEMENTED, http=501):
    pass


@dataclass(frozen=True)
class Mapped:
    """What an exception means on the wire."""

    code: grpc.StatusCode
    http: int
    message: str
    details: tuple[any_pb2.Any, ...] = ()

    @property
    def rpc_code(self) -> int:
        """The google.rpc.Code number of `code`."""
        return self.code.value[0]

    def to_status(self) -> status_pb2.Status:
        return status_pb2.Status(code=self.rpc_code, message=self.message, details=list(self.details))


# Order matters: the first matching class wins (subclasses before their bases).
_TABLE: tuple[tuple[type[BaseException], grpc.StatusCode, int], ...] = (
    (MissingBlobs, grpc.StatusCode.FAILED_PRECONDITION, 412),
    (InvalidAssetRequest, grpc.StatusCode.INVALID_ARGUMENT, 400),
    (AssetTimeout, grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    (AssetNotFound, grpc.StatusCode.NOT_FOUND, 404),
    (InvalidActionResult, grpc.StatusCode.INVALID_ARGUMENT, 400),
    (DigestMismatch, grpc.StatusCode.INVALID_ARGUMENT, 400),
    (InvalidDigest, grpc.StatusCode.INVALID_ARGUMENT, 400),
    (InvalidRange, grpc.StatusCode.OUT_OF_RANGE, 416),
    (NotFound, grpc.StatusCode.NOT_FOUND, 404),
    (CapacityExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED, 413),
    (StorageFull, grpc.StatusCode.RESOURCE_EXHAUSTED, 507),
    (Unavailable, grpc.StatusCode.UNAVAILABLE, 503),
    (StorageError, grpc.StatusCode.INTERNAL, 500),
)


# A refused compressed payload (gRPC compressed-blobs, HTTP Content-Encoding), by reason. Output
# past the declared size is a digest mismatch (400); past a server limit it is too large (413).
_COMPRESSION: dict[Reason, tuple[grpc.StatusCode, int]] = {
    Reason.MALFORMED: (grpc.StatusCode.INVALID_ARGUMENT, 400),
    Reason.TRUNCATED: (grpc.StatusCode.INVALID_ARGUMENT, 400),
    Reason.OVER_DECLARED_SIZE: (grpc.StatusCode.INVALID_ARGUMENT, 400),
    Reason.TOO_LARGE: (grpc.StatusCode.RESOURCE_EXHAUSTED, 413),
}


def blob_subject(digest: Digest) -> str:
    """`blobs/{digest_function/}{hash}/{size}`: the PreconditionFailure subject of a missing blob.

    The digest function is omitted for SHA-256 (and the other "old style" functions), as the spec says.
    """
    if digest.function is DigestFunction.SHA256:
        return f"blobs/{digest.hash}/{digest.size_bytes}"
    return f"blobs/{digest.function.label}/{digest.hash}/{digest.size_bytes}"


def precondition_failure(digests: list[Digest]) -> any_pb2.Any:
    failure = error_details_pb2.PreconditionFailure(
        violations=[
            error_details_pb2.PreconditionFailure.Violation(
                type="MISSING", subject=blob_subject(d), description=f"blob {d} is not in the CAS"
            )
            for d in digests
        ]
    )
    packed = any_pb2.Any()
    packed.Pack(failure)
    return packed


def bad_request(violations: list[tuple[str, str]]) -> any_pb2.Any:
    """A BadRequest detail: one FieldViolation per (field, description)."""
    request = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=field, description=description[:300])
            for field, description in violations[:50]
        ]
    )
    packed = any_pb2.Any()
    packed.Pack(request)
    return packed


def _message(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


def map_exception(exc: BaseException) -> Mapped:
    """The status an exception stands for. Unknown exceptions are INTERNAL (and a bug)."""
    if isinstance(exc, RequestError):
        return Mapped(exc.code, exc.http, _message(exc))
    if isinstance(exc, CompressionError):
        code, http = _COMPRESSION[exc.reason]
        return Mapped(code, http, _message(exc))
    for cls, code, http in _TABLE:
        if isinstance(exc, cls):
            details: tuple[any_pb2.Any, ...] = ()
            if isinstance(exc, MissingBlobs):
                details = (precondition_failure(exc.digests),)
            elif isinstance(exc, InvalidAssetRequest):
                details = (bad_request(exc.violations),)
            return Mapped(code, http, _message(exc), details)
    return Mapped(grpc.StatusCode.INTERNAL, 500, f"internal error: {type(exc).__name__}: {_message(exc)}")


def is_internal(exc: BaseException) -> bool:
    return map_exception(exc).code is grpc.StatusCode.INTERNAL


def rpc_status(exc: BaseException | None) -> status_pb2.Status:
    """A google.rpc.Status for a per-item result (BatchUpdateBlobs, BatchReadBlobs); None is OK."""
    if exc is None:
        return status_pb2.Status(code=code_pb2.OK)
    return map_exception(exc).to_status()


def http_status(exc: BaseException) -> int:
    """The HTTP status code of an exception, for the HTTP front end."""
    return map_exception(exc).http


def trailing_metadata(mapped: Mapped) -> tuple[tuple[str, bytes], ...]:
    """The `grpc-status-details-bin` trailer carrying the rich status, when there are details."""
    if not mapped.details:
        return ()
    return ((STATUS_DETAILS_KEY, mapped.to_status().SerializeToString()),)


async def abort(context: grpc.aio.ServicerContext[Any, Any], exc: BaseException) -> NoReturn:
    """End the RPC with the status `exc` maps to (and its rich details, if any)."""
    mapped = map_exception(exc)
    if mapped.code is grpc.StatusCode.INTERNAL:
        log.error("internal error", exc_info=exc)
    await context.abort(mapped.code, mapped.message, trailing_metadata=trailing_metadata(mapped))
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover
