"""The standard `grpc.health.v1.Health` service, open to every caller (its methods have no rule)."""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from buildvault.server.grpc.registration import WrappingServer

__all__ = ["add_health_service"]


async def add_health_service(server: WrappingServer, services: list[str]) -> health.aio.HealthServicer:
    """Register Health on `server`: SERVING for "" (the whole server) and each service name."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ["", *services]:
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer
