"""Handlers are wrapped once, when registered (server/grpc/registration.py), and the metrics wrapper
counts every call under its method, kind and status."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from buildvault.server.grpc.registration import WrappingServer
from buildvault.server.grpc.request_metrics import metered
from buildvault.server.metrics import Metrics

SERVICE = "build.bazel.remote.execution.v2.ActionCache"
GET = f"/{SERVICE}/GetActionResult"


def requests(metrics: Metrics, status: str) -> float:
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            labels = s.labels
            if s.name == "buildvault_requests_total" and labels.get("method") == "GetActionResult" and (
                labels.get("kind") == "ac" and labels.get("status") == status
            ):
                return s.value
    return 0.0


def handler(answer: str) -> Any:
    async def behaviour(request: object, context: object) -> str:
        return answer

    return grpc.unary_unary_rpc_method_handler(behaviour)


class Context:
    def code(self) -> None:
        return None  # still running: the wrapper takes OK


class Recorder:
    """What WrappingServer forwards to: the registered handlers, and the generic ones."""

    def __init__(self) -> None:
        self.registered: dict[str, dict[str, Any]] = {}
        self.generic: list[grpc.GenericRpcHandler] = []

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.registered[service] = handlers

    def add_generic_rpc_handlers(self, handlers: list[grpc.GenericRpcHandler]) -> None:
        self.generic.extend(handlers)


async def test_registered_handlers_are_wrapped_once_and_every_call_is_counted():
    metrics = Metrics()
    recorder = Recorder()
    seen: list[str] = []

    def wrap(method: str, h: Any) -> Any:
        seen.append(method)
        return metered(metrics, method, h)

    server = WrappingServer(recorder, wrap)  # type: ignore[arg-type]
    original = handler("result")
    server.add_registered_method_handlers(SERVICE, {"GetActionResult": original})
    assert seen == [GET]
    wrapped = recorder.registered[SERVICE]["GetActionResult"]
    assert wrapped is not original
    for _ in range(3):
        assert await wrapped.unary_unary(None, Context()) == "result"
    assert seen == [GET]  # no wrapping per call
    assert requests(metrics, "OK") == 3


async def test_a_generic_handler_is_wrapped_once_per_handler_and_never_stale():
    metrics = Metrics()
    recorder = Recorder()
    server = WrappingServer(recorder, lambda method, h: metered(metrics, method, h))  # type: ignore[arg-type]
    answers = {"now": handler("first")}

    class Generic(grpc.GenericRpcHandler):
        def service(self, details: Any) -> Any:
            return answers["now"] if details.method == GET else None

    server.add_generic_rpc_handlers([Generic()])
    (generic,) = recorder.generic
    details = SimpleNamespace(method=GET)
    first, again = generic.service(details), generic.service(details)
    assert first is again  # wrapped once
    assert await first.unary_unary(None, Context()) == "first"
    answers["now"] = handler("second")
    other = generic.service(details)
    assert other is not first and await other.unary_unary(None, Context()) == "second"
    assert generic.service(SimpleNamespace(method="/no.Such/Method")) is None
    assert requests(metrics, "OK") == 2
