"""Fixtures for buildvault-cc tests: a live `buildvault serve`, compiler shims, launcher env, and
the checks for the system tools (shared with tests/e2e: a missing tool fails, never skips)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
for extra in (HERE, HERE.parent / "integration", HERE.parent / "e2e"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from launcher_harness import LauncherEnv, Toolchain, make_env, start_server  # noqa: E402
from required_tools import require_bazel, require_tools  # noqa: E402,F401 - require_bazel: a fixture
from server_process import ServerProcess  # noqa: E402


# A missing tool fails the test (never skips it) and names scripts/install-system-deps.sh.
@pytest.fixture(scope="session")
def require_cmake() -> None:
    require_tools("cmake", "g++")


@pytest.fixture
def require_gxx() -> None:
    require_tools("g++")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    s = start_server(tmp_path)
    yield s
    try:
        s.stop()
    finally:
        s.kill()


@pytest.fixture
def env_factory() -> Iterator[Callable[..., LauncherEnv]]:
    made: list[LauncherEnv] = []

    def make(server: ServerProcess | None, **kwargs: Any) -> LauncherEnv:
        env = make_env(server, **kwargs)
        made.append(env)
        return env

    yield make
    for env in made:
        env.stop()
        shutil.rmtree(env["BUILDVAULT_AGENT_DIR"], ignore_errors=True)


@pytest.fixture
def toolchain(tmp_path: Path) -> Toolchain:
    return Toolchain(tmp_path / "toolchain")
