"""The Remote Asset v1 messages as the public specification defines them on the wire: a client
built from upstream's .proto (Bazel's remote downloader) must read ours field for field."""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor as F

from buildvault.remote_apis import ra_grpc, ra_pb2

_STR, _MSG, _ENUM = F.TYPE_STRING, F.TYPE_MESSAGE, F.TYPE_ENUM
_DIGEST = ".build.bazel.remote.execution.v2.Digest"
_FN = ".build.bazel.remote.execution.v2.DigestFunction.Value"
_QUALIFIER = ".build.bazel.remote.asset.v1.Qualifier"
_FETCH_REQUEST = [
    ("instance_name", 1, _STR, None, False),
    ("timeout", 2, _MSG, ".google.protobuf.Duration", False),
    ("oldest_content_accepted", 3, _MSG, ".google.protobuf.Timestamp", False),
    ("uris", 4, _STR, None, True),
    ("qualifiers", 5, _MSG, _QUALIFIER, True),
    ("digest_function", 6, _ENUM, _FN, False),
]


def _response(result: str) -> list[tuple[str, int, int, str | None, bool]]:
    return [
        ("status", 1, _MSG, ".google.rpc.Status", False),
        ("uri", 2, _STR, None, False),
        ("qualifiers", 3, _MSG, _QUALIFIER, True),
        ("expires_at", 4, _MSG, ".google.protobuf.Timestamp", False),
        (result, 5, _MSG, _DIGEST, False),
        ("digest_function", 6, _ENUM, _FN, False),
    ]


def _push(target: str) -> list[tuple[str, int, int, str | None, bool]]:
    return [
        ("instance_name", 1, _STR, None, False),
        ("uris", 2, _STR, None, True),
        ("qualifiers", 3, _MSG, _QUALIFIER, True),
        ("expire_at", 4, _MSG, ".google.protobuf.Timestamp", False),
        (target, 5, _MSG, _DIGEST, False),
        ("references_blobs", 6, _MSG, _DIGEST, True),
        ("references_directories", 7, _MSG, _DIGEST, True),
        ("digest_function", 8, _ENUM, _FN, False),
    ]


SPEC = {
    "Qualifier": [("name", 1, _STR, None, False), ("value", 2, _STR, None, False)],
    "FetchBlobRequest": _FETCH_REQUEST,
    "FetchDirectoryRequest": _FETCH_REQUEST,
    "FetchBlobResponse": _response("blob_digest"),
    "FetchDirectoryResponse": _response("root_directory_digest"),
    "PushBlobRequest": _push("blob_digest"),
    "PushDirectoryRequest": _push("root_directory_digest"),
    "PushBlobResponse": [],
    "PushDirectoryResponse": [],
}


def test_every_message_has_the_specified_fields() -> None:
    for name, fields in SPEC.items():
        descriptor = getattr(ra_pb2, name).DESCRIPTOR
        assert descriptor.full_name == f"build.bazel.remote.asset.v1.{name}"
        found = []
        for f in descriptor.fields:
            type_name = None
            if f.message_type is not None:
                type_name = "." + f.message_type.full_name
            elif f.enum_type is not None:
                type_name = "." + f.enum_type.full_name
            found.append((f.name, f.number, f.type, type_name, f.is_repeated))
        assert found == fields, name


def test_the_services_have_the_specified_methods() -> None:
    services = ra_pb2.DESCRIPTOR.services_by_name
    assert set(services) == {"Fetch", "Push"}
    shapes = {
        (s.full_name, m.name, m.input_type.name, m.output_type.name, m.client_streaming, m.server_streaming)
        for s in services.values()
        for m in s.methods
    }
    assert shapes == {
        ("build.bazel.remote.asset.v1.Fetch", "FetchBlob", "FetchBlobRequest", "FetchBlobResponse", False, False),
        ("build.bazel.remote.asset.v1.Fetch", "FetchDirectory", "FetchDirectoryRequest", "FetchDirectoryResponse",
         False, False),
        ("build.bazel.remote.asset.v1.Push", "PushBlob", "PushBlobRequest", "PushBlobResponse", False, False),
        ("build.bazel.remote.asset.v1.Push", "PushDirectory", "PushDirectoryRequest", "PushDirectoryResponse",
         False, False),
    }
    assert hasattr(ra_grpc, "add_FetchServicer_to_server") and hasattr(ra_grpc, "add_PushServicer_to_server")
