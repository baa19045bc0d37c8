"""The gRPC metrics interceptor wraps each service handler once, never serves a stale wrapper, and
counts every call under its method, kind and status."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
from prometheus_client.parser import text_string_to_metric_families

from buildvault.server.grpc.metrics_interceptor import MetricsInterceptor
from buildvault.server.metrics import Metrics

GET = "/build.bazel.remote.execution.v2.ActionCache/GetActionResult"


def requests(metrics: Metrics, status: str) -> float:
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            labels = s.labels
            if s.name == "buildvault_requests_total" and labels.get("method") == "GetActionResult" and (
                labels.get("kind") == "ac" and labels.get("status") == status
            ):
                return s.value
    return 0.0


def handler(answer: str) -> grpc.RpcMethodHandler:
    async def behaviour(request: object, context: object) -> str:
        return answer

    return grpc.unary_unary_rpc_method_handler(behaviour)


class Context:
    def code(self) -> None:
        return None  # still running: the interceptor takes OK


async def test_each_handler_is_wrapped_once_and_a_new_one_is_wrapped_anew():
    metrics = Metrics()
    interceptor = MetricsInterceptor(metrics)
    details = SimpleNamespace(method=GET)
    served = handler("first")

    async def continuation(_details: object) -> grpc.RpcMethodHandler:
        return served

    first = await interceptor.intercept_service(continuation, details)
    again = await interceptor.intercept_service(continuation, details)
    assert first is again and first is not served  # wrapped, once
    assert await first.unary_unary(None, Context()) == "first"
    assert await again.unary_unary(None, Context()) == "first"

    served = handler("second")  # e.g. a later interceptor's own handler for this call
    other = await interceptor.intercept_service(continuation, details)
    assert other is not first
    assert await other.unary_unary(None, Context()) == "second"
    assert requests(metrics, "OK") == 3
