"""The system tools the real-client tests need (Bazel, ccache, CMake, compilers), and the one way
a missing tool ends a test: it FAILS (never skips) with a hint to run
``scripts/install-system-deps.sh``.

Shared by tests/e2e and tests/launcher: their conftests import the fixtures below, the harnesses
``find_tool``.
"""

from __future__ import annotations

import shutil

import pytest

INSTALL_HINT = (
    "run `bash scripts/install-system-deps.sh` (as root or with sudo) to install "
    "Bazel (bazel-bootstrap 4.2.3), ccache, cmake and g++ for the e2e and launcher tests"
)


class MissingToolError(RuntimeError):
    pass


def find_tool(name: str) -> str:
    """The path of `name` on PATH; MissingToolError (with the install hint) when there is none."""
    exe = shutil.which(name)
    if not exe:
        raise MissingToolError(f"`{name}` not found on PATH: {INSTALL_HINT}")
    return exe


def require_tools(*tools: str) -> None:
    """Fail the running test (not skip it) when any of `tools` is not on PATH."""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.fail(f"missing tool(s) {', '.join(missing)}: {INSTALL_HINT}", pytrace=False)


@pytest.fixture(scope="session")
def require_bazel() -> None:
    require_tools("bazel", "gcc", "g++")


@pytest.fixture(scope="session")
def require_ccache() -> None:
    require_tools("ccache", "cmake", "make", "gcc", "g++")
