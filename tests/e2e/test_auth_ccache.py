"""Real ccache 4.7.5 against a buildvault with credentials.

`http://user:pass@…|layout=bazel` (htpasswd) and `|bearer-token=…` (token file) write and then
hit; without credentials the compiles succeed and nothing is stored; `|read-only=true` hits
what the writer stored and writes nothing.
"""

from __future__ import annotations

import pytest
from auth_setup import basic, htpasswd, new_token, status
from ccache_harness import EXPECTED_OUTPUT, TRANSLATION_UNITS

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def auth_server(tmp_path, servers):
    users, tokens = tmp_path / "htpasswd", tmp_path / "tokens"
    htpasswd(users, "ci", "ci-secret")
    token = new_token(tokens, "ci-token")
    server = servers("auth", "--htpasswd-file", str(users), "--token-file", str(tokens))
    server.token = token  # type: ignore[attr-defined]
    return server


def entries(server) -> int:
    return int(status(server.http_address, basic("ci", "ci-secret"))["ac_entries"])


def test_ccache_basic_auth_writes_and_hits(ccache_project_factory, auth_server):
    remote = f"http://ci:ci-secret@{auth_server.http_address}/basic|layout=bazel"
    ccache_project_factory("a", remote_storage=remote).build_cold()
    assert entries(auth_server) == 2 * TRANSLATION_UNITS
    ccache_project_factory("b", remote_storage=remote).rebuild_all_remote_hits()


def test_ccache_bearer_token_writes_and_hits(ccache_project_factory, auth_server):
    remote = f"http://{auth_server.http_address}/bearer|layout=bazel|bearer-token={auth_server.token}"
    ccache_project_factory("a", remote_storage=remote).build_cold()
    assert entries(auth_server) == 2 * TRANSLATION_UNITS
    ccache_project_factory("b", remote_storage=remote).rebuild_all_remote_hits()


def test_ccache_without_credentials_compiles_and_stores_nothing(ccache_project_factory, auth_server):
    project = ccache_project_factory("anon", remote_storage=f"http://{auth_server.http_address}/anon|layout=bazel")
    project.build()
    assert project.run_binary().stdout == EXPECTED_OUTPUT + "\n"
    stats = project.stats()
    assert stats["cache_miss"] == TRANSLATION_UNITS and stats["remote_storage_hit"] == 0, project.show_stats()
    assert entries(auth_server) == 0


def test_ccache_read_only_hits_what_the_writer_stored(ccache_project_factory, auth_server):
    base = f"http://ci:ci-secret@{auth_server.http_address}/ro|layout=bazel"
    ccache_project_factory("writer", remote_storage=base).build_cold()
    reader = ccache_project_factory("reader", remote_storage=f"{base}|read-only=true")
    reader.build()
    stats = reader.stats()
    assert stats["remote_storage_hit"] == TRANSLATION_UNITS, reader.show_stats()
    assert stats["remote_storage_write"] == 0, reader.show_stats()
    assert entries(auth_server) == 2 * TRANSLATION_UNITS
