"""Remote execution under access control: Execute needs the `execute` permission, on any listener.

With credentials configured the loopback-only rule gives way to the grant: a real server bound to
0.0.0.0 (reached through 127.0.0.1) runs actions for a principal granted `execute` and refuses
everyone else with the answer that names what is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from auth_setup import bearer, new_token, write_access
from execution_client import ActionSpec, execute, final_response
from reapi_client import CLIENT_OPTIONS, make_stubs

from buildvault.remote_apis import re_pb2


class _AddAuthorization:
    """Adds one `authorization` metadata entry to every call (plaintext channels take no call credentials)."""

    def __init__(self, value: str) -> None:
        self.value = value

    def _with_header(self, details: Any) -> Any:
        metadata = list(details.metadata or ()) + [("authorization", self.value)]
        return details._replace(metadata=metadata)


# grpc.aio files each interceptor under one kind only: one class per kind of call.
class _UnaryAuthorization(_AddAuthorization, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(self._with_header(details), request)


class _StreamAuthorization(_AddAuthorization, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(self._with_header(details), request)


def _channel(port: str, token: str | None) -> grpc.aio.Channel:
    interceptors: list[Any] = []
    if token is not None:
        interceptors = [_UnaryAuthorization(bearer(token)), _StreamAuthorization(bearer(token))]
    return grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CLIENT_OPTIONS, interceptors=interceptors)


@pytest.fixture
def tokens(tmp_path: Path) -> dict[str, str]:
    path = tmp_path / "tokens"
    made = {name: new_token(path, name) for name in ("runner", "ci")}
    grants = [("runner", ["read", "write", "execute"], [""]), ("ci", ["read", "write"], [""])]
    write_access(tmp_path / "access.toml", grants)
    return made


async def test_execute_needs_the_execute_grant_on_a_non_loopback_listener(buildvault_server_factory, tmp_path, tokens):
    server = buildvault_server_factory(
        "guarded",
        grpc_address="0.0.0.0:0",
        extra_args=[
            "--local-workers", "1",
            "--token-file", str(tmp_path / "tokens"),
            "--access-file", str(tmp_path / "access.toml"),
        ],
    )  # fmt: skip
    port = server.grpc_address.rpartition(":")[2]
    spec = ActionSpec(["/bin/sh", "-c", "echo ran-under-a-grant"], salt=b"exec-auth")

    async with _channel(port, tokens["runner"]) as channel:
        caps = await make_stubs(channel).capabilities.GetCapabilities(re_pb2.GetCapabilitiesRequest())
        assert caps.execution_capabilities.exec_enabled
        action_digest = await spec.upload(make_stubs(channel))
        response = final_response(await execute(channel, action_digest, skip_cache_lookup=True))
        assert response.status.code == 0 and response.result.exit_code == 0
        stdout = await make_stubs(channel).cas.BatchReadBlobs(
            re_pb2.BatchReadBlobsRequest(digests=[response.result.stdout_digest])
        )
        assert stdout.responses[0].data == b"ran-under-a-grant\n"

    async with _channel(port, tokens["ci"]) as channel:  # may write, may not execute
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await execute(channel, action_digest, skip_cache_lookup=True)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "execute" in refused.value.details()

    async with _channel(port, None) as channel:  # no credentials at all
        with pytest.raises(grpc.aio.AioRpcError) as anonymous:
            await execute(channel, action_digest, skip_cache_lookup=True)
        assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
