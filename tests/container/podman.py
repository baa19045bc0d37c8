"""Podman for the container tests: a runtime config that works on these hosts, a local base
image made from Debian packages, and the image built from docker/Dockerfile.

Registries are unreachable from the test machines, so the base image is made with
`debootstrap --variant=minbase` plus python3 and python3-venv from the host's own Debian
mirror and imported with `podman import`. It is cached twice: as a podman image (name and tag
from a hash of what went into it) and as a tarball under /var/tmp, so a later run skips the
minutes debootstrap takes; a fresh machine builds it from nothing.

The image build reaches the same package index as the host's pip: its index URL (when it is
http[s]) goes in as a build argument and its CA bundle as a build secret, never into a layer.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
INSTALL_HINT = "run scripts/install-system-deps.sh (podman, runc, debootstrap)"

BASE_PACKAGES = ("python3", "python3-venv")
BASE_CACHE = Path(os.environ.get("BUILDVAULT_TEST_IMAGE_CACHE", "/var/tmp/buildvault-test-images"))

# crun fails on these hosts' cgroups; runc with explicit ulimits works.
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""


class MissingToolError(AssertionError):
    """A tool the container tests need is not installed (the test fails, it does not skip)."""


def require(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        raise MissingToolError(f"not installed: {', '.join(missing)}: {INSTALL_HINT}")


def host_debian() -> tuple[str, str]:
    """(suite, mirror URL) of the host's Debian, read from os-release and apt's sources."""
    release = Path("/etc/os-release").read_text()
    match = re.search(r"^VERSION_CODENAME=(\S+)$", release, re.MULTILINE)
    suite = match.group(1).strip('"') if match else "bookworm"
    mirror = "http://deb.debian.org/debian"
    sources = sorted(Path("/etc/apt").glob("sources.list.d/*.sources")) + [Path("/etc/apt/sources.list")]
    for path in sources:
        if not path.is_file():
            continue
        text = path.read_text()
        found = re.search(r"^URIs:\s*(\S+/debian)/?\s*$", text, re.MULTILINE) or re.search(
            r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+/debian)/?\s", text, re.MULTILINE
        )
        if found:
            mirror = found.group(1)
            break
    return suite, mirror


def pip_setting(name: str) -> str:
    """The host pip's value for `name` (environment first, then its config files), or ''."""
    value = os.environ.get("PIP_" + name.upper().replace("-", "_"), "")
    if value:
        return value
    proc = subprocess.run(
        ["python3", "-m", "pip", "config", "get", f"global.{name}"], capture_output=True, text=True, check=False
    )
    return proc.stdout.strip() if proc.returncode == 0 else ""


@dataclass
class Podman:
    """Runs `podman` with a CONTAINERS_CONF written under `workdir`."""

    workdir: Path
    env: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        require("podman", "runc")
        self.workdir.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "containers.conf"
        conf.write_text(CONTAINERS_CONF)
        self.env = dict(os.environ, CONTAINERS_CONF=str(conf))

    def run(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            ["podman", *args], env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def image_exists(self, name: str) -> bool:
        return self.run("image", "exists", name, check=False).returncode == 0

    def inspect(self, name: str) -> dict[str, object]:
        data = json.loads(self.run("inspect", name).stdout)
        assert isinstance(data, list) and data, data
        first = data[0]
        assert isinstance(first, dict)
        return first

    def base_image(self) -> str:
        """A local Debian minbase image with python3 (the Dockerfile's BASE_IMAGE)."""
        suite, mirror = host_debian()
        key = hashlib.sha256(f"{suite} {mirror} {' '.join(BASE_PACKAGES)}".encode()).hexdigest()[:12]
        name = f"localhost/buildvault-test-base:{suite}-{key}"
        if self.image_exists(name):
            return name
        tarball = BASE_CACHE / f"base-{suite}-{key}.tar"
        if not tarball.exists():
            require("debootstrap")
            BASE_CACHE.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=BASE_CACHE) as scratch:
                rootfs = Path(scratch) / "rootfs"
                include = f"--include={','.join(BASE_PACKAGES)}"
                proc = subprocess.run(
                    ["debootstrap", "--variant=minbase", include, suite, str(rootfs), mirror],
                    capture_output=True,
                    text=True,
                    timeout=900,
                    check=False,
                )
                if proc.returncode != 0:
                    output = f"{proc.stdout[-4000:]}\n{proc.stderr}"
                    raise AssertionError(f"debootstrap failed ({proc.returncode}):\n{output}")
                # apt's downloaded .debs are not part of the image.
                shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
                partial = tarball.with_suffix(".partial")
                subprocess.run(["tar", "-C", str(rootfs), "-cf", str(partial), "."], check=True, timeout=600)
                partial.rename(tarball)  # only a complete tarball is ever reused
        self.run("import", "--change", "CMD [\"/bin/bash\"]", str(tarball), name)
        return name

    def build_image(self, tag: str, base: str, context: Path) -> None:
        """podman build of docker/Dockerfile on `base`, from a context of what the image needs."""
        context.mkdir(parents=True, exist_ok=True)
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(REPO / name, context / name)
        shutil.copytree(REPO / "src", context / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        # docker format: the OCI image format has no HEALTHCHECK (podman drops it). No layer cache:
        # with it, every build left its 390 MB build stage behind as an untagged image.
        args = ["build", "--format", "docker", "--force-rm", "--layers=false", "--network", "host"]
        args += ["--build-arg", f"BASE_IMAGE={base}"]
        args += ["-f", str(DOCKERFILE), "-t", tag]
        index = pip_setting("index-url")
        if index.startswith(("http://", "https://")):
            args += ["--build-arg", f"PIP_INDEX={index}"]
        cert = pip_setting("cert")
        if cert and Path(cert).is_file():
            args += ["--secret", f"id=pip-ca,src={cert}"]
        self.run(*args, str(context), timeout=900)
