"""The Build Event Service: Bazel's events become the invocation's command, exit code, targets and
tests on the build pages; out-of-order, foreign, undecodable, oversized and stalled streams are cut
with a precise status, and what came before stays; publishing needs write on the instance."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from auth_setup import bearer, new_token, write_access
from loopback_app import loopback_app
from polling import wait_until
from reapi_client import CLIENT_OPTIONS

from buildvault.config import Settings
from buildvault.history import Recorder
from buildvault.remote_apis import bep_pb2, bes_grpc, bes_pb2, build_events_pb2
from buildvault.server.app import App
from buildvault.server.grpc import server_options
from buildvault.server.grpc.build_events import BuildEventService
from buildvault.storage.memory import MemoryActionStore, MemoryBlobStore

LOG = "bytestream://127.0.0.1:1/blobs/" + "ab" * 32 + "/12"


def bazel_events(invocation: str) -> list[bep_pb2.BuildEvent]:
    started = bep_pb2.BuildEvent(started=bep_pb2.BuildStarted(uuid=invocation, command="test",
                                                               start_time_millis=1_700_000_000_000))  # fmt: skip
    started.id.started.SetInParent()
    pattern = bep_pb2.BuildEvent(expanded=bep_pb2.PatternExpanded())
    pattern.id.pattern.pattern.append("//pkg/<b>...")
    options = bep_pb2.BuildEvent(options_parsed=bep_pb2.OptionsParsed(explicit_cmd_line=["--copt=-O2"]))
    target = bep_pb2.BuildEvent(completed=bep_pb2.TargetComplete(success=True))
    target.id.target_completed.label = "//pkg:lib"
    test = bep_pb2.BuildEvent(test_result=bep_pb2.TestResult(status=bep_pb2.PASSED))
    test.test_result.test_action_output.add(name="test.log", uri=LOG)
    test.id.test_result.label = "//pkg:lib_test"
    failed = bep_pb2.BuildEvent(action=bep_pb2.ActionExecuted(success=False, type="CppCompile", exit_code=1))
    failed.id.action_completed.label = "//pkg:broken"
    finished = bep_pb2.BuildEvent(finished=bep_pb2.BuildFinished(exit_code=bep_pb2.BuildFinished.ExitCode(
        name="BUILD_FAILURE", code=1), finish_time_millis=1_700_000_005_000))  # fmt: skip
    return [started, pattern, options, target, test, failed, finished]


def stream_request(invocation: str, number: int, event: object, project: str = "") -> object:
    ordered = bes_pb2.OrderedBuildEvent(sequence_number=number)
    ordered.stream_id.build_id = "build-1"
    ordered.stream_id.invocation_id = invocation
    ordered.stream_id.component = build_events_pb2.StreamId.TOOL
    if isinstance(event, bep_pb2.BuildEvent):
        ordered.event.bazel_event.Pack(event)
    else:
        ordered.event.CopyFrom(event)  # type: ignore[arg-type]
    return bes_pb2.PublishBuildToolEventStreamRequest(ordered_build_event=ordered, project_id=project)


def finish() -> build_events_pb2.BuildEvent:
    event = build_events_pb2.BuildEvent()
    event.component_stream_finished.type = build_events_pb2.BuildEvent.BuildComponentStreamFinished.FINISHED
    return event


async def publish(stub, requests, metadata=None):  # type: ignore[no-untyped-def]
    async def source():  # type: ignore[no-untyped-def]
        for r in requests:
            yield r

    return [a.sequence_number async for a in stub.PublishBuildToolEventStream(source(), metadata=metadata)]


@pytest.fixture
async def server(tmp_path):
    async with loopback_app(tmp_path) as (app, channel, http):
        yield app, bes_grpc.PublishBuildEventStub(channel), http


async def test_bazel_events_fill_the_invocation_page(server) -> None:
    app, stub, http = server
    events = [*bazel_events("inv-bes"), finish()]
    acks = await publish(stub, [stream_request("inv-bes", n + 1, e) for n, e in enumerate(events)])
    assert acks == list(range(1, len(events) + 1))

    async def page_once_written() -> str:  # the stream's events are written as it ends
        async with http.get("/invocation/inv-bes") as response:
            text = await response.text()
            return text if response.status == 200 and "PASSED" in text else ""

    page = await wait_until(page_once_written, 10, "the invocation page with the stream's events")
    assert "test //pkg/&lt;b&gt;..." in page  # command and pattern, escaped
    assert "exit code 1 BUILD_FAILURE" in page and "failed" in page
    assert "//pkg:lib_test" in page and "PASSED" in page
    assert 'href="/blob/' + "ab" * 32 + '-12/test.log"' in page  # the test log, downloadable
    assert "//pkg:broken" in page and "CppCompile" in page
    async with http.get("/invocations?outcome=failed") as response:
        assert "inv-bes" in await response.text()


async def test_a_retried_stream_resumes_and_is_recorded_once(server) -> None:
    app, stub, http = server
    events = bazel_events("inv-retry")
    await publish(stub, [stream_request("inv-retry", n + 1, e) for n, e in enumerate(events[:4])])
    # Bazel reconnects and resends from the first event it saw unacknowledged (here: from 3).
    acks = await publish(stub, [stream_request("inv-retry", n + 1, e) for n, e in enumerate(events[:5]) if n >= 2])
    assert acks == [3, 4, 5]
    store = app.services.history.store
    events_seen = await wait_until(lambda: len(store.events_of("inv-retry")) >= 2 and store.events_of("inv-retry"),
                                   10, "the resumed stream's events")  # fmt: skip
    assert [label for _, kind, label, _, _ in events_seen if kind in ("target", "test")] == ["//pkg:lib",
                                                                                           "//pkg:lib_test"]


@pytest.mark.parametrize(
    "case,code,message",
    [
        ("out of order", grpc.StatusCode.INVALID_ARGUMENT, "event 3 out of order: event 2 was expected next"),
        ("another stream", grpc.StatusCode.INVALID_ARGUMENT, "belongs to another stream"),
        ("undecodable", grpc.StatusCode.INVALID_ARGUMENT, "is not a build_event_stream.BuildEvent"),
        ("bad instance", grpc.StatusCode.INVALID_ARGUMENT, "invalid instance name"),
        ("zero", grpc.StatusCode.INVALID_ARGUMENT, "sequence number 0: numbers start at 1"),
    ],
)
async def test_malformed_streams_are_cut_with_a_precise_error(server, case: str, code, message: str) -> None:
    app, stub, http = server
    events = bazel_events(f"inv-{case}")
    first = stream_request(f"inv-{case}", 1, events[0])
    if case == "out of order":
        requests = [first, stream_request(f"inv-{case}", 3, events[1])]
    elif case == "another stream":
        requests = [first, stream_request("someone-else", 2, events[1])]
    elif case == "undecodable":
        bad = stream_request(f"inv-{case}", 2, events[1])
        bad.ordered_build_event.event.bazel_event.value = b"\xff\xff\xff"  # type: ignore[attr-defined]
        requests = [first, bad]
    elif case == "bad instance":
        requests = [stream_request(f"inv-{case}", 1, events[0], project="../etc")]
    else:
        requests = [stream_request(f"inv-{case}", 0, events[0])]
    with pytest.raises(grpc.aio.AioRpcError) as cut:
        await publish(stub, requests)
    assert cut.value.code() == code and message in (cut.value.details() or ""), cut.value.details()
    if case in ("out of order", "another stream", "undecodable"):  # what came before stays
        store = app.services.history.store
        summary = await wait_until(lambda: store.invocation(f"inv-{case}"), 10, "the cut stream's record")
        assert summary.command == "test"


async def test_unknown_event_kinds_are_acknowledged_and_ignored(server) -> None:
    app, stub, http = server
    other = build_events_pb2.BuildEvent()
    other.build_execution_event.type_url = "type.example.com/something.Else"
    other.build_execution_event.value = b"\x08\x01"
    foreign = build_events_pb2.BuildEvent()
    foreign.bazel_event.type_url = "type.googleapis.com/not.bazel.Event"
    console = build_events_pb2.BuildEvent()
    console.console_output.text_output = "hello"
    unknown_payload = bep_pb2.BuildEvent()
    unknown_payload.id.unknown.details = "x"
    unknown_payload.MergeFromString(b"\xba\x01\x02\x08\x01")  # field 23 (a payload this proto leaves out)
    requests = [stream_request("inv-unknown", n + 1, e) for n, e in enumerate([other, foreign, console,
                                                                             unknown_payload, finish()])]  # fmt: skip
    assert await publish(stub, requests) == [1, 2, 3, 4, 5]


async def test_huge_endless_and_unfinished_streams(tmp_path) -> None:
    recorder = Recorder(tmp_path / "h.sqlite")
    await recorder.start()
    service = BuildEventService(recorder, None, idle_timeout=0.5, max_events=3, max_event_bytes=10_000)
    grpc_server = grpc.aio.server(options=server_options())
    bes_grpc.add_PublishBuildEventServicer_to_server(service, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CLIENT_OPTIONS) as channel:
            stub = bes_grpc.PublishBuildEventStub(channel)
            events = bazel_events("inv-x")
            huge = bep_pb2.BuildEvent(progress=bep_pb2.Progress(stdout="x" * 20_000))
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                await publish(stub, [stream_request("inv-huge", 1, huge)])
            assert cut.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "the limit is 10000" in (cut.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                await publish(stub, [stream_request("inv-many", n + 1, events[0]) for n in range(4)])
            assert cut.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "more than 3 events" in (cut.value.details() or "")

            stalled = asyncio.Event()

            async def never_ends():  # type: ignore[no-untyped-def]
                yield stream_request("inv-stall", 1, events[0])
                await stalled.wait()

            call = stub.PublishBuildToolEventStream(never_ends())
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                async for _ in call:
                    pass
            stalled.set()
            assert cut.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "no build event for 0.5 s" in (cut.value.details() or "")
            # What the stream said before it stalled is kept (written as the stream ends).
            summary = await wait_until(lambda: recorder.store.invocation("inv-stall"), 10, "the stalled stream")
            assert summary.command == "test" and summary.outcome == "running"
    finally:
        await grpc_server.stop(0)
        await recorder.close()


async def test_publishing_needs_write_on_the_instance(tmp_path) -> None:
    tokens, access = tmp_path / "tokens", tmp_path / "access.toml"
    issued = {"ci": new_token(tokens, "ci"), "reader": new_token(tokens, "reader")}
    write_access(access, [("ci", ["read", "write"], ["team-a"]), ("reader", ["read"], [""])])
    settings = Settings(dir=tmp_path / "data", grpc_address="127.0.0.1:0", http_address="", local_workers="0",
                        processes=1, token_file=str(tokens), access_file=str(access))  # fmt: skip
    app = App(settings, blobs=MemoryBlobStore(), actions=MemoryActionStore())
    await app.start()
    try:
        async with grpc.aio.insecure_channel(app.grpc_address, options=CLIENT_OPTIONS) as channel:
            stub = bes_grpc.PublishBuildEventStub(channel)
            event = bazel_events("inv-a")[0]
            for token, project, code in (
                (None, "team-a", grpc.StatusCode.UNAUTHENTICATED),
                (issued["reader"], "", grpc.StatusCode.PERMISSION_DENIED),
                (issued["ci"], "team-b", grpc.StatusCode.PERMISSION_DENIED),
            ):
                metadata = [("authorization", bearer(token))] if token else None
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await publish(stub, [stream_request("inv-a", 1, event, project)], metadata)
                assert refused.value.code() == code
            ci = [("authorization", bearer(issued["ci"]))]
            acks = await publish(stub, [stream_request("inv-a", 1, event, "team-a")], ci)
            assert acks == [1]
            lifecycle = bes_pb2.PublishLifecycleEventRequest(project_id="team-b")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.PublishLifecycleEvent(lifecycle, metadata=[("authorization", bearer(issued["ci"]))])
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await app.stop(grace=1)
