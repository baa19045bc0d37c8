"""docker/compose.yml, validated by Debian's docker-compose and checked for what it promises:
a scoped S3 user for buildvault (not the S3 server's root), restart policies, healthchecks,
ports on localhost only."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

import yaml
from podman import INSTALL_HINT, REPO


def _config(**env: str) -> tuple[int, str, str]:
    exe = shutil.which("docker-compose")
    assert exe, f"docker-compose is not installed: {INSTALL_HINT}"
    proc = subprocess.run(
        [exe, "-f", str(REPO / "docker" / "compose.yml"), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith(("MINIO_", "BUILDVAULT_"))} | env,
    )
    return proc.returncode, proc.stdout, proc.stderr


def test_compose_file_is_valid_and_scoped() -> None:
    code, out, err = _config(MINIO_ROOT_PASSWORD="root-secret", BUILDVAULT_S3_SECRET="bv-secret")
    assert code == 0, err
    services: dict[str, Any] = yaml.safe_load(out)["services"]
    buildvault, minio = services["buildvault"], services["minio"]
    env = buildvault["environment"]
    assert env["AWS_SECRET_ACCESS_KEY"] == "bv-secret"
    assert env["AWS_ACCESS_KEY_ID"] != minio["environment"]["MINIO_ROOT_USER"]
    assert "root-secret" not in str(buildvault)
    for name in ("buildvault", "minio"):
        assert services[name]["restart"] == "unless-stopped"
        assert services[name]["healthcheck"]["test"]
    for service in services.values():
        for port in service.get("ports", []):
            assert (port["host_ip"] if isinstance(port, dict) else port.split(":")[0]) == "127.0.0.1", port


def test_compose_refuses_to_start_without_secrets() -> None:
    code, _, err = _config()
    assert code != 0
    assert "set MINIO_ROOT_PASSWORD" in err or "set BUILDVAULT_S3_SECRET" in err, err
