"""Real Bazel 4.2.3 and ccache 4.7 with CI identity tokens (OIDC) from a test issuer on loopback.

The csrc trust model: the access file grants read and write to main-branch pushes of the
repository and read to every other job of it (pull requests). Tokens are minted by the test
with the claims GitHub Actions puts in a job's token.

- Bazel over gRPC with `--remote_header=authorization=Bearer <main token>`: a cold build stores
  every action, `bazel clean` and a rebuild are all remote hits. With a pull-request token the
  build passes, no ActionResult is stored (counted through the server) and the audit log shows
  nothing written by it.
- ccache over HTTP with `|bearer-token=<main token>` writes and then hits; with a PR token it
  reads (hits what main stored) and stores nothing, even when it tries to write.
- `buildvault audit` names the main job as the writer of an entry Bazel wrote over gRPC and of
  one ccache wrote over HTTP.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from auth_setup import bearer, new_token, status
from bazel_harness import ALL_HITS, CACHEABLE_SPAWNS, EXPECTED_OUTPUT
from ccache_harness import TRANSLATION_UNITS
from oidc_issuer import TestIssuer

pytestmark = pytest.mark.timeout(1500)

MAIN = {"ref": "refs/heads/main", "event_name": "push", "run_id": "1111"}
PR = {"ref": "refs/pull/9/merge", "event_name": "pull_request", "sub": "repo:org/vllm-ascend:pull_request",
      "run_id": "2222"}  # fmt: skip


@pytest.fixture
def oidc_server(tmp_path, servers):
    with TestIssuer(kinds=("rsa", "ec")) as issuer:
        tokens = tmp_path / "tokens"
        admin = new_token(tokens, "admin")
        access = tmp_path / "access.toml"
        access.write_text(
            f"""
[[grant]]
principal = "admin"
permissions = ["read"]

[[grant]]
issuer = "{issuer.url}"
claims = {{ repository = "org/vllm-ascend", ref = "refs/heads/main", event_name = "push" }}
permissions = ["read", "write"]

[[grant]]
issuer = "{issuer.url}"
claims = {{ repository = "org/vllm-ascend" }}
permissions = ["read"]
"""
        )
        audit = tmp_path / "audit.jsonl"
        server = servers(
            "oidc",
            "--token-file", str(tokens), "--access-file", str(access), "--oidc-issuer", issuer.url,
            "--oidc-audience", issuer.audience, "--audit-log", str(audit),
        )  # fmt: skip
        server.issuer, server.admin, server.audit = issuer, admin, audit  # type: ignore[attr-defined]
        yield server


def entries(server) -> int:
    return int(status(server.http_address, bearer(server.admin))["ac_entries"])


def audit_lines(server) -> list[dict]:
    path = server.audit
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def buildvault_audit(server, digest: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "buildvault.cli", "audit", digest, "--audit-log", str(server.audit)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_bazel_main_token_writes_and_hits_pr_token_stores_nothing(oidc_server, bazel_workspace_factory):
    from polling import wait_for

    issuer = oidc_server.issuer
    url = f"grpc://{oidc_server.grpc_address}"
    main = issuer.mint(issuer.published[0], **MAIN)
    ws = bazel_workspace_factory("main")
    cold = ws.build(f"--remote_header=authorization=Bearer {main}", remote_cache=url, check=True).processes
    assert cold.executed == CACHEABLE_SPAWNS and cold.cache_hits == 0, cold.line
    assert entries(oidc_server) == CACHEABLE_SPAWNS
    ws.clean()
    warm = ws.build(f"--remote_header=authorization=Bearer {main}", remote_cache=url, check=True).processes
    assert warm.as_dict() == ALL_HITS, warm.line
    assert ws.run_binary().stdout == EXPECTED_OUTPUT + "\n"
    wait_for(lambda: len(audit_lines(oidc_server)) >= CACHEABLE_SPAWNS, 20, "the main job's audit lines")
    written = audit_lines(oidc_server)
    assert {e["principal"] for e in written} == {f"oidc:{issuer.url[7:]}:repo:org/vllm-ascend:ref:refs/heads/main"}
    assert {e["claims"]["run_id"] for e in written} == {"1111"} and {e["kind"] for e in written} == {"action_result"}
    # `buildvault audit` names the job that wrote an entry Bazel stored over gRPC.
    found = buildvault_audit(oidc_server, written[0]["digest"])
    assert found.returncode == 0 and "run_id=1111" in found.stdout and "grpc" in found.stdout, found.stderr

    # A pull-request job (another key of the same issuer), on a fresh output base and instance:
    # the build passes, nothing is stored, nothing is audited.
    pr = issuer.mint(issuer.published[1], **PR)
    result = bazel_workspace_factory("pr").build(
        f"--remote_header=authorization=Bearer {pr}", "--remote_instance_name=pr",
        "--noremote_upload_local_results", remote_cache=url, check=True,
    )  # fmt: skip
    assert result.processes.executed == CACHEABLE_SPAWNS, result.processes.line
    assert entries(oidc_server) == CACHEABLE_SPAWNS
    # ... and it hits what main stored.
    hits = bazel_workspace_factory("pr-hits").build(
        f"--remote_header=authorization=Bearer {pr}", "--noremote_upload_local_results", remote_cache=url, check=True
    )
    assert hits.processes.as_dict() == ALL_HITS, hits.processes.line
    assert len(audit_lines(oidc_server)) == len(written)
    assert not [e for e in audit_lines(oidc_server) if e["claims"].get("run_id") == "2222"]
    # For the record (pytest -s): what Bazel did with each kind of token.
    print(f"bazel main cold: {cold.line}\nbazel main after clean: {warm.line}")
    print(f"bazel PR, own instance: {result.processes.line}\nbazel PR, main's results: {hits.processes.line}")


def test_ccache_main_token_writes_and_hits_pr_token_only_reads(oidc_server, ccache_project_factory):
    from polling import wait_for

    issuer = oidc_server.issuer
    main, pr = issuer.mint(**MAIN), issuer.mint(**PR)
    base = f"http://{oidc_server.http_address}/csrc|layout=bazel"
    cold = ccache_project_factory("main", remote_storage=f"{base}|bearer-token={main}")
    cold.build_cold()
    assert entries(oidc_server) == 2 * TRANSLATION_UNITS
    again = ccache_project_factory("main-again", remote_storage=f"{base}|bearer-token={main}")
    again.rebuild_all_remote_hits()
    # The PR job hits everything main stored ...
    reader = ccache_project_factory("pr", remote_storage=f"{base}|bearer-token={pr}|read-only=true")
    reader.build()
    stats = reader.stats()
    assert stats["remote_storage_hit"] == TRANSLATION_UNITS, reader.show_stats()
    # ... and when it tries to write (another instance, not read-only), nothing is stored.
    writer = ccache_project_factory("pr-writes", remote_storage=f"http://{oidc_server.http_address}/pr|layout=bazel"
                                    f"|bearer-token={pr}")  # fmt: skip
    writer.build()
    assert writer.run_binary().returncode == 0
    assert writer.stats()["cache_miss"] == TRANSLATION_UNITS, writer.show_stats()
    assert entries(oidc_server) == 2 * TRANSLATION_UNITS
    # The audit log names the main job for every entry ccache wrote over HTTP, never the PR job.
    wait_for(lambda: len(audit_lines(oidc_server)) >= 2 * TRANSLATION_UNITS, 20, "ccache's audit lines")
    written = audit_lines(oidc_server)
    assert len(written) == 2 * TRANSLATION_UNITS
    assert {(e["protocol"], e["kind"], e["claims"]["run_id"], e["instance"]) for e in written} == {
        ("http", "ac_entry", "1111", "csrc")
    }
    found = buildvault_audit(oidc_server, written[0]["digest"])
    assert found.returncode == 0 and "run_id=1111" in found.stdout and " http " in found.stdout, found.stderr
    # For the record (pytest -s): what ccache did with each kind of token.
    keys = ("cache_miss", "direct_cache_hit", "remote_storage_hit", "remote_storage_write", "remote_storage_error")
    for name, project in (("main cold", cold), ("main again", again), ("PR read-only", reader), ("PR writing", writer)):
        print(f"ccache {name}: " + " ".join(f"{k}={project.stats().get(k, 0)}" for k in keys))
