"""The build pages answer as the API would: 401 without a credential, 403 without read on the
instance shown, and the invocation list holds only the instances the caller may read."""

from __future__ import annotations

import grpc
import pytest
from action_builder import build_action, key, upload
from auth_setup import bearer, new_token, write_access
from loopback_app import loopback_app
from reapi_client import make_stubs

from buildvault.history.metadata import metadata_header
from buildvault.remote_apis import re_pb2


@pytest.fixture
async def server(tmp_path):
    tokens, access = tmp_path / "tokens", tmp_path / "access.toml"
    issued = {"ci": new_token(tokens, "ci"), "team-a": new_token(tokens, "team-a")}
    write_access(access, [("ci", ["read", "write"], [""]), ("team-a", ["read", "write"], ["team-a"])])
    async with loopback_app(tmp_path, token_file=str(tokens), access_file=str(access)) as (app, channel, http):
        yield app, make_stubs(channel), http, issued


async def _miss(stubs, token: str, instance: str, invocation: str):  # type: ignore[no-untyped-def]
    built = build_action({"a.c": invocation.encode()}, ["cc", "-c", "a.c"], ["a.o"])
    auth = ("authorization", bearer(token))
    meta = [auth, metadata_header(tool="bazel", invocation=invocation, target="//:a", mnemonic="CppCompile")]
    with pytest.raises(grpc.aio.AioRpcError):
        await stubs.ac.GetActionResult(
            re_pb2.GetActionResultRequest(instance_name=instance, action_digest=built.action), metadata=meta
        )
    await upload(stubs, built.blobs, instance, metadata=[auth])
    return built


async def _status(http, url: str, token: str | None) -> tuple[int, str]:
    headers = {"Authorization": bearer(token)} if token else {}
    async with http.get(url, headers=headers) as response:
        return response.status, await response.text()


async def test_pages_follow_the_instance_read_rule(server) -> None:
    app, stubs, http, tokens = server
    secret = await _miss(stubs, tokens["ci"], "", "inv-default")
    team = await _miss(stubs, tokens["team-a"], "team-a", "inv-team")
    await app.services.history.flush()

    status, body = await _status(http, "/invocations", None)
    assert status == 401 and "unauthenticated" in body
    status, body = await _status(http, "/invocations", tokens["team-a"])
    assert status == 200 and "inv-team" in body and "inv-default" not in body
    status, body = await _status(http, "/invocations", tokens["ci"])
    assert status == 200 and "inv-team" in body and "inv-default" in body

    assert (await _status(http, "/invocation/inv-default", tokens["team-a"]))[0] == 403
    assert (await _status(http, "/invocation/inv-team", tokens["team-a"]))[0] == 200
    assert (await _status(http, f"/action/{key(secret.action)}", tokens["team-a"]))[0] == 403
    assert (await _status(http, f"/action/{key(team.action)}?instance=team-a", tokens["team-a"]))[0] == 200
    assert (await _status(http, f"/explain/{key(secret.action)}", tokens["team-a"]))[0] == 403
    assert (await _status(http, f"/compare/{key(secret.action)}/{key(team.action)}", tokens["team-a"]))[0] == 403
    assert (await _status(http, f"/blob/{key(secret.action)}/x", tokens["team-a"]))[0] == 403
    assert (await _status(http, f"/action/{key(secret.action)}", None))[0] == 401
