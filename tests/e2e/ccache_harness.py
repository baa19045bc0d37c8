"""Drive a real ccache (Debian's 4.7.5, or any other given by path) + CMake build against HTTP
remote storage.

Typical e2e use::

    url = f"http://127.0.0.1:{port}|layout=bazel"
    a = CcacheProject(tmp_path / "a", remote_storage=url)
    a.build().check_returncode()
    assert a.stats()["remote_storage_write"] > 0
    b = CcacheProject(tmp_path / "b", remote_storage=url)   # fresh local cache
    b.build()
    assert b.stats()["remote_storage_hit"] == TRANSLATION_UNITS

Each project has its own copy of ``cmake_project/``, build directory,
``CCACHE_DIR`` and ``CCACHE_CONFIGPATH`` (so neither ``~/.config/ccache`` nor
``/etc/ccache.conf`` is read), and every inherited ``CCACHE_*`` variable is
dropped.  ``base_dir`` is set to the project root so that two projects in
different directories produce the same cache keys (CMake passes absolute paths).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from required_tools import debian_ccache, find_tool

HERE = Path(__file__).resolve().parent
TEMPLATE_DIR = HERE / "cmake_project"

#: cacheable compiler invocations in cmake_project (2 C + 2 C++); links are not cached by ccache
TRANSLATION_UNITS = 4
EXECUTABLE = "ccache_demo"
EXPECTED_OUTPUT = "buildvault-ccache-e2e: crc32(123456789)=cbf43926"

DEFAULT_TIMEOUT = 300.0


def parse_print_stats(text: str) -> dict[str, int]:
    """Parse ``ccache --print-stats`` (``key<TAB>value`` per line) into ints.

    Keys include (ccache 4.7.5): cache_miss, direct_cache_hit,
    direct_cache_miss, preprocessed_cache_hit, preprocessed_cache_miss,
    local_storage_hit/miss/read_hit/read_miss/write, remote_storage_hit/miss/
    read_hit/read_miss/write/error/timeout, files_in_cache, ...
    """
    stats: dict[str, int] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        key, sep, value = line.partition("\t")
        if not sep:
            raise ValueError(f"unexpected ccache --print-stats line: {line!r}")
        stats[key.strip()] = int(value.strip())
    return stats


def cache_hits(stats: dict[str, int]) -> int:
    return stats.get("direct_cache_hit", 0) + stats.get("preprocessed_cache_hit", 0)


class CcacheProject:
    """An isolated copy of ``cmake_project`` built through ccache.

    Layout under ``root``: ``src/`` (project copy), ``build/``, ``ccache/``
    (CCACHE_DIR), ``ccache.conf`` (CCACHE_CONFIGPATH), ``ccache.log`` when
    ``debug_log``.  ``ccache`` is the binary (CMake's launcher too); Debian's by default.
    ``remote_storage`` is passed as ``CCACHE_REMOTE_STORAGE``,
    e.g. ``http://127.0.0.1:PORT|layout=bazel`` or ``http://127.0.0.1:PORT/ccache|layout=subdirs``.
    """

    def __init__(
        self,
        root: Path | str,
        *,
        remote_storage: str | None = None,
        ccache: str | None = None,
        template: Path | str = TEMPLATE_DIR,
        config: dict[str, str] | None = None,
        debug_log: bool = False,
        jobs: int = 2,
        env: dict[str, str] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.ccache = ccache or debian_ccache()
        self.cmake = find_tool("cmake")
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.src = self.root / "src"
        if self.src.exists():
            shutil.rmtree(self.src)
        shutil.copytree(template, self.src)
        self.build_dir = self.root / "build"
        self.ccache_dir = self.root / "ccache"
        self.config_path = self.root / "ccache.conf"
        self.log_path = self.root / "ccache.log" if debug_log else None
        self.remote_storage = remote_storage
        self.jobs = jobs
        self.timeout = timeout

        conf = {
            # Paths below root are hashed relative to it -> same keys for
            # projects in different tmp dirs (needed for cross-"machine" hits).
            "base_dir": str(self.root),
            "max_size": "1G",
        }
        conf.update(config or {})
        self.config_path.write_text("".join(f"{k} = {v}\n" for k, v in conf.items()))

        base_env = dict(os.environ if env is None else env)
        self.env = {k: v for k, v in base_env.items() if not k.startswith("CCACHE_")}
        self.env["CCACHE_DIR"] = str(self.ccache_dir)
        self.env["CCACHE_CONFIGPATH"] = str(self.config_path)
        if remote_storage is not None:
            self.env["CCACHE_REMOTE_STORAGE"] = remote_storage
        if self.log_path is not None:
            self.env["CCACHE_LOGFILE"] = str(self.log_path)

    # -- helpers -------------------------------------------------------------
    def _run(self, argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            argv,
            env=self.env,
            cwd=self.root,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=self.timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"command failed (exit {proc.returncode}): {' '.join(argv)}\n"
                f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
            )
        return proc

    def ccache_cmd(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self._run([self.ccache, *args], check=check)

    # -- build ---------------------------------------------------------------
    def configure(self, *extra: str) -> subprocess.CompletedProcess[str]:
        return self._run([
            self.cmake, "-S", str(self.src), "-B", str(self.build_dir),
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_C_COMPILER_LAUNCHER={self.ccache}",
            f"-DCMAKE_CXX_COMPILER_LAUNCHER={self.ccache}",
            *extra,
        ])

    def build(self, *, fresh: bool = True, cmake_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
        """Configure (into an empty build dir if ``fresh``) and build everything."""
        if fresh and self.build_dir.exists():
            shutil.rmtree(self.build_dir)
        if fresh or not (self.build_dir / "CMakeCache.txt").exists():
            self.configure(*cmake_args)
        return self._run([self.cmake, "--build", str(self.build_dir), "-j", str(self.jobs)])

    def run_binary(self) -> subprocess.CompletedProcess[str]:
        return self._run([str(self.build_dir / EXECUTABLE)])

    def build_cold(self) -> dict[str, int]:
        """A first build against an empty remote: every compile is a miss that writes its result and
        its manifest, nothing fails, the binary runs. Returns the stats."""
        self.build()
        stats = self.stats()
        assert stats["cache_miss"] == TRANSLATION_UNITS, self.show_stats()
        assert stats["remote_storage_write"] == 2 * TRANSLATION_UNITS, self.show_stats()
        assert stats["remote_storage_error"] == 0, self.show_stats()
        assert self.run_binary().stdout == EXPECTED_OUTPUT + "\n"
        return stats

    def rebuild_all_remote_hits(self) -> dict[str, int]:
        """``ccache -C`` (the local cache only), zeroed stats and a build from a deleted build dir:
        every compile is a remote hit (direct mode), the binary runs. Returns the stats."""
        self.clear_local()
        self.zero_stats()
        self.build(fresh=True)
        stats = self.stats()
        assert stats["remote_storage_hit"] == TRANSLATION_UNITS, self.show_stats()
        assert stats["direct_cache_hit"] == TRANSLATION_UNITS, self.show_stats()
        assert stats["cache_miss"] == 0 and stats["local_storage_hit"] == 0, self.show_stats()
        assert stats["remote_storage_error"] == 0 and stats["remote_storage_miss"] == 0, self.show_stats()
        assert self.run_binary().stdout == EXPECTED_OUTPUT + "\n"
        return stats

    # -- ccache state --------------------------------------------------------
    def clear_local(self) -> None:
        """``ccache -C``: empties the local cache only (remote storage untouched)."""
        self.ccache_cmd("-C")

    def zero_stats(self) -> None:
        self.ccache_cmd("-z")

    def stats(self) -> dict[str, int]:
        return parse_print_stats(self.ccache_cmd("--print-stats").stdout)

    def show_stats(self) -> str:
        """Human-readable ``ccache -s -v`` (for assertion messages)."""
        return self.ccache_cmd("-s", "-v").stdout

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path and self.log_path.exists() else ""
