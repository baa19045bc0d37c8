"""Real Bazel 4.2.3 against buildvault's bazel-remote HTTP protocol.

`--remote_cache=http://127.0.0.1:PORT/prefix`: a cold build uploads every cacheable spawn, and
after `bazel clean` (and in a second workspace in another directory, with its own Bazel
server) every compile and link is a remote cache hit. The ActionResults Bazel PUT over HTTP
are real action cache entries: a gRPC build with the same instance name hits them too.
"""

from __future__ import annotations

import pytest
from bazel_harness import ALL_HITS, CACHEABLE_SPAWNS, EXPECTED_OUTPUT

pytestmark = pytest.mark.timeout(600)


def test_bazel_http_clean_rebuild_is_all_remote_hits(bazel_workspace_factory, server):
    url = f"http://{server.http_address}/prefix"
    ws = bazel_workspace_factory("a")

    cold = ws.build(remote_cache=url, check=True).processes
    assert cold.executed == CACHEABLE_SPAWNS and cold.cache_hits == 0, cold.line
    assert ws.run_binary().stdout == EXPECTED_OUTPUT + "\n"
    after_cold = server.status()
    assert after_cold["ac_misses_by_protocol"]["http"] == CACHEABLE_SPAWNS
    assert after_cold["ac_entries"] == CACHEABLE_SPAWNS  # all real ActionResults, none raw

    ws.clean()
    warm = ws.build(remote_cache=url, check=True).processes
    assert warm.as_dict() == ALL_HITS, warm.line
    assert ws.run_binary().stdout == EXPECTED_OUTPUT + "\n"
    assert server.status()["ac_hits_by_protocol"]["http"] == CACHEABLE_SPAWNS

    # Another checkout in another directory, with its own Bazel server: all hits as well.
    other = bazel_workspace_factory("b")
    hits = other.build(remote_cache=url, check=True).processes
    assert hits.as_dict() == ALL_HITS, hits.line
    assert other.run_binary().stdout == EXPECTED_OUTPUT + "\n"

    # A different prefix is a different instance: nothing shared.
    isolated = bazel_workspace_factory("c")
    miss = isolated.build(remote_cache=f"http://{server.http_address}/other", check=True).processes
    assert miss.cache_hits == 0 and miss.executed == CACHEABLE_SPAWNS, miss.line


def test_bazel_http_results_serve_grpc_builds(bazel_workspace_factory, server):
    """What Bazel stored over HTTP is what a gRPC Bazel build finds (same instance name)."""
    http = bazel_workspace_factory("http")
    http.build(remote_cache=f"http://{server.http_address}/shared", check=True)

    grpc_ws = bazel_workspace_factory("grpc")
    result = grpc_ws.build(
        "--remote_instance_name=shared", remote_cache=f"grpc://{server.grpc_address}", check=True
    ).processes
    assert result.as_dict() == ALL_HITS, result.line
    assert grpc_ws.run_binary().stdout == EXPECTED_OUTPUT + "\n"
    status = server.status()
    assert status["ac_hits_by_protocol"]["grpc"] == CACHEABLE_SPAWNS
