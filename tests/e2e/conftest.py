"""Shared fixtures for the real-client e2e tests (Bazel 4.2.3, ccache 4.7.5).

Nothing here skips: a missing tool makes the tests FAIL with a hint to run
``scripts/install-system-deps.sh``.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bazel_harness import INSTALL_HINT, BazelWorkspace  # noqa: E402
from ccache_harness import CcacheProject  # noqa: E402


def _require(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.fail(f"missing e2e tool(s) {', '.join(missing)}: {INSTALL_HINT}", pytrace=False)


@pytest.fixture(scope="session")
def require_bazel() -> None:
    _require("bazel", "gcc", "g++")


@pytest.fixture(scope="session")
def require_ccache() -> None:
    _require("ccache", "cmake", "make", "gcc", "g++")


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
