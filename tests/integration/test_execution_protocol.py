"""Remote execution against a real `buildvault serve` with local workers, through a grpcio client:
the protocol's edges (stages, errors before queueing, outputs, timeouts, cancel, dedup)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid

import grpc
import pytest
from execution_client import (
    ActionSpec,
    execute,
    execution_stub,
    final_response,
    operations_stub,
    processes_with,
    response_of,
    stage,
)
from google.longrunning import operations_pb2
from google.rpc import code_pb2
from polling import wait_for, wait_until
from reapi_client import CLIENT_OPTIONS, make_stubs, precondition_violations, read
from server_process import ServerProcess

from buildvault.remote_apis import re_pb2

CACHE_CHECK, QUEUED, EXECUTING, COMPLETED = (
    re_pb2.ExecutionStage.CACHE_CHECK,
    re_pb2.ExecutionStage.QUEUED,
    re_pb2.ExecutionStage.EXECUTING,
    re_pb2.ExecutionStage.COMPLETED,
)
POOLS = "1:soc=ascend910b1,cann=8.0.RC3;1:soc=ascend310p;2"


@pytest.fixture(scope="module")
def exec_server(tmp_path_factory) -> ServerProcess:
    server = ServerProcess(
        tmp_path_factory.mktemp("exec") / "data",
        name="exec",
        extra_args=[
            "--local-workers",
            POOLS,
            "--execution-grace",
            "1",
            "--max-action-timeout",
            "120",
            "--action-timeout",
            "60",
        ],
    )
    server.start()
    yield server
    try:
        server.stop()
    finally:
        server.kill()


@pytest.fixture
async def channel(exec_server):
    async with grpc.aio.insecure_channel(exec_server.grpc_address, options=CLIENT_OPTIONS) as channel:
        await channel.channel_ready()
        yield channel


def unique() -> str:
    return uuid.uuid4().hex


async def test_capabilities_offer_execution(channel):
    caps = await make_stubs(channel).capabilities.GetCapabilities(re_pb2.GetCapabilitiesRequest())
    execution = caps.execution_capabilities
    assert execution.exec_enabled
    assert execution.digest_function == re_pb2.DigestFunction.SHA256  # the legacy field Bazel 4.2.3 needs
    assert list(execution.digest_functions) == [re_pb2.DigestFunction.SHA256]
    (priorities,) = execution.execution_priority_capabilities.priorities
    assert priorities.min_priority < 0 < priorities.max_priority


async def test_stages_in_order_result_cached_then_served_from_cache(channel):
    stubs = make_stubs(channel)
    spec = ActionSpec(
        ["/bin/sh", "-c", f"cat in/a > out/x; echo {unique()}"], inputs={"in/a": b"hello"}, output_files=["out/x"]
    )
    action_digest = await spec.upload(stubs)
    messages = await execute(channel, action_digest)
    assert [stage(m) for m in messages] == [CACHE_CHECK, QUEUED, EXECUTING, COMPLETED]
    assert not any(m.done for m in messages[:-1])
    response = final_response(messages)
    assert response.status.code == code_pb2.OK and not response.cached_result
    result = response.result
    assert result.exit_code == 0
    (out,) = result.output_files
    assert out.path == "out/x" and await read(stubs, out.digest) == b"hello"
    metadata = result.execution_metadata
    assert metadata.worker
    for name in (
        "queued",
        "worker_start",
        "input_fetch_start",
        "input_fetch_completed",
        "execution_start",
        "execution_completed",
        "output_upload_start",
        "output_upload_completed",
        "worker_completed",
    ):
        assert metadata.HasField(f"{name}_timestamp"), name
    # The ActionCache has it (written before done)...
    cached = await stubs.ac.GetActionResult(re_pb2.GetActionResultRequest(action_digest=action_digest))
    assert cached.output_files[0].digest == out.digest
    # ...so the next Execute is a cache hit; skip_cache_lookup runs it again.
    again = await execute(channel, action_digest)
    assert [stage(m) for m in again] == [CACHE_CHECK, COMPLETED] and final_response(again).cached_result
    rerun = final_response(await execute(channel, action_digest, skip_cache_lookup=True))
    assert not rerun.cached_result
    assert rerun.result.execution_metadata.worker_start_timestamp != metadata.worker_start_timestamp


async def test_environment_is_exactly_the_commands(channel):
    stubs = make_stubs(channel)
    env = {"PATH": "/usr/bin:/bin", "ONLY_THIS": unique()}
    action_digest = await ActionSpec(["/usr/bin/env"], env=env).upload(stubs)
    response = final_response(await execute(channel, action_digest))
    printed = (await read(stubs, response.result.stdout_digest)).decode().splitlines()
    assert sorted(printed) == sorted(f"{k}={v}" for k, v in env.items())


async def test_failing_command_is_not_cached(channel):
    stubs = make_stubs(channel)
    action_digest = await ActionSpec(["/bin/sh", "-c", f"echo {unique()} >&2; exit 3"]).upload(stubs)
    response = final_response(await execute(channel, action_digest))
    assert response.status.code == code_pb2.OK and response.result.exit_code == 3
    assert (await read(stubs, response.result.stderr_digest)).strip()
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stubs.ac.GetActionResult(re_pb2.GetActionResultRequest(action_digest=action_digest))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


async def test_missing_blobs_are_failed_precondition_with_exact_subjects(channel):
    stubs = make_stubs(channel)
    spec = ActionSpec(["/bin/cat", "a/f"], inputs={"a/f": unique().encode()})
    action, blobs = spec.action()
    command_data, tree = blobs[0], blobs[1:]
    action_digest = await spec.upload(stubs, skip=("command", "inputs"))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await execute(channel, action_digest)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    violations = precondition_violations(error.value)
    # the command and the root Directory (its children are unknown until it is uploaded)
    wanted = {f"blobs/{hashlib.sha256(b).hexdigest()}/{len(b)}" for b in (command_data, tree[-1])}
    assert {subject for kind, subject in violations} == wanted and {k for k, _ in violations} == {"MISSING"}
    # With the Directories there, exactly the missing file is named.
    file_blob = spec.inputs["a/f"]
    await spec.upload(stubs)
    missing_file = ActionSpec(["/bin/cat", "a/f"], inputs={"a/f": file_blob + b"!"})
    _, more = missing_file.action()
    from reapi_client import batch_update

    await batch_update(stubs, [b for b in more if b != file_blob + b"!"])
    digest_two = await missing_file.upload(stubs, skip=("command", "inputs"))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await execute(channel, digest_two)
    subject = f"blobs/{hashlib.sha256(file_blob + b'!').hexdigest()}/{len(file_blob) + 1}"
    assert precondition_violations(error.value) == [("MISSING", subject)]
    # And an action that is not there at all.
    ghost = re_pb2.Digest(hash=hashlib.sha256(b"no such action").hexdigest(), size_bytes=14)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await execute(channel, ghost)
    assert precondition_violations(error.value) == [("MISSING", f"blobs/{ghost.hash}/14")]


async def test_timeout_above_maximum_is_invalid_argument(channel):
    action_digest = await ActionSpec(["/bin/true"], timeout=121).upload(make_stubs(channel))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await execute(channel, action_digest)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "maximum" in error.value.details()


async def test_unknown_platform_key_is_invalid_argument(channel):
    action_digest = await ActionSpec(["/bin/true"], platform={"gpu-kind": "h100"}).upload(make_stubs(channel))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await execute(channel, action_digest)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "gpu-kind" in error.value.details()


async def test_platform_no_pool_offers_is_failed_precondition_at_once(channel):
    action_digest = await ActionSpec(["/bin/true"], platform={"soc": "ascend999"}).upload(make_stubs(channel))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await asyncio.wait_for(execute(channel, action_digest), 10)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "soc=ascend999" in error.value.details()


async def test_actions_run_in_the_pool_their_platform_names(channel):
    stubs = make_stubs(channel)
    for soc, cann in (("ascend910b1", "8.0.RC3"), ("ascend310p", None)):
        wanted = {"soc": soc, **({"cann": cann} if cann else {})}
        # Command.platform says the other SOC: Action.platform wins, key by key.
        spec = ActionSpec(["/bin/echo", unique()], platform=wanted, command_platform={"soc": "other"})
        response = final_response(await execute(channel, await spec.upload(stubs)))
        worker = response.result.execution_metadata.worker
        assert f"soc={soc}" in worker, worker
    plain = final_response(await execute(channel, await ActionSpec(["/bin/echo", unique()]).upload(stubs)))
    assert plain.result.exit_code == 0


async def test_wait_execution_unknown_name_is_not_found(channel):
    request = re_pb2.WaitExecutionRequest(name=f"operations/{uuid.uuid4()}")
    with pytest.raises(grpc.aio.AioRpcError) as error:
        [op async for op in execution_stub(channel).WaitExecution(request)]
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


async def _executing(channel, action_digest, **kwargs):
    """Start an Execute; return the call and its name once the stream says EXECUTING."""
    call = execution_stub(channel).Execute(re_pb2.ExecuteRequest(action_digest=action_digest, **kwargs))
    messages = []
    async for message in call:
        messages.append(message)
        if stage(message) == EXECUTING:
            return call, message.name, messages
    raise AssertionError(f"the stream ended before EXECUTING: {messages}")


async def test_identical_in_flight_actions_share_one_run(channel):
    stubs = make_stubs(channel)
    spec = ActionSpec(["/bin/sh", "-c", f"sleep 1; echo {unique()}"])
    action_digest = await spec.upload(stubs)
    first, _, _ = await _executing(channel, action_digest)
    second = await execute(channel, action_digest)
    rest = [m async for m in first]
    one, two = final_response(rest), final_response(second)
    assert one.result.execution_metadata == two.result.execution_metadata  # one run, one worker start


async def test_do_not_cache_actions_run_separately(channel):
    stubs = make_stubs(channel)
    spec = ActionSpec(["/bin/sh", "-c", f"sleep 1; echo {unique()}"], do_not_cache=True)
    action_digest = await spec.upload(stubs)
    first, _, _ = await _executing(channel, action_digest)
    second = final_response(await execute(channel, action_digest))
    one = final_response([m async for m in first])
    starts = {r.result.execution_metadata.worker_start_timestamp.ToNanoseconds() for r in (one, second)}
    assert len(starts) == 2
    with pytest.raises(grpc.aio.AioRpcError):
        await stubs.ac.GetActionResult(re_pb2.GetActionResultRequest(action_digest=action_digest))


async def test_cancel_operation_kills_the_action(channel):
    marker = f"{int.from_bytes(os.urandom(3), 'big') % 1000 + 500}.{os.getpid()}"
    action_digest = await ActionSpec(["/bin/sh", "-c", f"sleep {marker}"]).upload(make_stubs(channel))
    call, name, _ = await _executing(channel, action_digest)
    wait_for(lambda: processes_with(f"sleep {marker}"), 10, "the action to run")
    await operations_stub(channel).CancelOperation(operations_pb2.CancelOperationRequest(name=name))
    response = final_response([m async for m in call])
    assert response.status.code == code_pb2.CANCELLED
    await wait_until(lambda: not processes_with(f"sleep {marker}"), 10, "the cancelled action's processes to end")
    got = await operations_stub(channel).GetOperation(operations_pb2.GetOperationRequest(name=name))
    assert got.done and response_of(got).status.code == code_pb2.CANCELLED


async def test_client_gone_past_the_grace_kills_the_action(channel):
    marker = f"{int.from_bytes(os.urandom(3), 'big') % 1000 + 1500}.{os.getpid()}"
    action_digest = await ActionSpec(["/bin/sh", "-c", f"sleep {marker}"]).upload(make_stubs(channel))
    call, name, _ = await _executing(channel, action_digest)
    wait_for(lambda: processes_with(f"sleep {marker}"), 10, "the action to run")
    call.cancel()  # the client goes away; the server's grace is 1 s
    await wait_until(lambda: not processes_with(f"sleep {marker}"), 20, "the abandoned action to be killed")

    async def cancelled():
        got = await operations_stub(channel).GetOperation(operations_pb2.GetOperationRequest(name=name))
        return got.done and response_of(got).status.code == code_pb2.CANCELLED

    await wait_until(cancelled, 10, "the abandoned operation to end CANCELLED")


async def test_timeout_is_deadline_exceeded_with_output_and_no_cache_entry(channel):
    stubs = make_stubs(channel)
    marker = f"{int.from_bytes(os.urandom(3), 'big') % 1000 + 2500}.{os.getpid()}"
    spec = ActionSpec(
        ["/bin/sh", "-c", f"echo before-the-kill; echo partial > out; sleep {marker}"], output_files=["out"], timeout=1
    )
    action_digest = await spec.upload(stubs)
    response = await asyncio.wait_for(execute(channel, action_digest), 30)
    response = final_response(response)
    assert response.status.code == code_pb2.DEADLINE_EXCEEDED
    assert await read(stubs, response.result.stdout_digest) == b"before-the-kill\n"
    assert [f.path for f in response.result.output_files] == ["out"]
    assert not processes_with(f"sleep {marker}")
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stubs.ac.GetActionResult(re_pb2.GetActionResultRequest(action_digest=action_digest))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


TREE_SCRIPT = (
    "mkdir -p d/sub/deeper; echo a > d/a; echo b > d/sub/b; echo c > d/sub/deeper/c; ln -s a d/link; "
    "echo f > f; ln -s f flink; mkdir real; ln -s real dlink"
)


def _check_tree(tree: re_pb2.Tree) -> None:
    """Every DirectoryNode's digest is the hash of one of the Tree's children."""
    children = {hashlib.sha256(c.SerializeToString(deterministic=True)).hexdigest(): c for c in tree.children}
    names = {}

    def walk(directory, prefix):
        for node in directory.files:
            names[prefix + node.name] = "file"
        for link in directory.symlinks:
            names[prefix + link.name] = f"-> {link.target}"
        for node in directory.directories:
            assert node.digest.hash in children, node
            walk(children[node.digest.hash], prefix + node.name + "/")

    walk(tree.root, "")
    assert names == {"a": "file", "link": "-> a", "sub/b": "file", "sub/deeper/c": "file"}, names


async def test_old_output_fields_tree_and_symlinks(channel):
    stubs = make_stubs(channel)
    spec = ActionSpec(
        ["/bin/sh", "-c", f"{TREE_SCRIPT}; : {unique()}"],
        output_files=["f", "flink"],
        output_directories=["d", "dlink"],
    )
    result = final_response(await execute(channel, await spec.upload(stubs))).result
    assert [f.path for f in result.output_files] == ["f"]
    assert [(s.path, s.target) for s in result.output_file_symlinks] == [("flink", "f")]
    assert [(s.path, s.target) for s in result.output_directory_symlinks] == [("dlink", "real")]
    (directory,) = result.output_directories
    assert directory.path == "d"
    _check_tree(re_pb2.Tree.FromString(await read(stubs, directory.tree_digest)))


async def test_output_paths(channel):
    stubs = make_stubs(channel)
    spec = ActionSpec(
        ["/bin/sh", "-c", f"mkdir -p gen/x; {TREE_SCRIPT}; : {unique()}"],
        output_paths=["d", "f", "flink", "dlink", "gen/x/absent"],
    )
    result = final_response(await execute(channel, await spec.upload(stubs))).result
    assert [f.path for f in result.output_files] == ["f"]
    assert [d.path for d in result.output_directories] == ["d"]
    assert sorted((s.path, s.target) for s in result.output_symlinks) == [("dlink", "real"), ("flink", "f")]
    _check_tree(re_pb2.Tree.FromString(await read(stubs, result.output_directories[0].tree_digest)))


async def test_list_operations_includes_a_finished_one(channel):
    stubs = make_stubs(channel)
    messages = await execute(channel, await ActionSpec(["/bin/echo", unique()]).upload(stubs))
    listed = await operations_stub(channel).ListOperations(operations_pb2.ListOperationsRequest())
    assert messages[-1].name in {op.name for op in listed.operations}


async def test_execution_refused_on_a_non_loopback_listener(buildvault_server_factory):
    server = buildvault_server_factory("open", grpc_address="0.0.0.0:0", extra_args=["--local-workers", "1"])
    port = server.grpc_address.rpartition(":")[2]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CLIENT_OPTIONS) as channel:
        caps = await make_stubs(channel).capabilities.GetCapabilities(re_pb2.GetCapabilitiesRequest())
        assert not caps.execution_capabilities.exec_enabled
        action_digest = await ActionSpec(["/bin/true"]).upload(make_stubs(channel))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await execute(channel, action_digest)
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED and "--execution open" in error.value.details()


async def test_no_local_workers_means_no_execution(buildvault_server_factory):
    server = buildvault_server_factory("off", extra_args=["--local-workers", "0"])
    async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
        caps = await make_stubs(channel).capabilities.GetCapabilities(re_pb2.GetCapabilitiesRequest())
        assert not caps.HasField("execution_capabilities")
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await execute(channel, await ActionSpec(["/bin/true"]).upload(make_stubs(channel)))
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
