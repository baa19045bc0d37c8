"""Redis mode beyond one server: operations and in-flight dedup shared by two servers on one real
redis-server; CancelOperation of queued and running jobs on a `buildvault worker`; priority bands.

Actions that must wait wait for a file the test creates (the workers run `--sandbox none`, so
they see the test's directory); every ordering asserted is read from the workers' own records.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid

import grpc
import pytest
import redis as redis_client
from execution_client import ActionSpec, execution_stub, final_response, operations_stub, processes_with, stage
from google.longrunning import operations_pb2
from google.rpc import code_pb2
from polling import wait_for, wait_until
from reapi_client import CLIENT_OPTIONS, make_stubs
from redis_process import RedisProcess, WorkerProcess, wait_workers

from buildvault.remote_apis import re_pb2

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def redis(tmp_path):
    with RedisProcess(tmp_path / "redis") as process:
        yield process


@pytest.fixture
def worker(tmp_path, redis):
    started: list[WorkerProcess] = []

    def start(server, name: str = "worker") -> WorkerProcess:
        process = WorkerProcess(server.grpc_address, redis.url, "", tmp_path / name / "work", name,
                                extra_args=("--sandbox", "none", "--concurrency", "1"))  # fmt: skip
        started.append(process)
        process.start()
        wait_workers(server.status, 1)
        return process

    yield start
    for process in started:
        process.stop()


def gated(gate, command: str, **kwargs) -> ActionSpec:
    """An action that runs `command` once the file `gate` exists."""
    return ActionSpec(["/bin/sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done; {command}"], **kwargs)


def started_jobs(url: str) -> list[str]:
    """The job ids workers reported starting, on every server's results stream, in order."""
    with redis_client.Redis.from_url(url) as r:
        started = []
        for stream in r.scan_iter("bv:results:*"):
            started += [f[b"id"].decode() for _, f in r.xrange(stream) if f.get(b"type") == b"started"]
        return started


def queued_entries(url: str) -> int:
    with redis_client.Redis.from_url(url) as r:
        return sum(r.xlen(stream) for stream in r.scan_iter("bv:jobs:*"))


async def _all(call):
    return [message async for message in call]


async def _rest(call):
    """The messages after those already read with `call.read()` (the two styles do not mix)."""
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


def _request(digest, priority: int = 0) -> re_pb2.ExecuteRequest:
    return re_pb2.ExecuteRequest(action_digest=digest, execution_policy=re_pb2.ExecutionPolicy(priority=priority))


async def test_two_servers_share_operations_and_in_flight_dedup(buildvault_server_factory, redis, worker, tmp_path):
    a = buildvault_server_factory("a", extra_args=["--queue", redis.url])
    b = buildvault_server_factory("b", extra_args=["--queue", redis.url])
    worker(a)
    gate = tmp_path / "go"
    spec = gated(gate, "head -c 16 /dev/urandom | od -An -tx1", salt=uuid.uuid4().bytes)
    async with (
        grpc.aio.insecure_channel(a.grpc_address, options=CLIENT_OPTIONS) as on_a,
        grpc.aio.insecure_channel(b.grpc_address, options=CLIENT_OPTIONS) as on_b,
    ):
        digest = await spec.upload(make_stubs(on_a))
        await spec.upload(make_stubs(on_b))  # B checks the inputs in its own CAS
        call_a = execution_stub(on_a).Execute(_request(digest))
        first = await call_a.read()
        name = first.name
        rest_a = asyncio.ensure_future(_rest(call_a))
        # B knows A's operation: GetOperation answers its state, WaitExecution follows it.
        got = await operations_stub(on_b).GetOperation(operations_pb2.GetOperationRequest(name=name))
        assert got.name == name and not got.done
        wait_call = execution_stub(on_b).WaitExecution(re_pb2.WaitExecutionRequest(name=name))
        first_waited = await wait_call.read()
        assert first_waited.name == name and not first_waited.done
        waited = asyncio.ensure_future(_rest(wait_call))
        # The same action Executed on B joins A's job instead of running again (its first message
        # comes once B has decided).
        call_b = execution_stub(on_b).Execute(_request(digest))
        first_b = await call_b.read()
        executed_b = asyncio.ensure_future(_rest(call_b))
        await wait_until(lambda: started_jobs(redis.url), 60, "the job to start on the worker")
        gate.touch()
        response_a = final_response([first, *await asyncio.wait_for(rest_a, 60)])
        response_waited = final_response([first_waited, *await asyncio.wait_for(waited, 60)])
        messages_b = [first_b, *await asyncio.wait_for(executed_b, 60)]
        response_b = final_response(messages_b)
        assert not response_b.cached_result
        assert b.status()["execution"]["dedup_merges"] == 1
        assert response_a.status.code == code_pb2.OK and response_a.result.exit_code == 0, response_a
        assert response_a.result.stdout_digest.size_bytes > 0
        # Random output, identical everywhere: one run served all three.
        assert response_waited.result == response_a.result
        assert response_b.result == response_a.result
        assert len(started_jobs(redis.url)) == 1
        assert [stage(m) for m in messages_b][0] == re_pb2.ExecutionStage.CACHE_CHECK
        done = await operations_stub(on_b).GetOperation(operations_pb2.GetOperationRequest(name=name))
        assert done.done
        later = re_pb2.ExecuteResponse()
        assert done.response.Unpack(later) and later.result == response_a.result
        # Published with the done state (B has seen it): the next Execute is a cache hit, not a join.
        with redis_client.Redis.from_url(redis.url) as r:
            assert not list(r.scan_iter("bv:inflight:*"))
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await operations_stub(on_b).GetOperation(
                operations_pb2.GetOperationRequest(name=f"operations/{uuid.uuid4()}")
            )
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


async def test_cancel_stops_a_job_running_on_a_redis_worker(buildvault_server_factory, redis, worker):
    server = buildvault_server_factory("queue", extra_args=["--queue", redis.url])
    worker(server)
    marker = f"9{int.from_bytes(os.urandom(3), 'big'):08d}"  # a long sleep no other process has
    spec = ActionSpec(["/bin/sh", "-c", f"sleep {marker}; echo never"])
    async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
        digest = await spec.upload(make_stubs(channel))
        call = execution_stub(channel).Execute(_request(digest))
        name = (await call.read()).name
        rest = asyncio.ensure_future(_rest(call))
        await wait_until(lambda: processes_with(f"sleep {marker}"), 60, "the action to run")
        await operations_stub(channel).CancelOperation(operations_pb2.CancelOperationRequest(name=name))
        response = final_response(await asyncio.wait_for(rest, 60))
        assert response.status.code == code_pb2.CANCELLED, response
    wait_for(lambda: not processes_with(f"sleep {marker}"), 30, "the worker to kill the action's process group")


async def test_cancel_of_a_queued_job_means_no_worker_runs_it(buildvault_server_factory, redis, worker, tmp_path):
    server = buildvault_server_factory("queue", extra_args=["--queue", redis.url])
    worker(server)
    gate = tmp_path / "go"
    blocker, victim, after = (gated(gate, f"echo {what}", salt=uuid.uuid4().bytes) for what in ("b", "v", "a"))
    async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
        stubs = make_stubs(channel)
        digests = [await spec.upload(stubs) for spec in (blocker, victim, after)]
        running = asyncio.ensure_future(_all(execution_stub(channel).Execute(_request(digests[0]))))
        await wait_until(lambda: started_jobs(redis.url), 60, "the blocker to start")
        call = execution_stub(channel).Execute(_request(digests[1]))
        name = (await call.read()).name
        rest = asyncio.ensure_future(_rest(call))
        await wait_until(lambda: queued_entries(redis.url) == 2, 30, "the victim in the Redis queue")
        await operations_stub(channel).CancelOperation(operations_pb2.CancelOperationRequest(name=name))
        assert final_response(await asyncio.wait_for(rest, 30)).status.code == code_pb2.CANCELLED
        following = asyncio.ensure_future(_all(execution_stub(channel).Execute(_request(digests[2]))))
        gate.touch()
        assert final_response(await asyncio.wait_for(running, 60)).result.exit_code == 0
        assert final_response(await asyncio.wait_for(following, 60)).result.exit_code == 0
    # The victim was queued between the two: the worker reached it, and skipped it.
    assert len(started_jobs(redis.url)) == 2


async def test_a_more_urgent_job_queued_later_runs_first(buildvault_server_factory, redis, worker, tmp_path):
    server = buildvault_server_factory("queue", extra_args=["--queue", redis.url])
    worker(server)
    gate = tmp_path / "go"
    blocker, low, high = (gated(gate, f"echo {what}", salt=uuid.uuid4().bytes) for what in ("b", "low", "high"))
    async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
        stubs = make_stubs(channel)
        digests = [await spec.upload(stubs) for spec in (blocker, low, high)]
        calls = [asyncio.ensure_future(_all(execution_stub(channel).Execute(_request(digests[0]))))]
        await wait_until(lambda: started_jobs(redis.url), 60, "the blocker to start")
        calls.append(asyncio.ensure_future(_all(execution_stub(channel).Execute(_request(digests[1], 50)))))
        await wait_until(lambda: queued_entries(redis.url) == 2, 30, "the low-priority job in the queue")
        calls.append(asyncio.ensure_future(_all(execution_stub(channel).Execute(_request(digests[2], -50)))))
        await wait_until(lambda: queued_entries(redis.url) == 3, 30, "the high-priority job in the queue")
        gate.touch()
        blocked, low_done, high_done = [final_response(await asyncio.wait_for(c, 60)) for c in calls]
    assert all(r.result.exit_code == 0 for r in (blocked, low_done, high_done))
    started = [r.result.execution_metadata.worker_start_timestamp.ToNanoseconds() for r in (low_done, high_done)]
    assert started[1] < started[0], "the priority -50 job should start before the priority 50 one"


async def test_an_operation_whose_server_stopped_is_not_found_elsewhere(buildvault_server_factory, redis, worker,
                                                                         tmp_path):  # fmt: skip
    a = buildvault_server_factory("a", extra_args=["--queue", redis.url])
    b = buildvault_server_factory("b", extra_args=["--queue", redis.url])
    worker(a)
    spec = gated(tmp_path / "never", "true", salt=uuid.uuid4().bytes)
    async with (
        grpc.aio.insecure_channel(a.grpc_address, options=CLIENT_OPTIONS) as on_a,
        grpc.aio.insecure_channel(b.grpc_address, options=CLIENT_OPTIONS) as on_b,
    ):
        digest = await spec.upload(make_stubs(on_a))
        call_a = execution_stub(on_a).Execute(_request(digest))
        name = (await call_a.read()).name
        wait_call = execution_stub(on_b).WaitExecution(re_pb2.WaitExecutionRequest(name=name))
        assert not (await wait_call.read()).done
        following = asyncio.ensure_future(_rest(wait_call))
        await wait_until(lambda: processes_with(str(tmp_path / "never")), 60, "the job to run on the worker")
        a.stop()
        # The stream on B ends with a retryable answer (Bazel Executes again).
        lost = final_response(await asyncio.wait_for(following, 30))
        assert lost.status.code == code_pb2.UNAVAILABLE, lost
    # Nobody can read the job's result any more: the worker kills it (its timeout is 10 minutes).
    await wait_until(lambda: not processes_with(str(tmp_path / "never")), 30, "the orphaned action to be killed")
    # A server that never saw the operation, A restarted, answers NOT_FOUND (Bazel re-Executes).
    a.start()
    async with grpc.aio.insecure_channel(a.grpc_address, options=CLIENT_OPTIONS) as restarted:
        with pytest.raises(grpc.aio.AioRpcError) as again:
            await operations_stub(restarted).GetOperation(operations_pb2.GetOperationRequest(name=name))
        assert again.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_stopped_worker_kills_its_action_and_another_worker_reruns_the_job(
    buildvault_server_factory, redis, worker, tmp_path
):
    server = buildvault_server_factory("queue", extra_args=["--queue", redis.url])
    first = worker(server, "first")
    gate = tmp_path / "go"
    spec = gated(gate, "echo done", salt=uuid.uuid4().bytes)
    async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
        digest = await spec.upload(make_stubs(channel))
        running = asyncio.ensure_future(_all(execution_stub(channel).Execute(_request(digest))))
        await wait_until(lambda: processes_with(str(gate)), 60, "the action to run on the first worker")
        first.stop()  # SIGTERM
        assert first.process is not None and first.process.returncode is not None
        assert not processes_with(str(gate)), "the stopped worker left its action running"
        worker(server, "second")
        await wait_until(lambda: len(started_jobs(redis.url)) == 2, 60, "the second worker to take the job back")
        gate.touch()
        response = final_response(await asyncio.wait_for(running, 60))
    assert response.status.code == code_pb2.OK and response.result.exit_code == 0, response
    assert response.result.execution_metadata.worker == "second"


@contextlib.asynccontextmanager
async def running_on_a(buildvault_server_factory, redis, worker, gate):
    """Servers A and B on one Redis, a worker of A's running an action gated on `gate`, executed
    through A: yields channels to both, the action digest, the operation name and A's stream's rest."""
    a = buildvault_server_factory("a", extra_args=["--queue", redis.url])
    b = buildvault_server_factory("b", extra_args=["--queue", redis.url])
    worker(a)
    spec = gated(gate, "echo ran", salt=uuid.uuid4().bytes)
    async with (
        grpc.aio.insecure_channel(a.grpc_address, options=CLIENT_OPTIONS) as on_a,
        grpc.aio.insecure_channel(b.grpc_address, options=CLIENT_OPTIONS) as on_b,
    ):
        digest = await spec.upload(make_stubs(on_a))
        call = execution_stub(on_a).Execute(_request(digest))
        name = (await call.read()).name
        rest = asyncio.ensure_future(_rest(call))
        await wait_until(lambda: processes_with(str(gate)), 60, "the job to run on the worker")
        yield on_a, on_b, digest, name, rest


async def test_list_operations_on_one_server_lists_every_servers_operations(
    buildvault_server_factory, redis, worker, tmp_path
):
    gate = tmp_path / "go"
    async with running_on_a(buildvault_server_factory, redis, worker, gate) as (_, on_b, digest, name, rest):

        async def listed_on_b() -> dict[str, operations_pb2.Operation]:
            response = await operations_stub(on_b).ListOperations(operations_pb2.ListOperationsRequest())
            return {op.name: op for op in response.operations}

        running = (await listed_on_b())[name]
        metadata = re_pb2.ExecuteOperationMetadata()
        assert not running.done and running.metadata.Unpack(metadata)
        assert metadata.stage == re_pb2.ExecutionStage.EXECUTING and metadata.action_digest == digest
        gate.touch()
        final = final_response(await asyncio.wait_for(rest, 60))
        done = (await listed_on_b())[name]
        response = re_pb2.ExecuteResponse()
        assert done.done and done.response.Unpack(response)
        assert response.result == final.result and response.result.exit_code == 0


async def test_a_cancel_through_another_server_ends_the_operation_where_it_was_executed(
    buildvault_server_factory, redis, worker, tmp_path
):
    gate = tmp_path / "never"
    async with running_on_a(buildvault_server_factory, redis, worker, gate) as (on_a, on_b, _, name, rest):
        await operations_stub(on_b).CancelOperation(operations_pb2.CancelOperationRequest(name=name))
        # The client still watching on A sees its operation end CANCELLED, and the action stops.
        response = final_response(await asyncio.wait_for(rest, 30))
        assert response.status.code == code_pb2.CANCELLED, response
        await wait_until(lambda: not processes_with(str(gate)), 30, "the worker to kill the cancelled action")
        on_a_now = await operations_stub(on_a).GetOperation(operations_pb2.GetOperationRequest(name=name))
        assert on_a_now.done
