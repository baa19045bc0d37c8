"""Fixtures for the container tests: podman with a working runtime config and the built image.

Nothing here skips: a missing podman, runc, debootstrap or bazel fails the test with a hint to
run scripts/install-system-deps.sh.
"""

from __future__ import annotations

import concurrent.futures
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for extra in (HERE, HERE.parent / "e2e", HERE.parent / "integration"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import required_tools  # noqa: E402
from bazel_harness import BazelWorkspace  # noqa: E402
from podman import Podman  # noqa: E402

# One tag per test session: two sessions on one machine (two checkouts' CI) must not remove or
# replace each other's image.
IMAGE_TAG = f"localhost/buildvault-test:{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Podman:
    return Podman(tmp_path_factory.mktemp("podman"))


@pytest.fixture(scope="session")
def image(podman: Podman, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """docker/Dockerfile built on the local Debian base image; removed after the session."""
    base = podman.base_image()
    podman.build_image(IMAGE_TAG, base, tmp_path_factory.mktemp("context"))
    yield IMAGE_TAG
    podman.run("rmi", "--force", IMAGE_TAG, check=False)


@pytest.fixture
def bazel_workspace_factory(tmp_path: Path) -> Iterator[Callable[[str], BazelWorkspace]]:
    """``make(name) -> BazelWorkspace`` under tmp_path; their Bazel servers are shut down afterwards."""
    required_tools.find_tool("bazel")  # fails (does not skip) when Bazel is missing
    created: list[BazelWorkspace] = []

    def make(name: str) -> BazelWorkspace:
        ws = BazelWorkspace(tmp_path / name)
        created.append(ws)
        return ws

    yield make
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(created))) as pool:
        list(pool.map(lambda ws: ws.shutdown(), created))
