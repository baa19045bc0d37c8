"""Scale-out remote execution: `buildvault serve --queue redis://...` with `buildvault worker`
processes (their own directories, inputs and outputs through the server's gRPC CAS), routed by
platform; a worker killed mid-lease loses its job to another worker (XAUTOCLAIM)."""

from __future__ import annotations

import asyncio
import os
import uuid

import grpc
import pytest
from execution_client import ActionSpec, execute, execution_stub, final_response, processes_running, processes_with
from polling import wait_for, wait_until
from reapi_client import CLIENT_OPTIONS, make_stubs, read
from redis_process import RedisProcess, WorkerProcess, wait_workers

from buildvault.remote_apis import re_pb2

pytestmark = pytest.mark.timeout(300)

SOC_A = "soc=ascend910b1,cann=8.0.RC3"
SOC_B = "soc=ascend310p"


@pytest.fixture
def redis(tmp_path):
    with RedisProcess(tmp_path / "redis") as process:
        yield process


@pytest.fixture
def queue_server(buildvault_server_factory, redis):
    return buildvault_server_factory("queue", extra_args=["--queue", redis.url])


@pytest.fixture
def workers(tmp_path):
    started: list[WorkerProcess] = []

    def start(server, queue: str, platform: str, name: str) -> WorkerProcess:
        worker = WorkerProcess(server.grpc_address, queue, platform, tmp_path / name / "work", name)
        started.append(worker)
        return worker.start()

    yield start
    for worker in started:
        worker.stop()


async def test_jobs_route_to_the_worker_whose_platform_they_name(queue_server, redis, workers):
    workers(queue_server, redis.url, SOC_A, "worker-a")
    workers(queue_server, redis.url, SOC_B, "worker-b")
    wait_workers(queue_server.status, 2)
    async with grpc.aio.insecure_channel(queue_server.grpc_address, options=CLIENT_OPTIONS) as channel:
        stubs = make_stubs(channel)
        routes = (({"soc": "ascend910b1", "cann": "8.0.RC3"}, "worker-a"), ({"soc": "ascend310p"}, "worker-b"))
        for props, name in routes:
            spec = ActionSpec(["/bin/sh", "-c", f"echo {uuid.uuid4().hex} | tee out"], platform=props,
                              inputs={"in": b"x"}, output_files=["out"])  # fmt: skip
            response = final_response(await execute(channel, await spec.upload(stubs)))
            assert response.status.code == 0 and response.result.exit_code == 0, response
            assert response.result.execution_metadata.worker == name
            assert await read(stubs, response.result.output_files[0].digest)  # uploaded through the CAS


async def _all(call):
    return [message async for message in call]


async def test_a_lost_workers_job_is_taken_back(queue_server, redis, workers):
    first = workers(queue_server, redis.url, SOC_A, "worker-1")
    second = workers(queue_server, redis.url, SOC_A, "worker-2")
    wait_workers(queue_server.status, 2)
    by_name = {w.name: w for w in (first, second)}
    marker = f"4.{int.from_bytes(os.urandom(3), 'big'):08d}"  # about 4 s, an argument no other process has
    async with grpc.aio.insecure_channel(queue_server.grpc_address, options=CLIENT_OPTIONS) as channel:
        stubs = make_stubs(channel)
        spec = ActionSpec(["/bin/sh", "-c", f"sleep {marker} || true; echo done"],
                          platform={"soc": "ascend910b1", "cann": "8.0.RC3"})  # fmt: skip
        digest = await spec.upload(stubs)
        call = execution_stub(channel).Execute(re_pb2.ExecuteRequest(action_digest=digest))
        messages = asyncio.ensure_future(_all(call))
        running = await wait_until(lambda: queue_server.status()["execution"]["running"], 60, "the job to start")
        victim = by_name[running[0]["worker"]]
        assert b"sandbox=bwrap" in victim.log.read_bytes()
        # The sleep itself, not bwrap naming it: bwrap arms --die-with-parent only after its exec.
        wait_for(lambda: processes_running(["sleep", marker]), 30, "the action to run")
        action = set(processes_with(f"sleep {marker}"))  # bwrap, the shell and the sleep
        victim.kill()
        # bwrap's --die-with-parent ends the action with its worker. The survivor may already be
        # running it again once the lease (3 s) lapses, so only the victim's own pids are watched.
        wait_for(lambda: not action & set(processes_with(f"sleep {marker}")), 1.5, "the killed worker's action to end")
        response = final_response(await asyncio.wait_for(messages, 120))
        assert response.status.code == 0 and response.result.exit_code == 0, response
        survivor = next(name for name in by_name if name != victim.name)
        assert response.result.execution_metadata.worker == survivor
        assert queue_server.status()["execution"]["retries"] == 1
    wait_for(lambda: not processes_with(f"sleep {marker}"), 30, "the rerun to end")
