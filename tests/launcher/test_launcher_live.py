"""buildvault-cc invoked directly (no CMake) against a live buildvault server: path-dependent
outputs, diagnostics replay, read-only mode, bypasses, fail-open, the summary command."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from launcher_harness import LauncherEnv, Toolchain, flush, launcher_command, make_env, read_events
from server_process import ServerProcess


class Tree:
    """A checkout with a source and a header, and its build dir; compiles through the shim."""

    def __init__(
        self, root: Path, toolchain: Toolchain, env: dict[str, str], source: str, header: str = "#define V 1\n"
    ) -> None:
        self.root = root
        self.build = root / "build"
        self.build.mkdir(parents=True, exist_ok=True)
        (root / "inc").mkdir(exist_ok=True)
        (root / "inc" / "v.h").write_text(header)
        (root / "a.cc").write_text(source)
        self.toolchain = toolchain
        self.env = dict(env)
        self.env["BUILDVAULT_ROOTS"] = f"SRC={root},BUILD={self.build}"
        self.env["SHIM_LOG"] = str(toolchain.log)

    def compile(self, *flags: str, launcher: bool = True, output: str = "a.o") -> subprocess.CompletedProcess[str]:
        argv = [
            self.toolchain.cxx,
            *flags,
            f"-I{self.root}/inc",
            "-MD",
            "-MF",
            output + ".d",
            "-o",
            output,
            "-c",
            str(self.root / "a.cc"),
        ]
        if launcher:
            argv = [launcher_command(), *argv]
        result = subprocess.run(argv, cwd=self.build, env=self.env, capture_output=True, text=True, timeout=120)
        if launcher:
            flush(self.env)
        return result

    def obj(self, name: str = "a.o") -> bytes:
        return (self.build / name).read_bytes()


def real_compiles(toolchain: Toolchain) -> int:
    return len(toolchain.take())


@pytest.fixture
def live(
    server: ServerProcess,
    env_factory: Callable[..., LauncherEnv],
    tmp_path: Path,
    toolchain: Toolchain,
    require_gxx: None,
) -> tuple[LauncherEnv, Path]:
    events = tmp_path / "events.jsonl"
    env = env_factory(server, BUILDVAULT_EVENT_LOG=str(events))
    return env, events


SIMPLE = '#include "v.h"\n#include <vector>\nint f() { std::vector<int> v(V); return (int)v.size(); }\n'


def test_hit_replays_diagnostics_with_this_checkouts_paths(
    live: tuple[LauncherEnv, Path], tmp_path: Path, toolchain: Toolchain
) -> None:
    env, events = live
    source = '#include "v.h"\n#warning "check tiling"\nint f() { return V; }\n'
    a = Tree(tmp_path / "a", toolchain, env, source)
    b = Tree(tmp_path / "elsewhere" / "b", toolchain, env, source)
    first = a.compile()
    assert first.returncode == 0 and f"{a.root}/a.cc" in first.stderr and "check tiling" in first.stderr
    toolchain.take()
    second = b.compile()
    assert second.returncode == 0
    assert real_compiles(toolchain) == 0
    assert f"{b.root}/a.cc" in second.stderr and str(a.root) not in second.stderr
    assert b.obj() == a.obj()
    # The dependency file names this checkout's files.
    deps = (b.build / "a.o.d").read_text()
    assert f"{b.root}/inc/v.h" in deps and str(a.root) not in deps
    assert [e["status"] for e in read_events(events)] == ["MISS", "HIT"]


@pytest.mark.parametrize(
    "flags, source",
    [
        (["-g"], SIMPLE),  # debug info records the checkout and build paths
        ([], '#include "v.h"\nconst char* where() { return __FILE__; }\n'),  # __FILE__ is the absolute path
    ],
    ids=["debug-info", "__FILE__"],
)
def test_outputs_that_embed_the_checkout_path_never_hit_elsewhere(
    live: tuple[LauncherEnv, Path], tmp_path: Path, toolchain: Toolchain, flags: list[str], source: str
) -> None:
    env, events = live
    a = Tree(tmp_path / "a", toolchain, env, source)
    b = Tree(tmp_path / "b", toolchain, env, source)
    assert a.compile(*flags).returncode == 0
    assert read_events(events)[-1]["reason"] == "stored-exact"
    toolchain.take()
    assert b.compile(*flags).returncode == 0
    assert real_compiles(toolchain) == 1  # not a (wrong) hit from checkout a
    via_cache = b.obj()
    assert b.compile(*flags, launcher=False, output="fresh.o").returncode == 0
    assert via_cache == b.obj("fresh.o")
    # The same checkout again is a hit, byte-identical.
    (a.build / "a.o").unlink()
    toolchain.take()
    assert a.compile(*flags).returncode == 0
    assert real_compiles(toolchain) == 0
    assert a.compile(*flags, launcher=False, output="fresh.o").returncode == 0
    assert a.obj() == a.obj("fresh.o")


def test_read_only_client_never_stores(
    server: ServerProcess,
    env_factory: Callable[..., LauncherEnv],
    tmp_path: Path,
    toolchain: Toolchain,
    require_gxx: None,
) -> None:
    events = tmp_path / "events.jsonl"
    env = env_factory(server, writer=False, BUILDVAULT_EVENT_LOG=str(events))
    t = Tree(tmp_path / "a", toolchain, env, SIMPLE)
    assert t.compile().returncode == 0
    assert t.compile().returncode == 0
    assert real_compiles(toolchain) == 2
    assert [(e["status"], e["reason"]) for e in read_events(events)] == [("MISS", "read-only")] * 2


def test_unsupported_lines_and_failures_run_the_compiler_untouched(
    live: tuple[LauncherEnv, Path], tmp_path: Path, toolchain: Toolchain
) -> None:
    env, events = live
    t = Tree(tmp_path / "a", toolchain, env, SIMPLE)
    pre = subprocess.run(
        [launcher_command(), toolchain.cxx, "-I", str(t.root / "inc"), "-E", str(t.root / "a.cc")],
        cwd=t.build,
        env=t.env,
        capture_output=True,
        text=True,
    )
    assert pre.returncode == 0 and "std" in pre.stdout
    (t.root / "a.cc").write_text("int f( {\n")
    for _ in range(2):
        bad = t.compile()
        assert bad.returncode != 0 and "error" in bad.stderr
    assert real_compiles(toolchain) == 2  # a failed compile is never cached
    statuses = [(e["status"], e["reason"]) for e in read_events(events)]
    assert statuses == [("BYPASS", "preprocess-only"), ("MISS", "compile-failed"), ("MISS", "compile-failed")]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_unreachable_server_compiles_locally_with_one_warning(
    env_factory: Callable[..., LauncherEnv], tmp_path: Path, toolchain: Toolchain, require_gxx: None
) -> None:
    events = tmp_path / "events.jsonl"
    env = env_factory(None, remote=f"grpc://127.0.0.1:{_closed_port()}", BUILDVAULT_EVENT_LOG=str(events))
    t = Tree(tmp_path / "a", toolchain, env, SIMPLE)
    results = [t.compile(output=f"o{i}.o") for i in range(3)]
    assert all(r.returncode == 0 for r in results)
    assert all((t.build / f"o{i}.o").exists() for i in range(3))
    assert sum(r.stderr.count("remote cache unavailable") for r in results) == 1
    assert real_compiles(toolchain) == 3
    reasons = {e["reason"] for e in read_events(events)}
    assert reasons <= {"remote-error", "remote-unavailable", "upload-failed"}, reasons


def test_server_that_never_answers_costs_a_bounded_wait(
    env_factory: Callable[..., LauncherEnv], tmp_path: Path, toolchain: Toolchain, require_gxx: None
) -> None:
    """A black-hole server (accepts TCP, never speaks): the timeout bounds the wait, then local."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        env = env_factory(None, remote=f"grpc://127.0.0.1:{listener.getsockname()[1]}", BUILDVAULT_TIMEOUT="1")
        t = Tree(tmp_path / "a", toolchain, env, SIMPLE)
        t.compile(output="warmup.o")  # starts the agent (not what we time)
        start = time.monotonic()
        r = t.compile()
        assert r.returncode == 0 and (t.build / "a.o").exists()
        assert time.monotonic() - start < 8
    finally:
        stop.set()
        thread.join(5)
        for c in held:
            c.close()
        listener.close()


def test_no_remote_configured_just_runs_the_compiler(tmp_path: Path, toolchain: Toolchain, require_gxx: None) -> None:
    env = make_env(None, remote="unused")
    del env["BUILDVAULT_REMOTE"]
    try:
        t = Tree(tmp_path / "a", toolchain, env, SIMPLE)
        assert t.compile(launcher=True).returncode == 0
        assert real_compiles(toolchain) == 1
        assert not any(Path(env["BUILDVAULT_AGENT_DIR"]).glob("*.sock"))
    finally:
        shutil.rmtree(env["BUILDVAULT_AGENT_DIR"], ignore_errors=True)


def test_summary_command(live: tuple[LauncherEnv, Path], tmp_path: Path, toolchain: Toolchain) -> None:
    env, events = live
    t = Tree(tmp_path / "a", toolchain, env, SIMPLE)
    t.compile()
    (t.build / "a.o").unlink()
    t.compile()
    out = subprocess.run([launcher_command(), "--summary", str(events)], capture_output=True, text=True, check=True)
    assert "hits:             1" in out.stdout and "misses:           1" in out.stdout
    assert "time saved:" in out.stdout


def test_outputs_larger_than_a_batch_go_through_bytestream(
    server: ServerProcess,
    env_factory: Callable[..., LauncherEnv],
    tmp_path: Path,
    toolchain: Toolchain,
    require_gxx: None,
) -> None:
    """Blobs over the batch limit (here 64 KiB) go up with ByteStream.Write, down with ByteStream.Read."""
    env = env_factory(server, BUILDVAULT_BATCH_LIMIT=str(64 * 1024))
    source = (
        '#include "v.h"\nextern const unsigned char big[] = {'
        + ",".join(str((i * 7919) % 251) for i in range(300_000))
        + "};\nint f() { return V; }\n"
    )
    a = Tree(tmp_path / "a", toolchain, env, source)
    assert a.compile("-O0").returncode == 0
    assert (a.build / "a.o").stat().st_size > 4 * 64 * 1024
    first = a.obj()
    (a.build / "a.o").unlink()
    toolchain.take()
    assert a.compile("-O0").returncode == 0
    assert real_compiles(toolchain) == 0
    assert a.obj() == first


def test_has_include_probe_sees_a_new_file(
    live: tuple[LauncherEnv, Path], tmp_path: Path, toolchain: Toolchain
) -> None:
    """`__has_include` makes the *existence* of a file an input: creating it must not give a stale hit."""
    env, events = live
    source = (
        '#if __has_include("feature.h")\n#include "feature.h"\n#else\n#define FEATURE 0\n#endif\n'
        '#include "v.h"\nint f() { return FEATURE + V; }\n'
    )
    a = Tree(tmp_path / "a", toolchain, env, source)
    assert a.compile().returncode == 0
    without = a.obj()
    (a.build / "a.o").unlink()
    toolchain.take()
    assert a.compile().returncode == 0 and real_compiles(toolchain) == 0  # a hit, confirmed by a deps scan
    (a.root / "inc" / "feature.h").write_text("#define FEATURE 41\n")
    assert a.compile().returncode == 0
    assert real_compiles(toolchain) == 1
    assert a.obj() != without
    assert a.compile(launcher=False, output="fresh.o").returncode == 0
    assert a.obj() == a.obj("fresh.o")


def test_read_only_client_hits_what_a_writer_stored(
    server: ServerProcess,
    env_factory: Callable[..., LauncherEnv],
    tmp_path: Path,
    toolchain: Toolchain,
    require_gxx: None,
) -> None:
    writer = env_factory(server)
    events = tmp_path / "reader.jsonl"
    reader = env_factory(server, writer=False, BUILDVAULT_EVENT_LOG=str(events))
    assert Tree(tmp_path / "ci", toolchain, writer, SIMPLE).compile().returncode == 0
    toolchain.take()
    dev = Tree(tmp_path / "dev", toolchain, reader, SIMPLE)
    assert dev.compile().returncode == 0
    assert real_compiles(toolchain) == 0
    assert [e["status"] for e in read_events(events)] == ["HIT"]
