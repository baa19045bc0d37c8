"""Drive a real Bazel (Debian bazel-bootstrap 4.2.3) against a remote cache.

Typical e2e use::

    with BazelWorkspace(tmp_path / "a") as ws:
        first = ws.build(remote_cache=f"grpc://127.0.0.1:{port}")
        assert first.ok, first.output
        ws.clean()
        second = ws.build(remote_cache=f"grpc://127.0.0.1:{port}")
        assert second.processes.cache_hits == CACHEABLE_SPAWNS
        assert ws.run_binary().stdout.strip() == EXPECTED_OUTPUT

Every workspace gets its own copy of ``bazel_workspace/`` and its own
``--output_user_root`` (so its own Bazel server); call ``shutdown()`` (or use
the context manager) when done.  The server also exits by itself after
``--max_idle_secs``.

What Bazel 4.2.3 counts for this workspace (``//...``):
  * 10 cacheable spawns: 5 ``CppCompile`` (lib/base/{add,mul,fmt}.cc,
    lib/greet/greet.cc, app/main.cc) + 5 ``CppLink`` (libbase.a, libbase.so,
    libgreet.a, libgreet.so, app/hello).  These are looked up in / uploaded to
    the remote (or disk) cache.
  * 8 "internal" actions (params-file writes, solib symlinks, runfiles
    manifest/tree): never cached, always reported as "internal".
  * Bazel 4.2.3 reports --disk_cache hits as "remote cache hit" too (the
    separate "disk cache hit" label only exists in newer Bazel); the parser
    accepts both and ``ProcessSummary.cache_hits`` sums them.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from required_tools import INSTALL_HINT, MissingToolError

HERE = Path(__file__).resolve().parent
TEMPLATE_DIR = HERE / "bazel_workspace"

#: the line ``bazel-bin/app/hello`` prints
EXPECTED_OUTPUT = "buildvault-e2e: hello sum=5 product=42"
BINARY_LABEL = "//app:hello"
BINARY_PATH = "app/hello"
#: CppCompile x5 + CppLink x5 (see module docstring)
CACHEABLE_SPAWNS = 10
INTERNAL_SPAWNS = 8
#: a build where every cacheable spawn is a remote cache hit
ALL_HITS = {"remote cache hit": CACHEABLE_SPAWNS, "internal": INTERNAL_SPAWNS}

# Debian's bazel-bootstrap ships a pre-extracted install base; its client
# binary has no embedded archive, so with --nosystem_rc we must point at it.
DEBIAN_INSTALL_BASE = Path("/usr/share/bazel")

DEFAULT_TIMEOUT = 600.0


def find_bazel() -> str:
    exe = os.environ.get("BUILDVAULT_E2E_BAZEL") or shutil.which("bazel")
    if not exe:
        raise MissingToolError(f"`bazel` not found on PATH: {INSTALL_HINT}")
    return exe


# --------------------------------------------------------------------------
# Summary-line parsing
# --------------------------------------------------------------------------

# Bazel 4.2.3 forms seen:
#   INFO: 18 processes: 8 internal, 10 processwrapper-sandbox.
#   INFO: 18 processes: 10 remote cache hit, 8 internal.
#   INFO: 18 processes: 8 internal, 10 linux-sandbox.
#   INFO: 2 processes: 1 internal, 1 local.
#   INFO: 1 process: 1 internal.
#   INFO: 0 processes.
_SUMMARY_RE = re.compile(r"^(?:INFO: )?(\d+) process(?:es)?(?:: (.*?))?\.?\s*$")
_KIND_RE = re.compile(r"^(\d+) (.+)$")

#: kinds that mean "result came from a cache" (remote/HTTP/gRPC or --disk_cache)
CACHE_HIT_KINDS = ("remote cache hit", "disk cache hit")
#: kinds that are never cached
INTERNAL_KINDS = ("internal",)


class ProcessSummary(collections.Counter):
    """Counter of process kinds from Bazel's ``N processes: ...`` line.

    Missing kinds read as 0, e.g. ``summary["processwrapper-sandbox"] == 0``.
    ``declared_total`` is the ``N`` of the line (== ``self.total()``).
    """

    declared_total: int = 0
    line: str = ""

    @property
    def cache_hits(self) -> int:
        return sum(self[k] for k in CACHE_HIT_KINDS)

    @property
    def executed(self) -> int:
        """Spawns actually run (sandbox/local/worker/remote exec), not cache hits or internal."""
        return sum(v for k, v in self.items() if k not in CACHE_HIT_KINDS and k not in INTERNAL_KINDS)

    def as_dict(self) -> dict[str, int]:
        return dict(self)


def parse_process_line(line: str) -> ProcessSummary | None:
    """Parse one ``INFO: N processes: a kind, b kind.`` line (None if not one)."""
    m = _SUMMARY_RE.match(line.strip())
    if not m:
        return None
    summary = ProcessSummary()
    summary.declared_total = int(m.group(1))
    summary.line = line.strip()
    if m.group(2):
        for part in m.group(2).split(","):
            km = _KIND_RE.match(part.strip())
            if not km:
                return None
            summary[km.group(2).strip()] += int(km.group(1))
    if summary.total() != summary.declared_total:
        raise ValueError(f"process kinds do not add up to the total: {line!r}")
    return summary


def parse_process_summary(output: str) -> ProcessSummary | None:
    """The last ``N processes: ...`` summary in Bazel's output, or None."""
    found = None
    for line in output.splitlines():
        if "process" not in line:
            continue
        parsed = parse_process_line(line)
        if parsed is not None:
            found = parsed
    return found


_TOTAL_ACTIONS_RE = re.compile(r"Build completed successfully, (\d+) total actions?")


def parse_total_actions(output: str) -> int | None:
    totals = _TOTAL_ACTIONS_RE.findall(output)
    return int(totals[-1]) if totals else None


# --------------------------------------------------------------------------
# Running Bazel
# --------------------------------------------------------------------------


@dataclass
class BazelResult:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def output(self) -> str:
        """stdout + stderr (Bazel prints INFO lines on stderr)."""
        return self.stdout + self.stderr

    @property
    def processes(self) -> ProcessSummary | None:
        return parse_process_summary(self.stderr) or parse_process_summary(self.stdout)

    @property
    def total_actions(self) -> int | None:
        return parse_total_actions(self.output)

    def check(self) -> BazelResult:
        if not self.ok:
            raise AssertionError(f"bazel failed (exit {self.returncode}): {' '.join(self.args)}\n{self.output[-6000:]}")
        return self


class BazelWorkspace:
    """A private copy of the e2e workspace with its own Bazel server.

    ``root`` is created if needed; the workspace goes to ``root/ws`` and the
    Bazel output user root to ``root/output_user_root`` unless given.
    """

    def __init__(
        self,
        root: Path | str,
        *,
        template: Path | str = TEMPLATE_DIR,
        output_user_root: Path | str | None = None,
        startup_options: list[str] | tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        max_idle_secs: int = 300,
        jvm_heap: str = "1g",
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.bazel = find_bazel()
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.path = self.root / "ws"
        if self.path.exists():
            shutil.rmtree(self.path)
        shutil.copytree(template, self.path, symlinks=True)
        self.output_user_root = Path(output_user_root) if output_user_root else self.root / "output_user_root"
        self.output_user_root.mkdir(parents=True, exist_ok=True)
        self.timeout = timeout
        self.env = dict(os.environ if env is None else env)
        # A bazelisk-style wrapper (Debian's /usr/bin/bazel) would honour these.
        self.env.pop("USE_BAZEL_VERSION", None)
        self.env.pop("BAZELISK_HOME", None)
        self._startup = self._default_startup(max_idle_secs, jvm_heap) + list(startup_options)
        self._info_cache: dict[str, str] = {}
        self._started = False

    # -- options -------------------------------------------------------------
    def _default_startup(self, max_idle_secs: int, jvm_heap: str) -> list[str]:
        opts = [
            f"--output_user_root={self.output_user_root}",
            "--nohome_rc",
            f"--max_idle_secs={max_idle_secs}",
            f"--host_jvm_args=-Xmx{jvm_heap}",
            # Faster JVM start-up/warm-up for short builds.
            "--host_jvm_args=-XX:TieredStopAtLevel=1",
        ]
        if (DEBIAN_INSTALL_BASE / "A-server.jar").exists():
            # Skip /etc/bazel/bazelrc (it adds --sandbox_debug and imports
            # /etc/bazel.bazelrc) but keep what it is needed for.
            opts += [
                "--nosystem_rc",
                f"--install_base={DEBIAN_INSTALL_BASE}",
                "--trust_install_base",
            ]
        return opts

    @property
    def startup_options(self) -> list[str]:
        return list(self._startup)

    # -- commands ------------------------------------------------------------
    def run(self, command: str, *args: str, timeout: float | None = None) -> BazelResult:
        """``bazel <startup options> <command> <args>`` in the workspace."""
        argv = [self.bazel, *self._startup, command, *args]
        self._started = True
        proc = subprocess.run(
            argv,
            cwd=self.path,
            env=self.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout or self.timeout,
        )
        return BazelResult(argv, proc.returncode, proc.stdout, proc.stderr)

    def build(
        self,
        *extra_flags: str,
        targets: tuple[str, ...] | list[str] = ("//...",),
        remote_cache: str | None = None,
        disk_cache: Path | str | None = None,
        check: bool = False,
    ) -> BazelResult:
        """``bazel build //... [--remote_cache=URL] [--disk_cache=DIR] <extra flags>``.

        ``remote_cache`` is e.g. ``grpc://127.0.0.1:PORT`` or
        ``http://127.0.0.1:PORT[/prefix]``.
        """
        flags: list[str] = []
        if remote_cache is not None:
            flags.append(f"--remote_cache={remote_cache}")
        if disk_cache is not None:
            flags.append(f"--disk_cache={disk_cache}")
        flags.extend(extra_flags)
        result = self.run("build", *flags, "--", *targets)
        return result.check() if check else result

    def clean(self, expunge: bool = False) -> BazelResult:
        return self.run("clean", *(["--expunge"] if expunge else [])).check()

    def shutdown(self) -> None:
        if not self._started:
            return
        self.run("shutdown", timeout=120)
        self._started = False
        self._info_cache.clear()

    def info(self, key: str) -> str:
        if key not in self._info_cache:
            self._info_cache[key] = self.run("info", key).check().stdout.strip()
        return self._info_cache[key]

    # -- outputs -------------------------------------------------------------
    def binary_path(self, rel: str = BINARY_PATH) -> Path:
        return Path(self.info("bazel-bin")) / rel

    def run_binary(self, rel: str = BINARY_PATH, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.binary_path(rel)), *args], capture_output=True, text=True, timeout=60, check=True
        )

    def write_file(self, rel: str, text: str) -> Path:
        """Create/replace a workspace file (e.g. to invalidate one compile)."""
        p = self.path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        return p

    # -- context manager -----------------------------------------------------
    def __enter__(self) -> BazelWorkspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
