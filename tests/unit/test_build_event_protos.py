"""The Build Event Service and Bazel event messages carry the specification's field numbers."""

from __future__ import annotations

from buildvault.remote_apis import bep_pb2, bes_pb2, build_events_pb2


def _numbers(message) -> dict[str, int]:  # type: ignore[no-untyped-def]
    return {f.name: f.number for f in message.DESCRIPTOR.fields}


def test_publish_build_event_numbers() -> None:
    service = bes_pb2.DESCRIPTOR.services_by_name["PublishBuildEvent"]
    assert service.full_name == "google.devtools.build.v1.PublishBuildEvent"
    assert _numbers(bes_pb2.PublishBuildToolEventStreamRequest) == {
        "ordered_build_event": 4, "notification_keywords": 5, "project_id": 6,
        "check_preceding_lifecycle_events_present": 7}  # fmt: skip
    assert _numbers(bes_pb2.OrderedBuildEvent) == {"stream_id": 1, "sequence_number": 2, "event": 3}
    assert _numbers(build_events_pb2.StreamId) == {"build_id": 1, "invocation_id": 6, "component": 3}
    events = _numbers(build_events_pb2.BuildEvent)
    assert (events["bazel_event"], events["component_stream_finished"], events["invocation_attempt_finished"]) == (
        60, 59, 52)  # fmt: skip


def test_bazel_event_numbers() -> None:
    payloads = _numbers(bep_pb2.BuildEvent)
    wanted = {"started": 5, "completed": 8, "test_result": 10, "finished": 14, "action": 7, "options_parsed": 13}
    assert {k: payloads[k] for k in wanted} == wanted
    ids = _numbers(bep_pb2.BuildEventId)
    assert (ids["pattern"], ids["target_completed"], ids["test_result"], ids["action_completed"]) == (4, 5, 8, 6)
    assert _numbers(bep_pb2.BuildFinished.ExitCode) == {"name": 1, "code": 2}
    assert _numbers(bep_pb2.BuildFinished)["exit_code"] == 3
    assert _numbers(bep_pb2.TestResult)["status"] == 5 and bep_pb2.TestStatus.Value("PASSED") == 1
