"""The image built from docker/Dockerfile, run with podman: what an operator relies on.

Real Bazel 4.2.3 gets remote cache hits through the published ports over HTTP and gRPC, the
image's HEALTHCHECK turns healthy, SIGTERM stops the server cleanly (exit 0), and what Bazel
uploaded is still there after the container is stopped and started again on its volume.
"""

from __future__ import annotations

import json
import socket
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from bazel_harness import ALL_HITS, CACHEABLE_SPAWNS, EXPECTED_OUTPUT
from podman import Podman
from polling import wait_for

pytestmark = pytest.mark.timeout(1800)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _health(podman: Podman, name: str) -> str:
    state = podman.inspect(name)["State"]
    assert isinstance(state, dict)
    health = state.get("Health") or state.get("Healthcheck") or {}
    return str(health.get("Status", ""))


def _healthy(podman: Podman, name: str) -> bool:
    # Without systemd podman runs no healthcheck timer: run the image's check the way the timer would.
    return podman.run("healthcheck", "run", name, check=False).returncode == 0 and _health(podman, name) == "healthy"


def _status(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as response:
        doc = json.load(response)
    assert isinstance(doc, dict)
    return doc


@pytest.fixture
def container(podman: Podman, image: str) -> Iterator[tuple[str, int, int]]:
    """(name, gRPC port, HTTP port) of a container on a fresh named volume, removed afterwards."""
    name = f"buildvault-test-{uuid.uuid4().hex[:8]}"
    grpc_port, http_port = _free_port(), _free_port()
    podman.run("volume", "create", name)
    try:
        podman.run(
            "run", "--detach", "--name", name,
            "--publish", f"127.0.0.1:{grpc_port}:9092", "--publish", f"127.0.0.1:{http_port}:8080",
            "--volume", f"{name}:/data", image, "--max-size", "2GiB",
        )  # fmt: skip
        yield name, grpc_port, http_port
    finally:
        podman.run("rm", "--force", "--time", "5", name, check=False)
        podman.run("volume", "rm", "--force", name, check=False)


def test_image_metadata(podman: Podman, image: str) -> None:
    config = podman.inspect(image)["Config"]
    assert isinstance(config, dict)
    assert config["User"] == "10001:10001"
    assert "/data" in config["Volumes"]
    assert config["Entrypoint"] == ["buildvault", "serve"]
    assert config["StopSignal"] in ("SIGTERM", "15")
    assert config["Labels"]["org.opencontainers.image.title"] == "buildvault"
    # The check is the image's own command (the base has no curl).
    inspected = podman.inspect(image)
    health = inspected.get("Healthcheck") or config.get("Healthcheck")  # podman 4.x puts it at the top
    assert isinstance(health, dict), inspected
    assert health["Test"] == ["CMD", "buildvault", "healthcheck"]
    version = podman.run("run", "--rm", "--entrypoint", "buildvault", image, "--version")
    assert version.stdout.startswith("buildvault ")


def test_container_bazel_hits_sigterm_and_restart(
    podman: Podman, container: tuple[str, int, int], bazel_workspace_factory
) -> None:
    name, grpc_port, http_port = container
    wait_for(lambda: _healthy(podman, name), 90, "the container's healthcheck to pass")
    owner = podman.run("exec", name, "stat", "-c", "%u:%g", "/data").stdout.strip()
    assert owner == "10001:10001"

    ws_http = bazel_workspace_factory("http")
    cold = ws_http.build(remote_cache=f"http://127.0.0.1:{http_port}", check=True).processes
    assert cold.executed == CACHEABLE_SPAWNS and cold.cache_hits == 0, cold.line
    assert _status(http_port)["ac_entries"] == CACHEABLE_SPAWNS

    # SIGTERM (what `podman stop` sends first): a clean stop, well inside the grace period.
    podman.run("stop", "--time", "60", name)
    state = podman.inspect(name)["State"]
    assert isinstance(state, dict)
    assert state["ExitCode"] == 0, podman.run("logs", name).stderr
    logs = podman.run("logs", name)
    assert "SIGTERM, shutting down" in logs.stdout + logs.stderr
    assert "buildvault: stopped" in logs.stdout + logs.stderr

    podman.run("start", name)
    wait_for(lambda: _healthy(podman, name), 90, "the restarted container's healthcheck to pass")
    assert _status(http_port)["ac_entries"] == CACHEABLE_SPAWNS  # the volume kept them

    # A second workspace with its own Bazel server, over gRPC: every spawn is a hit.
    ws_grpc = bazel_workspace_factory("grpc")
    warm = ws_grpc.build(remote_cache=f"grpc://127.0.0.1:{grpc_port}", check=True).processes
    assert warm.as_dict() == ALL_HITS, warm.line
    assert ws_grpc.run_binary().stdout == EXPECTED_OUTPUT + "\n"

    ws_http.clean()
    warm_http = ws_http.build(remote_cache=f"http://127.0.0.1:{http_port}", check=True).processes
    assert warm_http.as_dict() == ALL_HITS, warm_http.line
    status = _status(http_port)
    assert status["ac_hits_by_protocol"] == {"grpc": CACHEABLE_SPAWNS, "http": CACHEABLE_SPAWNS}
