"""No wrong hit (issue 10): every family of edge cases, real g++, small projects made here.

Each case compiles once through buildvault-cc (a writer), makes a change, and compiles again:
the second compile must not be a hit, and what it leaves (object, listing, exit status) must be
byte-identical to what plain g++ leaves for the same arguments. Every case runs with the agent
kept warm and with a fresh agent for the second compile (manifests then come from the server).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from launcher_harness import LauncherEnv, flush, launcher_command, read_events, stop_agent
from server_process import ServerProcess

GXX = ["g++", "-O1", "-g0"]


class Project:
    """A checkout made by the test; compiles run in `root` with roots SRC=root."""

    def __init__(self, root: Path, env: LauncherEnv, events: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.events_path = events
        self.env = dict(env, BUILDVAULT_ROOTS=f"SRC={root}", BUILDVAULT_EVENT_LOG=str(events))
        self.launcher_env = env

    def write(self, rel: str, text: str | bytes) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
        return path

    def cc(
        self, *args: str, launcher: bool = True, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        argv = [*GXX, *args]
        if launcher:
            argv = [launcher_command(), *argv]
        run_env = dict(self.env, **(env or {}))
        result = subprocess.run(argv, cwd=self.root, env=run_env, capture_output=True, text=True, timeout=120)
        if launcher:
            flush(run_env)
        return result

    def last_event(self) -> dict[str, object]:
        return read_events(self.events_path)[-1]


@pytest.fixture(params=["warm-agent", "fresh-agent"])
def agent_mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_project(
    server: ServerProcess, env_factory: Callable[..., LauncherEnv], tmp_path: Path, require_gxx: None
) -> Callable[[str], Project]:
    env = env_factory(server)

    def make(name: str) -> Project:
        return Project(tmp_path / name, env, tmp_path / f"{name}.events.jsonl")

    return make


def between(project: Project, agent_mode: str) -> None:
    """What happens between the two compiles: nothing (warm) or a restart of the agent (fresh)."""
    if agent_mode == "fresh-agent":
        stop_agent(project.launcher_env)


def assert_like_plain_gxx(
    project: Project, args: list[str], outputs: list[str], result: subprocess.CompletedProcess[str]
) -> None:
    """The files the launcher left equal what plain g++ leaves (run after, same arguments)."""
    left = {name: (project.root / name).read_bytes() for name in outputs if (project.root / name).exists()}
    for name in outputs:
        if (project.root / name).exists():
            (project.root / name).unlink()
    fresh = project.cc(*args, launcher=False)
    assert fresh.returncode == result.returncode, (fresh.stderr, result.stderr)
    again = {name: (project.root / name).read_bytes() for name in outputs if (project.root / name).exists()}
    assert set(left) == set(again)
    for name in left:
        assert left[name] == again[name], f"{name}: the launcher's output differs from plain g++"


def two_compiles(
    project: Project,
    agent_mode: str,
    args: list[str],
    change: Callable[[], object],
    outputs: list[str] | None = None,
    stored: bool = True,
) -> subprocess.CompletedProcess[str]:
    outputs = outputs or ["a.o"]
    first = project.cc(*args)
    assert first.returncode == 0, first.stderr
    if stored:
        assert project.last_event()["reason"] in ("stored", "stored-exact"), project.last_event()
    else:
        assert project.last_event()["status"] == "BYPASS", project.last_event()
    between(project, agent_mode)
    change()
    second = project.cc(*args)
    assert project.last_event()["status"] != "HIT", project.last_event()
    assert_like_plain_gxx(project, args, outputs, second)
    return second


VALUE_OF_H = "int f() { return H; }\n"


# -- 1. header shadowing ---------------------------------------------------------------------------------------


def test_header_in_an_earlier_I_dir(make_project: Callable[[str], Project], agent_mode: str) -> None:
    t = make_project("shadow-I")
    t.write("a.cc", '#include "h.h"\n' + VALUE_OF_H)
    t.write("b/h.h", "#define H 2\n")
    (t.root / "a").mkdir()
    two_compiles(t, agent_mode, ["-Ia", "-Ib", "-c", "a.cc", "-o", "a.o"], lambda: t.write("a/h.h", "#define H 1\n"))


def test_header_beside_the_including_header(make_project: Callable[[str], Project], agent_mode: str) -> None:
    t = make_project("shadow-own-dir")
    t.write("a.cc", '#include "lib/a.h"\n' + VALUE_OF_H)
    t.write("inc/lib/a.h", '#include "b.h"\n')
    t.write("inc/b.h", "#define H 2\n")
    two_compiles(t, agent_mode, ["-Iinc", "-c", "a.cc", "-o", "a.o"], lambda: t.write("inc/lib/b.h", "#define H 1\n"))


def test_I_dir_searched_before_isystem_whatever_the_order(
    make_project: Callable[[str], Project], agent_mode: str
) -> None:
    t = make_project("shadow-isystem")
    t.write("a.cc", "#include <h.h>\n" + VALUE_OF_H)
    t.write("sys/h.h", "#define H 2\n")
    (t.root / "inc").mkdir()
    two_compiles(
        t,
        agent_mode,
        ["-isystem", "sys", "-Iinc", "-c", "a.cc", "-o", "a.o"],
        lambda: t.write("inc/h.h", "#define H 1\n"),
    )


def test_forced_include_found_in_the_working_directory_first(
    make_project: Callable[[str], Project], agent_mode: str
) -> None:
    t = make_project("shadow-include")
    t.write("a.cc", VALUE_OF_H)
    t.write("inc/cfg.h", "#define H 2\n")
    two_compiles(
        t,
        agent_mode,
        ["-include", "cfg.h", "-Iinc", "-c", "a.cc", "-o", "a.o"],
        lambda: t.write("cfg.h", "#define H 1\n"),
    )


def test_system_header_shadowed_by_a_project_dir(make_project: Callable[[str], Project], agent_mode: str) -> None:
    t = make_project("shadow-system")
    t.write("a.cc", "#include <alloca.h>\n#ifndef H\n#define H 2\n#endif\n" + VALUE_OF_H)
    (t.root / "inc").mkdir()
    two_compiles(t, agent_mode, ["-Iinc", "-c", "a.cc", "-o", "a.o"], lambda: t.write("inc/alloca.h", "#define H 1\n"))


@pytest.mark.parametrize("variable", ["CPATH", "CPLUS_INCLUDE_PATH"])
def test_include_path_from_the_environment(
    make_project: Callable[[str], Project], agent_mode: str, variable: str
) -> None:
    t = make_project("shadow-env")
    t.write("a.cc", "#include <h.h>\n" + VALUE_OF_H)
    t.write("c2/h.h", "#define H 2\n")
    (t.root / "c1").mkdir()
    t.env[variable] = f"{t.root}/c1:{t.root}/c2"
    two_compiles(t, agent_mode, ["-c", "a.cc", "-o", "a.o"], lambda: t.write("c1/h.h", "#define H 1\n"))


def test_include_next_finds_a_new_middle_header(make_project: Callable[[str], Project], agent_mode: str) -> None:
    t = make_project("shadow-next")
    t.write("a.cc", "#include <h.h>\n" + VALUE_OF_H)
    t.write("i1/h.h", "#include_next <h.h>\n")
    t.write("i3/h.h", "#define H 3\n")
    (t.root / "i2").mkdir()
    two_compiles(
        t, agent_mode, ["-Ii1", "-Ii2", "-Ii3", "-c", "a.cc", "-o", "a.o"], lambda: t.write("i2/h.h", "#define H 2\n")
    )


# -- 2. __has_include ------------------------------------------------------------------------------------------

HAS_OPT = "#if __has_include(<opt.h>)\n#define H 1\n#else\n#define H 2\n#endif\n"


def test_has_include_used_only_as_a_test(make_project: Callable[[str], Project], agent_mode: str) -> None:
    t = make_project("has-include")
    t.write("a.cc", HAS_OPT + VALUE_OF_H)
    (t.root / "inc").mkdir()
    two_compiles(t, agent_mode, ["-Iinc", "-c", "a.cc", "-o", "a.o"], lambda: t.write("inc/opt.h", "\n"))


def test_has_include_in_a_header_outside_the_roots(
    make_project: Callable[[str], Project], agent_mode: str, tmp_path: Path
) -> None:
    t = make_project("has-include-outside")
    outside = tmp_path / "outside-sdk"
    (outside / "include").mkdir(parents=True)
    (outside / "include" / "sdk.h").write_text(HAS_OPT)
    (outside / "extra").mkdir()
    t.write("a.cc", "#include <sdk.h>\n" + VALUE_OF_H)
    two_compiles(
        t,
        agent_mode,
        [f"-I{outside}/include", f"-I{outside}/extra", "-c", "a.cc", "-o", "a.o"],
        lambda: (outside / "extra" / "opt.h").write_text("\n"),
    )


# -- 3. the checkout path hidden in an object --------------------------------------------------------------------


@pytest.mark.parametrize("expression", ['L"" __FILE__', "sizeof(__FILE__)"], ids=["wide-string", "sizeof"])
def test_path_derived_values_never_hit_in_another_checkout(
    make_project: Callable[[str], Project], agent_mode: str, expression: str
) -> None:
    source = f"extern const unsigned long n = sizeof({expression});\nconst void* p = {expression};\n"
    if expression.startswith("sizeof"):
        source = f"extern const unsigned long n = {expression};\n"
    a = make_project("checkout-a")
    b = make_project("elsewhere/checkout-b-longer")
    for t in (a, b):
        t.write("src/a.cc", source)
    assert a.cc("-c", f"{a.root}/src/a.cc", "-o", "a.o").returncode == 0  # absolute, as CMake passes it
    assert a.last_event()["reason"] == "stored-exact", a.last_event()
    between(a, agent_mode)
    args = ["-c", f"{b.root}/src/a.cc", "-o", "a.o"]
    second = b.cc(*args)
    assert b.last_event()["status"] != "HIT", b.last_event()
    assert_like_plain_gxx(b, args, ["a.o"], second)


# -- 4. files the launcher does not know ------------------------------------------------------------------------


def test_assembler_listing_through_Xassembler_is_bypassed(
    make_project: Callable[[str], Project], agent_mode: str
) -> None:
    t = make_project("listing")
    t.write("a.cc", "int f() { return 1; }\n")
    args = ["-Xassembler", "-adhln=a.lst", "-c", "a.cc", "-o", "a.o"]
    two_compiles(t, agent_mode, args, lambda: (t.root / "a.lst").unlink(), outputs=["a.o", "a.lst"], stored=False)
    assert str(t.last_event()["reason"]).startswith("flag:-Xassembler")


def test_incbin_data_is_not_cached(make_project: Callable[[str], Project], agent_mode: str) -> None:
    t = make_project("incbin")
    t.write("data.bin", b"first")
    t.write("a.cc", 'asm(".section .rodata\\n.global blob\\nblob: .incbin \\"data.bin\\"\\n.previous");\n')
    first = t.cc("-c", "a.cc", "-o", "a.o")
    assert first.returncode == 0, first.stderr
    assert t.last_event()["status"] == "BYPASS" and ".incbin" in str(t.last_event()["reason"])
    between(t, agent_mode)
    t.write("data.bin", b"second")
    second = t.cc("-c", "a.cc", "-o", "a.o")
    assert t.last_event()["status"] != "HIT"
    assert b"second" in (t.root / "a.o").read_bytes()
    assert_like_plain_gxx(t, ["-c", "a.cc", "-o", "a.o"], ["a.o"], second)


FAKE_AS = """#!/bin/sh
# an assembler that marks its objects: a compile through it must not hit the real one's entry
{real} "$@" || exit $?
while [ $# -gt 0 ]; do
  if [ "$1" = "-o" ]; then printf 'FAKE-AS' >> "$2"; fi
  shift
done
"""


def test_another_assembler_earlier_on_path(
    make_project: Callable[[str], Project], agent_mode: str, tmp_path: Path
) -> None:
    t = make_project("assembler")
    t.write("a.cc", "int f() { return 7; }\n")
    fake = tmp_path / "fake-bin"
    fake.mkdir()
    real_as = shutil.which("as")
    assert real_as, "binutils `as` is required (scripts/install-system-deps.sh)"
    (fake / "as").write_text(FAKE_AS.format(real=real_as))
    (fake / "as").chmod(0o755)
    path = f"{fake}{os.pathsep}{t.env['PATH']}"
    two_compiles(t, agent_mode, ["-c", "a.cc", "-o", "a.o"], lambda: t.env.update(PATH=path))
    assert (t.root / "a.o").read_bytes().endswith(b"FAKE-AS")


# -- 5. two compiles writing the same output ----------------------------------------------------------------------


def test_concurrent_compiles_to_one_output_store_their_own_objects(
    make_project: Callable[[str], Project], agent_mode: str
) -> None:
    t = make_project("same-output")
    big = "".join(f"int g{i}(int x) {{ return x * {i} + {i % 7}; }}\n" for i in range(400))
    t.write("x.cc", big + "int which() { return 1; }\n")
    t.write("y.cc", big.replace("x *", "x -") + "int which() { return 2; }\n")
    results: list[int] = []

    def compile_one(name: str) -> None:
        results.append(t.cc("-c", name, "-o", "same.o").returncode)

    threads = [threading.Thread(target=compile_one, args=(name,)) for name in ("x.cc", "y.cc") * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert results == [0, 0, 0, 0]
    between(t, agent_mode)
    for name in ("x.cc", "y.cc"):
        (t.root / "same.o").unlink()
        hit = t.cc("-c", name, "-o", "same.o")
        assert t.last_event()["status"] == "HIT", t.last_event()
        assert_like_plain_gxx(t, ["-c", name, "-o", "same.o"], ["same.o"], hit)


# -- 6. outputs that are not regular files ------------------------------------------------------------------------


def test_output_that_is_a_symlink_to_dev_null(make_project: Callable[[str], Project], agent_mode: str) -> None:
    t = make_project("symlink-output")
    t.write("a.cc", "int f() { return 1; }\n")
    (t.root / "out").mkdir()
    args = ["-c", "a.cc", "-o", "out/a.o"]
    assert t.cc(*args).returncode == 0  # stored as a regular file
    between(t, agent_mode)
    (t.root / "out" / "a.o").unlink()
    (t.root / "out" / "a.o").symlink_to(os.devnull)
    result = t.cc(*args)
    assert result.returncode == 0 and t.last_event()["status"] == "BYPASS", t.last_event()
    assert (t.root / "out" / "a.o").is_symlink() and stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_output_dev_null_stays_a_device(make_project: Callable[[str], Project], agent_mode: str) -> None:
    t = make_project("dev-null")
    t.write("a.cc", "int f() { return 1; }\n")
    for _ in range(2):
        result = t.cc("-c", "a.cc", "-o", os.devnull)
        assert result.returncode == 0, result.stderr
        assert t.last_event()["status"] == "BYPASS", t.last_event()
        between(t, agent_mode)
    assert stat.S_ISCHR(os.lstat(os.devnull).st_mode)


def test_output_directory_removed(make_project: Callable[[str], Project], agent_mode: str) -> None:
    t = make_project("missing-dir")
    t.write("a.cc", "int f() { return 1; }\n")
    (t.root / "out").mkdir()
    args = ["-c", "a.cc", "-o", "out/a.o"]
    assert t.cc(*args).returncode == 0
    between(t, agent_mode)
    shutil.rmtree(t.root / "out")
    result = t.cc(*args)
    plain = t.cc(*args, launcher=False)
    assert result.returncode == plain.returncode != 0
    assert t.last_event()["status"] == "BYPASS" and not (t.root / "out").exists()


# -- 7. __TIME__ by token pasting ----------------------------------------------------------------------------------


def test_time_macro_built_by_token_pasting_is_not_cached(
    make_project: Callable[[str], Project], agent_mode: str
) -> None:
    t = make_project("pasted-time")
    t.write(
        "a.cc",
        "#define CAT2(a, b) a##b\n#define CAT(a, b) CAT2(a, b)\nconst char* built() { return CAT(__TI, ME__); }\n",
    )
    first = t.cc("-c", "a.cc", "-o", "a.o")
    assert first.returncode == 0
    assert t.last_event()["status"] == "BYPASS" and "__TIME__" in str(t.last_event()["reason"]), t.last_event()
    between(t, agent_mode)
    t.cc("-c", "a.cc", "-o", "a.o")
    assert t.last_event()["status"] != "HIT"
