"""Real Bazel 4.2.3 against buildvault's gRPC (REAPI v2) remote cache.

A cold build uploads every cacheable spawn; `bazel clean`, a restart of the buildvault server
on the same data dir (persistence), and the rebuild finds every compile and link action as a
remote cache hit, and the binary runs. The same again with --remote_download_minimal, where
Bazel trusts the cache to keep every output it was told about.
"""

from __future__ import annotations

import pytest
from bazel_harness import ALL_HITS, CACHEABLE_SPAWNS, EXPECTED_OUTPUT
from server_process import ServerProcess

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def server_log_level() -> str:
    return "debug"  # one JSON line per request: the tests count the RPCs Bazel made


def _requests(server: ServerProcess, rpc: str) -> int:
    return server.output().count(f'"rpc":"{rpc}"')


def test_bazel_grpc_cache_survives_server_restart(bazel_workspace_factory, server):
    ws = bazel_workspace_factory("a")
    url = f"grpc://{server.grpc_address}"

    cold = ws.build(remote_cache=url, check=True).processes
    assert cold.executed == CACHEABLE_SPAWNS and cold.cache_hits == 0, cold.line
    assert ws.run_binary().stdout == EXPECTED_OUTPUT + "\n"
    assert _requests(server, "UpdateActionResult") == CACHEABLE_SPAWNS
    assert '"code":"INTERNAL"' not in server.output() and '"code":"UNKNOWN"' not in server.output()

    ws.clean()
    server.restart()  # same data dir, same port: what Bazel uploaded must have been persisted
    assert f"grpc://{server.grpc_address}" == url

    warm = ws.build(remote_cache=url, check=True).processes
    assert warm.as_dict() == ALL_HITS, warm.line
    assert ws.run_binary().stdout == EXPECTED_OUTPUT + "\n"


def test_bazel_grpc_remote_download_minimal(bazel_workspace_factory, server):
    ws = bazel_workspace_factory("minimal")
    url = f"grpc://{server.grpc_address}"

    cold = ws.build("--remote_download_minimal", remote_cache=url, check=True).processes
    assert cold.executed == CACHEABLE_SPAWNS and cold.cache_hits == 0, cold.line

    ws.clean()
    server.restart()

    warm = ws.build("--remote_download_minimal", remote_cache=url, check=True).processes
    # (without local outputs Bazel skips one internal action, the runfiles tree)
    assert warm.cache_hits == CACHEABLE_SPAWNS and warm.executed == 0, warm.line
    assert not ws.binary_path().exists()  # minimal: nothing was downloaded
    # Bazel 4.2.3's `bazel run` does not fetch remote-only outputs; a top-level build does, from
    # the cache, which must still hold what the minimal build was told about.
    top = ws.build("--remote_download_toplevel", remote_cache=url, check=True).processes
    assert top.executed == 0, top.line
    assert ws.run_binary().stdout == EXPECTED_OUTPUT + "\n"
    assert '"code":"INTERNAL"' not in server.output() and '"code":"UNKNOWN"' not in server.output()


def test_bazel_grpc_second_workspace_and_instance_names(bazel_workspace_factory, server):
    url = f"grpc://{server.grpc_address}"
    first = bazel_workspace_factory("first")
    first.build("--remote_instance_name=team/a", remote_cache=url, check=True)

    # another checkout in another directory, with its own Bazel server: all hits
    second = bazel_workspace_factory("second")
    hits = second.build("--remote_instance_name=team/a", remote_cache=url, check=True).processes
    assert hits.as_dict() == ALL_HITS, hits.line
    assert second.run_binary().stdout == EXPECTED_OUTPUT + "\n"

    # another instance name shares the CAS but not the action cache
    third = bazel_workspace_factory("third")
    miss = third.build("--remote_instance_name=team/b", remote_cache=url, check=True).processes
    assert miss.cache_hits == 0 and miss.executed == CACHEABLE_SPAWNS, miss.line
