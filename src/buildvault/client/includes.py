"""Which files' existence decides what a compile reads: the include search as the compiler does it.

A hit is only right if every header would still be found where it was found, and every
`__has_include` would still answer the same. A manifest entry therefore records, besides the
hashed inputs, the state (absent, a file, something else) of the places the search looks, in
GCC's order, up to and including the place where a file is found:

- `#include "x"` in file F: F's own directory, `-iquote`, then the bracket chain;
- `#include <x>`: the bracket chain: `-I`, CPATH, `-isystem`, C_INCLUDE_PATH / CPLUS_INCLUDE_PATH /
  OBJC_INCLUDE_PATH, the compiler's own dirs (asked with `-E -v`), `-idirafter`; an `-I` or CPATH
  dir that is also a system dir is searched only at its system place (GCC drops the other);
- `-include x` / `-imacros x`: the working directory first, then `-iquote` and the bracket chain;
- `#include_next` and `__has_include_next` names: every place (where the search starts depends on
  where the including file was found);
- names a macro computes: every header read, under every dir of the chain that holds it.

Names come from the text of every file read (inactive branches too: more places recorded, never
fewer) and `__has_include` is handled like `#include`. An absent path is recorded as its first
missing component (one lstat covers everything below it). Stdlib only.
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass

from .compile_args import Compile

ABSENT, FILE, OTHER = "-", "f", "o"
_INCLUDE_ENV = ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "OBJC_INCLUDE_PATH", "OBJCPLUS_INCLUDE_PATH")

_DIRECTIVE = re.compile(rb'^[ \t]*#[ \t]*(include|include_next|import)[ \t]*([<"])([^>"\r\n]*)[>"]', re.M)
_COMPUTED_DIRECTIVE = re.compile(rb'^[ \t]*#[ \t]*(?:include|include_next|import)[ \t]+[^<"\s]', re.M)
_HAS_INCLUDE = re.compile(rb'__has_include(_next)?\s*\(\s*([<"])([^>"\r\n]*)[>"]\s*\)')
_HAS_INCLUDE_CALL = re.compile(rb"__has_include(?:_next)?\s*\(")
# What makes the compile read a file no dependency list names, or depend on a file's mtime.
_UNSEEN_READS = (
    (re.compile(rb"\.incbin\b", re.I), ".incbin in an input (the assembler reads a file the launcher cannot see)"),
    (re.compile(rb"^[ \t]*\.include\b|\"[ \t]*\.include\b", re.I | re.M), "assembler .include in an input"),
    (re.compile(rb"GCC[ \t]+dependency"), "#pragma GCC dependency in an input (depends on another file's mtime)"),
    (re.compile(rb"^[ \t]*#[ \t]*embed\b|__has_embed", re.M), "#embed in an input"),
)


@dataclass(frozen=True)
class Directives:
    """What one file asks the include search for (read from its text; inactive branches included)."""

    quoted: tuple[bytes, ...]  # names in #include "..." and __has_include("...")
    angled: tuple[bytes, ...]  # names in #include <...> and __has_include(<...>)
    following: tuple[bytes, ...]  # names in #include_next / __has_include_next (either form)
    computed: bool  # an #include whose name a macro makes
    unseen: str | None  # why this file makes the compile uncacheable, if it does


def scan_directives(data: bytes) -> Directives:
    quoted: set[bytes] = set()
    angled: set[bytes] = set()
    following: set[bytes] = set()
    for m in _DIRECTIVE.finditer(data):
        if m.group(1) == b"include_next":
            following.add(m.group(3))
        (quoted if m.group(2) == b'"' else angled).add(m.group(3))
    for m in _HAS_INCLUDE.finditer(data):
        if m.group(1):
            following.add(m.group(3))
        (quoted if m.group(2) == b'"' else angled).add(m.group(3))
    unseen = None
    if b"__has_include" in data and len(_HAS_INCLUDE_CALL.findall(data)) != len(_HAS_INCLUDE.findall(data)):
        unseen = "__has_include with a computed name in an input"
    for pattern, reason in _UNSEEN_READS:
        if unseen is None and pattern.search(data):
            unseen = reason
    return Directives(
        tuple(sorted(quoted)),
        tuple(sorted(angled)),
        tuple(sorted(following)),
        bool(_COMPUTED_DIRECTIVE.search(data)),
        unseen,
    )


@dataclass(frozen=True)
class SearchPath:
    """The dirs of a compile's include search, absolute, as the compiler spells them, in order."""

    quote: tuple[str, ...]  # -iquote
    bracket: tuple[str, ...]  # -I, CPATH, -isystem, *_INCLUDE_PATH, the compiler's own, -idirafter


def _real(d: str) -> str:
    return os.path.realpath(d)


def search_path(c: Compile, cwd: str, env: dict[str, str], system_dirs: Iterable[str]) -> SearchPath:
    def given(flag: str) -> list[str]:
        return [os.path.join(cwd, d) for f, d in c.include_flags if f == flag]

    def from_env(*names: str) -> list[str]:
        out: list[str] = []
        for name in names:
            value = env.get(name)
            if value is not None:
                out.extend(os.path.join(cwd, d or ".") for d in value.split(os.pathsep))
        return out

    system = [
        *given("-isystem"),
        *from_env(*_INCLUDE_ENV[1:]),
        *(os.path.join(cwd, d) for d in system_dirs),
        *given("-idirafter"),
    ]
    system_real = {_real(d) for d in system}
    # GCC drops a non-system dir that is also a system dir: it is searched at its system place only.
    user = [d for d in [*given("-I"), *from_env("CPATH")] if _real(d) not in system_real]
    quote = [d for d in given("-iquote") if _real(d) not in system_real]
    return SearchPath(tuple(dict.fromkeys(quote)), tuple(dict.fromkeys(user + system)))


def _forms(path: str) -> set[str]:
    return {path, os.path.normpath(path), os.path.realpath(path)}


def state(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return OTHER if os.path.lexists(path) else ABSENT
    return FILE if stat.S_ISREG(st.st_mode) else OTHER


def _first_missing(path: str, exists: dict[str, bool]) -> str:
    """The shortest prefix of absent `path` that is itself absent (`exists`: a memo of lexists)."""
    parent = path.rpartition("/")[0]
    if not parent:
        return path
    known = exists.get(parent)
    if known is None:
        known = exists[parent] = os.path.lexists(parent)
    return path if known else _first_missing(parent, exists)


class _Recorder:
    def __init__(self, inputs: set[str]) -> None:
        self.inputs = inputs
        self.out: dict[str, str] = {}
        self._walked: set[tuple[str, tuple[str, ...], bool]] = set()
        self._exists: dict[str, bool] = {}

    def walk(self, name: str, dirs: tuple[str, ...], whole: bool = False) -> None:
        """Record the places `dirs`/`name` in order, up to the first file (every one if `whole`)."""
        if os.path.isabs(name):
            dirs, name = ("/",), name.lstrip("/")
        key = (name, dirs, whole)
        if key in self._walked:
            return
        self._walked.add(key)
        for d in dirs:
            candidate = os.path.join(d, name)
            s = state(candidate)
            if os.path.normpath(candidate) not in self.inputs:  # an input's content check covers it
                self.out[_first_missing(candidate, self._exists) if s == ABSENT else candidate] = s
            if s == FILE and not whole:
                return


def snapshot(
    c: Compile, cwd: str, files: list[tuple[str, Directives]], search: SearchPath, inputs: set[str]
) -> dict[str, str]:
    """{path: state} of every place the search for the headers and probes of this compile looks.

    `files`: (absolute path as the compiler spelled it, its directives) of every file read, the source
    first. `inputs`: normalized paths of the hashed inputs."""
    rec = _Recorder(inputs)
    every = (cwd, *search.quote, *search.bracket)
    for path, directives in files:
        quote_chain = (os.path.dirname(path), *search.quote, *search.bracket)
        for raw in directives.quoted:
            rec.walk(raw.decode("utf-8", "surrogateescape"), quote_chain)
        for raw in directives.angled:
            rec.walk(raw.decode("utf-8", "surrogateescape"), search.bracket)
        for raw in directives.following:
            rec.walk(raw.decode("utf-8", "surrogateescape"), (os.path.dirname(path), *every), whole=True)
    for name in c.forced_includes:
        rec.walk(name, (cwd, *search.quote, *search.bracket))
    # Headers a macro may have named (and a net under the name-based walks): every header read,
    # under every dir of the chain (or an including file's own dir) that holds it.
    chain = [(d, _forms(d)) for d in (*search.quote, *search.bracket)]
    computed = [os.path.dirname(p) for p, d in files if d.computed]
    for path, _ in files[1:]:
        path_forms = _forms(path)
        for index, (_, forms) in enumerate(chain):
            for d in forms:
                prefix = d.rstrip("/") + "/"
                for form in path_forms:
                    if form.startswith(prefix):
                        rel = form[len(prefix) :]
                        rec.walk(rel, tuple(d for d, _ in chain[: index + 1]))
                        for here in computed:
                            rec.walk(rel, (here, *(d for d, _ in chain[: index + 1])))
    return rec.out


def holds(recorded: dict[str, str]) -> bool:
    """Does every recorded place still have the state it had?"""
    for path, expected in recorded.items():
        if expected == ABSENT:
            if os.path.lexists(path):
                return False
        elif state(path) != expected:
            return False
    return True


class AbsenceCache:
    """`holds` with one stat per directory instead of one per absent name.

    A directory whose inode, mtime and ctime are unchanged has had no entry added, removed or renamed,
    so names found absent in it stay absent. A directory changed within RACY_SECONDS of the check
    is not trusted (the clock may not have ticked since the change): its names are checked one by one."""

    RACY_SECONDS = 2.0

    def __init__(self) -> None:
        self._dirs: dict[str, tuple[tuple[int, int, int, int], set[str]]] = {}

    def holds(self, recorded: dict[str, str]) -> bool:
        by_dir: dict[str, list[str]] = {}
        for path, expected in recorded.items():
            if expected == ABSENT:
                parent, _, name = path.rpartition("/")
                by_dir.setdefault(parent or "/", []).append(name)
            elif state(path) != expected:
                return False
        now = time.time()
        for parent, names in by_dir.items():
            try:
                st = os.stat(parent)
                sig = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)  # ctime: utime cannot set it back
            except OSError:
                sig = None
            cached = self._dirs.get(parent)
            if sig is not None and cached is not None and cached[0] == sig and cached[1].issuperset(names):
                continue
            base = "" if parent == "/" else parent
            if any(os.path.lexists(f"{base}/{name}") for name in names):
                return False
            if sig is not None and now - max(sig[2], sig[3]) / 1e9 > self.RACY_SECONDS:
                known = cached[1] if cached is not None and cached[0] == sig else set()
                known.update(names)
                self._dirs[parent] = (sig, known)
                if len(self._dirs) > 100_000:
                    self._dirs.clear()
        return True
