"""A local worker closed while its process is still starting (a job's first `run` awaits the
process's hello line) closes that process too, and starts none afterwards. The scheduler marks a
job EXECUTING before its worker process exists, so a server stopped right after a client saw
EXECUTING closes a worker in exactly this state; a process left behind blocks on its stdin for
ever, and so does the event loop's shutdown awaiting the worker's reader task."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from polling import wait_until

from buildvault.digest import Digest
from buildvault.execution.local.scheduler import WorkerLost
from buildvault.execution.local.workers import LocalWorker
from buildvault.execution.operations import Job
from buildvault.remote_apis import re_pb2


def _job() -> Job:
    command = re_pb2.Command(arguments=["/bin/true"])
    action = re_pb2.Action(command_digest=Digest.of(command.SerializeToString()).to_proto(re_pb2.Digest))
    return Job(
        id="job-1", instance="", action_digest=Digest.of(action.SerializeToString()), action=action, command=command,
        requirements={}, timeout=60.0, priority=0, cacheable=False, dedup_key=None,
    )  # fmt: skip


async def test_closing_a_starting_worker_leaves_no_process(tmp_path):
    worker = LocalWorker("test/local-0-0[default]", "default", {}, tmp_path / "w0", "none")
    # Never reached: the job fails its input fetch, or never reaches the process at all.
    worker.server = "127.0.0.1:1"
    run = asyncio.create_task(worker.run(_job()))
    try:
        # The first run holds the start lock from spawning the process until its hello is read.
        await wait_until(worker._starting.locked, 30, "the worker process to be starting")
        assert worker.process is None
        await worker.close()
        process = worker.process
        assert process is not None, "close returned before the starting process was known"
        assert process.returncode is not None, "close left the worker process running"
        # The job ends (a lost worker or a failed result), it does not wait for ever.
        with contextlib.suppress(WorkerLost):
            response = await asyncio.wait_for(run, 30)
            assert response.status.code != 0
        # A closed worker starts no new process.
        with pytest.raises(WorkerLost, match="closed"):
            await worker.run(_job())
        assert worker.process is process
    finally:
        if worker.process is not None and worker.process.returncode is None:
            worker.process.kill()
            await worker.process.wait()
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
