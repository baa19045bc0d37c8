"""buildvault-cc-native (`buildvault-cc --install-native`, client/native_launcher.c) against a
live server: it serves hits itself, byte for byte what buildvault-cc would, and hands every
other compile, option and odd input to buildvault-cc."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from launcher_harness import LauncherEnv, Toolchain, flush, launcher_command, read_events, stop_agent
from test_launcher_live import Tree, real_compiles

WARNS = '#include "v.h"\nint f() { int unused = V; return 0; }\n'


@pytest.fixture
def native(tmp_path: Path, require_gxx: None) -> str:
    done = subprocess.run([launcher_command(), "--install-native", str(tmp_path / "bin")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    path = done.stdout.strip()
    assert path == str(tmp_path / "bin" / "buildvault-cc-native") and os.access(path, os.X_OK)
    return path


def _compile(tree: Tree, launcher: str, env: dict[str, str] | None = None,
             *extra: str) -> subprocess.CompletedProcess[bytes]:
    argv = [launcher, tree.toolchain.cxx, "-Wall", *extra, f"-I{tree.root}/inc", "-MD", "-MF", "a.o.d", "-o", "a.o",
            "-c", str(tree.root / "a.cc")]
    return subprocess.run(argv, cwd=tree.build, env=env or tree.env, capture_output=True, timeout=120)


@pytest.fixture
def logged(server, env_factory: Callable[..., LauncherEnv], tmp_path: Path, toolchain: Toolchain) -> tuple[Tree, Path]:
    """A tree compiled through an agent of the live server, and its event log."""
    events = tmp_path / "events.jsonl"
    env = env_factory(server, BUILDVAULT_EVENT_LOG=str(events))
    return Tree(tmp_path / "a", toolchain, env, WARNS), events


def test_native_launcher_serves_hits_and_hands_misses_to_buildvault_cc(
    logged: tuple[Tree, Path], toolchain: Toolchain, native: str
) -> None:
    tree, events = logged

    miss = _compile(tree, native)  # no agent yet: buildvault-cc starts it, compiles, stores
    flush(tree.env)
    assert miss.returncode == 0 and b"unused" in miss.stderr, miss.stderr
    assert real_compiles(toolchain) == 1
    stored, stored_deps = tree.obj(), (tree.build / "a.o.d").read_bytes()

    for name in ("a.o", "a.o.d"):
        (tree.build / name).unlink()
    hit = _compile(tree, native)
    assert hit.returncode == 0
    assert real_compiles(toolchain) == 0
    assert tree.obj() == stored and (tree.build / "a.o.d").read_bytes() == stored_deps
    assert hit.stderr == miss.stderr and hit.stdout == miss.stdout  # the diagnostics, replayed
    last = read_events(events)[-1]
    assert (last["status"], last["via"], last["source"], last["exit"]) == ("HIT", "native", str(tree.root / "a.cc"), 0)
    assert last["cwd"] == str(tree.build) and last["action"]

    (tree.root / "inc" / "v.h").write_text("#define V 2\n")  # a changed header: a miss again
    changed = _compile(tree, native)
    flush(tree.env)
    assert changed.returncode == 0 and real_compiles(toolchain) == 1
    assert read_events(events)[-1]["status"] == "MISS"


def test_native_launcher_hits_what_buildvault_cc_stored_in_any_locale(
    logged: tuple[Tree, Path], toolchain: Toolchain, native: str
) -> None:
    """Python's start-up sets LC_CTYPE in a C locale (PEP 538) and LC_CTYPE is in the key: the
    native launcher sends the environment buildvault-cc would, or it would never hit there."""
    tree, events = logged
    plain = {k: v for k, v in tree.env.items() if k not in ("LANG", "LC_ALL", "LC_CTYPE", "LANGUAGE")}
    for lc_ctype in (None, "C", "POSIX", "C.utf8", "C.UTF-8"):
        locale_env = plain if lc_ctype is None else {**plain, "LC_CTYPE": lc_ctype}
        assert _compile(tree, launcher_command(), locale_env).returncode == 0
        flush(locale_env)
        toolchain.take()
        (tree.build / "a.o").unlink()
        assert _compile(tree, native, locale_env).returncode == 0
        assert real_compiles(toolchain) == 0, f"LC_CTYPE={lc_ctype}: the native launcher missed"
        assert read_events(events)[-1]["via"] == "native"


def test_native_launcher_hands_options_and_odd_input_to_buildvault_cc(
    logged: tuple[Tree, Path], toolchain: Toolchain, native: str
) -> None:
    tree, events = logged
    assert _compile(tree, native).returncode == 0
    flush(tree.env)
    assert real_compiles(toolchain) == 1
    status = subprocess.run([native, "--agent-status"], env=tree.env, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and '"op":"pong"' in status.stdout.replace(" ", "")

    # Bytes that are not UTF-8 (here in the environment) go to buildvault-cc, which hits.
    (tree.build / "a.o").unlink()
    odd = _compile(tree, native, {**tree.env, "ODD": "\udcff"})  # the byte 0xff, as os.environ holds it
    assert odd.returncode == 0, odd.stderr
    assert real_compiles(toolchain) == 0
    last = read_events(events)[-1]
    assert last["status"] == "HIT" and "via" not in last

    stop_agent(tree.env)  # no agent: buildvault-cc starts one and hits
    (tree.build / "a.o").unlink()
    assert _compile(tree, native).returncode == 0
    assert real_compiles(toolchain) == 0 and read_events(events)[-1]["status"] == "HIT"

    disabled = _compile(tree, native, {**tree.env, "BUILDVAULT_DISABLE": "1"})
    assert disabled.returncode == 0 and real_compiles(toolchain) == 1  # the compiler, untouched
