"""Fixtures for `buildvault run` tests: a live server per test and an operator step checkout."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_harness import OPERATOR_STEP, ServerProcess, stop_agent_at


@pytest.fixture(autouse=True)
def stop_run_agents(tmp_path: Path) -> Iterator[None]:
    """`buildvault run` starts buildvault-cc's agent in the test's agent directory: stop each one."""
    yield
    for sock_path in tmp_path.rglob("agent-*.sock"):
        stop_agent_at(sock_path)


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """start(**ServerProcess kwargs): a live server; every one is stopped at teardown."""
    started: list[ServerProcess] = []

    def start(name: str = "server", **kwargs: Any) -> ServerProcess:
        process = ServerProcess(tmp_path / name / "data", name=name, **kwargs)
        started.append(process)
        return process.start()

    yield start
    for process in started:
        try:
            process.stop()
        finally:
            process.kill()


@pytest.fixture
def server(server_factory: Callable[..., ServerProcess]) -> ServerProcess:
    return server_factory()


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A checkout with an operator step script and two operator sources."""
    root = tmp_path / "checkout"
    (root / "ops").mkdir(parents=True)
    script = root / "op_step.sh"
    script.write_text(OPERATOR_STEP)
    script.chmod(0o755)
    (root / "ops" / "add.cc").write_text(f"// add operator of {tmp_path.name}\nint add() {{ return 1; }}\n")
    (root / "ops" / "mul.cc").write_text(f"// mul operator of {tmp_path.name}\nint mul() {{ return 2; }}\n")
    (root / "toolchain").mkdir()
    (root / "toolchain" / "version.info").write_text("Version=8.0.RC3\n")
    return root
