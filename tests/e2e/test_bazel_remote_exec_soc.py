"""SOC routing with real Bazel 4.2.3: bazel_example (the csrc-like operator tree) built with
--remote_executor against two local pools, `soc=ascend910b1,cann=8.0.RC3` and `soc=ascend310p`.
The execution platform's exec_properties send every action to the 910b1 pool, except the
third-party library, whose per-target exec_properties override `soc` (and drop `cann`): each
action's `execution_metadata.worker` shows the pool its properties name, never the other.
Again with both pools as `buildvault worker` processes on a Redis queue."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from bazel_harness import BazelWorkspace
from google.longrunning import operations_pb2, operations_pb2_grpc
from redis_process import RedisProcess, WorkerProcess, wait_workers

from buildvault.remote_apis import re_grpc, re_pb2

pytestmark = pytest.mark.timeout(900)

EXAMPLE = Path(__file__).resolve().parents[2] / "bazel_example"
BINARY = "csrc/op_registry_demo"
# 20 C++ compiles + 1 genrule + 8 links/archives (tests/launcher/test_bazel_example.py)
CACHEABLE = 29
POOLS = "1:soc=ascend910b1,cann=8.0.RC3;1:soc=ascend310p"
PLATFORM = """
platform(
    name = "npu_910b1",
    parents = ["@local_config_platform//:host"],
    exec_properties = {"soc": "ascend910b1", "cann": "8.0.RC3"},
)
"""
# Per-target exec_properties win over the platform's, key by key; an empty value drops a key.
TINYFMT_OVERRIDE = '    exec_properties = {"soc": "ascend310p", "cann": ""},\n'


@pytest.fixture
def soc_workspace(tmp_path, require_bazel):
    template = tmp_path / "template"
    shutil.copytree(EXAMPLE, template, ignore=shutil.ignore_patterns("build", "_build", "bazel-*"))
    subprocess.run([sys.executable, str(template / "gen_bazel.py"), str(template)], check=True, capture_output=True)
    with open(template / "BUILD.bazel", "a") as f:
        f.write(PLATFORM)
    tinyfmt = template / "csrc/third_party/tinyfmt/BUILD.bazel"
    text = tinyfmt.read_text()
    assert '    name = "tinyfmt",\n' in text
    tinyfmt.write_text(text.replace('    name = "tinyfmt",\n', '    name = "tinyfmt",\n' + TINYFMT_OVERRIDE, 1))
    ws = BazelWorkspace(tmp_path / "bazel", template=template)
    yield ws
    ws.shutdown()


def read_blob(cas: re_grpc.ContentAddressableStorageStub, digest: re_pb2.Digest) -> bytes:
    (blob,) = cas.BatchReadBlobs(re_pb2.BatchReadBlobsRequest(digests=[digest])).responses
    assert blob.status.code == 0, blob.status
    return blob.data


def executed_actions(address: str) -> list[tuple[list[str], str]]:
    """(output paths, worker) of every action the server executed (its finished operations)."""
    out = []
    with grpc.insecure_channel(address) as channel:
        operations = operations_pb2_grpc.OperationsStub(channel)
        cas = re_grpc.ContentAddressableStorageStub(channel)
        listed = operations.ListOperations(operations_pb2.ListOperationsRequest()).operations
        for operation in listed:
            response = re_pb2.ExecuteResponse()
            assert operation.done and operation.response.Unpack(response)
            if response.cached_result:
                continue
            metadata = re_pb2.ExecuteOperationMetadata()
            operation.metadata.Unpack(metadata)
            action = re_pb2.Action.FromString(read_blob(cas, metadata.action_digest))
            command = re_pb2.Command.FromString(read_blob(cas, action.command_digest))
            out.append(([*command.output_files, *command.output_paths], response.result.execution_metadata.worker))
    return out


def build_and_check_routing(soc_workspace, server, pool_a: str, pool_b: str) -> None:
    flags = (
        f"--remote_executor=grpc://{server.grpc_address}",
        "--spawn_strategy=remote",
        "--noremote_local_fallback",
        "--extra_execution_platforms=//:npu_910b1",
    )
    build = soc_workspace.build(*flags, check=True).processes
    assert build["remote"] == CACHEABLE, build.line
    assert soc_workspace.run_binary(BINARY).stdout.strip() == "csrc-demo:ok soc=ascend910b1 total=490"

    actions = executed_actions(server.grpc_address)
    assert len(actions) == CACHEABLE
    third_party = [worker for outputs, worker in actions if any("third_party/tinyfmt" in p for p in outputs)]
    others = [worker for outputs, worker in actions if not any("third_party/tinyfmt" in p for p in outputs)]
    assert len(third_party) == 3  # 2 compiles + the archive
    assert all(pool_b in worker for worker in third_party), third_party
    assert all(pool_a in worker for worker in others), others


def test_bazel_actions_run_in_the_pool_their_platform_names(soc_workspace, servers):
    server = servers("soc", "--local-workers", POOLS)
    build_and_check_routing(soc_workspace, server, "[cann=8.0.RC3,soc=ascend910b1]", "[soc=ascend310p]")


def test_bazel_routing_with_redis_workers(soc_workspace, servers, tmp_path):
    with RedisProcess(tmp_path / "redis") as redis:
        server = servers("soc-redis", "--queue", redis.url)
        started = [
            WorkerProcess(server.grpc_address, redis.url, "soc=ascend910b1,cann=8.0.RC3", tmp_path / "a" / "work",
                          "pool-910b1"),
            WorkerProcess(server.grpc_address, redis.url, "soc=ascend310p", tmp_path / "b" / "work", "pool-310p"),
        ]  # fmt: skip
        try:
            for worker in started:
                worker.start()
            wait_workers(server.status, 2)
            build_and_check_routing(soc_workspace, server, "pool-910b1", "pool-310p")
        finally:
            for worker in started:
                worker.stop()
