"""buildvault-cc against a buildvault that only the CI token may write (issue 11, item 7).

A PR job given only a read token, even one configured as a writer, compiles everything on a
cold cache, warns once that uploads are refused and stores nothing. The CI token stores, and a
second checkout then gets every compile from the cache. `grpcs://` with BUILDVAULT_TLS_CA works
the same with a token file.
"""

from __future__ import annotations

import subprocess

import pytest
from auth_setup import Pki, bearer, new_token, status, write_access
from launcher_harness import ALL_COMPILES, cmake_build, copy_checkout, flush, launcher_command
from server_process import ServerProcess

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture
def tokens_server(tmp_path):
    tokens = tmp_path / "tokens"
    ci, reader = new_token(tokens, "ci"), new_token(tokens, "reader")
    access = write_access(tmp_path / "access.toml", [("ci", ["read", "write"], [""]), ("reader", ["read"], [""])])
    with ServerProcess(
        tmp_path / "server" / "data", extra_args=["--token-file", str(tokens), "--access-file", str(access)]
    ) as s:
        s.ci, s.reader = ci, reader  # type: ignore[attr-defined]
        yield s


def entries(server) -> int:
    return int(status(server.http_address, bearer(server.ci))["ac_entries"])


def test_read_token_compiles_everything_and_stores_nothing_then_ci_token_fills_the_cache(
    tokens_server, env_factory, toolchain, tmp_path, require_cmake
):
    token_file = tmp_path / "reader.token"
    token_file.write_text(tokens_server.reader + "\n")
    pr = env_factory(tokens_server, BUILDVAULT_TOKEN_FILE=str(token_file))  # a writer by mistake
    checkout = copy_checkout(tmp_path / "pr")
    build = cmake_build(toolchain, checkout, checkout / "build", pr).check()
    assert build.compiled_set == ALL_COMPILES
    assert entries(tokens_server) == 0
    assert build.output.count("the remote cache refused an upload") == 1, build.output[-3000:]

    ci = env_factory(tokens_server, BUILDVAULT_TOKEN=tokens_server.ci)
    first = copy_checkout(tmp_path / "ci")
    assert cmake_build(toolchain, first, first / "build", ci).check().compiled_set == ALL_COMPILES
    assert entries(tokens_server) > 0
    second = copy_checkout(tmp_path / "ci-second")
    assert cmake_build(toolchain, second, second / "build", ci).check().compiled == []
    # The read token now hits everything CI stored.
    reader_checkout = copy_checkout(tmp_path / "pr-again")
    reread = env_factory(tokens_server, BUILDVAULT_TOKEN_FILE=str(token_file), BUILDVAULT_WRITER="0")
    assert cmake_build(toolchain, reader_checkout, reader_checkout / "build", reread).check().compiled == []


def test_grpcs_with_a_private_ca_and_a_token_file(tmp_path, env_factory, toolchain, require_gxx):
    pki = Pki(tmp_path / "pki", kind="ec")
    cert = pki.issue("localhost", server=True)
    tokens = tmp_path / "tokens"
    token_file = tmp_path / "ci.token"
    token_file.write_text(new_token(tokens, "ci"))
    args = ["--tls-cert-file", str(cert.cert), "--tls-key-file", str(cert.key), "--token-file", str(tokens)]
    with ServerProcess(tmp_path / "server" / "data", extra_args=args) as server:
        host_port = server.grpc_address.replace("127.0.0.1", "localhost")
        env = env_factory(
            server,
            remote=f"grpcs://{host_port}",
            BUILDVAULT_TOKEN_FILE=str(token_file),
            BUILDVAULT_TLS_CA=str(pki.ca_cert),
        )
        env["SHIM_LOG"] = str(toolchain.log)
        for name in ("a", "b"):
            tree = tmp_path / name
            tree.mkdir()
            (tree / "x.cc").write_text("int x() { return 42; }\n")
            run_env = dict(env, BUILDVAULT_ROOTS=f"SRC={tree},BUILD={tree}")
            argv = [launcher_command(), toolchain.cxx, "-O2", "-c", str(tree / "x.cc"), "-o", str(tree / "x.o")]
            done = subprocess.run(argv, cwd=tree, env=run_env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            assert "unavailable" not in done.stderr, done.stderr
            flush(run_env)
        assert len(toolchain.take()) == 1  # the second tree's compile came from the cache over TLS
        assert (tmp_path / "a" / "x.o").read_bytes() == (tmp_path / "b" / "x.o").read_bytes()


def test_a_token_file_replaced_halfway_keeps_storing_with_the_new_token(tmp_path, env_factory, toolchain, require_gxx):
    """A CI job's OIDC token is renewed during a build: the agent, which outlives the token,
    reads BUILDVAULT_TOKEN_FILE again when it changes and keeps storing; no compile fails,
    although the old token stops working when its key leaves the issuer's set."""
    import signal

    import grpc
    from oidc_issuer import TestIssuer
    from polling import wait_for

    from buildvault.client.ci_token import write_token_file
    from buildvault.remote_apis import re_grpc, re_pb2

    main = {"ref": "refs/heads/main", "event_name": "push"}
    with TestIssuer(kinds=("rsa",)) as issuer:
        tokens = tmp_path / "tokens"
        admin = new_token(tokens, "admin")
        access = tmp_path / "access.toml"
        access.write_text(
            '[[grant]]\nprincipal = "admin"\npermissions = ["read", "write"]\n'
            f'[[grant]]\nissuer = "{issuer.url}"\n'
            'claims = { repository = "org/vllm-ascend", ref = "refs/heads/main" }\n'
            'permissions = ["read", "write"]\n'
        )
        args = [
            "--token-file", str(tokens), "--access-file", str(access),
            "--oidc-issuer", issuer.url, "--oidc-audience", issuer.audience,
        ]  # fmt: skip
        with ServerProcess(tmp_path / "server" / "data", extra_args=args) as server:
            token_file = tmp_path / "ci.token"
            old = issuer.mint(**main)
            write_token_file(str(token_file), old)
            env = env_factory(server, BUILDVAULT_TOKEN_FILE=str(token_file))
            env["SHIM_LOG"] = str(toolchain.log)

            def compile_one(name: str) -> None:
                tree = tmp_path / name
                tree.mkdir()
                (tree / f"{name}.cc").write_text(f"int {name}() {{ return {len(name)}; }}\n")
                run_env = dict(env, BUILDVAULT_ROOTS=f"SRC={tree},BUILD={tree}")
                argv = [launcher_command(), toolchain.cxx, "-O2", "-c", str(tree / f"{name}.cc"), "-o", "out.o"]
                done = subprocess.run(argv, cwd=tree, env=run_env, capture_output=True, text=True, timeout=120)
                assert done.returncode == 0, done.stderr
                assert (tree / "out.o").exists()
                assert "refused" not in done.stderr and "unavailable" not in done.stderr, done.stderr
                flush(run_env)

            def stored() -> int:
                return int(status(server.http_address, bearer(admin))["ac_entries"])

            for name in ("a1", "a2", "a3"):
                compile_one(name)
            first = stored()
            assert first > 0
            # The issuer rotates its key (the server learns it on SIGHUP): the old token is dead.
            fresh_key = issuer.rotate("rsa")
            server.process.send_signal(signal.SIGHUP)
            wait_for(lambda: server.output().count("keys loaded") >= 2, 20, "the new key set")

            async def refused_now() -> grpc.StatusCode:
                async with grpc.aio.insecure_channel(server.grpc_address) as channel:
                    try:
                        await re_grpc.ActionCacheStub(channel).GetActionResult(
                            re_pb2.GetActionResultRequest(action_digest=re_pb2.Digest(hash="0" * 64, size_bytes=1)),
                            metadata=(("authorization", bearer(old)),),
                        )
                    except grpc.aio.AioRpcError as e:
                        return e.code()
                return grpc.StatusCode.OK

            import asyncio

            assert asyncio.run(refused_now()) == grpc.StatusCode.UNAUTHENTICATED
            write_token_file(str(token_file), issuer.mint(fresh_key, **main))  # the CI renews the token
            for name in ("b1", "b2", "b3"):
                compile_one(name)
            assert stored() == 2 * first  # three more compiles stored as much as the first three
            assert len(toolchain.take()) == 6  # every compile ran (distinct sources), none failed
