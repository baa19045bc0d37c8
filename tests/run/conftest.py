"""Fixtures for `buildvault run` tests: a live server per test and an operator step checkout."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_harness import OPERATOR_STEP, ServerProcess


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(tmp_path / "server" / "data", name="server")
    process.start()
    try:
        yield process
    finally:
        process.stop()
        process.kill()


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
