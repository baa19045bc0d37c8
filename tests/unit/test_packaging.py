"""What a built wheel and `./run.sh` install: the package with every data file, the server's
dependencies and nothing from the test or dev extras.

The wheel is built from a copy of the source tree, so the checkout gets no build/ directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from buildvault.remote_apis import regen

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = REPO_ROOT / "src" / "buildvault"
PROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]


def _package_files() -> set[str]:
    """Every file of the buildvault package in the source tree, as a wheel names it."""
    return {
        path.relative_to(PACKAGE_DIR.parent).as_posix()
        for path in PACKAGE_DIR.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(text).name) for text in requirements}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = tmp_path_factory.mktemp("tree")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, tree / name)
    shutil.copytree(PACKAGE_DIR, tree / "src" / "buildvault", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(tree)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = dist.glob("buildvault-*.whl")
    return built


def test_wheel_carries_every_package_file(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    expected = _package_files()
    assert expected - names == set()
    # regen's outputs and sources by name, so one missing from the tree itself fails too.
    assert {path.as_posix() for path in regen.generated_files()} | set(regen.PROTOS) <= names
    assert "buildvault/py.typed" in names
    assert not [name for name in names if name.startswith(("tests/", "bench/", "src/"))]


def test_wheel_metadata_requires_only_the_server_dependencies(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        info = f"buildvault-{PROJECT['version']}.dist-info"
        metadata = Parser().parsestr(archive.read(f"{info}/METADATA").decode())
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    assert metadata["Version"] == PROJECT["version"]
    requirements = [Requirement(text) for text in metadata.get_all("Requires-Dist") or []]
    unconditional = {canonicalize_name(r.name) for r in requirements if r.marker is None}
    assert unconditional == _names(PROJECT["dependencies"])
    for extra, listed in PROJECT["optional-dependencies"].items():
        under_extra = {
            canonicalize_name(r.name) for r in requirements if r.marker and r.marker.evaluate({"extra": extra})
        }
        assert _names(listed) <= under_extra, extra
    assert "buildvault = buildvault.cli:main" in entry_points


def test_installed_wheel_works_without_the_source_tree(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    probe = textwrap.dedent(
        """\
        import json, sys
        from importlib import resources
        import buildvault
        from buildvault import cli
        from buildvault.remote_apis import re_pb2
        proto = resources.files("buildvault.remote_apis.google.bytestream") / "bytestream.proto"
        digest = re_pb2.Digest(hash="ab", size_bytes=2)
        print(json.dumps({
            "package": buildvault.__file__,
            "proto": proto.is_file(),
            "digest": digest.SerializeToString().hex(),
            "version": cli.version(),
        }))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr
    found = json.loads(run.stdout)
    assert Path(found["package"]).is_relative_to(site), found
    assert found["proto"] is True
    assert found["digest"] == "0a026162" "1002"
    assert found["version"] == PROJECT["version"]


def test_run_sh_installs_the_server_without_test_or_dev_tools(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    before = _installed(venv)
    env = {**os.environ, "BUILDVAULT_VENV": str(venv)}
    proc = subprocess.run(
        [str(REPO_ROOT / "run.sh"), "--help"], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--grpc-address" in proc.stdout  # `buildvault serve --help` ran from the new venv
    added = _installed(venv) - before
    extras = set().union(*(_names(listed) for listed in PROJECT["optional-dependencies"].values()))
    assert added & extras == set()
    assert _names(PROJECT["dependencies"]) <= added
    version = subprocess.run(
        [str(venv / "bin" / "buildvault"), "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert version.stdout == f"buildvault {PROJECT['version']}\n", version.stderr


def _installed(venv: Path) -> set[str]:
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return {canonicalize_name(entry["name"]) for entry in json.loads(proc.stdout)}
