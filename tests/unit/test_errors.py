"""The one mapping from storage/digest/request errors to gRPC and HTTP status codes."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2, status_pb2

from buildvault.actions import InvalidActionResult, MissingBlobs
from buildvault.compression import CompressionError, Reason
from buildvault.digest import Digest, DigestFunction, InvalidDigest
from buildvault.server import errors
from buildvault.storage import (
    CapacityExceeded,
    DigestMismatch,
    InvalidRange,
    NotFound,
    StorageError,
    StorageFull,
    Unavailable,
)

S = grpc.StatusCode


@pytest.mark.parametrize(
    "exc,code,http",
    [
        (InvalidDigest("bad"), S.INVALID_ARGUMENT, 400),
        (DigestMismatch("mismatch"), S.INVALID_ARGUMENT, 400),
        (InvalidActionResult("bad result"), S.INVALID_ARGUMENT, 400),
        (NotFound("gone"), S.NOT_FOUND, 404),
        (InvalidRange("range"), S.OUT_OF_RANGE, 416),
        (CapacityExceeded("too big"), S.RESOURCE_EXHAUSTED, 413),
        (StorageFull("full"), S.RESOURCE_EXHAUSTED, 507),
        (Unavailable("down"), S.UNAVAILABLE, 503),
        (StorageError("disk said no"), S.INTERNAL, 500),
        (MissingBlobs([Digest.of(b"x")]), S.FAILED_PRECONDITION, 412),
        (errors.InvalidArgument("x"), S.INVALID_ARGUMENT, 400),
        (errors.OutOfRange("x"), S.OUT_OF_RANGE, 416),
        (errors.FailedPrecondition("x"), S.FAILED_PRECONDITION, 412),
        (errors.ResourceExhausted("x"), S.RESOURCE_EXHAUSTED, 413),
        (errors.Aborted("x"), S.ABORTED, 409),
        (errors.ServiceUnavailable("x"), S.UNAVAILABLE, 503),
        (CompressionError(Reason.MALFORMED, "not zstd"), S.INVALID_ARGUMENT, 400),
        (CompressionError(Reason.TRUNCATED, "ended inside a frame"), S.INVALID_ARGUMENT, 400),
        (CompressionError(Reason.OVER_DECLARED_SIZE, "longer than declared", 10), S.INVALID_ARGUMENT, 400),
        (CompressionError(Reason.TOO_LARGE, "over the entry limit", 10), S.RESOURCE_EXHAUSTED, 413),
        (RuntimeError("a bug"), S.INTERNAL, 500),
        (KeyError("k"), S.INTERNAL, 500),
    ],
)
def test_mapping(exc, code, http):
    mapped = errors.map_exception(exc)
    assert mapped.code == code
    assert errors.http_status(exc) == http
    assert mapped.message
    assert errors.is_internal(exc) == (code == S.INTERNAL)


def test_subclasses_before_bases():
    class Custom(NotFound):
        pass

    assert errors.map_exception(Custom("x")).code == S.NOT_FOUND


def test_long_messages_are_cut():
    mapped = errors.map_exception(InvalidDigest("x" * 10_000))
    assert len(mapped.message) <= 1024


def test_rpc_status():
    assert errors.rpc_status(None).code == code_pb2.OK
    status = errors.rpc_status(DigestMismatch("blob x: content hashes to y"))
    assert status.code == code_pb2.INVALID_ARGUMENT and "hashes to" in status.message
    assert errors.rpc_status(NotFound("n")).code == code_pb2.NOT_FOUND
    assert errors.rpc_status(CapacityExceeded("c")).code == code_pb2.RESOURCE_EXHAUSTED


def test_grpc_and_rpc_code_numbers_agree():
    for code in S:
        if code.name in code_pb2.Code.keys():  # noqa: SIM118 - an EnumTypeWrapper, not a dict
            assert code.value[0] == code_pb2.Code.Value(code.name)


def test_blob_subject():
    sha = Digest.of(b"abc")
    assert errors.blob_subject(sha) == f"blobs/{sha.hash}/3"
    b3 = Digest.of(b"abc", DigestFunction.BLAKE3)
    assert errors.blob_subject(b3) == f"blobs/blake3/{b3.hash}/3"


def test_missing_blobs_rich_status():
    digests = [Digest.of(b"a"), Digest.of(b"bb", DigestFunction.BLAKE3)]
    mapped = errors.map_exception(MissingBlobs(digests))
    ((key, value),) = errors.trailing_metadata(mapped)
    assert key == "grpc-status-details-bin"
    status = status_pb2.Status.FromString(value)
    assert status.code == code_pb2.FAILED_PRECONDITION and status.message == mapped.message
    failure = error_details_pb2.PreconditionFailure()
    assert status.details[0].Unpack(failure)
    assert [(v.type, v.subject) for v in failure.violations] == [
        ("MISSING", errors.blob_subject(digests[0])),
        ("MISSING", errors.blob_subject(digests[1])),
    ]
    assert errors.trailing_metadata(errors.map_exception(NotFound("x"))) == ()


class FakeContext:
    def __init__(self):
        self.aborted = None

    async def abort(self, code, details, trailing_metadata=()):
        self.aborted = (code, details, trailing_metadata)
        raise grpc.aio.AbortError()


def test_abort_sends_code_message_and_details():
    context = FakeContext()
    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(errors.abort(context, MissingBlobs([Digest.of(b"a")])))
    code, details, trailers = context.aborted
    assert code == S.FAILED_PRECONDITION and "missing" in details and trailers[0][0] == "grpc-status-details-bin"
    context = FakeContext()
    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(errors.abort(context, InvalidDigest("nope")))
    assert context.aborted == (S.INVALID_ARGUMENT, "nope", ())


def test_every_compression_reason_has_a_status():
    for reason in Reason:
        mapped = errors.map_exception(CompressionError(reason, "x"))
        assert mapped.code is not S.INTERNAL and 400 <= mapped.http < 500, reason
