"""The cache key of one step: a real REAPI Action any REAPI tool can read.

- Command: argv and `--env` values with the roots replaced by placeholders, the working
  directory as a path inside the input root, the declared output paths.
- Input root: every `--input` and `--recipe-file` at its root layout (`SRC/...`, `BUILD/...`,
  `_abs/...`, see client/roots.py), text files under a root hashed with the roots normalized,
  symlinks as SymlinkNodes that also carry the digest of the file they point to.
- Platform: OS/arch, the `--platform` properties, `--recipe-value`s, a digest of every
  `--toolchain-file` and of every `--tool`'s `--version` output.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import platform as platform_mod
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from buildvault.digest import Digest
from buildvault.remote_apis import re_pb2

from ..keys import FileHasher, action_blobs
from ..roots import Roots, find_cmake_roots, parse_roots
from .spec import SpecError, StepSpec
from .tree import TreeBuilder

KEY_VERSION = "buildvault-run/1"
LINK_TARGET_PROPERTY = "target-digest"


@dataclass
class StepKey:
    digest: Digest  # of the Action: the ActionCache key
    blobs: dict[Digest, bytes]  # Action, Command and input-root Directory messages
    command: re_pb2.Command
    output_paths: list[str]  # relative to the working directory
    roots: Roots


def step_roots(spec: StepSpec, env: Mapping[str, str]) -> Roots:
    """BUILDVAULT_ROOTS, else CMake's source and build dirs (else the workdir), then --normalize-root."""
    named: list[tuple[str, str]] = []
    declared = env.get("BUILDVAULT_ROOTS", "").strip()
    if declared:
        named = parse_roots(declared)
    else:
        source, build = find_cmake_roots(spec.workdir)
        if source:
            named.append(("SRC", source))
        named.append(("BUILD", build or spec.workdir))
    for i, item in enumerate(spec.roots):
        name, sep, path = item.partition("=")
        if not sep:
            name, path = f"N{i}", item
        named.append((name.upper(), os.path.join(spec.workdir, path)))
    return Roots(named)


def _excluded(name: str, excludes: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in excludes)


class InputWalker:
    """Adds files, directories and symlinks to an input-root TreeBuilder."""

    def __init__(self, roots: Roots, hasher: FileHasher, excludes: list[str]):
        self.roots = roots
        self.hasher = hasher
        self.excludes = excludes
        self.tree = TreeBuilder()
        self.count = 0

    def add(self, path: str) -> None:
        path = os.path.normpath(os.path.abspath(path))
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise SpecError(f"input not found: {path}") from None
        if os.path.islink(path):
            self._link(path)
        elif os.path.isdir(path):
            self._walk(path)
        else:
            self._file(path, st.st_mode)

    def _layout(self, path: str) -> str:
        return self.roots.layout(path)

    def _file(self, path: str, mode: int | None = None) -> None:
        info = self.hasher.info(path, self.roots)
        self.tree.add_file(self._layout(path), info.digest, info.executable)
        self.count += 1

    def _link(self, path: str) -> None:
        target = os.readlink(path)
        props = []
        resolved = os.path.realpath(path)
        if os.path.isfile(resolved):
            props.append((LINK_TARGET_PROPERTY, str(self.hasher.info(resolved, self.roots).digest)))
        self.tree.add_symlink(self._layout(path), self.roots.normalize(target), props)
        self.count += 1

    def _walk(self, top: str) -> None:
        self.tree.add_dir(self._layout(top))
        for here, dirs, files in os.walk(top):
            dirs[:] = sorted(d for d in dirs if not _excluded(d, self.excludes))
            for name in list(dirs):
                full = os.path.join(here, name)
                if os.path.islink(full):  # os.walk does not descend into links: record them as links
                    dirs.remove(name)
                    self._link(full)
                else:
                    self.tree.add_dir(self._layout(full))
            for name in sorted(files):
                if _excluded(name, self.excludes):
                    continue
                full = os.path.join(here, name)
                if os.path.islink(full):
                    self._link(full)
                else:
                    self._file(full)


def tool_version(name: str, env: Mapping[str, str]) -> str:
    """sha256 of `NAME --version` (stdout and stderr) for the tool NAME resolves to on PATH."""
    path = shutil.which(name, path=env.get("PATH", os.defpath))
    if path is None:
        raise SpecError(f"--tool {name}: not found on PATH")
    run_env = {k: v for k, v in env.items() if k in ("PATH", "HOME", "LD_LIBRARY_PATH")}
    run_env["LC_ALL"] = "C"
    try:
        done = subprocess.run([path, "--version"], capture_output=True, timeout=30, env=run_env,
                              stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SpecError(f"--tool {name}: --version failed: {e}") from None
    return hashlib.sha256(done.stdout + b"\0" + done.stderr).hexdigest()


def _file_sha256(path: str, what: str) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError as e:
        raise SpecError(f"{what} {path}: {e.strerror}") from None
    return h.hexdigest()


def _output_paths(spec: StepSpec) -> list[str]:
    wanted = spec.outputs if spec.outputs else [spec.output_dir or spec.workdir]
    out = []
    for path in wanted:
        rel = os.path.relpath(path, spec.workdir)
        if rel == ".." or rel.startswith("../"):
            raise SpecError(f"output {path} is outside the working directory {spec.workdir}")
        out.append(rel)
    return sorted(out)


def platform_properties(spec: StepSpec, roots: Roots, env: Mapping[str, str]) -> dict[str, str]:
    props = {"OSFamily": platform_mod.system().lower(), "arch": platform_mod.machine().lower(), "key": KEY_VERSION}
    if spec.output_dir:
        props["outputs"] = "discovered"
    for i, value in enumerate(spec.recipe_values):
        props[f"recipe.{i}"] = roots.normalize(value)
    for path in spec.toolchain_files:
        name = f"toolchain.{os.path.basename(path)}"
        while name in props:
            name += "+"
        props[name] = _file_sha256(path, "--toolchain-file")
    for tool in spec.tools:
        props[f"tool.{tool}"] = tool_version(tool, env)
    for name, value in spec.platform:
        props[name] = value
    return props


def step_key(spec: StepSpec, env: Mapping[str, str], hasher: FileHasher | None = None) -> StepKey:
    """The Action of `spec`; raises SpecError for a missing input, tool or toolchain file."""
    roots = step_roots(spec, env)
    walker = InputWalker(roots, hasher or FileHasher(), spec.excludes)
    for path in [*spec.inputs, *spec.recipe_files]:
        walker.add(path)
    root_digest, blobs = walker.tree.root()
    output_paths = _output_paths(spec)
    props = platform_properties(spec, roots, env)
    platform = re_pb2.Platform(properties=[re_pb2.Platform.Property(name=k, value=v) for k, v in sorted(props.items())])
    command = re_pb2.Command(
        arguments=[roots.normalize(a) for a in spec.argv],
        environment_variables=[
            re_pb2.Command.EnvironmentVariable(name=k, value=roots.normalize(v))
            for k, v in sorted(dict(spec.env).items())
        ],
        working_directory=roots.layout(spec.workdir),
        output_paths=output_paths,
        platform=platform,
    )
    digest, action_and_command = action_blobs(command, root_digest, platform)
    blobs.update(action_and_command)
    return StepKey(digest, blobs, command, output_paths, roots)
