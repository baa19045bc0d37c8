"""The gRPC side of the history (buildvault.history): a wrapper on the method handlers that are
recorded (ActionCache lookups and updates, Execute, ByteStream reads and writes), put on once at
registration, inside the access check (a refused call is not recorded).

Each call costs the wrapper a clock read, the RequestMetadata header's parse and one tuple queued
for the recorder's thread. Nothing here can fail a call: the outcome is read from the status the
handler ended with, and a malformed header is recorded as such.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from buildvault.digest import InvalidDigest, parse_read_resource, parse_write_resource
from buildvault.history import Recorder
from buildvault.remote_apis import re_pb2
from buildvault.server.grpc.request_metrics import _code_of, _error_code

__all__ = ["RECORDED_METHODS", "recorded"]

_RE = "/build.bazel.remote.execution.v2."
_BS = "/google.bytestream.ByteStream/"
# full method -> the history's method name
RECORDED_METHODS = {
    _RE + "ActionCache/GetActionResult": "ac_get",
    _RE + "ActionCache/UpdateActionResult": "ac_update",
    _RE + "Execution/Execute": "execute",
    _BS + "Read": "read",
    _BS + "Write": "write",
}
_LIMIT = 256


def _digest(message: Any) -> str:
    return f"{message.hash[:_LIMIT]}/{message.size_bytes}"


def recorded(recorder: Recorder, full_method: str, handler: Any) -> Any:
    """`handler` with its calls recorded when `full_method` is one the history keeps."""
    method = RECORDED_METHODS.get(full_method)
    if method is None:
        return handler
    if method in ("ac_get", "ac_update"):
        return handler._replace(unary_unary=_action_cache(recorder, method, handler.unary_unary))
    if method == "execute":
        return handler._replace(unary_stream=_execute(recorder, handler.unary_stream))
    if method == "read":
        return handler._replace(unary_stream=_read(recorder, handler.unary_stream))
    return handler._replace(stream_unary=_write(recorder, handler.stream_unary))


def _action_cache(recorder: Recorder, method: str, behaviour: Callable[..., Any]) -> Callable[..., Any]:
    ok = "hit" if method == "ac_get" else "upload"

    async def wrapper(request: Any, context: Any) -> Any:
        started = time.time()
        clock = time.perf_counter()
        try:
            response = await behaviour(request, context)
        except BaseException as e:
            code = _error_code(context, e)
            outcome = "miss" if code is grpc.StatusCode.NOT_FOUND and method == "ac_get" else "failed"
            _note(recorder, method, request.instance_name, _digest(request.action_digest), outcome, code, 0,
                  started, clock, context)  # fmt: skip
            raise
        code = _code_of(context, grpc.StatusCode.OK)
        outcome = ok if code is grpc.StatusCode.OK else "miss" if code is grpc.StatusCode.NOT_FOUND else "failed"
        _note(recorder, method, request.instance_name, _digest(request.action_digest), outcome, code, 0, started,
              clock, context)  # fmt: skip
        return response

    return wrapper


class _WriteWatcher:
    """The servicer context as Execute's handler sees it, keeping the last Operation written."""

    def __init__(self, context: Any) -> None:
        self._context = context
        self.last: Any = None

    async def write(self, message: Any) -> None:
        self.last = message
        await self._context.write(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def _execute_outcome(operation: Any) -> str:
    """hit (a cached result), executed, or failed (an error, a bad status or a non-zero exit)."""
    if operation is None or not operation.done or operation.HasField("error"):
        return "failed"
    response = re_pb2.ExecuteResponse()
    if not operation.response.Unpack(response):
        return "failed"
    if response.status.code != 0:
        return "failed"
    if response.cached_result:
        return "hit"
    return "executed" if response.result.exit_code == 0 else "failed"


def _execute(recorder: Recorder, behaviour: Callable[..., Any]) -> Callable[..., Any]:
    async def wrapper(request: Any, context: Any) -> Any:
        started = time.time()
        clock = time.perf_counter()
        watcher = _WriteWatcher(context)
        digest = _digest(request.action_digest)
        try:
            result = await behaviour(request, watcher)
        except BaseException as e:
            _note(recorder, "execute", request.instance_name, digest, "failed", _error_code(context, e), 0, started,
                  clock, context)  # fmt: skip
            raise
        _note(recorder, "execute", request.instance_name, digest, _execute_outcome(watcher.last),
              _code_of(context, grpc.StatusCode.OK), 0, started, clock, context)  # fmt: skip
        return result

    return wrapper


def _resource(name: str, upload: bool) -> tuple[str, str, int]:
    try:
        parsed = parse_write_resource(name) if upload else parse_read_resource(name)
    except InvalidDigest:
        return "", "", 0
    d = parsed.digest
    return parsed.instance_name, f"{d.hash}/{d.size_bytes}", d.size_bytes


def _read(recorder: Recorder, behaviour: Callable[..., Any]) -> Callable[..., Any]:
    def finish(request: Any, context: Any, started: float, clock: float, error: BaseException | None) -> None:
        instance, digest, size = _resource(request.resource_name, False)
        if error is None:
            code = _code_of(context, grpc.StatusCode.OK)
            outcome = "download" if code is grpc.StatusCode.OK else "failed"
        else:
            code, outcome, size = _error_code(context, error), "failed", 0
        _note(recorder, "read", instance, digest, outcome, code, size, started, clock, context)

    async def streamed(request: Any, context: Any) -> AsyncIterator[Any]:
        started, clock = time.time(), time.perf_counter()
        try:
            async for response in behaviour(request, context):
                yield response
        except BaseException as e:
            finish(request, context, started, clock, e)
            raise
        finish(request, context, started, clock, None)

    async def written(request: Any, context: Any) -> Any:
        """A handler that sends its responses with `context.write` rather than yielding them."""
        started, clock = time.time(), time.perf_counter()
        try:
            result = await behaviour(request, context)
        except BaseException as e:
            finish(request, context, started, clock, e)
            raise
        finish(request, context, started, clock, None)
        return result

    return streamed if inspect.isasyncgenfunction(behaviour) else written


def _write(recorder: Recorder, behaviour: Callable[..., Any]) -> Callable[..., Any]:
    async def wrapper(requests: Any, context: Any) -> Any:
        started = time.time()
        clock = time.perf_counter()
        first: list[str] = []

        async def watched() -> AsyncIterator[Any]:
            async for message in requests:
                if not first:
                    first.append(message.resource_name)
                yield message

        try:
            response = await behaviour(watched(), context)
        except BaseException as e:
            instance, digest, _ = _resource(first[0] if first else "", True)
            _note(recorder, "write", instance, digest, "failed", _error_code(context, e), 0, started, clock, context)
            raise
        instance, digest, size = _resource(first[0] if first else "", True)
        code = _code_of(context, grpc.StatusCode.OK)
        outcome = "upload" if code is grpc.StatusCode.OK else "failed"
        _note(recorder, "write", instance, digest, outcome, code, size, started, clock, context)
        return response

    return wrapper


def _note(
    recorder: Recorder,
    method: str,
    instance: str,
    digest: str,
    outcome: str,
    code: grpc.StatusCode,
    size: int,
    started: float,
    clock: float,
    context: Any,
) -> None:
    try:
        pairs = context.invocation_metadata()  # parsed in the recorder's thread, off the loop
    except Exception:  # a context that cannot say: record without metadata
        pairs = None
    recorder.record(
        "grpc", method, instance[:_LIMIT], digest, outcome, code.name, size, started, time.perf_counter() - clock, pairs
    )
