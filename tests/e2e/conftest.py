"""Shared fixtures for the real-client e2e tests (Bazel 4.2.3, ccache 4.7.5).

Nothing here skips: a missing tool makes the tests FAIL with a hint to run
``scripts/install-system-deps.sh`` (``required_tools``, shared with tests/launcher).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for extra in (HERE, HERE.parent / "integration"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import required_tools  # noqa: E402
import s3_server  # noqa: E402
from bazel_harness import BazelWorkspace  # noqa: E402
from ccache_harness import CcacheProject  # noqa: E402
from server_process import ServerProcess  # noqa: E402

# Fixtures defined beside their helpers, offered to every e2e test. Bound by assignment, not
# imported by name, so a parameter that requests one is not a redefinition to the linter.
require_bazel = required_tools.require_bazel
require_ccache = required_tools.require_ccache
aws_env = s3_server.aws_env
moto_server = s3_server.moto_server
s3 = s3_server.s3


@pytest.fixture
def servers(tmp_path):
    """``start(name, *flags, **ServerProcess kwargs)`` -> a running ``buildvault serve`` with its
    own data dir; all are stopped at teardown."""
    with contextlib.ExitStack() as stack:

        def start(name: str, *args: str, **kwargs) -> ServerProcess:
            process = ServerProcess(tmp_path / name / "data", name=name, extra_args=list(args), **kwargs)
            return stack.enter_context(process)

        yield start


@pytest.fixture
def server_log_level() -> str:
    """The ``server`` fixture's --log-level (a test module overrides this fixture to change it)."""
    return "info"


@pytest.fixture
def server(servers, server_log_level) -> ServerProcess:
    """One ``buildvault serve`` (gRPC and HTTP on loopback) with a fresh data dir."""
    return servers("server", log_level=server_log_level)


@pytest.fixture
def bazel_workspace_factory(tmp_path, require_bazel):
    """``make(name, **kwargs) -> BazelWorkspace`` under tmp_path; servers are shut down afterwards."""
    created: list[BazelWorkspace] = []

    def make(name: str = "ws", **kwargs) -> BazelWorkspace:
        ws = BazelWorkspace(tmp_path / name, **kwargs)
        created.append(ws)
        return ws

    yield make
    # `bazel shutdown` takes ~2 s each: stop the servers concurrently.
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(created))) as pool:
        list(pool.map(lambda ws: ws.shutdown(), created))


@pytest.fixture
def ccache_project_factory(tmp_path, require_ccache):
    """``make(name, remote_storage=..., **kwargs) -> CcacheProject`` under tmp_path."""

    def make(name: str = "proj", **kwargs) -> CcacheProject:
        return CcacheProject(tmp_path / name, **kwargs)

    return make
