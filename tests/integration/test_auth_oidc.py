"""OIDC identity tokens on gRPC and HTTP: a test issuer on loopback, tokens minted by the test.

The access file grants on claims as the csrc trust model wants: main-branch pushes of the
repository read and write, every other job of the repository only reads, other repositories
nothing. Forged and mutated tokens are refused with UNAUTHENTICATED / 401 and store nothing.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import random
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import grpc
import jwt
import pytest
from auth_setup import action_result, bearer, metric, new_token
from oidc_issuer import TestIssuer, hand_signed_hs256, new_key
from polling import wait_for
from reapi_client import CLIENT_OPTIONS, make_stubs
from server_process import ServerError, ServerProcess

from buildvault.remote_apis import re_pb2

pytestmark = pytest.mark.timeout(600)

MAIN = {"ref": "refs/heads/main", "event_name": "push"}
PR = {"ref": "refs/pull/7/merge", "event_name": "pull_request", "sub": "repo:org/vllm-ascend:pull_request"}


def write_grants(path: Path, issuer: str, *, pr_writes: bool = False) -> Path:
    pr = '["read", "write"]' if pr_writes else '["read"]'
    path.write_text(
        f"""
[[grant]]
principal = "admin"
permissions = ["read", "write"]

[[grant]]
issuer = "{issuer}"
claims = {{ repository = "org/vllm-ascend", ref = "refs/heads/main", event_name = "push" }}
permissions = ["read", "write"]
instances = ["", "csrc"]

[[grant]]
issuer = "{issuer}"
claims = {{ repository = "org/*" , job_workflow_ref = "org/vllm-ascend/.github/workflows/*" }}
permissions = {pr}
instances = ["", "csrc"]
"""
    )
    return path


class Setup:
    def __init__(self, directory: Path, issuer: TestIssuer) -> None:
        self.issuer = issuer
        self.tokens = directory / "tokens"
        self.admin = new_token(self.tokens, "admin")
        self.access = write_grants(directory / "access.toml", issuer.url)

    def args(self, *extra: str) -> list[str]:
        return [
            "--token-file", str(self.tokens), "--access-file", str(self.access),
            "--oidc-issuer", self.issuer.url, "--oidc-audience", self.issuer.audience, *extra,
        ]  # fmt: skip


@pytest.fixture(scope="module")
def issuer():
    with TestIssuer() as running:
        yield running


@pytest.fixture(scope="module")
def setup(tmp_path_factory, issuer) -> Setup:
    return Setup(tmp_path_factory.mktemp("oidc"), issuer)


@pytest.fixture(scope="module")
def server(tmp_path_factory, setup):
    data = tmp_path_factory.mktemp("server") / "data"
    with ServerProcess(data, extra_args=setup.args(), log_level="debug") as process:
        yield process


@pytest.fixture
async def stubs(server):
    async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
        yield make_stubs(channel)


def meta(token: str | None) -> tuple[tuple[str, str], ...]:
    return () if token is None else (("authorization", bearer(token)),)


async def grpc_update(stubs, token: str | None, instance: str = "") -> tuple[re_pb2.Digest, grpc.StatusCode]:
    action, result = action_result(b"built\n")
    try:
        await stubs.ac.UpdateActionResult(
            re_pb2.UpdateActionResultRequest(instance_name=instance, action_digest=action, action_result=result),
            metadata=meta(token),
        )
    except grpc.aio.AioRpcError as e:
        return action, e.code()
    return action, grpc.StatusCode.OK


async def grpc_get(stubs, authorization: str, action: re_pb2.Digest, instance: str = "") -> grpc.StatusCode:
    try:
        await stubs.ac.GetActionResult(
            re_pb2.GetActionResultRequest(instance_name=instance, action_digest=action),
            metadata=(("authorization", authorization),),
        )
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def http(server, method: str, path: str, token: str | None = None, body: bytes | None = None) -> tuple[int, bytes]:
    headers = {"Authorization": bearer(token)} if token is not None else {}
    request = urllib.request.Request(f"http://{server.http_address}{path}", data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def ac_path(instance: str = "") -> str:
    key = hashlib.sha256(str(random.random()).encode()).hexdigest()
    return (f"/{instance}" if instance else "") + f"/ac/{key}"


async def test_main_branch_token_writes_over_grpc_and_http(server, stubs, setup, issuer):
    for key in issuer.published:  # RS256, ES256 and EdDSA keys alike
        token = issuer.mint(key, **MAIN)
        action, code = await grpc_update(stubs, token, "csrc")
        assert code == grpc.StatusCode.OK, key.kind
        assert await grpc_get(stubs, bearer(setup.admin), action, "csrc") == grpc.StatusCode.OK
        path = ac_path("csrc")
        assert http(server, "PUT", path, token, b"entry")[0] == 200
        assert http(server, "GET", path, token) == (200, b"entry")


async def test_pull_request_token_reads_and_is_denied_writes(server, stubs, setup, issuer):
    writer = issuer.mint(**MAIN)
    action, _ = await grpc_update(stubs, writer)
    pr = issuer.mint(**PR)
    assert await grpc_get(stubs, bearer(pr), action) == grpc.StatusCode.OK
    fresh, code = await grpc_update(stubs, pr)
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert await grpc_get(stubs, bearer(setup.admin), fresh) == grpc.StatusCode.NOT_FOUND
    path = ac_path()
    status, body = http(server, "PUT", path, pr, b"poison")
    host = issuer.url.removeprefix("http://")
    assert status == 403 and f"'oidc:{host}:repo:org/vllm-ascend:pull_request' lacks write" in body.decode()
    assert http(server, "GET", path, setup.admin)[0] == 404


async def test_a_token_matching_no_grant_may_do_nothing(server, stubs, setup, issuer):
    other = issuer.mint(repository="elsewhere/repo", job_workflow_ref="elsewhere/repo/.github/workflows/ci.yml@x")
    _, code = await grpc_update(stubs, other)
    assert code == grpc.StatusCode.PERMISSION_DENIED
    status, body = http(server, "GET", ac_path(), other)
    assert status == 403 and b"lacks read" in body
    # A glob matches a run of characters and nothing else: `org/*` is not `orgx/...`.
    near = issuer.mint(repository="orgx/vllm-ascend")
    assert http(server, "GET", ac_path(), near)[0] == 403


async def test_principal_in_request_logs_is_issuer_host_and_sub(server, stubs, issuer):
    token = issuer.mint(**MAIN)
    await grpc_update(stubs, token)
    host = issuer.url.removeprefix("http://")
    principal = f"oidc:{host}:repo:org/vllm-ascend:ref:refs/heads/main"

    def logged() -> bool:
        return any(
            line.startswith("{") and f'"principal":"{principal}"' in line.replace(" ", "")
            for line in server.output().splitlines()
        )

    wait_for(logged, 10, "the OIDC principal in a request log line")
    assert token not in server.output()


def forged_tokens(issuer: TestIssuer) -> dict[str, str]:
    key = issuer.published[0]
    now = int(time.time())
    attacker = new_key("rsa", kid=key.kid)  # the same kid, another key
    stranger = new_key("rsa")
    good = issuer.mint(key, **MAIN)
    header_b64, payload_b64, signature_b64 = good.split(".")
    payload = jwt.decode(good, options={"verify_signature": False})
    tampered = dict(payload, ref="refs/heads/main", repository="org/vllm-ascend", sub="repo:org/other:ref:x")
    reencoded_payload = base64.urlsafe_b64encode(json.dumps(payload, indent=1).encode()).rstrip(b"=").decode()
    padded = header_b64 + "." + payload_b64 + "=" * (-len(payload_b64) % 4 or 4) + "." + signature_b64

    def signed(signer, headers=None, **claims) -> str:  # type: ignore[no-untyped-def]
        return jwt.encode(
            issuer.claims(**{**MAIN, **claims}), signer.private, algorithm=signer.algorithm,
            headers={"kid": signer.kid, **(headers or {})},
        )  # fmt: skip

    return {
        "alg none": jwt.encode(issuer.claims(**MAIN), None, algorithm="none", headers={"kid": key.kid}),
        "HS256 keyed with the public key": hand_signed_hs256(
            {"alg": "HS256", "typ": "JWT", "kid": key.kid}, issuer.claims(**MAIN), key.public_pem()
        ),
        "another key with the same kid": signed(attacker),
        "expired": signed(key, iat=now - 900, nbf=now - 900, exp=now - 300),
        "not yet valid": signed(key, nbf=now + 600, exp=now + 900),
        "issued in the future": signed(key, iat=now + 600, nbf=None, exp=now + 900),
        "wrong iss": signed(key, iss="https://token.actions.githubusercontent.com"),
        "iss with a trailing slash": signed(key, iss=issuer.url + "/"),
        "wrong aud": signed(key, aud="someone-else"),
        "missing aud": signed(key, aud=None),
        "missing exp": signed(key, exp=None),
        "jku pointing at the attacker's key set": signed(
            stranger, headers={"jku": "http://127.0.0.1:1/attacker-keys.json"}
        ),
        "embedded jwk": signed(stranger, headers={"jwk": stranger.jwk()}),
        "x5u": signed(stranger, headers={"x5u": "http://127.0.0.1:1/cert.pem"}),
        "unknown kid": signed(stranger),
        "past the maximum lifetime": signed(key, exp=now + 25 * 3600),
        "truncated": good[:-12],
        "signature dropped": header_b64 + "." + payload_b64 + ".",
        "claims changed, signature kept": header_b64
        + "."
        + jwt.utils.base64url_encode(json.dumps(tampered).encode()).decode()
        + "."
        + signature_b64,
        "re-encoded payload": header_b64 + "." + reencoded_payload + "." + signature_b64,
        "re-encoded with padding": padded,
        "6 KiB of junk": "eyJ" + "A" * 3000 + "." + "B" * 3000 + "." + "C" * 200,
        "junk in three parts": "eyJhbGciOi.junk.junk",
    }


async def test_forged_tokens_are_unauthenticated_and_store_nothing(server, stubs, setup, issuer):
    forged = forged_tokens(issuer)
    for name, token in forged.items():
        action, code = await grpc_update(stubs, token)
        assert code == grpc.StatusCode.UNAUTHENTICATED, name
        assert await grpc_get(stubs, bearer(setup.admin), action) == grpc.StatusCode.NOT_FOUND, name
        path = ac_path()
        status, _ = http(server, "PUT", path, token, b"poison")
        assert status == 401, name
        assert http(server, "GET", path, setup.admin)[0] == 404, name
    # The good token of the same issuer still writes: the refusals were the tokens', not the server's.
    assert (await grpc_update(stubs, issuer.mint(**MAIN)))[1] == grpc.StatusCode.OK
    refused = {
        reason: metric(
            server.http_address, "buildvault_auth_refusals_total", {"protocol": "http", "reason": reason},
            {"Authorization": bearer(setup.admin)},
        )
        for reason in ("bad_token", "expired_token", "unknown_key", "malformed")
    }  # fmt: skip
    assert all(count > 0 for count in refused.values()), refused


def mutate(token: str, rng: random.Random) -> str:
    """A random edit that changes what the token decodes to (never the last character of a
    part, whose spare bits may not count)."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_."
    chars = list(token)
    ends = {i for i, c in enumerate(token) if c == "."} | {len(token)}
    safe = [i for i in range(len(chars)) if chars[i] != "." and (i + 1) not in ends]
    kind = rng.randrange(6)
    if kind == 0:
        i = rng.choice(safe)
        chars[i] = rng.choice([c for c in alphabet if c not in (chars[i], ".")])
    elif kind == 1:
        del chars[rng.choice(safe)]
    elif kind == 2:
        chars.insert(rng.choice(safe), rng.choice(alphabet))
    elif kind == 3:
        return token[: rng.randrange(1, len(token) - 1)]
    elif kind == 4:
        parts = token.split(".")
        rng.shuffle(parts)
        joined = ".".join(parts)
        return joined if joined != token else token + "A"
    else:
        for _ in range(rng.randrange(2, 12)):
            i = rng.choice(safe)
            chars[i] = rng.choice([c for c in alphabet if c not in (chars[i], ".")])
    return "".join(chars)


async def test_thousands_of_mutated_tokens_are_refused_and_the_server_stays_up(server, stubs, setup, issuer):
    rng = random.Random(36)
    originals = [issuer.mint(key, **MAIN) for key in issuer.published]
    mutated = [mutate(rng.choice(originals), rng) for _ in range(3000)]
    mutated = [m for m in mutated if m not in originals]
    statuses: dict[int, int] = {}
    async with aiohttp.ClientSession() as session:
        semaphore = asyncio.Semaphore(8)

        async def put(token: str) -> None:
            async with semaphore:
                url = f"http://{server.http_address}{ac_path()}"
                async with session.put(url, data=b"fuzz", headers={"Authorization": bearer(token)}) as response:
                    statuses[response.status] = statuses.get(response.status, 0) + 1

        await asyncio.gather(*(put(token) for token in mutated))
    assert statuses == {401: len(mutated)}, statuses
    codes: dict[grpc.StatusCode, int] = {}
    for token in mutated[:600]:
        code = (await grpc_update(stubs, token))[1]
        codes[code] = codes.get(code, 0) + 1
    assert codes == {grpc.StatusCode.UNAUTHENTICATED: 600}, codes
    assert server.running
    assert http(server, "GET", "/healthz")[0] == 200
    assert (await grpc_update(stubs, originals[0]))[1] == grpc.StatusCode.OK


async def test_sighup_reloads_claim_grants(tmp_path, issuer):
    setup = Setup(tmp_path, issuer)
    with ServerProcess(tmp_path / "data", extra_args=setup.args()) as server:
        async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
            stubs = make_stubs(channel)
            pr = issuer.mint(**PR)
            assert (await grpc_update(stubs, pr))[1] == grpc.StatusCode.PERMISSION_DENIED
            write_grants(setup.access, issuer.url, pr_writes=True)
            server.process.send_signal(signal.SIGHUP)
            wait_for(lambda: "reloaded access control" in server.output(), 20, "the reload")
            assert (await grpc_update(stubs, pr))[1] == grpc.StatusCode.OK


async def test_key_rotation_and_an_issuer_outage(tmp_path):
    with TestIssuer(kinds=("rsa",)) as issuer:
        setup = Setup(tmp_path, issuer)
        with ServerProcess(tmp_path / "data", extra_args=setup.args()) as server:
            async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
                stubs = make_stubs(channel)
                old_key = issuer.published[0]
                old = issuer.mint(old_key, **MAIN)
                assert (await grpc_update(stubs, old))[1] == grpc.StatusCode.OK
                assert issuer.jwks_requests == 1
                # The issuer swaps keys: a token of the new key works after one refresh ...
                new_key_ = issuer.rotate("ec")
                assert (await grpc_update(stubs, issuer.mint(new_key_, **MAIN)))[1] == grpc.StatusCode.OK
                assert issuer.jwks_requests == 2
                # ... and the removed key's tokens (even one verified before) stop working.
                assert (await grpc_update(stubs, old))[1] == grpc.StatusCode.UNAUTHENTICATED
                assert (await grpc_update(stubs, issuer.mint(old_key, **MAIN)))[1] == grpc.StatusCode.UNAUTHENTICATED
                # Unknown kids within the minute do not make the server fetch again.
                for _ in range(5):
                    stray = issuer.mint(new_key("rsa"), **MAIN)
                    assert (await grpc_update(stubs, stray))[1] == grpc.StatusCode.UNAUTHENTICATED
                assert issuer.jwks_requests == 2
                # An outage: known keys keep working, and a refresh (forced by SIGHUP) that
                # fails lets no unknown key in.
                issuer.down = True
                server.process.send_signal(signal.SIGHUP)
                wait_for(lambda: "fetching its keys failed" in server.output(), 20, "the failed refresh")
                assert (await grpc_update(stubs, issuer.mint(new_key_, **MAIN)))[1] == grpc.StatusCode.OK
                rotated = issuer.rotate("rsa")
                assert (await grpc_update(stubs, issuer.mint(rotated, **MAIN)))[1] == grpc.StatusCode.UNAUTHENTICATED
                assert (await grpc_update(stubs, issuer.mint(new_key_, **MAIN)))[1] == grpc.StatusCode.OK


async def test_an_issuer_down_at_start_then_up(tmp_path):
    with TestIssuer(kinds=("ed25519",)) as issuer:
        issuer.down = True
        setup = Setup(tmp_path, issuer)
        with ServerProcess(tmp_path / "data", extra_args=setup.args()) as server:
            async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
                stubs = make_stubs(channel)
                token = issuer.mint(**MAIN)
                assert (await grpc_update(stubs, token))[1] == grpc.StatusCode.UNAUTHENTICATED
                issuer.down = False
                server.process.send_signal(signal.SIGHUP)
                wait_for(lambda: "keys loaded" in server.output(), 20, "the keys")
                assert (await grpc_update(stubs, token))[1] == grpc.StatusCode.OK


async def test_air_gapped_jwks_file(tmp_path):
    issuer = TestIssuer(kinds=("rsa", "ec"))  # never started: nothing is fetched
    issuer.url = "https://ci.example.internal"
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps(issuer.jwks()))
    setup = Setup(tmp_path, issuer)
    with ServerProcess(tmp_path / "data", extra_args=setup.args("--oidc-jwks-file", str(jwks))) as server:
        async with grpc.aio.insecure_channel(server.grpc_address, options=CLIENT_OPTIONS) as channel:
            stubs = make_stubs(channel)
            for key in issuer.published:
                assert (await grpc_update(stubs, issuer.mint(key, **MAIN)))[1] == grpc.StatusCode.OK
            # The file changes (the operator rotated it): SIGHUP, and the dropped key is refused.
            kept = issuer.published[1]
            dropped = issuer.mint(issuer.published[0], **MAIN)
            jwks.write_text(json.dumps({"keys": [kept.jwk()]}))
            server.process.send_signal(signal.SIGHUP)
            wait_for(lambda: "reloaded access control" in server.output(), 20, "the reload")
            assert (await grpc_update(stubs, dropped))[1] == grpc.StatusCode.UNAUTHENTICATED
            assert (await grpc_update(stubs, issuer.mint(kept, **MAIN)))[1] == grpc.StatusCode.OK


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--oidc-issuer", "https://ci.example"], "needs oidc_audience"),
        (["--oidc-issuer", "http://ci.example", "--oidc-audience", "a"], "not an https URL"),
        (["--oidc-audience", "a"], "need oidc_issuer"),
    ],
)
def test_oidc_settings_that_cannot_work_stop_the_start(tmp_path, args, message):
    access = tmp_path / "access.toml"
    access.write_text('[[grant]]\nprincipal = "x"\npermissions = ["read"]\n')
    server = ServerProcess(tmp_path / "data", extra_args=[*args, "--access-file", str(access)])
    with pytest.raises(ServerError):
        server.start(timeout=30)
    wait_for(lambda: not server.running, 10, "the server to exit")
    assert message in server.output()


def test_a_grant_naming_an_untrusted_issuer_stops_the_start(tmp_path):
    access = write_grants(tmp_path / "access.toml", "https://other.example")
    args = ["--access-file", str(access), "--oidc-issuer", "https://ci.example", "--oidc-audience", "a"]
    server = ServerProcess(tmp_path / "data", extra_args=args)
    with pytest.raises(ServerError):
        server.start(timeout=30)
    wait_for(lambda: not server.running, 10, "the server to exit")
    assert "is not an --oidc-issuer" in server.output()
