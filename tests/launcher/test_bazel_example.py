"""bazel_example/ the Bazel way: gen_bazel.py writes the BUILD files, real Bazel 4.2.3 builds
them with --remote_cache=grpc://<live buildvault>, and after `bazel clean` every cacheable
spawn is a remote cache hit. A SOC change (--define soc=...) re-runs only SOC-dependent work."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from bazel_harness import BazelWorkspace, ProcessSummary  # tests/e2e (on sys.path through conftest.py)
from launcher_harness import EXAMPLE, start_server

BINARY = "csrc/op_registry_demo"
# 20 C++ compiles + 1 genrule + 8 links/archives (Bazel 4.2.3, this tree).
CACHEABLE = 29
# With another SOC the third-party library (2 compiles + its archive) and the adapter genrule
# (the generator knows no SOC) stay as they are (Bazel may skip more: unchanged objects).
SOC_INDEPENDENT = 4


def processes(build: object) -> ProcessSummary:
    summary = getattr(build, "processes", None)
    assert isinstance(summary, ProcessSummary), "Bazel printed no process summary"
    return summary


@pytest.fixture
def workspace(tmp_path: Path, require_bazel: None) -> Iterator[BazelWorkspace]:
    template = tmp_path / "template"
    shutil.copytree(EXAMPLE, template, ignore=shutil.ignore_patterns("build", "_build", "bazel-*"))
    subprocess.run([sys.executable, str(template / "gen_bazel.py"), str(template)], check=True, capture_output=True)
    ws = BazelWorkspace(tmp_path / "bazel", template=template)
    yield ws
    ws.shutdown()


def test_generated_bazel_build_is_all_remote_hits_after_clean(workspace: BazelWorkspace, tmp_path: Path) -> None:
    server = start_server(tmp_path)
    try:
        remote = f"grpc://{server.grpc_address}"
        first = workspace.build(remote_cache=remote).check()
        assert processes(first).executed == CACHEABLE, processes(first).line
        assert workspace.run_binary(BINARY).stdout.strip() == "csrc-demo:ok soc=ascend910b1 total=490"

        workspace.clean()
        second = workspace.build(remote_cache=remote).check()
        assert processes(second).cache_hits == CACHEABLE, processes(second).line
        assert processes(second).executed == 0

        other_soc = workspace.build("--define", "soc=ascend310p1", remote_cache=remote).check()
        assert 18 <= processes(other_soc).executed <= CACHEABLE - SOC_INDEPENDENT, processes(other_soc).line
        assert workspace.run_binary(BINARY).stdout.strip() == "csrc-demo:ok soc=ascend310p1 total=490"
        workspace.clean()
        again = workspace.build("--define", "soc=ascend310p1", remote_cache=remote).check()
        assert processes(again).cache_hits == CACHEABLE and processes(again).executed == 0
    finally:
        server.stop()
        server.kill()
