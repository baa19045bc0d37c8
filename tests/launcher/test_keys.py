"""Unit tests of buildvault-cc's key computation: argv classification, root normalization,
dependency-file parsing, file hashing and the REAPI Action built from them."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from buildvault.client.compile_args import Bypass, Compile, classify, parse_depfile
from buildvault.client.keys import EXACT, ActionKey, FileHasher, Prepared, action_key, parse_platform, prepare
from buildvault.client.roots import Roots, parse_roots
from buildvault.client.summary import summarize
from buildvault.digest import Digest
from buildvault.remote_apis import re_pb2

# -- classification -------------------------------------------------------------------------------


def test_plain_compile_is_cacheable() -> None:
    c = classify(["g++", "-O2", "-Iinc", "-DX=1", "-c", "a.cc", "-o", "out/a.o"])
    assert isinstance(c, Compile)
    assert (c.source, c.output, c.depfile, c.language) == ("a.cc", "out/a.o", None, "c++")
    assert c.include_dirs == ["inc"]


def test_cmake_style_depfile_and_force_include() -> None:
    argv = [
        "c++",
        "-DSOC=ascend910b1",
        "-I/ck/inc",
        "-O3",
        "-include",
        "/ck/compat.h",
        "-MD",
        "-MT",
        "x.o",
        "-MF",
        "x.o.d",
        "-o",
        "x.o",
        "-c",
        "/ck/x.cc",
    ]
    c = classify(argv)
    assert isinstance(c, Compile)
    assert c.depfile == "x.o.d" and c.forced_includes == ["/ck/compat.h"] and c.include_dirs == ["/ck/inc"]
    c = classify(["gcc", "-MD", "-c", "a.c", "-o", "obj/a.o"])
    assert isinstance(c, Compile)
    assert c.depfile == "obj/a.d"
    c = classify(["gcc", "-c", "a.c"])
    assert isinstance(c, Compile)
    assert c.output == "a.o"


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["g++", "a.o", "b.o", "-o", "app"], "not-a-cacheable-source"),
        (["g++", "a.cc", "-o", "app"], "not-a-compile"),
        (["g++", "-E", "a.cc"], "preprocess-only"),
        (["g++", "-S", "-c", "a.cc"], "assembly-output"),
        (["g++", "-c", "a.cc", "b.cc"], "multiple-sources"),
        (["g++", "-MMD", "-c", "a.cc"], "mmd-not-supported"),
        (["g++", "@args.rsp"], "response-file"),
        (["g++", "-fprofile-generate", "-c", "a.cc"], "flag:-fprofile-generate"),
        (["g++", "--coverage", "-c", "a.cc"], "flag:--coverage"),
        (["g++", "-save-temps", "-c", "a.cc"], "flag:-save-temps"),
        (["g++", "-march=native", "-c", "a.cc"], "flag:-march=native"),
        (["g++", "-gsplit-dwarf", "-c", "a.cc"], "flag:-gsplit-dwarf"),
        (["g++", "--frobnicate", "-c", "a.cc"], "unknown-flag:--frobnicate"),
        (["g++", "-Wp,-MD,x.d", "-c", "a.cc"], "flag:-Wp,-MD,x.d"),
        (["g++", "-c", "a.cc", "-o", "-"], "output-to-stdout"),
        (["g++", "-c", "-"], "stdin-source"),
        (["g++", "-c", "a.s"], "not-a-cacheable-source"),
    ],
)
def test_unsupported_lines_are_bypassed(argv: list[str], reason: str) -> None:
    result = classify(argv)
    assert isinstance(result, Bypass)
    assert result.reason.startswith(reason)


def test_side_output_environment_is_bypassed_and_extra_safe_flags_are_allowed() -> None:
    assert isinstance(classify(["g++", "-c", "a.cc"], {"DEPENDENCIES_OUTPUT": "x.d"}), Bypass)
    assert isinstance(classify(["ccec", "--cce-aicore-arch=dav-c220", "-c", "k.cc"]), Bypass)
    assert isinstance(classify(["ccec", "--cce-aicore-arch=dav-c220", "-c", "k.cc"], {}, ("--cce-",)), Compile)


def test_parse_depfile_handles_continuations_escapes_and_phony_targets() -> None:
    text = (
        "obj/a.o: /ck/a.cc /ck/inc/a\\ b.h \\\n  /usr/include/stdio.h \\\n /ck/x$$y.h\n/ck/inc/a\\ b.h:\n"
        "/usr/include/stdio.h:\n"
    )
    assert parse_depfile(text) == ["/ck/a.cc", "/ck/inc/a b.h", "/usr/include/stdio.h", "/ck/x$y.h"]


# -- roots ------------------------------------------------------------------------------------------


def test_roots_normalize_whole_path_prefixes_only() -> None:
    roots = Roots([("SRC", "/ck"), ("BUILD", "/ck/build")])
    assert roots.normalize("-DROOT=/ck/inc") == "-DROOT=@SRC_ROOT@/inc"
    assert roots.normalize("/ck/build/gen/x.cc") == "@BUILD_ROOT@/gen/x.cc"  # innermost root wins
    assert roots.normalize("/ck2/inc /x/ck/y /ck") == "/ck2/inc /x/ck/y @SRC_ROOT@"
    assert roots.normalize_bytes(b'#include "/ck/a.h"') == b'#include "@SRC_ROOT@/a.h"'
    assert roots.denormalize(roots.normalize("a /ck/b /ck/build/c")) == "a /ck/b /ck/build/c"
    assert roots.layout("/ck/build/gen/x.cc") == "BUILD/gen/x.cc"
    assert roots.layout("/usr/include/stdio.h") == "_abs/usr/include/stdio.h"
    assert roots.from_layout("SRC/a/b.h") == "/ck/a/b.h"
    assert roots.from_layout("_abs/usr/include/stdio.h") == "/usr/include/stdio.h"


def test_parse_roots() -> None:
    assert parse_roots("SRC=/a,build=/a/b") == [("SRC", "/a"), ("BUILD", "/a/b")]
    assert parse_roots("/a:/b") == [("R0", "/a"), ("R1", "/b")]


# -- the action -------------------------------------------------------------------------------------


def _argv(ck: str, build: str, *extra: str) -> list[str]:
    return [
        "/usr/bin/c++",
        "-DSOC=ascend910b1",
        f"-I{ck}/inc",
        "-include",
        f"{ck}/compat.h",
        "-O2",
        *extra,
        "-MD",
        "-MT",
        "a.o",
        "-MF",
        "a.o.d",
        "-o",
        "a.o",
        "-c",
        f"{ck}/a.cc",
    ]


def _key(
    ck: str = "/ck1",
    build: str | None = None,
    argv: list[str] | None = None,
    env: dict[str, str] | None = None,
    compiler: str = "c1",
    platform: str = "soc=ascend910b1,cann=8.0.RC3",
    inputs: dict[str, tuple[Digest, bool]] | None = None,
    exact: bool = False,
) -> tuple[Prepared, ActionKey]:
    build = build or f"{ck}/build"
    argv = argv or _argv(ck, build)
    c = classify(argv, env or {})
    assert isinstance(c, Compile)
    roots = Roots([("SRC", ck), ("BUILD", build)])
    p = prepare(c, build, env or {}, roots, compiler, parse_platform(platform))
    inputs = inputs or {
        "SRC/a.cc": (Digest.of(b"int a;"), False),
        "SRC/inc/a.h": (Digest.of(b"#define A"), False),
        "SRC/compat.h": (Digest.of(b"#define C"), False),
        "_abs/usr/include/stdio.h": (Digest.of(b"stdio"), False),
    }
    return p, action_key(p, inputs, exact=exact)


def _platform_of(key: ActionKey) -> dict[str, str]:
    action = re_pb2.Action.FromString(key.blobs[key.digest])
    return {prop.name: prop.value for prop in action.platform.properties}


def test_same_tree_in_another_checkout_and_build_dir_depth_gives_the_same_key() -> None:
    _, a = _key("/ck1", "/ck1/build")
    _, b = _key("/home/x/elsewhere/ck2", "/home/x/elsewhere/ck2/build")
    _, c = _key("/ck1", "/ck1/_build/x86_64-release")
    assert a.digest == b.digest == c.digest
    assert "@SRC_ROOT@/inc" in " ".join(a.command.arguments[1:]).replace("-I", " ")
    assert a.command.working_directory == "BUILD"


def test_every_input_reaching_the_compiler_changes_the_key() -> None:
    p, base = _key()
    variants = [
        _key(argv=_argv("/ck1", "/ck1/build", "-DEXTRA"))[1],  # a flag
        _key(env={"CPATH": "/opt/inc"})[1],  # an allow-listed variable
        _key(compiler="c2")[1],  # compiler identity
        _key(inputs={"SRC/a.cc": (Digest.of(b"int b;"), False)})[1],  # a file's content
        _key(inputs={"SRC/b.cc": (Digest.of(b"int a;"), False)})[1],  # a file's place
        _key(argv=_argv("/ck1", "/ck1/build", "-DSOC2"), platform="soc=ascend910b1")[1],
        _key(exact=True)[1],  # path-dependent outputs: byte-exact key
    ]
    digests = {base.digest} | {v.digest for v in variants}
    assert len(digests) == len(variants) + 1


def test_nothing_else_changes_the_key() -> None:
    _, base = _key()
    assert _key(env={"HOME": "/x", "MAKEFLAGS": "-j9", "SHIM_LOG": "/tmp/l"})[1].digest == base.digest
    # A platform property the compile does not mention (third-party code knows no SOC) stays out.
    third_party = ["/usr/bin/c++", "-O2", "-c", "/ck1/tp.cc", "-o", "tp.o"]
    _, tp1 = _key(argv=third_party, platform="soc=ascend910b1,cann=8.0.RC3")
    _, tp2 = _key(argv=third_party, platform="soc=ascend310p1,cann=8.0.RC3")
    assert tp1.digest == tp2.digest
    assert "soc" not in _platform_of(tp1)


def test_platform_properties() -> None:
    _, key = _key()
    props = _platform_of(key)
    assert props["soc"] == "ascend910b1" and props["compiler"] == "c1"
    assert props["OSFamily"] and props["arch"]
    assert "cann" not in props  # not mentioned by this compile
    _, forced = _key(platform="soc=ascend910b1,cann=8.0.RC3!")
    assert _platform_of(forced)["cann"] == "8.0.RC3"
    _, soc2 = _key(
        argv=[a.replace("ascend910b1", "ascend310p1") for a in _argv("/ck1", "/ck1/build")], platform="soc=ascend310p1"
    )
    assert _platform_of(soc2)["soc"] == "ascend310p1"


def test_relative_paths_leaving_the_working_root_are_rewritten_and_remembered() -> None:
    argv = ["c++", "-I../inc", "-Igen", "-c", "../a.cc", "-o", "a.o"]
    c = classify(argv)
    assert isinstance(c, Compile)
    roots = Roots([("SRC", "/ck"), ("BUILD", "/ck/build")])
    p = prepare(c, "/ck/build", {}, roots, "c", [])
    assert p.argv_norm == ["c++", "-I@SRC_ROOT@/inc", "-Igen", "-c", "@SRC_ROOT@/a.cc", "-o", "a.o"]
    assert set(p.rewritten) == {"../inc", "../a.cc"}


def test_action_is_a_real_reapi_action() -> None:
    _, key = _key()
    action = re_pb2.Action.FromString(key.blobs[key.digest])
    command = re_pb2.Command.FromString(key.blobs[Digest(action.command_digest.hash, action.command_digest.size_bytes)])
    root_digest = Digest(action.input_root_digest.hash, action.input_root_digest.size_bytes)
    root = re_pb2.Directory.FromString(key.blobs[root_digest])
    assert [d.name for d in root.directories] == ["SRC", "_abs"]
    assert list(command.output_paths) == ["a.o", "a.o.d"]
    assert command.arguments[0] == "/usr/bin/c++"


# -- file hashing -----------------------------------------------------------------------------------


def _old(path: Path) -> None:
    past = time.time() - 60
    os.utime(path, (past, past))


def test_text_inputs_are_normalized_binary_and_outside_inputs_are_exact(tmp_path: Path) -> None:
    hasher = FileHasher()
    infos = {}
    for name in ("ck1", "ck2"):
        ck = tmp_path / name
        ck.mkdir()
        (ck / "gen.h").write_text(f'#include "{ck}/inc/a.h"\n')
        (ck / "blob.bin").write_bytes(b"\0" + str(ck).encode())
        roots = Roots([("SRC", str(ck))])
        infos[name] = (
            hasher.info(str(ck / "gen.h"), roots),
            hasher.info(str(ck / "blob.bin"), roots),
            hasher.info(str(ck / "gen.h"), EXACT),
        )
    assert infos["ck1"][0].digest == infos["ck2"][0].digest  # normalized text
    assert infos["ck1"][1].digest != infos["ck2"][1].digest  # binary: byte-exact
    assert infos["ck1"][2].digest != infos["ck2"][2].digest  # outside every root: byte-exact


def test_hash_cache_notices_edits(tmp_path: Path) -> None:
    hasher = FileHasher()
    f = tmp_path / "a.h"
    f.write_text("#define A 1\n")
    _old(f)
    first = hasher.info(str(f), EXACT)
    assert hasher.info(str(f), EXACT) is first  # cached by inode/size/mtime/ctime
    f.write_text("#define A 2\n")  # same size, new content
    _old(f)
    assert hasher.info(str(f), EXACT).digest != first.digest


def test_time_macros_are_detected(tmp_path: Path) -> None:
    f = tmp_path / "t.cc"
    f.write_text('const char* built = __DATE__ " " __TIME__;\n')
    info = FileHasher().info(str(f), EXACT)
    assert info.time_macros and not info.timestamp_macro


def test_summary_counts() -> None:
    lines = [
        '{"status":"HIT","reason":"hit","outputs":2,"seconds":0.01,"saved":0.5}',
        '{"status":"HIT","reason":"hit","outputs":2,"seconds":0.01,"saved":0.25}',
        '{"status":"MISS","reason":"stored","outputs":2,"seconds":0.9,"compile_seconds":0.8}',
        '{"status":"BYPASS","reason":"not-a-compile","seconds":0.1}',
        "garbage",
    ]
    s = summarize(lines)
    assert (s["hits"], s["misses"], s["bypassed"], s["actions"]) == (2, 1, 1, 4)
    assert s["seconds_saved"] == 0.75 and s["hit_rate"] == round(2 / 3, 4)
    assert s["reasons"] == {"MISS:stored": 1, "BYPASS:not-a-compile": 1}
