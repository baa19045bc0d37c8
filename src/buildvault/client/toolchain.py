"""What a compile's toolchain is: the driver, the programs it runs, and its own include dirs.

A cache key that named only the driver (`g++`) would let a different assembler earlier on PATH,
or a rebuilt `cc1plus`, replay objects they did not produce. So the identity is a hash over the
driver's bytes and `--version`, and over the bytes of every program the driver resolves for a
compile (`cc1`, `cc1plus`, `as`), found the way the driver finds them: its own program dirs
(`-print-search-dirs`), then PATH. The resolution is redone on every compile (a few stat calls),
so a new `as` on PATH changes the identity at once; hashing is cached by stat signature.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import threading
import time
from dataclasses import dataclass

from .keys import RACY_SECONDS, Uncacheable

# Programs a compile-only (-c) driver runs; a linker is never run for a cached compile.
DRIVEN_PROGRAMS = ("cc1", "cc1plus", "cc1obj", "cc1objplus", "as")
# Environment that changes where the driver looks for its programs.
PROGRAM_ENV = ("GCC_EXEC_PREFIX", "COMPILER_PATH")
# Flags that can change the compiler's own include dirs (multilib, sysroot, target, -nostdinc).
_SYSTEM_DIR_FLAGS = (
    "-m",
    "-nostdinc",
    "-nostdlibinc",
    "--sysroot",
    "-isysroot",
    "-target",
    "--target",
    "-stdlib",
    "--gcc-toolchain",
    "-std=",
)
_SEPARATE_SYSTEM_DIR_FLAGS = ("--sysroot", "-isysroot", "-target")
_SIGNATURE_FIELDS = ("st_dev", "st_ino", "st_size", "st_mtime_ns", "st_ctime_ns")
Signature = tuple[int, ...]


def _signature(st: os.stat_result) -> Signature:
    return tuple(getattr(st, name) for name in _SIGNATURE_FIELDS)


def _tool_env(env: dict[str, str]) -> dict[str, str]:
    run_env = {k: v for k, v in env.items() if k in ("PATH", "HOME", "TMPDIR", "LD_LIBRARY_PATH", *PROGRAM_ENV)}
    run_env["LC_ALL"] = "C"
    return run_env


@dataclass(frozen=True)
class _Driver:
    digest: str  # sha256 of the driver's bytes and --version
    program_dirs: tuple[str, ...]  # where the driver looks for cc1/as before PATH


def resolve_compiler(argv0: str, cwd: str, env: dict[str, str]) -> str:
    """The compiler binary `argv0` names, as the launcher's exec would find it."""
    if "/" in argv0:
        path = os.path.join(cwd, argv0)
        if os.access(path, os.X_OK):
            return os.path.normpath(path)
        raise Uncacheable(f"compiler not found: {argv0}")
    for d in env.get("PATH", os.defpath).split(os.pathsep):
        candidate = os.path.join(d or ".", argv0)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return os.path.normpath(os.path.join(cwd, candidate))
    raise Uncacheable(f"compiler not found on PATH: {argv0}")


def system_dir_flags(argv: list[str]) -> tuple[str, ...]:
    """The flags of `argv` that can change the compiler's own include dirs."""
    out: list[str] = []
    args = argv[1:]
    for i, arg in enumerate(args):
        if arg.startswith(_SYSTEM_DIR_FLAGS):
            out.append(arg)
            if arg in _SEPARATE_SYSTEM_DIR_FLAGS and i + 1 < len(args):
                out.append(args[i + 1])
    return tuple(out)


class CompilerIdentity:
    """Identity of (driver, the programs it runs), and the compiler's own include dirs."""

    def __init__(self) -> None:
        self._drivers: dict[tuple[object, ...], _Driver] = {}
        self._files: dict[str, tuple[Signature, str]] = {}
        self._system_dirs: dict[tuple[object, ...], tuple[str, ...]] = {}
        self._lock = threading.Lock()

    def resolve(self, argv0: str, cwd: str, env: dict[str, str]) -> str:
        return resolve_compiler(argv0, cwd, env)

    def identity(self, path: str, env: dict[str, str]) -> str:
        """sha256 over the driver and every program it would run now (resolved again each call)."""
        driver = self._driver(path, env)
        h = hashlib.sha256(driver.digest.encode())
        search = driver.program_dirs + tuple(d or "." for d in env.get("PATH", os.defpath).split(os.pathsep))
        for name in DRIVEN_PROGRAMS:
            found = _find_program(name, search)
            h.update(f"\0{name}\0{found or '-'}\0".encode())
            if found:
                h.update(self._file_digest(found).encode())
        return h.hexdigest()

    def system_include_dirs(
        self, path: str, ident: str, argv: list[str], language: str, env: dict[str, str]
    ) -> tuple[str, ...]:
        """The compiler's own #include <...> dirs for this language and these flags (`-E -v`), asked
        once per (identity, flags). Raises Uncacheable when the compiler does not say."""
        flags = system_dir_flags(argv)
        key = (ident, flags, language, tuple(env.get(k, "") for k in PROGRAM_ENV))
        cached = self._system_dirs.get(key)
        if cached is not None:
            return cached
        try:
            done = subprocess.run(
                [path, *flags, f"-x{language}", "-E", "-v", "-"],
                capture_output=True,
                timeout=60,
                env=_tool_env(env),
                stdin=subprocess.DEVNULL,
                cwd="/",
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise Uncacheable(f"cannot ask the compiler for its include dirs: {e}") from None
        dirs = parse_search_list(done.stderr.decode("utf-8", "surrogateescape"))
        if dirs is None:
            raise Uncacheable("the compiler did not print its include search list (-E -v)")
        with self._lock:
            self._system_dirs[key] = dirs
        return dirs

    def _driver(self, path: str, env: dict[str, str]) -> _Driver:
        real = os.path.realpath(path)
        st = os.stat(real)
        key = (path, real, _signature(st), tuple(env.get(k, "") for k in PROGRAM_ENV))
        cached = self._drivers.get(key)
        if cached is not None:
            return cached
        h = hashlib.sha256()
        with open(real, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        version = _run_tool([path, "--version"], env)
        h.update(b"\0--version\0" + version.stdout + version.stderr)
        dirs = _parse_program_dirs(_run_tool([path, "-print-search-dirs"], env).stdout.decode("utf-8", "replace"))
        driver = _Driver(h.hexdigest(), dirs)
        if time.time() - st.st_mtime > RACY_SECONDS:
            with self._lock:
                self._drivers[key] = driver
        return driver

    def _file_digest(self, path: str) -> str:
        st = os.stat(path)
        sig = _signature(st)
        cached = self._files.get(path)
        if cached is not None and cached[0] == sig:
            return cached[1]
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        digest = h.hexdigest()
        if time.time() - st.st_mtime > RACY_SECONDS:
            with self._lock:
                self._files[path] = (sig, digest)
        return digest


def _run_tool(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(
            argv, capture_output=True, timeout=20, env=_tool_env(env), stdin=subprocess.DEVNULL, cwd="/"
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Uncacheable(f"compiler {argv[1]} failed: {e}") from None


def _find_program(name: str, search: tuple[str, ...]) -> str | None:
    for d in search:
        candidate = os.path.join(d, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return os.path.realpath(candidate)
    return None


def _parse_program_dirs(text: str) -> tuple[str, ...]:
    """The `programs: =a:b:...` line of `-print-search-dirs` (GCC and Clang)."""
    for line in text.splitlines():
        if line.startswith("programs:"):
            value = line.split(":", 1)[1].strip().lstrip("=")
            seen: list[str] = []
            for d in value.split(":"):
                if d and d not in seen:
                    seen.append(d)
            return tuple(seen)
    return ()


def parse_search_list(stderr: str) -> tuple[str, ...] | None:
    """Every dir of the `#include "..."` and `#include <...>` search lists that `-E -v` prints."""
    lines = stderr.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith('#include "..." search starts here'))
        end = next(i for i, line in enumerate(lines) if line.startswith("End of search list"))
    except StopIteration:
        return None
    dirs: list[str] = []
    for line in lines[start + 1 : end]:
        if line.startswith("#include"):
            continue
        d = line.strip().removesuffix(" (framework directory)")
        if d and d not in dirs:
            dirs.append(d)
    return tuple(dirs)
