"""Real Bazel 4.2.3 against a buildvault that only trusted writers may write.

- gRPC, plaintext, `--remote_header=authorization=Bearer <token>`: the CI token writes and a
  clean rebuild is all remote hits; a read token and no header still build, storing nothing.
- HTTP with `http://user:pass@…` (htpasswd): writes, then hits; a wrong password is refused
  (and counted) while the build still passes.
- HTTPS: Debian's Bazel 4.2.3 trusts only the JVM trust store for https, so the test hands it
  a PKCS12 store holding the test CA (`--host_jvm_args=-Djavax.net.ssl.trustStore=…`).
  (This Bazel cannot use grpcs:// at all: gRPC TLS is tested with grpcio clients.)
"""

from __future__ import annotations

import ssl

import pytest
from auth_setup import Pki, basic, bearer, htpasswd, metric, new_token, status, trust_store, write_access
from bazel_harness import ALL_HITS, CACHEABLE_SPAWNS, EXPECTED_OUTPUT

pytestmark = pytest.mark.timeout(1200)


def test_bazel_grpc_tokens_ci_writes_readers_never_do(tmp_path, servers, bazel_workspace_factory):
    tokens = tmp_path / "tokens"
    ci, reader = new_token(tokens, "ci"), new_token(tokens, "reader")
    access = write_access(tmp_path / "access.toml", [("ci", ["read", "write"], [""]), ("reader", ["read"], [""])])
    server = servers("auth", "--token-file", str(tokens), "--access-file", str(access))
    url = f"grpc://{server.grpc_address}"

    def entries() -> int:
        return int(status(server.http_address, bearer(ci))["ac_entries"])

    ws = bazel_workspace_factory("ci")
    cold = ws.build(f"--remote_header=authorization=Bearer {ci}", remote_cache=url, check=True).processes
    assert cold.executed == CACHEABLE_SPAWNS and cold.cache_hits == 0, cold.line
    assert entries() == CACHEABLE_SPAWNS
    ws.clean()
    warm = ws.build(f"--remote_header=authorization=Bearer {ci}", remote_cache=url, check=True).processes
    assert warm.as_dict() == ALL_HITS, warm.line
    assert ws.run_binary().stdout == EXPECTED_OUTPUT + "\n"

    # A PR job with the read token, on an instance nobody wrote: builds locally, stores nothing.
    # GetCapabilities tells it update_enabled=false, and Bazel 4.2.3 then refuses to start unless
    # told not to upload: readers pass --noremote_upload_local_results.
    pr = bazel_workspace_factory("pr")
    result = pr.build(
        f"--remote_header=authorization=Bearer {reader}",
        "--remote_instance_name=pr",
        "--noremote_upload_local_results",
        remote_cache=url,
        check=True,
    )
    assert result.processes.executed == CACHEABLE_SPAWNS, result.processes.line
    assert entries() == CACHEABLE_SPAWNS
    # ... and the read token does hit what CI wrote.
    hits = (
        bazel_workspace_factory("reader")
        .build(
            f"--remote_header=authorization=Bearer {reader}",
            "--noremote_upload_local_results",
            remote_cache=url,
            check=True,
        )
        .processes
    )
    assert hits.as_dict() == ALL_HITS, hits.line

    # No header at all: its lookups are refused (UNAUTHENTICATED), the build passes, nothing stored.
    anonymous = bazel_workspace_factory("anonymous").build(
        "--remote_instance_name=anon", "--noremote_upload_local_results", remote_cache=url, check=True
    )
    assert anonymous.processes.executed == CACHEABLE_SPAWNS, anonymous.processes.line
    assert entries() == CACHEABLE_SPAWNS
    refusals = {"Authorization": bearer(ci)}
    assert metric(
        server.http_address, "buildvault_auth_refusals_total", {"protocol": "grpc", "reason": "missing"}, refusals
    )


def test_bazel_http_basic_auth_and_wrong_password(tmp_path, servers, bazel_workspace_factory):
    users = tmp_path / "htpasswd"
    htpasswd(users, "ci", "ci-secret")
    server = servers("auth", "--htpasswd-file", str(users))
    base = f"ci:ci-secret@{server.http_address}/inst"

    ws = bazel_workspace_factory("a")
    cold = ws.build(remote_cache=f"http://{base}", check=True).processes
    assert cold.executed == CACHEABLE_SPAWNS, cold.line
    assert status(server.http_address, basic("ci", "ci-secret"))["ac_entries"] == CACHEABLE_SPAWNS
    ws.clean()
    warm = ws.build(remote_cache=f"http://{base}", check=True).processes
    assert warm.as_dict() == ALL_HITS, warm.line

    def bad() -> float:
        labels = {"protocol": "http", "reason": "bad_credentials"}
        return metric(
            server.http_address, "buildvault_auth_refusals_total", labels, {"Authorization": basic("ci", "ci-secret")}
        )

    before = bad()
    wrong = (
        bazel_workspace_factory("wrong")
        .build(remote_cache=f"http://ci:wrong@{server.http_address}/other", check=True)
        .processes
    )
    assert wrong.executed == CACHEABLE_SPAWNS and wrong.cache_hits == 0, wrong.line
    assert bad() > before
    assert status(server.http_address, basic("ci", "ci-secret"))["ac_entries"] == CACHEABLE_SPAWNS


def test_bazel_https_with_the_jvm_trust_store(tmp_path, servers, bazel_workspace_factory):
    pki = Pki(tmp_path / "pki")
    cert = pki.issue("localhost", server=True)
    users = tmp_path / "htpasswd"
    htpasswd(users, "ci", "ci-secret")
    server = servers(
        "tls", "--htpasswd-file", str(users), "--tls-cert-file", str(cert.cert), "--tls-key-file", str(cert.key)
    )
    store = trust_store(tmp_path, pki.ca_cert)
    jvm = [
        f"--host_jvm_args=-Djavax.net.ssl.trustStore={store}",
        "--host_jvm_args=-Djavax.net.ssl.trustStorePassword=changeit",
    ]
    url = f"https://ci:ci-secret@{server.http_address}/inst"
    ws = bazel_workspace_factory("a", startup_options=jvm)
    cold = ws.build(remote_cache=url, check=True).processes
    assert cold.executed == CACHEABLE_SPAWNS, cold.line
    ws.clean()
    warm = ws.build(remote_cache=url, check=True).processes
    assert warm.as_dict() == ALL_HITS, warm.line
    assert ws.run_binary().stdout == EXPECTED_OUTPUT + "\n"


def test_bazel_with_a_read_token_that_would_upload_stops_before_building(tmp_path, servers, bazel_workspace_factory):
    """update_enabled=false for a reader: Bazel 4.2.3 with uploads on refuses to start (exit 34)."""
    tokens = tmp_path / "tokens"
    reader = new_token(tokens, "reader")
    access = write_access(tmp_path / "access.toml", [("reader", ["read"], [""])])
    server = servers("auth", "--token-file", str(tokens), "--access-file", str(access))
    result = bazel_workspace_factory("pr").build(
        f"--remote_header=authorization=Bearer {reader}", remote_cache=f"grpc://{server.grpc_address}"
    )
    assert result.returncode == 34, result.output[-3000:]
    assert "not authorized to write local results to the remote cache" in result.output


def test_bazel_https_stops_at_the_server_certificate_tokens_carry_identity(
    tmp_path, servers, bazel_workspace_factory
):
    """Where TLS stops for Debian's Bazel 4.2.3 over HTTP: its HTTP cache presents no client
    certificate even with `--tls_client_certificate` (every request is refused, it builds
    locally, nothing stored), so the working set-up is a TLS server certificate,
    `--tls-client-auth optional` and a bearer token in `--remote_header`."""
    pki = Pki(tmp_path / "pki")
    cert = pki.issue("localhost", server=True)
    client = pki.issue("ci-runner")
    tokens = tmp_path / "tokens"
    ci = new_token(tokens, "ci")
    access = write_access(
        tmp_path / "access.toml", [("ci", ["read", "write"], [""]), ("cert:ci-runner", ["read", "write"], [""])]
    )
    server = servers(
        "tls",
        "--token-file", str(tokens), "--access-file", str(access),
        "--tls-cert-file", str(cert.cert), "--tls-key-file", str(cert.key),
        "--tls-client-ca-file", str(pki.ca_cert), "--tls-client-auth", "optional",
        grpc_address="",
    )  # fmt: skip
    store = trust_store(tmp_path, pki.ca_cert)
    jvm = [
        f"--host_jvm_args=-Djavax.net.ssl.trustStore={store}",
        "--host_jvm_args=-Djavax.net.ssl.trustStorePassword=changeit",
    ]
    url = f"https://{server.http_address}/inst"
    context = ssl.create_default_context(cafile=str(pki.ca_cert))

    def entries() -> int:
        return int(status(server.http_address, bearer(ci), scheme="https", context=context)["ac_entries"])

    def missing() -> float:
        labels = {"protocol": "http", "reason": "missing"}
        return metric(
            server.http_address, "buildvault_auth_refusals_total", labels, {"Authorization": bearer(ci)},
            scheme="https", context=context,
        )  # fmt: skip

    # The client certificate alone: Bazel never presents it, so it is refused and builds locally.
    before = missing()
    certificate_only = bazel_workspace_factory("cert", startup_options=jvm).build(
        f"--tls_client_certificate={client.cert}", f"--tls_client_key={client.key}", remote_cache=url, check=True
    )
    assert certificate_only.processes.executed == CACHEABLE_SPAWNS, certificate_only.processes.line
    assert certificate_only.processes.cache_hits == 0
    assert missing() > before
    assert entries() == 0

    # A server certificate and a bearer token: writes, then a clean rebuild is all remote hits.
    ws = bazel_workspace_factory("token", startup_options=jvm)
    cold = ws.build(f"--remote_header=authorization=Bearer {ci}", remote_cache=url, check=True).processes
    assert cold.executed == CACHEABLE_SPAWNS, cold.line
    assert entries() == CACHEABLE_SPAWNS
    ws.clean()
    warm = ws.build(f"--remote_header=authorization=Bearer {ci}", remote_cache=url, check=True).processes
    assert warm.as_dict() == ALL_HITS, warm.line

