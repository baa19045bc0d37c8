"""One cached step: HIT (outputs restored, exit code and output replayed), MISS (ran, not
stored), SAVED (ran and stored: writers only), BYPASS (ran uncached: no cache configured, the
cache failed, or an identical step held the lock too long).

Every cache failure falls back to running the command untouched with one warning; a failing
command is never stored. One status line per step goes to stdout, one JSON line to
BUILDVAULT_EVENT_LOG (statuses as buildvault-cc's: a SAVED step is a MISS with `stored`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass

from google.protobuf.timestamp_pb2 import Timestamp

from buildvault.client.invocation import invocation_id, no_request_metadata, request_metadata
from buildvault.digest import Digest
from buildvault.remote_apis import re_pb2

from ..remote import Remote, RemoteError
from .key import StepKey, step_key
from .lock import KeyLock
from .outputs import Collected, OutputError, UnusableResult, collect, discovered, restore, snapshot
from .report import SETUP_FAILED, Ran, StepReport, echo, run_command, warn_once
from .spec import SpecError, StepSpec


def _timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


@dataclass
class Restored:
    """A usable cached result, restored: what to replay."""

    exit: int
    stdout: bytes
    stderr: bytes


class Step(StepReport):
    def __init__(self, spec: StepSpec, env: Mapping[str, str]):
        super().__init__(spec, env)
        self.key: StepKey | None = None
        self.remote: Remote | None = None
        self.looked_up = False  # the agent's lookup (the recorded one) came first: see run_step

    # -- the step ------------------------------------------------------------------------------
    def run(self) -> int:
        spec = self.spec
        if not spec.remote or spec.disabled:
            return self.bypass("no-remote" if not spec.remote else "disabled")
        try:
            self.key = step_key(spec, self.run_env)
            self.key_text = key_text(self.key)
        except SpecError as e:
            print(f"buildvault run: {e}", file=sys.stderr, flush=True)
            return self.finish("BYPASS", SETUP_FAILED, "setup-failed")
        except (OSError, ValueError) as e:
            warn_once(f"buildvault run: cannot compute the key ({e}); running the step uncached")
            return self.bypass("key-failed")
        try:
            self.remote = Remote(spec.remote, spec.instance, timeout=spec.timeout,
                                 upload_timeout=max(spec.timeout * 4, 20.0))
        except RemoteError as e:
            warn_once(f"buildvault run: {e}; running the step uncached")
            return self.bypass("bad-remote")
        try:
            with step_metadata(spec, self.run_env, os.getpid()):  # the server's history (client/invocation.py)
                return self._cached(self.key, self.remote)
        except Exception as e:  # a cache bug must never fail the build
            if self.ran:
                raise
            warn_once(f"buildvault run: internal error ({type(e).__name__}: {e}); running the step uncached")
            return self.bypass("internal-error")
        finally:
            self.remote.close()

    def _lookup(self, key: StepKey, remote: Remote) -> int | None:
        """The step's exit code if a usable cached result was restored (its output replayed), else None."""
        restored = self.restore_cached(key, remote)
        if restored is None:
            return None
        echo(restored.stdout, restored.stderr)
        return restored.exit

    def restore_cached(self, key: StepKey, remote: Remote) -> Restored | None:
        """Restore a usable cached result into the workdir and return what to replay; None (and
        event["reason"] says why) when there is none. RemoteError: the cache did not answer."""
        result = remote.get_action_result(key.digest, inline_files=key.output_paths)
        if result is None:
            self.event["reason"] = "not-cached"
            return None
        if result.exit_code != 0:
            self.event["reason"] = "cached-failure"
            return None
        discover = key.output_paths[0] if self.spec.output_dir else None
        try:
            count = restore(result, self.spec.workdir, key.output_paths, discover, key.roots, remote.download)
            stdout, stderr = self._streams(result, remote)
        except (UnusableResult, RemoteError, OSError) as e:
            print(f"buildvault run: cached result of step {self.spec.label} is unusable ({e}); running it",
                  file=sys.stderr, flush=True)
            self.event["reason"] = "unusable-result"
            return None
        self.event["outputs"] = count
        meta = result.execution_metadata
        if meta.HasField("execution_start_timestamp") and meta.HasField("execution_completed_timestamp"):
            took = (meta.execution_completed_timestamp.ToNanoseconds()
                    - meta.execution_start_timestamp.ToNanoseconds()) / 1e9
            self.event["saved"] = round(max(0.0, took - (time.monotonic() - self.start)), 4)
        return Restored(result.exit_code, key.roots.denormalize_bytes(stdout), key.roots.denormalize_bytes(stderr))

    @staticmethod
    def _streams(result: re_pb2.ActionResult, remote: Remote) -> tuple[bytes, bytes]:
        out = []
        for raw, digest, has in ((result.stdout_raw, result.stdout_digest, result.HasField("stdout_digest")),
                                 (result.stderr_raw, result.stderr_digest, result.HasField("stderr_digest"))):
            if raw or not has or not digest.hash:
                out.append(raw)
                continue
            d = Digest.from_proto(digest)
            out.append(remote.download([d])[d])
        return out[0], out[1]

    def _cached(self, key: StepKey, remote: Remote) -> int:
        try:
            if self.looked_up:
                with no_request_metadata():
                    code = self._lookup(key, remote)
            else:
                code = self._lookup(key, remote)
        except RemoteError as e:
            warn_once(f"buildvault run: remote cache unavailable ({e}); running steps uncached")
            return self.bypass("remote-unavailable")
        if code is not None:
            return self.finish("HIT", code, "hit")
        if not self.spec.writer:
            return self._run_and_store(key, remote, store=False)
        lock = KeyLock(key.digest.hash)
        if not lock.acquire(self.spec.lock_timeout):
            return self.bypass("lock-timeout")
        try:
            try:
                with no_request_metadata():  # the history has this step's lookup already
                    code = self._lookup(key, remote)  # an identical step may have stored it while we waited
            except RemoteError:
                code = None
            if code is not None:
                return self.finish("HIT", code, "hit-after-wait")
            return self._run_and_store(key, remote, store=True)
        finally:
            lock.release()

    def _run_and_store(self, key: StepKey, remote: Remote, store: bool) -> int:
        spec = self.spec
        before = snapshot(spec.output_dir) if spec.output_dir else {}
        self.ran = True
        ran = run_command(spec, self.run_env)
        self.event["compile_seconds"] = round(ran.seconds, 4)
        if ran.exit != 0:
            return self.finish("MISS", ran.exit, "command-failed")
        try:
            if spec.output_dir:
                base = os.path.relpath(spec.output_dir, spec.workdir)
                found = discovered(spec.output_dir, before)
                if not found:
                    raise OutputError(f"the command created or changed nothing in {spec.output_dir}")
                paths = [os.path.normpath(os.path.join(base, p)) for p in found]
            else:
                paths = key.output_paths
            collected = collect(spec.workdir, paths, key.roots)
        except (OutputError, OSError) as e:
            print(f"buildvault run: step {spec.label}: {e}", file=sys.stderr, flush=True)
            return self.finish("MISS", 1, "no-outputs")
        self.event["outputs"] = collected.count
        if not store:
            return self.finish("MISS", 0, "not-writer")
        try:
            self._store(key, remote, collected, ran)
        except RemoteError as e:
            warn_once(f"buildvault run: could not store step {spec.label} ({e})")
            return self.finish("MISS", 0, "store-failed")
        return self.finish("SAVED", 0, "saved")

    def _store(self, key: StepKey, remote: Remote, collected: Collected, ran: Ran) -> None:
        result = collected.result
        blobs = dict(key.blobs)
        blobs.update(collected.blobs)
        for data, field_name in ((key.roots.normalize_bytes(ran.stdout), "stdout_digest"),
                                 (key.roots.normalize_bytes(ran.stderr), "stderr_digest")):
            if data:
                digest = Digest.of(data)
                blobs[digest] = data
                getattr(result, field_name).CopyFrom(digest.to_proto(re_pb2.Digest))
        result.exit_code = 0
        meta = result.execution_metadata
        meta.worker = "buildvault-run"
        meta.execution_start_timestamp.CopyFrom(_timestamp(ran.started))
        meta.execution_completed_timestamp.CopyFrom(_timestamp(ran.started + ran.seconds))
        missing = remote.find_missing(blobs)
        remote.upload({d: blobs[d] for d in missing})
        remote.update_action_result(key.digest, result)


def key_text(key: StepKey) -> str:
    return f"{key.digest.hash}/{key.digest.size_bytes}"


def run_step(spec: StepSpec, env: Mapping[str, str], looked_up: bool = False) -> int:
    """`looked_up`: the agent already looked the step up (and missed); its lookup was the one the
    server's history records, so this path's lookups are not recorded again."""
    step = Step(spec, env)
    step.looked_up = looked_up
    return step.run()


def step_metadata(spec: StepSpec, env: Mapping[str, str], pid: int | None) -> AbstractContextManager[None]:
    """The RequestMetadata of a step's calls: the build it runs under, its output, its name."""
    target = (spec.outputs[0] if spec.outputs else spec.output_dir) or spec.name
    if target and os.path.isabs(target) and spec.workdir:
        target = os.path.relpath(target, spec.workdir)  # the same in every checkout
    return request_metadata(invocation_id(dict(env), pid), target or "", spec.name or "step", tool="buildvault-run")
