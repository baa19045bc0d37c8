"""SOC routing with real Bazel 4.2.3: bazel_example (the csrc-like operator tree) built with
--remote_executor against two local pools, `soc=ascend910b1,cann=8.0.RC3` and `soc=ascend310p`.
The execution platform gen_bazel.py writes (`//:remote_ascend910b1`) sends every action to the
910b1 pool, except the third-party library, whose per-target exec_properties override `soc`
(and drop `cann`): each action's `execution_metadata.worker` shows the pool its properties
name, never the other. Again with both pools as `buildvault worker` processes on a Redis queue.

And the remote execution commands of bazel_example/README.md and the main README, run as
written there (only the server's port differs): a remote build on the SOC pool, all remote cache
hits after `bazel clean`, and all hits again from a second output base whose caller has another
PATH (`--incompatible_strict_action_env`); without that flag, none.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
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
# Per-target exec_properties win over the platform's, key by key; an empty value drops a key.
TINYFMT_OVERRIDE = '    exec_properties = {"soc": "ascend310p", "cann": ""},\n'


@pytest.fixture
def soc_workspace(tmp_path, require_bazel):
    template = tmp_path / "template"
    shutil.copytree(EXAMPLE, template, ignore=shutil.ignore_patterns("build", "_build", "bazel-*"))
    subprocess.run([sys.executable, str(template / "gen_bazel.py"), str(template)], check=True, capture_output=True)
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
        "--extra_execution_platforms=//:remote_ascend910b1",
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


# -- the READMEs' remote execution commands, as written -----------------------------------------

README_PORT = "127.0.0.1:9092"


def readme_commands(readme: Path) -> tuple[list[str], list[list[str]]]:
    """The `buildvault serve` arguments and the `bazel build` flags of `readme`'s first sh block
    that starts a server and runs Bazel with --remote_executor (continuation lines joined,
    comments dropped)."""
    blocks = re.findall(r"```sh\n(.*?)```", readme.read_text(), re.S)
    block = next(b for b in blocks if "buildvault serve" in b and "--remote_executor" in b)
    lines = [line for line in block.replace("\\\n", " ").splitlines() if line.strip() and not line.startswith("#")]
    serve = next(shlex.split(line)[2:] for line in lines if line.startswith("buildvault serve "))
    builds = [shlex.split(line)[3:] for line in lines if line.startswith("bazel build //... ")]
    assert builds and all(f"--remote_executor=grpc://{README_PORT}" in flags for flags in builds), builds
    return serve, builds


def at(flags: list[str], address: str) -> list[str]:
    return [flag.replace(README_PORT, address) for flag in flags]


@pytest.mark.parametrize("readme", ["bazel_example/README.md", "README.md"])
def test_readme_remote_execution_commands_build_and_share_hits_across_paths(tmp_path, servers, require_bazel, readme):
    serve, builds = readme_commands(EXAMPLE.parent / readme)
    server = servers("readme", *serve)
    template = tmp_path / "template"
    shutil.copytree(EXAMPLE, template, ignore=shutil.ignore_patterns("build", "_build", "bazel-*"))
    subprocess.run([sys.executable, str(template / "gen_bazel.py"), str(template)], check=True, capture_output=True)
    other_path = tmp_path / "other-bin"
    other_path.mkdir()
    other_env = {**os.environ, "PATH": f"{other_path}{os.pathsep}{os.environ['PATH']}"}
    first, last = at(builds[0], server.grpc_address), at(builds[-1], server.grpc_address)
    with contextlib.ExitStack() as stack:
        here = stack.enter_context(BazelWorkspace(tmp_path / "here", template=template))
        cold = here.build(*first, check=True).processes
        assert cold["remote"] == CACHEABLE and cold.cache_hits == 0, cold.line
        assert here.run_binary(BINARY).stdout.strip() == "csrc-demo:ok soc=ascend910b1 total=490"
        actions = executed_actions(server.grpc_address)
        assert len(actions) == CACHEABLE
        assert all("soc=ascend910b1" in worker and "cann=8.0.RC3" in worker for _, worker in actions), actions

        here.clean()
        again = here.build(*first, check=True).processes
        assert again["remote cache hit"] == CACHEABLE and again.executed == 0, again.line

        # Another output base (another checkout, its own Bazel server), another PATH.
        there = stack.enter_context(BazelWorkspace(tmp_path / "there", template=template, env=other_env))
        shared = there.build(*last, check=True).processes
        assert shared["remote cache hit"] == CACHEABLE and shared.executed == 0, shared.line
        assert there.run_binary(BINARY).stdout.strip() == "csrc-demo:ok soc=ascend910b1 total=490"

        if readme != "bazel_example/README.md":
            return  # the measurement below is the example README's; one run of it is enough
        # The same without --incompatible_strict_action_env: the PATH is in every key, no hit.
        loose = [flag for flag in first if flag != "--incompatible_strict_action_env"]
        assert len(loose) == len(first) - 1
        elsewhere = stack.enter_context(BazelWorkspace(tmp_path / "elsewhere", template=template, env=other_env))
        missed = elsewhere.build(*loose, check=True).processes
        assert missed.cache_hits == 0 and missed["remote"] == CACHEABLE, missed.line
