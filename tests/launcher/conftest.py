"""Fixtures for buildvault-cc tests: a live `buildvault serve`, compiler shims, launcher env."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for extra in (HERE, HERE.parent / "integration"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from launcher_harness import LauncherEnv, Toolchain, make_env, start_server  # noqa: E402,F401


def _require(*tools: str) -> None:
    missing = [t for t in tools if not shutil.which(t)]
    if missing:
        pytest.skip(f"missing {', '.join(missing)}: run scripts/install-system-deps.sh")


@pytest.fixture(scope="session")
def require_cmake():
    _require("cmake", "g++")


@pytest.fixture
def require_gxx():
    _require("g++")


@pytest.fixture
def server(tmp_path):
    s = start_server(tmp_path)
    yield s
    try:
        s.stop()
    finally:
        s.kill()


@pytest.fixture
def env_factory():
    made: list[LauncherEnv] = []

    def make(server, **kwargs) -> LauncherEnv:
        env = make_env(server, **kwargs)
        made.append(env)
        return env

    yield make
    for env in made:
        env.stop()
        shutil.rmtree(env["BUILDVAULT_AGENT_DIR"], ignore_errors=True)


@pytest.fixture
def toolchain(tmp_path) -> Toolchain:
    return Toolchain(tmp_path / "toolchain")
