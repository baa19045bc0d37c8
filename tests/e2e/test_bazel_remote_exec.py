"""Real Bazel 4.2.3 with `--remote_executor` against buildvault's embedded scheduler and its
local workers: every compile and link runs remotely, the rebuild after `bazel clean` is all
remote cache hits, a genrule outliving --remote_timeout still finishes (WaitExecution), a tree
artifact comes back as a Tree, and a test that sleeps past --test_timeout ends as TIMEOUT."""

from __future__ import annotations

import pytest
from bazel_harness import ALL_HITS, CACHEABLE_SPAWNS, EXPECTED_OUTPUT
from execution_client import processes_with

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


EXTRA_BUILD = """
load(":tree.bzl", "tree_artifact")

genrule(
    name = "slow",
    outs = ["slow.txt"],
    cmd = "sleep 6; echo slow-done > $@",
)

tree_artifact(name = "tree")

sh_test(
    name = "sleepy_test",
    srcs = ["sleepy_test.sh"],
)
"""

TREE_BZL = """
def _impl(ctx):
    out = ctx.actions.declare_directory(ctx.label.name + ".d")
    ctx.actions.run_shell(
        outputs = [out],
        command = "mkdir -p {o}/sub && echo one > {o}/one.txt && echo two > {o}/sub/two.txt && ln -s one.txt {o}/link"
            .format(o = out.path),
    )
    return [DefaultInfo(files = depset([out]))]

tree_artifact = rule(implementation = _impl)
"""

SLEEP_MARKER = "29.75311"  # a `sleep` argument no other process uses
SLEEPY_TEST = f"#!/bin/sh\necho printed-before-the-kill\nsleep {SLEEP_MARKER}\n"

# Offline `bazel test` needs @remote_coverage_tools: no-op coverage tools.
COVERAGE_STUB_BUILD = """
package(default_visibility = ["//visibility:public"])
sh_binary(name = "coverage_report_generator", srcs = ["noop.sh"])
sh_binary(name = "lcov_merger", srcs = ["noop.sh"])
"""


def add_extra_targets(ws) -> None:
    ws.write_file("extra/BUILD", EXTRA_BUILD)
    ws.write_file("extra/tree.bzl", TREE_BZL)
    (ws.write_file("extra/sleepy_test.sh", SLEEPY_TEST)).chmod(0o755)
    ws.write_file("third_party/coverage_stub/WORKSPACE", "")
    ws.write_file("third_party/coverage_stub/BUILD", COVERAGE_STUB_BUILD)
    (ws.write_file("third_party/coverage_stub/noop.sh", "#!/bin/sh\nexit 0\n")).chmod(0o755)
    workspace = (ws.path / "WORKSPACE").read_text()
    ws.write_file(
        "WORKSPACE",
        workspace + '\nlocal_repository(name = "remote_coverage_tools", path = "third_party/coverage_stub")\n',
    )


def test_bazel_remote_genrule_past_remote_timeout_and_tree_artifact(bazel_workspace_factory, exec_server):
    ws = bazel_workspace_factory("extra")
    add_extra_targets(ws)
    result = ws.build(
        *remote_exec(exec_server), "--remote_timeout=2", targets=("//extra:slow", "//extra:tree"), check=True
    )
    assert result.processes["remote"] == 2, result.processes.line
    # Bazel 4.2.3 puts no deadline on the Execute stream itself: the 6 s action simply outlives the
    # 2 s --remote_timeout (the server repeats the state meanwhile). WaitExecution: the restart test.
    bin_dir = ws.binary_path("extra")
    assert (bin_dir / "slow.txt").read_text() == "slow-done\n"
    tree = bin_dir / "tree.d"
    assert (tree / "one.txt").read_text() == "one\n" and (tree / "sub" / "two.txt").read_text() == "two\n"


def test_bazel_remote_test_timeout(bazel_workspace_factory, exec_server):
    ws = bazel_workspace_factory("timeout")
    add_extra_targets(ws)
    result = ws.run(
        "test",
        *remote_exec(exec_server),
        "--test_timeout=2",
        "--test_output=errors",
        "--",
        "//extra:sleepy_test",
        timeout=120,
    )
    assert result.returncode != 0
    assert "TIMEOUT" in result.output, result.output
    assert "printed-before-the-kill" in result.output, result.output
    assert not processes_with(f"sleep {SLEEP_MARKER}")  # the whole process group was killed
    log = exec_server.output()
    assert '"rpc":"UpdateActionResult"' not in log  # (remote execution: Bazel uploads no results)
    assert '"code":"INTERNAL"' not in log and '"code":"UNKNOWN"' not in log
