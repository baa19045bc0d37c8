"""Classify a compiler command line: is it one cacheable compile, and what does it read and write?

Stdlib only. A line is cacheable only if it is exactly one GCC/Clang-style compile
(`-c`, one source, a known output) whose every flag is on the allow-list below; anything
else (linking, -E, -S, several sources, response files, flags that write extra files or read
files the dependency output does not list) is a BYPASS: the launcher runs it untouched.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

SOURCE_LANGUAGES = {
    ".c": "c",
    ".cc": "c++",
    ".cp": "c++",
    ".cpp": "c++",
    ".cxx": "c++",
    ".c++": "c++",
    ".C": "c++",
    ".CPP": "c++",
    ".S": "assembler-with-cpp",
    ".sx": "assembler-with-cpp",
    ".i": "cpp-output",
    ".ii": "c++-cpp-output",
    ".m": "objective-c",
    ".mm": "objective-c++",
}
# -x values we cache (the language decides what the compiler reads, nothing else).
CACHEABLE_LANGUAGES = frozenset(
    {
        "c",
        "c++",
        "c-header",
        "c++-header",
        "assembler-with-cpp",
        "cpp-output",
        "c++-cpp-output",
        "objective-c",
        "objective-c++",
    }
)

# Flags whose value is the next argument (when not attached).
SEPARATE_VALUE = frozenset(
    {
        "-o",
        "-x",
        "-MF",
        "-MT",
        "-MQ",
        "-I",
        "-D",
        "-U",
        "-include",
        "-imacros",
        "-isystem",
        "-idirafter",
        "-iquote",
        "-iprefix",
        "-iwithprefix",
        "-iwithprefixbefore",
        "-isysroot",
        "-A",
        "--param",
        "-target",
        "-arch",
        "-L",
        "-l",
        "-Xassembler",
        "-Xlinker",
        "-T",
        "-u",
        "-z",
        "-e",
        "-F",
        "--sysroot",
        "-Xpreprocessor",
        "-Xclang",
        "-aux-info",
        "-MJ",
        "-B",
        "-specs",
    }
)
# Flags whose value is a path (separate or attached); used for normalization and include search.
PATH_FLAGS = ("-I", "-iquote", "-isystem", "-idirafter", "-include", "-imacros", "-isysroot", "--sysroot", "-o", "-MF")
INCLUDE_DIR_FLAGS = ("-iquote", "-I", "-isystem", "-idirafter")

# Output-changing or input-adding flags we cannot account for: run the compiler untouched.
_BYPASS_PREFIXES = (
    "-save-temps",
    "-fprofile-",
    "-fauto-profile",
    "--coverage",
    "-ftest-coverage",
    "-fbranch-probabilities",
    "-gsplit-dwarf",
    "-fstack-usage",
    "-fdump-",
    "-fcallgraph-info",
    "-aux-info",
    "-fplugin",
    "-B",
    "-specs",
    "-wrapper",
    "-###",
    "-fsanitize-blacklist",
    "-fsanitize-ignorelist",
    "-fmodule",
    "-fmodules",
    "-Xclang",
    "-Xpreprocessor",
    "-MJ",
    "-fcreate-profile",
    "-fopt-info",
    "-frecord-gcc-switches",
    "-fsave-optimization-record",
    "-ftime-trace",
    "-fdiagnostics-format=sarif",
    "-fdiagnostics-format=json-file",
    "-fdiagnostics-add-output",
    "-fdiagnostics-set-output",
    "-fsanitize-coverage-allowlist",
    "-fsanitize-coverage-ignorelist",
    "-fsanitize-coverage-whitelist",
    "-fsanitize-coverage-blacklist",
    "-fthinlto-index",
    "-fdeps-",
    "-fcompare-debug",
    "-ftime-report",
    "-fmem-report",
    "-fstats",
    "-iprefix",
    "-iwithprefix",
    "-Wp,",
    "-flto-compression-level",
    "-F",
    "-iframework",  # Clang framework search: not modelled by includes.py
)
# Assembler options (-Wa,X or -Xassembler X) known to change nothing but the object; any other one may
# write a listing or read a file the launcher does not know (-adhln=, @file, -I, --MD): bypass.
_SAFE_ASSEMBLER_OPTIONS = (
    "--noexecstack",
    "--compress-debug-sections",
    "--nocompress-debug-sections",
    "-mrelax-relocations=",
    "--generate-missing-build-notes=",
)
_NATIVE = ("-march=native", "-mtune=native", "-mcpu=native")
# Flags known to only change the object file (they are part of the key as text).
_ALLOWED_PREFIXES = (
    "-D",
    "-U",
    "-I",
    "-W",
    "-f",
    "-m",
    "-O",
    "-g",
    "-std=",
    "-iquote",
    "-isystem",
    "-idirafter",
    "-include",
    "-imacros",
    "-isysroot",
    "--sysroot",
    "-iprefix",
    "-iwithprefix",
    "-pedantic",
    "--param",
    "-target",
    "--target=",
    "-no-canonical-prefixes",
    "-nostdinc",
    "-nostdlib",
    "-nodefaultlibs",
    "-static",
    "-L",
    "-l",
    "-Xassembler",
    "-Xlinker",
    "-T",
    "-u",
    "-z",
    "-e",
    "-F",
    "-arch",
    "-A",
    "-x",
    "-o",
    "-MF",
    "-MT",
    "-MQ",
)
_ALLOWED_EXACT = frozenset(
    {
        "-c",
        "-pipe",
        "-pthread",
        "-w",
        "-ansi",
        "-shared",
        "-rdynamic",
        "-MD",
        "-MP",
        "-H",
        "-C",
        "-CC",
        "-trigraphs",
        "-undef",
        "-p",
        "-pg",
        "-s",
        "-x",
        "-o",
        "-MF",
        "-MT",
        "-MQ",
        "-P",
        "-pie",
        "-no-pie",
        "-fPIC",
        "-fpic",
        "-fPIE",
        "-fpie",
        "--version-script",
    }
)
# Environment that reaches the compiler's output or diagnostics: part of the key.
ENV_ALLOW = (
    "CPATH",
    "C_INCLUDE_PATH",
    "CPLUS_INCLUDE_PATH",
    "OBJC_INCLUDE_PATH",
    "OBJCPLUS_INCLUDE_PATH",
    "GCC_EXEC_PREFIX",
    "COMPILER_PATH",
    "SOURCE_DATE_EPOCH",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "LC_MESSAGES",
)
# Environment that makes the compiler write side files or run twice: bypass.
ENV_BYPASS = ("DEPENDENCIES_OUTPUT", "SUNPRO_DEPENDENCIES", "GCC_EXTRA_DIAGNOSTIC_OUTPUT", "GCC_COMPARE_DEBUG")


@dataclass
class Compile:
    """One cacheable compile."""

    argv: list[str]  # as given, argv[0] is the compiler
    source: str  # as given
    language: str
    output: str  # as given (or the default name)
    depfile: str | None  # user-requested dependency output (as given), or None
    include_dirs: list[str] = field(default_factory=list)  # search order, as given
    include_flags: list[tuple[str, str]] = field(default_factory=list)  # (-I / -iquote / -isystem / -idirafter, dir)
    forced_includes: list[str] = field(default_factory=list)
    debug_info: bool = False
    compressed_debug: bool = False
    dep_target_given: bool = False  # -MT/-MQ on the line (else the depfile's target is the -o value)


@dataclass
class Bypass:
    reason: str


def _safe_assembler_option(option: str) -> bool:
    return option.startswith(_SAFE_ASSEMBLER_OPTIONS)


def _takes_value(arg: str) -> bool:
    return arg in SEPARATE_VALUE


def _allowed(arg: str, extra: tuple[str, ...]) -> bool:
    if arg in _ALLOWED_EXACT:
        return True
    if extra and arg.startswith(extra):
        return True
    return arg.startswith(_ALLOWED_PREFIXES)


def classify(argv: list[str], env: dict[str, str] | None = None, extra_safe: tuple[str, ...] = ()) -> Compile | Bypass:
    """Return a Compile if `argv` (compiler first) is one cacheable compile, else why not."""
    if len(argv) < 2:
        return Bypass("no-arguments")
    env = env or {}
    for name in ENV_BYPASS:
        if env.get(name):
            return Bypass(f"env:{name}")
    args = argv[1:]
    compile_only = False
    sources: list[tuple[str, str]] = []
    output = None
    depfile = None
    dep_md = False
    language = None  # current -x
    include_dirs: list[str] = []
    include_flags: list[tuple[str, str]] = []
    forced: list[str] = []
    debug = False
    gz = False
    dep_target = False
    i = 0
    while i < len(args):
        arg = args[i]
        value = ""
        if arg.startswith("@"):
            return Bypass("response-file")
        if arg == "-":
            return Bypass("stdin-source")
        if not arg.startswith("-"):
            if language and language != "none":
                if language not in CACHEABLE_LANGUAGES:
                    return Bypass(f"language:{language}")
                sources.append((arg, language))
            else:
                ext = os.path.splitext(arg)[1]
                lang = SOURCE_LANGUAGES.get(ext)
                if lang is None:
                    if ext in (".s", ".o", ".a", ".so") or ext == "":
                        return Bypass(f"not-a-cacheable-source:{ext or arg}")
                    return Bypass(f"unknown-input:{ext}")
                sources.append((arg, lang))
            i += 1
            continue
        if arg in ("-E", "-S", "-M", "-MM", "-fsyntax-only"):
            names = {"-E": "preprocess-only", "-S": "assembly-output", "-fsyntax-only": "syntax-only"}
            return Bypass(names.get(arg, "deps-only"))
        if arg == "-MMD":
            return Bypass("mmd-not-supported")
        if arg.startswith(_BYPASS_PREFIXES):
            return Bypass(f"flag:{arg}")
        if arg in _NATIVE:
            return Bypass(f"flag:{arg}")
        if arg.startswith("-Wa,") and not all(_safe_assembler_option(o) for o in arg[4:].split(",")):
            return Bypass(f"flag:{arg}")
        if arg == "-Xassembler" and i + 1 < len(args) and not _safe_assembler_option(args[i + 1]):
            return Bypass(f"flag:-Xassembler {args[i + 1]}")
        if arg in ("-v", "-MG", "-I-"):  # -v: temp names in stderr; -MG: missing headers pass; -I-: old quote rules
            return Bypass(f"flag:{arg}")
        if not _allowed(arg, extra_safe):
            return Bypass(f"unknown-flag:{arg}")
        if _takes_value(arg):
            if i + 1 >= len(args):
                return Bypass(f"missing-value:{arg}")
            value = args[i + 1]
            i += 2
        else:
            i += 1
        if arg == "-c":
            compile_only = True
        elif arg == "-o":
            output = value
        elif arg.startswith("-o"):
            output = arg[2:]
        elif arg == "-x":
            language = value
        elif arg.startswith("-x"):
            language = arg[2:]
        elif arg == "-MD":
            dep_md = True
        elif arg.startswith(("-MT", "-MQ")):
            dep_target = True
        elif arg == "-MF":
            depfile = value
        elif arg.startswith("-MF"):
            depfile = arg[3:]
        elif arg in ("-include", "-imacros"):
            forced.append(value)
        elif arg.startswith(("-include", "-imacros")):
            return Bypass(f"attached-value:{arg}")  # the search for it is only modelled for the separate form
        elif arg in INCLUDE_DIR_FLAGS or (
            arg.startswith(INCLUDE_DIR_FLAGS) and not arg.startswith(("-include", "-imacros"))
        ):
            flag = arg if arg in INCLUDE_DIR_FLAGS else next(f for f in INCLUDE_DIR_FLAGS if arg.startswith(f))
            directory = value if arg in INCLUDE_DIR_FLAGS else arg[len(flag) :]
            if directory.startswith(("=", "$SYSROOT")) or directory.endswith(".hmap"):
                return Bypass(f"include-dir-not-modelled:{directory}")  # sysroot-relative, or a Clang header map
            include_dirs.append(directory)
            include_flags.append((flag, directory))
        elif arg.startswith("-g"):
            level = arg[2:]
            if level.startswith("z"):
                gz = True
            elif level not in ("0", "no-record-gcc-switches", "record-gcc-switches") and not level.startswith("no-"):
                debug = True
        elif arg.startswith("-f") and arg.startswith(("-fdebug-types-section", "-fvar-tracking")):
            pass
    if not compile_only:
        return Bypass("not-a-compile")
    if not sources:
        return Bypass("no-source")
    if len(sources) > 1:
        return Bypass("multiple-sources")
    source, lang = sources[0]
    if output is None:
        output = os.path.splitext(os.path.basename(source))[0] + ".o"
    if output == "-":
        return Bypass("output-to-stdout")
    if depfile is not None and not dep_md:
        return Bypass("MF-without-MD")
    if dep_md and depfile is None:
        depfile = os.path.splitext(output)[0] + ".d"
    return Compile(
        argv=list(argv),
        source=source,
        language=lang,
        output=output,
        depfile=depfile if dep_md else None,
        include_dirs=include_dirs,
        include_flags=include_flags,
        forced_includes=forced,
        debug_info=debug,
        compressed_debug=gz,
        dep_target_given=dep_target,
    )


def parse_depfile(text: str) -> list[str]:
    """The prerequisites of a Make-style dependency file as written by GCC/Clang (-MD, -MP)."""
    text = text.replace("\\\r\n", " ").replace("\\\n", " ")
    deps: list[str] = []
    for line in text.splitlines():
        colon = _rule_colon(line)
        if colon < 0:
            continue
        deps.extend(_split_escaped(line[colon + 1 :]))
    seen = set()
    unique = []
    for dep in deps:
        if dep not in seen:
            seen.add(dep)
            unique.append(dep)
    return unique


def _rule_colon(line: str) -> int:
    i = 0
    while i < len(line):
        c = line[i]
        if c == "\\":
            i += 2
            continue
        if c == ":" and (i + 1 == len(line) or line[i + 1] in " \t"):
            return i
        i += 1
    return -1


def _split_escaped(text: str) -> list[str]:
    if "\\" not in text and "$" not in text:
        return text.split()
    out: list[str] = []
    cur: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] in " #\\":
            cur.append(text[i + 1])
            i += 2
            continue
        if c == "$" and i + 1 < len(text) and text[i + 1] == "$":
            cur.append("$")
            i += 2
            continue
        if c in " \t":
            if cur:
                out.append("".join(cur))
                cur = []
            i += 1
            continue
        cur.append(c)
        i += 1
    if cur:
        out.append("".join(cur))
    return out
