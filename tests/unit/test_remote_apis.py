"""Checks for the generated REAPI / ByteStream modules in buildvault.remote_apis.

Every number asserted here was taken from the upstream specification
(bazelbuild/remote-apis remote_execution.proto + semver.proto, googleapis
bytestream.proto), not from our own .proto file, so a typo in our copy that
changes the wire format fails this test.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from google.longrunning import operations_pb2
from google.protobuf.descriptor import FieldDescriptor

from buildvault.remote_apis import bs_grpc, bs_pb2, re_grpc, re_pb2, semver_pb2

RE_PKG = "build.bazel.remote.execution.v2"
REPO_ROOT = Path(__file__).resolve().parents[2]


def _numbers(message_cls) -> dict[str, int]:
    return {f.name: f.number for f in message_cls.DESCRIPTOR.fields}


def _enum(enum_wrapper) -> dict[str, int]:
    return {v.name: v.number for v in enum_wrapper.DESCRIPTOR.values}


# --------------------------------------------------------------------------
# (a) generated code is in sync with the .proto sources
# --------------------------------------------------------------------------


def test_generated_modules_are_not_stale() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "buildvault.remote_apis.regen", "--check"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, (
        "generated protobuf modules are stale or regen failed; run "
        "`python -m buildvault.remote_apis.regen`\n"
        f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )


def test_generated_modules_type_check_for_callers(tmp_path: Path) -> None:
    """Code calling the generated modules passes the project's strict mypy, and a wrong field
    or type is caught: the .pyi stubs regen emits are what mypy reads."""
    good = tmp_path / "good_caller.py"
    good.write_text(
        textwrap.dedent(
            """\
            import grpc

            from buildvault.digest import DigestFunction
            from buildvault.remote_apis import bs_grpc, bs_pb2, re_grpc, re_pb2


            def request(hashes: list[str]) -> re_pb2.FindMissingBlobsRequest:
                return re_pb2.FindMissingBlobsRequest(
                    instance_name="main",
                    blob_digests=[re_pb2.Digest(hash=h, size_bytes=1) for h in hashes],
                    digest_function=DigestFunction.BLAKE3.proto,
                )


            def sizes(response: re_pb2.BatchReadBlobsResponse) -> list[int]:
                return [entry.digest.size_bytes for entry in response.responses]


            def write(name: str) -> bs_pb2.WriteRequest:
                return bs_pb2.WriteRequest(resource_name=name, data=b"x", finish_write=True)


            def bind(channel: grpc.Channel, server: grpc.aio.Server, cas: re_grpc.CapabilitiesServicer) -> None:
                re_grpc.ContentAddressableStorageStub(channel)
                bs_grpc.ByteStreamStub(channel)
                re_grpc.add_CapabilitiesServicer_to_server(cas, server)
            """
        )
    )
    bad = tmp_path / "bad_caller.py"
    bad.write_text(
        textwrap.dedent(
            """\
            from buildvault.remote_apis import re_pb2


            def wrong_type() -> re_pb2.Digest:
                return re_pb2.Digest(hash=3, size_bytes=1)


            def wrong_field() -> re_pb2.Digest:
                return re_pb2.Digest(sha="ab", size_bytes=1)


            def wrong_result(digest: re_pb2.Digest) -> int:
                return digest.hash
            """
        )
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(REPO_ROOT / "pyproject.toml"),
            "--cache-dir",
            str(tmp_path / "mypy-cache"),
            "--no-error-summary",
            "--show-error-codes",
            str(good),
            str(bad),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert not [line for line in errors if "good_caller.py" in line], proc.stdout + proc.stderr
    codes = sorted(
        (int(line.split(":")[1]), line.rsplit("[", 1)[-1].rstrip("]")) for line in errors if "bad_caller.py" in line
    )
    assert codes == [(5, "arg-type"), (9, "call-arg"), (13, "return-value")], proc.stdout + proc.stderr


# --------------------------------------------------------------------------
# (b) wire-compatibility spot checks
# --------------------------------------------------------------------------


def test_digest_field_numbers() -> None:
    assert _numbers(re_pb2.Digest) == {"hash": 1, "size_bytes": 2}
    fields = re_pb2.Digest.DESCRIPTOR.fields_by_name
    assert fields["hash"].type == FieldDescriptor.TYPE_STRING
    assert fields["size_bytes"].type == FieldDescriptor.TYPE_INT64


def test_action_result_field_numbers() -> None:
    assert _numbers(re_pb2.ActionResult) == {
        "output_files": 2,
        "output_directories": 3,
        "exit_code": 4,
        "stdout_raw": 5,
        "stdout_digest": 6,
        "stderr_raw": 7,
        "stderr_digest": 8,
        "execution_metadata": 9,
        "output_file_symlinks": 10,
        "output_directory_symlinks": 11,
        "output_symlinks": 12,
    }


def test_action_and_command_field_numbers() -> None:
    assert _numbers(re_pb2.Action) == {
        "command_digest": 1,
        "input_root_digest": 2,
        "timeout": 6,
        "do_not_cache": 7,
        "salt": 9,
        "platform": 10,
    }
    assert _numbers(re_pb2.Command) == {
        "arguments": 1,
        "environment_variables": 2,
        "output_files": 3,
        "output_directories": 4,
        "platform": 5,
        "working_directory": 6,
        "output_paths": 7,
        "output_node_properties": 8,
        "output_directory_format": 9,
    }
    deprecated = {
        f.name for f in re_pb2.Command.DESCRIPTOR.fields if f.GetOptions().deprecated
    }
    assert deprecated == {"output_files", "output_directories", "platform"}


def test_node_field_numbers_skip_reserved_slots() -> None:
    assert _numbers(re_pb2.FileNode) == {
        "name": 1,
        "digest": 2,
        "is_executable": 4,
        "node_properties": 6,
    }
    assert _numbers(re_pb2.OutputFile) == {
        "path": 1,
        "digest": 2,
        "is_executable": 4,
        "contents": 5,
        "node_properties": 7,
    }
    assert _numbers(re_pb2.OutputDirectory) == {
        "path": 1,
        "tree_digest": 3,
        "is_topologically_sorted": 4,
        "root_directory_digest": 5,
    }
    assert _numbers(re_pb2.ExecuteRequest) == {
        "instance_name": 1,
        "skip_cache_lookup": 3,
        "action_digest": 6,
        "execution_policy": 7,
        "results_cache_policy": 8,
        "digest_function": 9,
        "inline_stdout": 10,
        "inline_stderr": 11,
        "inline_output_files": 12,
    }
    assert _numbers(re_pb2.ExecutedActionMetadata)["virtual_execution_duration"] == 12
    assert _numbers(re_pb2.ExecutedActionMetadata)["auxiliary_metadata"] == 11


def test_digest_function_fields_everywhere() -> None:
    expected = {
        re_pb2.ExecuteRequest: 9,
        re_pb2.ExecuteOperationMetadata: 6,
        re_pb2.GetActionResultRequest: 6,
        re_pb2.UpdateActionResultRequest: 5,
        re_pb2.FindMissingBlobsRequest: 3,
        re_pb2.BatchUpdateBlobsRequest: 5,
        re_pb2.BatchReadBlobsRequest: 4,
        re_pb2.GetTreeRequest: 5,
        re_pb2.SplitBlobRequest: 3,
        re_pb2.SpliceBlobRequest: 4,
    }
    for cls, number in expected.items():
        field = cls.DESCRIPTOR.fields_by_name["digest_function"]
        assert field.number == number, cls.__name__
        assert field.enum_type.full_name == f"{RE_PKG}.DigestFunction.Value"


def test_enums() -> None:
    assert _enum(re_pb2.DigestFunction.Value) == {
        "UNKNOWN": 0,
        "SHA256": 1,
        "SHA1": 2,
        "MD5": 3,
        "VSO": 4,
        "SHA384": 5,
        "SHA512": 6,
        "MURMUR3": 7,
        "SHA256TREE": 8,
        "BLAKE3": 9,
        "GITSHA1": 10,
    }
    assert re_pb2.DigestFunction.BLAKE3 == 9
    assert _enum(re_pb2.Compressor.Value) == {
        "IDENTITY": 0,
        "ZSTD": 1,
        "DEFLATE": 2,
        "BROTLI": 3,
    }
    assert re_pb2.Compressor.ZSTD == 1
    assert _enum(re_pb2.ExecutionStage.Value) == {
        "UNKNOWN": 0,
        "CACHE_CHECK": 1,
        "QUEUED": 2,
        "EXECUTING": 3,
        "COMPLETED": 4,
    }
    assert _enum(re_pb2.SymlinkAbsolutePathStrategy.Value) == {
        "UNKNOWN": 0,
        "DISALLOWED": 1,
        "ALLOWED": 2,
    }
    assert _enum(re_pb2.ChunkingFunction.Value) == {
        "UNKNOWN": 0,
        "FAST_CDC_2020": 1,
        "REP_MAX_CDC": 2,
    }
    assert re_pb2.Command.OutputDirectoryFormat.DESCRIPTOR.values_by_name[
        "TREE_AND_DIRECTORY"
    ].number == 2


def test_capabilities_field_numbers() -> None:
    assert _numbers(re_pb2.CacheCapabilities) == {
        "digest_functions": 1,
        "action_cache_update_capabilities": 2,
        "cache_priority_capabilities": 3,
        "max_batch_total_size_bytes": 4,
        "symlink_absolute_path_strategy": 5,
        "supported_compressors": 6,
        "supported_batch_update_compressors": 7,
        "max_cas_blob_size_bytes": 8,
        "split_blob_support": 9,
        "splice_blob_support": 10,
        "fast_cdc_2020_params": 11,
        "rep_max_cdc_params": 12,
    }
    assert _numbers(re_pb2.ExecutionCapabilities) == {
        "digest_function": 1,
        "exec_enabled": 2,
        "execution_priority_capabilities": 3,
        "supported_node_properties": 4,
        "digest_functions": 5,
    }
    assert _numbers(re_pb2.ServerCapabilities) == {
        "cache_capabilities": 1,
        "execution_capabilities": 2,
        "deprecated_api_version": 3,
        "low_api_version": 4,
        "high_api_version": 5,
    }
    assert (
        re_pb2.ServerCapabilities.DESCRIPTOR.fields_by_name["high_api_version"].message_type.full_name
        == "build.bazel.semver.SemVer"
    )
    assert _numbers(semver_pb2.SemVer) == {"major": 1, "minor": 2, "patch": 3, "prerelease": 4}


def test_request_metadata_field_numbers() -> None:
    assert _numbers(re_pb2.RequestMetadata) == {
        "tool_details": 1,
        "action_id": 2,
        "tool_invocation_id": 3,
        "correlated_invocations_id": 4,
        "action_mnemonic": 5,
        "target_id": 6,
        "configuration_id": 7,
    }
    assert _numbers(re_pb2.ToolDetails) == {"tool_name": 1, "tool_version": 2}


def test_bytestream_field_numbers() -> None:
    assert _numbers(bs_pb2.ReadRequest) == {"resource_name": 1, "read_offset": 2, "read_limit": 3}
    assert _numbers(bs_pb2.ReadResponse) == {"data": 10}
    assert _numbers(bs_pb2.WriteRequest) == {
        "resource_name": 1,
        "write_offset": 2,
        "finish_write": 3,
        "data": 10,
    }
    assert _numbers(bs_pb2.WriteResponse) == {"committed_size": 1}
    assert _numbers(bs_pb2.QueryWriteStatusResponse) == {"committed_size": 1, "complete": 2}


def test_service_names_and_streaming_shapes() -> None:
    def shapes(file_desc, service: str) -> tuple[str, dict]:
        svc = file_desc.services_by_name[service]
        return svc.full_name, {
            m.name: (
                m.input_type.full_name,
                m.output_type.full_name,
                m.client_streaming,
                m.server_streaming,
            )
            for m in svc.methods
        }

    op = "google.longrunning.Operation"
    assert shapes(re_pb2.DESCRIPTOR, "Execution") == (
        f"{RE_PKG}.Execution",
        {
            "Execute": (f"{RE_PKG}.ExecuteRequest", op, False, True),
            "WaitExecution": (f"{RE_PKG}.WaitExecutionRequest", op, False, True),
        },
    )
    assert shapes(re_pb2.DESCRIPTOR, "ActionCache") == (
        f"{RE_PKG}.ActionCache",
        {
            "GetActionResult": (f"{RE_PKG}.GetActionResultRequest", f"{RE_PKG}.ActionResult", False, False),
            "UpdateActionResult": (
                f"{RE_PKG}.UpdateActionResultRequest",
                f"{RE_PKG}.ActionResult",
                False,
                False,
            ),
        },
    )
    name, cas = shapes(re_pb2.DESCRIPTOR, "ContentAddressableStorage")
    assert name == "build.bazel.remote.execution.v2.ContentAddressableStorage"
    assert {k: v[2:] for k, v in cas.items()} == {
        "FindMissingBlobs": (False, False),
        "BatchUpdateBlobs": (False, False),
        "BatchReadBlobs": (False, False),
        "GetTree": (False, True),
        "SplitBlob": (False, False),
        "SpliceBlob": (False, False),
    }
    assert shapes(re_pb2.DESCRIPTOR, "Capabilities")[0] == f"{RE_PKG}.Capabilities"
    assert shapes(bs_pb2.DESCRIPTOR, "ByteStream") == (
        "google.bytestream.ByteStream",
        {
            "Read": ("google.bytestream.ReadRequest", "google.bytestream.ReadResponse", False, True),
            "Write": ("google.bytestream.WriteRequest", "google.bytestream.WriteResponse", True, False),
            "QueryWriteStatus": (
                "google.bytestream.QueryWriteStatusRequest",
                "google.bytestream.QueryWriteStatusResponse",
                False,
                False,
            ),
        },
    )


class _RecordingChannel:
    """Stands in for grpc.Channel; records the method paths a stub binds."""

    def __init__(self) -> None:
        self.paths: list[tuple[str, str]] = []

    def _record(self, kind):
        def bind(path, request_serializer=None, response_deserializer=None, _registered_method=None):
            self.paths.append((kind, path))
            return object()

        return bind

    def __getattr__(self, kind):
        if kind in {"unary_unary", "unary_stream", "stream_unary", "stream_stream"}:
            return self._record(kind)
        raise AttributeError(kind)


def test_grpc_stub_method_paths() -> None:
    channel = _RecordingChannel()
    re_grpc.ContentAddressableStorageStub(channel)
    re_grpc.ExecutionStub(channel)
    bs_grpc.ByteStreamStub(channel)
    paths = set(channel.paths)
    assert ("unary_unary", f"/{RE_PKG}.ContentAddressableStorage/FindMissingBlobs") in paths
    assert ("unary_stream", f"/{RE_PKG}.ContentAddressableStorage/GetTree") in paths
    assert ("unary_stream", f"/{RE_PKG}.Execution/Execute") in paths
    assert ("unary_stream", "/google.bytestream.ByteStream/Read") in paths
    assert ("stream_unary", "/google.bytestream.ByteStream/Write") in paths
    assert ("unary_unary", "/google.bytestream.ByteStream/QueryWriteStatus") in paths


def test_serialised_bytes_match_hand_encoding() -> None:
    # Digest{hash="abc", size_bytes=300}: tag 1/LEN, tag 2/VARINT 300 = ac 02.
    digest = re_pb2.Digest(hash="abc", size_bytes=300)
    assert digest.SerializeToString() == b"\x0a\x03abc\x10\xac\x02"

    # ActionResult: exit_code (4/VARINT), stdout_digest (6/LEN), output_symlinks (12/LEN).
    result = re_pb2.ActionResult(
        exit_code=1,
        stdout_digest=re_pb2.Digest(hash="ab", size_bytes=2),
        output_symlinks=[re_pb2.OutputSymlink(path="l", target="t")],
    )
    assert result.SerializeToString(deterministic=True) == bytes.fromhex(
        "2001" "3206" "0a026162" "1002" "6206" "0a016c" "120174"
    )

    # CacheCapabilities: packed enums (1), int64 (8), bool (9), message (12).
    caps = re_pb2.CacheCapabilities(
        digest_functions=[re_pb2.DigestFunction.SHA256, re_pb2.DigestFunction.BLAKE3],
        max_cas_blob_size_bytes=1024,
        split_blob_support=True,
        rep_max_cdc_params=re_pb2.RepMaxCdcParams(min_chunk_size_bytes=64, horizon_size_bytes=128),
    )
    assert caps.SerializeToString(deterministic=True) == bytes.fromhex(
        "0a020109" "408008" "4801" "6205" "0840" "108001"
    )

    # ByteStream WriteRequest: data is field 10 -> tag 0x52.
    write = bs_pb2.WriteRequest(resource_name="u", write_offset=5, finish_write=True, data=b"x")
    assert write.SerializeToString() == b"\x0a\x01u\x10\x05\x18\x01\x52\x01x"


def test_parse_hand_encoded_bytes() -> None:
    # ExecuteRequest{instance_name="i", action_digest{hash="h", size_bytes=1}, digest_function=BLAKE3}
    raw = b"\x0a\x01i" + b"\x32\x05\x0a\x01h\x10\x01" + b"\x48\x09"
    req = re_pb2.ExecuteRequest.FromString(raw)
    assert req.instance_name == "i"
    assert req.action_digest == re_pb2.Digest(hash="h", size_bytes=1)
    assert req.digest_function == re_pb2.DigestFunction.BLAKE3

    # BatchReadBlobsResponse.Response: compressor is field 4, status field 3.
    raw = b"\x0a\x06" + b"\x12\x02zz" + b"\x20\x01"
    outer = re_pb2.BatchReadBlobsResponse.FromString(raw)
    (entry,) = outer.responses
    assert entry.data == b"zz"
    assert entry.compressor == re_pb2.Compressor.ZSTD


def test_execute_response_round_trips_through_operation() -> None:
    response = re_pb2.ExecuteResponse(
        result=re_pb2.ActionResult(exit_code=3),
        cached_result=True,
        server_logs={"worker": re_pb2.LogFile(digest=re_pb2.Digest(hash="a", size_bytes=1))},
    )
    op = operations_pb2.Operation(name="operations/x", done=True)
    op.response.Pack(response)
    meta = re_pb2.ExecuteOperationMetadata(stage=re_pb2.ExecutionStage.COMPLETED)
    op.metadata.Pack(meta)

    parsed = operations_pb2.Operation.FromString(op.SerializeToString())
    assert parsed.response.type_url.endswith(f"/{RE_PKG}.ExecuteResponse")
    out = re_pb2.ExecuteResponse()
    assert parsed.response.Unpack(out)
    assert out == response
    out_meta = re_pb2.ExecuteOperationMetadata()
    assert parsed.metadata.Unpack(out_meta)
    assert out_meta.stage == re_pb2.ExecutionStage.COMPLETED


@pytest.mark.parametrize(
    "module",
    ["re_pb2", "re_grpc", "bs_pb2", "bs_grpc", "semver_pb2"],
)
def test_package_aliases_exported(module: str) -> None:
    import buildvault.remote_apis as pkg

    assert module in pkg.__all__
    assert getattr(pkg, module) is not None
