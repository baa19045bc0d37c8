"""Unit tests of the rules behind "no wrong hit": include-search snapshots, private outputs, the
preprocessed-text check, toolchain parsing and the option bypasses (issue 10)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from buildvault.client import includes, outputs, preprocessed
from buildvault.client.compile_args import Bypass, Compile, classify
from buildvault.client.keys import Prepared, Uncacheable, parse_platform, prepare
from buildvault.client.roots import Roots
from buildvault.client.toolchain import parse_search_list, system_dir_flags


def _compile(argv: list[str]) -> Compile:
    c = classify(argv)
    assert isinstance(c, Compile), c
    return c


# -- option bypasses ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["g++", "-Xassembler", "-adhln=a.lst", "-c", "a.cc"], "flag:-Xassembler -adhln=a.lst"),
        (["g++", "-Wa,-adhln=a.lst", "-c", "a.cc"], "flag:-Wa,-adhln=a.lst"),
        (["g++", "-Wa,@opts", "-c", "a.cc"], "flag:-Wa,@opts"),
        (["g++", "-Wp,-I,x", "-c", "a.cc"], "flag:-Wp,"),
        (["g++", "-v", "-c", "a.cc"], "flag:-v"),
        (["g++", "-MD", "-MG", "-c", "a.cc"], "flag:-MG"),
        (["g++", "-I-", "-c", "a.cc"], "flag:-I-"),
        (["g++", "-iprefix", "/p", "-c", "a.cc"], "flag:-iprefix"),
        (["g++", "-includecfg.h", "-c", "a.cc"], "attached-value:"),
        (["g++", "-ftime-report", "-c", "a.cc"], "flag:-ftime-report"),
        (["g++", "-I=/inc", "-c", "a.cc"], "include-dir-not-modelled:=/inc"),
        (["clang++", "-I", "proj.hmap", "-c", "a.cc"], "include-dir-not-modelled:proj.hmap"),
        (["clang++", "-F/Library/Frameworks", "-c", "a.cc"], "flag:-F"),
    ],
)
def test_options_that_read_or_write_unknown_files_are_bypassed(argv: list[str], reason: str) -> None:
    result = classify(argv)
    assert isinstance(result, Bypass) and result.reason.startswith(reason), result


def test_harmless_assembler_options_stay_cacheable() -> None:
    assert isinstance(classify(["g++", "-Wa,--noexecstack", "-c", "a.cc"]), Compile)
    assert isinstance(classify(["g++", "-Xassembler", "--noexecstack", "-c", "a.cc"]), Compile)
    assert isinstance(classify(["g++", "-c", "a.cc"], {"GCC_COMPARE_DEBUG": "1"}), Bypass)


# -- directives ---------------------------------------------------------------------------------------------------


def test_directives_are_read_from_the_text() -> None:
    d = includes.scan_directives(
        b'#include "a.h"\n  #  include <b/c.h>\n#include_next <stdlib.h>\n#if __has_include(<opt.h>)\n'
        b'#endif // __has_include\n#if __has_include_next("n.h")\n#endif\n#include MACRO_HEADER\n'
    )
    assert d.quoted == (b"a.h", b"n.h")
    assert d.angled == (b"b/c.h", b"opt.h", b"stdlib.h")
    assert d.following == (b"n.h", b"stdlib.h")
    assert d.computed and d.unseen is None


@pytest.mark.parametrize(
    "text, reason",
    [
        (b'asm(".incbin \\"data.bin\\"");', ".incbin"),
        (b'.include "macros.s"\n', "assembler .include"),
        (b'#pragma GCC dependency "parse.y"\n', "GCC dependency"),
        (b"#if __has_include(HEADER)\n#endif\n", "computed name"),
        (b'#embed "x.bin"\n', "#embed"),
    ],
)
def test_reads_the_launcher_cannot_see_are_named(text: bytes, reason: str) -> None:
    unseen = includes.scan_directives(text).unseen
    assert unseen is not None and reason in unseen


# -- the search path and its snapshot -------------------------------------------------------------------------------


def test_search_path_follows_gcc_order_and_drops_I_dirs_that_are_system_dirs(tmp_path: Path) -> None:
    c = _compile(
        ["g++", "-isystem", "sys", "-Iinc", "-I/usr/include", "-iquote", "q", "-idirafter", "late", "-c", "a.cc"]
    )
    env = {"CPATH": "c1:", "CPLUS_INCLUDE_PATH": "cx"}
    search = includes.search_path(c, str(tmp_path), env, ["/usr/include"])
    t = str(tmp_path)
    assert search.quote == (f"{t}/q",)
    assert search.bracket == (f"{t}/inc", f"{t}/c1", f"{t}/.", f"{t}/sys", f"{t}/cx", "/usr/include", f"{t}/late")


def test_snapshot_records_the_places_searched_before_the_header_found(tmp_path: Path) -> None:
    for d in ("a", "b", "c", "src"):
        (tmp_path / d).mkdir()
    (tmp_path / "b" / "h.h").write_text("#define H 1\n")
    (tmp_path / "c" / "h.h").write_text("#define H 2\n")
    source = tmp_path / "src" / "m.cc"
    source.write_text('#include "h.h"\n')
    c = _compile(["g++", "-Ia", "-Ib", "-Ic", "-c", "src/m.cc"])
    search = includes.search_path(c, str(tmp_path), {}, [])
    files = [
        (str(source), includes.scan_directives(source.read_bytes())),
        (str(tmp_path / "b" / "h.h"), includes.scan_directives(b"")),
    ]
    snap = includes.snapshot(c, str(tmp_path), files, search, {str(source), str(tmp_path / "b" / "h.h")})
    t = str(tmp_path)
    assert snap == {f"{t}/src/h.h": includes.ABSENT, f"{t}/a/h.h": includes.ABSENT}  # c/h.h comes after
    assert includes.holds(snap)
    (tmp_path / "a" / "h.h").write_text("#define H 0\n")
    assert not includes.holds(snap)


def test_an_absent_path_is_recorded_as_its_first_missing_component(tmp_path: Path) -> None:
    c = _compile(["g++", "-Inope/deeper", "-c", "m.cc"])
    source = tmp_path / "m.cc"
    source.write_text("#include <x/y.h>\n")
    search = includes.search_path(c, str(tmp_path), {}, [])
    snap = includes.snapshot(
        c, str(tmp_path), [(str(source), includes.scan_directives(source.read_bytes()))], search, {str(source)}
    )
    assert snap == {f"{tmp_path}/nope": includes.ABSENT}


def test_a_directory_or_dangling_link_on_the_path_is_recorded_as_other(tmp_path: Path) -> None:
    (tmp_path / "i1" / "h.h").mkdir(parents=True)
    (tmp_path / "i2").mkdir()
    (tmp_path / "i2" / "h.h").symlink_to(tmp_path / "missing.h")
    assert includes.state(str(tmp_path / "i1" / "h.h")) == includes.OTHER
    assert includes.state(str(tmp_path / "i2" / "h.h")) == includes.OTHER
    assert not includes.holds({str(tmp_path / "i2" / "h.h"): includes.ABSENT})


# -- outputs --------------------------------------------------------------------------------------------------------


def test_outputs_go_to_private_temp_names_with_the_original_depfile_target() -> None:
    c = _compile(["g++", "-MD", "-MF", "a.d", "-o", "out/a.o", "-c", "a.cc"])
    outs = [("/b/out/a.o", "obj"), ("/b/a.d", "dep")]
    argv, temps, depfile = outputs.private_argv(c, outs, "T", "/tmp/agent")
    assert temps == {"/b/out/a.o": "/b/out/.a.o.bv-T.tmp", "/b/a.d": "/b/.a.d.bv-T.tmp"}
    assert argv == [
        "g++",
        "-MD",
        "-MF",
        "/b/.a.d.bv-T.tmp",
        "-o",
        "/b/out/.a.o.bv-T.tmp",
        "-c",
        "a.cc",
        "-MQ",
        "out/a.o",
    ]
    assert depfile == "/b/.a.d.bv-T.tmp"
    plain = _compile(["g++", "-c", "a.cc"])
    argv, temps, depfile = outputs.private_argv(plain, [("/b/a.o", "obj")], "T", "/tmp/agent")
    assert argv == ["g++", "-c", "a.cc", "-o", "/b/.a.o.bv-T.tmp", "-MD", "-MF", "/tmp/agent/T.d"]


def test_only_plain_file_paths_are_written_by_the_launcher(tmp_path: Path) -> None:
    regular = tmp_path / "a.o"
    regular.write_bytes(b"old")
    link = tmp_path / "l.o"
    link.symlink_to(os.devnull)
    hard = tmp_path / "h.o"
    hard.write_bytes(b"x")
    os.link(hard, tmp_path / "h2.o")
    assert outputs.unusable(str(regular)) is None
    assert outputs.unusable(str(tmp_path / "new.o")) is None
    assert outputs.unusable(str(link)) == "output-is-a-symlink"
    assert outputs.unusable(os.devnull) == "output-not-a-regular-file"
    assert outputs.unusable(str(hard)) == "output-hard-linked"
    assert outputs.unusable(str(tmp_path / "gone" / "a.o")) == "output-dir-missing"
    outputs.write_output(str(regular), b"new", False, "T")
    assert regular.read_bytes() == b"new"
    with pytest.raises(outputs.OutputChanged):
        outputs.write_output(str(link), b"new", False, "T")
    with pytest.raises(outputs.OutputChanged):
        outputs.write_output(str(tmp_path / "gone" / "a.o"), b"new", False, "T")
    assert not (tmp_path / "gone").exists() and os.path.islink(link)


# -- the preprocessed text --------------------------------------------------------------------------------------------


def _prepared(root: str = "/ck") -> Prepared:
    c = _compile(["g++", "-I../inc", "-c", f"{root}/a.cc", "-o", "a.o"])
    return prepare(c, f"{root}/build", {}, Roots([("SRC", root), ("BUILD", f"{root}/build")]), "id", parse_platform(""))


def test_preprocessed_text_reveals_paths_in_any_form() -> None:
    p = _prepared()
    assert not preprocessed.facts(b'const char* s = "a.cc";\n', p, False).path_dependent
    assert preprocessed.facts(b'const wchar_t* s = L"" "/ck/a.cc";\n', p, False).path_dependent
    assert preprocessed.facts(b'unsigned n = sizeof("../inc/x.h");\n', p, False).path_dependent
    assert preprocessed.facts(b"auto l = __builtin_source_location();\n", p, False).path_dependent
    assert not preprocessed.facts(b'const char* s = "/ck2/a.cc";\n', p, False).path_dependent


def test_preprocessed_text_reveals_the_time_of_the_compile() -> None:
    p = _prepared()
    with pytest.raises(Uncacheable):
        preprocessed.facts(b'const char* t = "20:31:07";\n', p, False)
    with pytest.raises(Uncacheable):
        preprocessed.facts(b'const char* d = "Dec  1 2026";\n', p, False)
    with pytest.raises(Uncacheable):
        preprocessed.facts(b'const char* d = "Tue Dec  1 20:31:07 2026";\n', p, True)
    assert not preprocessed.facts(b'const char* t = "20:31:07";\n', p, True).path_dependent  # SOURCE_DATE_EPOCH


def test_preprocess_argv_writes_nothing() -> None:
    argv = preprocessed.preprocess_argv(_prepared())
    assert argv == ["g++", "-I../inc", "/ck/a.cc", "-E", "-o", "-"]


# -- toolchain --------------------------------------------------------------------------------------------------------


def test_search_list_of_gcc_minus_v() -> None:
    stderr = (
        'ignoring nonexistent directory "/nope"\n#include "..." search starts here:\n'
        "#include <...> search starts here:\n /usr/lib/gcc/x86_64-linux-gnu/12/include\n /usr/include\n"
        " /System/Library/Frameworks (framework directory)\nEnd of search list.\n"
    )
    assert parse_search_list(stderr) == (
        "/usr/lib/gcc/x86_64-linux-gnu/12/include",
        "/usr/include",
        "/System/Library/Frameworks",
    )
    assert parse_search_list("no list here\n") is None


def test_flags_that_change_the_compilers_own_dirs() -> None:
    argv = ["g++", "-O2", "-m32", "-Iinc", "--sysroot", "/sr", "-nostdinc++", "-DX", "-c", "a.cc"]
    assert system_dir_flags(argv) == ("-m32", "--sysroot", "/sr", "-nostdinc++")


def test_absence_cache_trusts_an_unchanged_directory_only(tmp_path: Path) -> None:
    (tmp_path / "inc").mkdir()
    old = 1_600_000_000
    os.utime(tmp_path / "inc", (old, old))  # not racy: its mtime is long past
    recorded = {f"{tmp_path}/inc/h.h": includes.ABSENT, f"{tmp_path}/inc/g.h": includes.ABSENT}
    cache = includes.AbsenceCache()
    assert cache.holds(recorded) and cache.holds(recorded)
    (tmp_path / "inc" / "h.h").write_text("#define H 1\n")  # changes the directory's mtime
    assert not cache.holds(recorded)
    (tmp_path / "inc" / "h.h").unlink()
    cache = includes.AbsenceCache()
    os.utime(tmp_path / "inc", (old, old))
    assert cache.holds(recorded)
    (tmp_path / "inc" / "g.h").mkdir()
    os.utime(tmp_path / "inc", (old, old))  # the mtime set back by hand: the ctime still moved
    assert not cache.holds(recorded)
