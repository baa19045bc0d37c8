"""The Build Event Service (google.devtools.build.v1.PublishBuildEvent) on the gRPC port, so
`bazel build --bes_backend=grpc://HOST:PORT --bes_results_url=http://HOST:8080/invocation/` works.

Bazel's events (`bazel_event`, an Any of `build_event_stream.BuildEvent`) are decoded for what the
build pages show: the command, patterns and options, start and finish with the exit code, target
completion, test results with their log blobs, and failed actions; the rest are acknowledged and
dropped. Publishing needs write permission on the instance named by `project_id` (Bazel's
`--bes_instance_name`; empty: the default instance).

Every event is acknowledged in order, as the specification asks. A stream is cut with a precise
error when its events come out of order or from another stream (INVALID_ARGUMENT), when an event
cannot be decoded (INVALID_ARGUMENT), when it grows past `max_events` or one event past
`max_event_bytes` (RESOURCE_EXHAUSTED), or when it sends nothing for `idle_timeout` seconds
(DEADLINE_EXCEEDED). A stream that simply stops (Bazel killed) leaves its invocation unfinished.
What was decoded before an error is kept.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import empty_pb2
from google.protobuf.message import DecodeError

from buildvault.digest import verify_instance_name
from buildvault.history import Recorder
from buildvault.history.store import HistoryStore
from buildvault.remote_apis import bep_pb2, bes_grpc, bes_pb2, build_events_pb2
from buildvault.server import errors
from buildvault.server.auth import Auth
from buildvault.server.auth.grants import Permission
from buildvault.server.auth.grpc_auth import caller_may
from buildvault.server.grpc import Context, rpc

__all__ = ["BuildEventService", "add_build_event_service"]

log = logging.getLogger("buildvault.build_events")

_BAZEL_EVENT = "type.googleapis.com/build_event_stream.BuildEvent"
_TEXT_LIMIT = 4096
_ID_LIMIT = 512


def _cut(text: str, limit: int = _TEXT_LIMIT) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


@dataclass
class _Decoded:
    """What a batch of events says about an invocation."""

    fields: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, float, str, str, str, str]] = field(default_factory=list)


def _file_line(f: bep_pb2.File) -> str:
    where = f.uri if f.WhichOneof("file") == "uri" else ""
    return _cut(f"{f.name}: {where}".strip(), 1024)


def decode_bazel_event(invocation: str, event: bep_pb2.BuildEvent, into: _Decoded, now: float) -> None:
    """Fold one Bazel event into `into` (unknown payloads are ignored)."""
    kind = event.WhichOneof("payload")
    eid = event.id
    if kind == "started":
        s = event.started
        into.fields["command"] = _cut(s.command, 256)
        into.fields["tool"] = "bazel"
        if s.start_time_millis:
            into.fields["bes_started"] = s.start_time_millis / 1000.0
    elif kind == "options_parsed":
        into.fields["options"] = _cut(" ".join(event.options_parsed.explicit_cmd_line))
    elif kind == "expanded" or eid.WhichOneof("id") == "pattern":
        into.fields["patterns"] = _cut(" ".join(eid.pattern.pattern))
    elif kind == "completed":
        label = eid.target_completed.label
        status = "built" if event.completed.success else "failed to build"
        into.events.append((invocation, now, "target", _cut(label, 1024), status, ""))
    elif kind == "test_result":
        r = event.test_result
        label = eid.test_result.label
        detail = "\n".join(_file_line(f) for f in r.test_action_output)
        status = bep_pb2.TestStatus.Name(r.status) if r.status in bep_pb2.TestStatus.values() else str(r.status)
        into.events.append((invocation, now, "test", _cut(label, 1024), status, _cut(detail)))
    elif kind == "test_summary":
        summary = event.test_summary
        known = summary.overall_status in bep_pb2.TestStatus.values()
        status = bep_pb2.TestStatus.Name(summary.overall_status) if known else ""
        into.events.append((invocation, now, "test summary", _cut(eid.test_summary.label, 1024), status, ""))
    elif kind == "action" and not event.action.success:
        a = event.action
        label = a.label or eid.action_completed.label
        lines = [f"mnemonic: {a.type}", f"primary output: {eid.action_completed.primary_output}"]
        lines += [_file_line(f) for f in (a.stdout, a.stderr) if f.name or f.WhichOneof("file")]
        into.events.append((invocation, now, "action failed", _cut(label, 1024), f"exit code {a.exit_code}",
                            _cut("\n".join(lines))))  # fmt: skip
    elif kind == "aborted":
        aborted = event.aborted
        known = aborted.reason in bep_pb2.Aborted.AbortReason.values()
        reason = bep_pb2.Aborted.AbortReason.Name(aborted.reason) if known else ""
        into.events.append((invocation, now, "aborted", "", reason, _cut(aborted.description)))
    elif kind == "finished":
        f = event.finished
        into.fields["exit_code"] = f.exit_code.code
        into.fields["exit_name"] = _cut(f.exit_code.name, 64)
        into.fields["bes_finished"] = f.finish_time_millis / 1000.0 if f.finish_time_millis else now


class BuildEventService:
    """google.devtools.build.v1.PublishBuildEvent over the history."""

    def __init__(
        self,
        recorder: Recorder | None,
        auth: Auth | None,
        *,
        idle_timeout: float = 300.0,
        max_events: int = 1_000_000,
        max_event_bytes: int = 4 << 20,
        clock: Any = time.time,
    ) -> None:
        self.recorder = recorder
        self.auth = auth
        self.idle_timeout = idle_timeout
        self.max_events = max_events
        self.max_event_bytes = max_event_bytes
        self.clock = clock
        # The highest sequence number recorded per stream (a retried stream resends events).
        self._seen: OrderedDict[tuple[str, str, int], int] = OrderedDict()

    async def _instance(self, project_id: str, context: Context) -> str:
        instance = verify_instance_name(project_id)
        if not caller_may(self.auth, Permission.WRITE, instance):
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"permission denied: publishing build events needs write on instance {instance!r}",
            )
        return instance

    async def _save(self, invocation: str, instance: str, decoded: _Decoded) -> None:
        if self.recorder is None or not invocation or not (decoded.fields or decoded.events):
            return
        at = self.clock()
        fields = dict(decoded.fields)
        events = list(decoded.events)

        def write(store: HistoryStore) -> None:
            store.update_invocation(invocation, instance, at, **fields)
            if events:
                store.write_events(events)

        await self.recorder.run_in_writer(write)

    @rpc("PublishLifecycleEvent")
    async def PublishLifecycleEvent(
        self, request: bes_pb2.PublishLifecycleEventRequest, context: Context
    ) -> empty_pb2.Empty:
        instance = await self._instance(request.project_id, context)
        ordered = request.build_event
        invocation = ordered.stream_id.invocation_id[:_ID_LIMIT]
        kind = ordered.event.WhichOneof("event")
        decoded = _Decoded()
        now = self.clock()
        if kind == "invocation_attempt_started":
            decoded.fields["bes_started"] = now
        elif kind == "invocation_attempt_finished":
            status = ordered.event.invocation_attempt_finished.invocation_status
            if status.HasField("build_tool_exit_code"):
                decoded.fields["exit_code"] = status.build_tool_exit_code.value
            decoded.fields["bes_finished"] = now
        elif kind in ("bazel_event", "component_stream_finished", "console_output"):
            raise errors.InvalidArgument(f"a {kind} event is a build tool event: publish it on the event stream")
        await self._save(invocation, instance, decoded)
        return empty_pb2.Empty()

    @rpc("PublishBuildToolEventStream")
    async def PublishBuildToolEventStream(
        self, requests: AsyncIterator[bes_pb2.PublishBuildToolEventStreamRequest], context: Context
    ) -> None:
        iterator = requests.__aiter__()
        stream: build_events_pb2.StreamId | None = None
        instance = ""
        invocation = ""
        expected = 0
        count = 0
        decoded = _Decoded()
        try:
            while True:
                try:
                    request = await asyncio.wait_for(iterator.__anext__(), self.idle_timeout)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    await context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"no build event for {self.idle_timeout:g} s: the stream is cut (event {expected} expected)",
                    )
                count += 1
                if count > self.max_events:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"more than {self.max_events} events in one stream")  # fmt: skip
                size = request.ByteSize()
                if size > self.max_event_bytes:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"event of {size} bytes: the limit is {self.max_event_bytes}")  # fmt: skip
                ordered = request.ordered_build_event
                number = ordered.sequence_number
                if stream is None:
                    instance = await self._instance(request.project_id, context)
                    stream = ordered.stream_id
                    invocation = stream.invocation_id[:_ID_LIMIT]
                    if number < 1:
                        raise errors.InvalidArgument(f"sequence number {number}: numbers start at 1")
                    expected = number  # a retried stream starts at the first event not acknowledged
                elif ordered.stream_id != stream:
                    raise errors.InvalidArgument(
                        f"event {number} belongs to another stream (invocation "
                        f"{ordered.stream_id.invocation_id[:100]!r}, not {invocation[:100]!r})"
                    )
                elif request.project_id != instance:
                    raise errors.InvalidArgument("project_id changed within one stream")
                if number != expected:
                    raise errors.InvalidArgument(f"event {number} out of order: event {expected} was expected next")
                key = (stream.build_id[:_ID_LIMIT], invocation, int(stream.component))
                if number > self._seen.get(key, 0):
                    self._decode(invocation, ordered.event, decoded, number)
                    self._note_seen(key, number)
                ack = bes_pb2.PublishBuildToolEventStreamResponse(stream_id=stream, sequence_number=number)
                await context.write(ack)
                expected += 1
                if len(decoded.events) >= 500:  # a long build: write as it goes
                    await self._save(invocation, instance, decoded)
                    decoded = _Decoded()
        finally:
            await self._save(invocation, instance, decoded)

    def _decode(self, invocation: str, event: Any, into: _Decoded, number: int) -> None:
        kind = event.WhichOneof("event")
        if kind != "bazel_event":
            return  # component_stream_finished, console output, other tools' events: acknowledged only
        if event.bazel_event.type_url != _BAZEL_EVENT:
            return
        payload = bep_pb2.BuildEvent()
        try:
            payload.ParseFromString(event.bazel_event.value)
        except DecodeError:
            message = f"event {number}: the bazel_event is not a build_event_stream.BuildEvent"
            raise errors.InvalidArgument(message) from None
        decode_bazel_event(invocation, payload, into, self.clock())

    def _note_seen(self, key: tuple[str, str, int], number: int) -> None:
        self._seen[key] = number
        self._seen.move_to_end(key)
        while len(self._seen) > 10_000:
            self._seen.popitem(last=False)


def add_build_event_service(server: Any, recorder: Recorder | None, auth: Auth | None) -> None:
    """Register the Build Event Service on a gRPC server (a WrappingServer)."""
    add: Any = bes_grpc.add_PublishBuildEventServicer_to_server
    add(BuildEventService(recorder, auth), server)
