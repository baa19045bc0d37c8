"""One action from its Action and Command to an ActionResult and a status.

    runner = Runner(cas, work_root, sandbox="bwrap", name="host/local-0")
    result, status, logs = runner.run(job, cancel)

The action directory (inputs, outputs, stdout/stderr) lives under `work_root` and is removed
afterwards. A timeout answers DEADLINE_EXCEEDED with stdout, stderr and whatever outputs exist;
a cancel answers CANCELLED; a setup problem (an input that cannot be fetched, a program that
cannot start) answers a status with the reason, also in `server_logs`.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from pathlib import Path
from typing import Protocol

from google.protobuf import timestamp_pb2
from google.rpc import code_pb2, status_pb2  # type: ignore[import-untyped]

from buildvault.digest import Digest
from buildvault.execution.wire import JobFrame
from buildvault.execution.worker import inputs, outputs, process, sandbox
from buildvault.remote_apis import re_pb2

log = logging.getLogger("buildvault.worker")


class Cas(Protocol):
    def download(self, digests: list[Digest]) -> dict[Digest, bytes]: ...

    def find_missing(self, digests: list[Digest]) -> set[Digest]: ...

    def upload(self, blobs: dict[Digest, bytes]) -> None: ...


def _now() -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.GetCurrentTime()
    return stamp


def _status(code: int, message: str = "") -> status_pb2.Status:
    return status_pb2.Status(code=code, message=message)


class Runner:
    def __init__(self, cas: Cas, work_root: Path, *, sandbox_kind: str, name: str) -> None:
        self.cas = cas
        self.work_root = work_root
        self.sandbox_kind = sandbox_kind
        self.name = name

    def run(self, job: JobFrame, cancel: process.Cancel) -> tuple[re_pb2.ActionResult, status_pb2.Status, str]:
        meta = re_pb2.ExecutedActionMetadata(worker=self.name, worker_start_timestamp=_now())
        meta.queued_timestamp.FromNanoseconds(int(job.queued * 1e9))
        action_dir = self.work_root / uuid.uuid4().hex
        try:
            action_dir.mkdir(parents=True)
            return self._run(job, cancel, action_dir, meta)
        except Exception as e:
            log.warning("action setup failed: %s", e)
            result = re_pb2.ActionResult(execution_metadata=meta)
            result.execution_metadata.worker_completed_timestamp.CopyFrom(_now())
            text = f"worker {self.name}: {type(e).__name__}: {e}"
            return result, _status(code_pb2.FAILED_PRECONDITION, text), text
        finally:
            shutil.rmtree(action_dir, ignore_errors=True)

    def _run(
        self, job: JobFrame, cancel: process.Cancel, action_dir: Path, meta: re_pb2.ExecutedActionMetadata
    ) -> tuple[re_pb2.ActionResult, status_pb2.Status, str]:
        command = job.command
        for path in [*command.output_paths, *command.output_files, *command.output_directories]:
            outputs.check_output_path(path)
        if command.working_directory:
            outputs.check_output_path(command.working_directory)
        root = action_dir / "root"
        root.mkdir()
        meta.input_fetch_start_timestamp.CopyFrom(_now())
        inputs.materialise(self.cas, Digest.from_proto(job.action.input_root_digest), root)
        meta.input_fetch_completed_timestamp.CopyFrom(_now())
        workdir = root / command.working_directory if command.working_directory else root
        workdir.mkdir(parents=True, exist_ok=True)
        for directory in outputs.output_dirs_to_create(command):
            (workdir / directory).mkdir(parents=True, exist_ok=True)
        env = {var.name: var.value for var in command.environment_variables}
        argv = sandbox.wrap(self.sandbox_kind, list(command.arguments), action_dir, workdir, env)
        stdout, stderr = action_dir / "stdout", action_dir / "stderr"
        meta.execution_start_timestamp.CopyFrom(_now())
        started = time.monotonic()
        try:
            outcome = process.run(
                argv, cwd=workdir, env=env, stdout=stdout, stderr=stderr, timeout=job.timeout, cancel=cancel
            )
        except OSError as e:
            raise RuntimeError(f"cannot start {command.arguments[0]}: {e}") from None
        meta.execution_completed_timestamp.CopyFrom(_now())
        meta.output_upload_start_timestamp.CopyFrom(_now())
        collected = outputs.collect(command, workdir)
        result = collected.result
        result.exit_code = outcome.exit_code
        result.stdout_digest.CopyFrom(collected.add_blob(stdout.read_bytes()))
        result.stderr_digest.CopyFrom(collected.add_blob(stderr.read_bytes()))
        blobs = {d: data for d, data in collected.blobs.items() if d.size_bytes}
        if blobs:
            missing = self.cas.find_missing(list(blobs))
            self.cas.upload({d: blobs[d] for d in missing})
        meta.output_upload_completed_timestamp.CopyFrom(_now())
        meta.worker_completed_timestamp.CopyFrom(_now())
        result.execution_metadata.CopyFrom(meta)
        if outcome.cancelled:
            return result, _status(code_pb2.CANCELLED, "the action was cancelled"), ""
        if outcome.timed_out:
            elapsed = time.monotonic() - started
            return result, _status(code_pb2.DEADLINE_EXCEEDED, f"the action timed out after {elapsed:.1f}s"), ""
        return result, _status(code_pb2.OK), ""
