"""Which files' existence decides what a compile reads: the include search as the compiler does it.

A hit is only right if every header would still be found where it was found, and every
`__has_include` would still answer the same. A manifest entry therefore records, besides the
hashed inputs, the state (absent, a file, something else) of every place the search could have
looked: for each header used and each name a file asks `__has_include` about,

- the including file's own directory for the names that file quotes (`#include "x.h"`),
- every dir of the chain: `-iquote`, `-I`, CPATH, `-isystem`, C_INCLUDE_PATH / CPLUS_INCLUDE_PATH /
  OBJC_INCLUDE_PATH, the compiler's own dirs (asked with `-E -v`), `-idirafter`,
- the working directory for `-include` / `-imacros` names.

The order of the chain does not matter (the state of every candidate is recorded, not only the
earlier ones), so `#include_next`, `__has_include_next`, GCC dropping an `-I` that repeats a
system dir, and the relative order of CPATH and `-isystem` need no modelling. An absent path is
recorded as its first missing component (one lstat covers everything below it). Stdlib only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from .compile_args import Compile

ABSENT, FILE, OTHER = "-", "f", "o"
_INCLUDE_ENV = ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "OBJC_INCLUDE_PATH", "OBJCPLUS_INCLUDE_PATH")

_DIRECTIVE = re.compile(rb'^[ \t]*#[ \t]*(?:include|include_next|import)[ \t]*([<"])([^>"\r\n]*)[>"]', re.M)
_COMPUTED_DIRECTIVE = re.compile(rb'^[ \t]*#[ \t]*(?:include|include_next|import)[ \t]+[^<"\s]', re.M)
_HAS_INCLUDE = re.compile(rb'__has_include(?:_next)?\s*\(\s*([<"])([^>"\r\n]*)[>"]\s*\)')
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
    computed: bool  # an #include whose name a macro makes
    unseen: str | None  # why this file makes the compile uncacheable, if it does


def scan_directives(data: bytes) -> Directives:
    quoted: set[bytes] = set()
    angled: set[bytes] = set()
    for pattern in (_DIRECTIVE, _HAS_INCLUDE):
        for m in pattern.finditer(data):
            (quoted if m.group(1) == b'"' else angled).add(m.group(2))
    unseen = None
    if b"__has_include" in data and len(_HAS_INCLUDE_CALL.findall(data)) != len(_HAS_INCLUDE.findall(data)):
        unseen = "__has_include with a computed name in an input"
    for pattern, reason in _UNSEEN_READS:
        if unseen is None and pattern.search(data):
            unseen = reason
    return Directives(tuple(sorted(quoted)), tuple(sorted(angled)), bool(_COMPUTED_DIRECTIVE.search(data)), unseen)


def chain_dirs(c: Compile, cwd: str, env: dict[str, str], system_dirs: Iterable[str]) -> list[str]:
    """Every dir of the #include search chain of `c` (absolute, as the compiler spells them)."""
    dirs: list[str] = []
    for d in c.include_dirs:
        dirs.append(os.path.join(cwd, d))
    for name in _INCLUDE_ENV:
        value = env.get(name)
        if value is not None:
            dirs.extend(os.path.join(cwd, d or ".") for d in value.split(os.pathsep))
    dirs.extend(os.path.join(cwd, d) for d in system_dirs)
    return list(dict.fromkeys(dirs))


def _forms(path: str) -> set[str]:
    return {path, os.path.normpath(path), os.path.realpath(path)}


def _rels(path: str, dirs: list[tuple[str, set[str]]]) -> set[str]:
    """Every name under which `path` is reachable from one of `dirs`."""
    out = set()
    path_forms = _forms(path)
    for _, forms in dirs:
        for d in forms:
            prefix = d.rstrip("/") + "/"
            for p in path_forms:
                if p.startswith(prefix):
                    out.add(p[len(prefix):])
    return out


def state(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return OTHER if os.path.lexists(path) else ABSENT
    return FILE if os.path.stat.S_ISREG(st.st_mode) else OTHER


def _first_missing(path: str) -> str:
    """The shortest prefix of absent `path` that is itself absent."""
    parts = path.split("/")
    for i in range(2, len(parts) + 1):
        prefix = "/".join(parts[:i])
        if not os.path.lexists(prefix):
            return prefix
    return path


def snapshot(c: Compile, cwd: str, files: list[tuple[str, Directives]], chain: list[str],
             inputs: set[str]) -> dict[str, str]:
    """{path: state} of every place the search for the headers and probes of this compile could look.

    `files`: (absolute path as the compiler spelled it, its directives) of every file read, the source
    first. `inputs`: normalized paths of the hashed inputs (their content check already covers them)."""
    chain_forms = [(d, _forms(d)) for d in chain]
    names: set[str] = set()
    for path, _ in files[1:]:
        names |= _rels(path, chain_forms)
    for _, directives in files:
        names.update(n.decode("utf-8", "surrogateescape") for n in directives.quoted + directives.angled)
    names.update(n for n in c.forced_includes if not os.path.isabs(n))
    candidates: set[str] = set()
    for name in names:
        if os.path.isabs(name):
            candidates.add(name)
            continue
        candidates.update(os.path.join(d, name) for d in chain)
    # -include / -imacros: the working directory is searched first.
    candidates.update(os.path.join(cwd, n) for n in c.forced_includes if not os.path.isabs(n))
    for path, directives in files:
        here = os.path.dirname(path)
        # A file's own directory is searched for the names it quotes; when a macro names a header,
        # for any name at all.
        own = names if directives.computed else {n.decode("utf-8", "surrogateescape") for n in directives.quoted}
        candidates.update(os.path.join(here, n) for n in own if not os.path.isabs(n))
    out: dict[str, str] = {}
    for candidate in candidates:
        if os.path.normpath(candidate) in inputs:
            continue
        s = state(candidate)
        out[_first_missing(candidate) if s == ABSENT else candidate] = s
    return out


def holds(recorded: dict[str, str]) -> bool:
    """Does every recorded place still have the state it had?"""
    for path, expected in recorded.items():
        if expected == ABSENT:
            if os.path.lexists(path):
                return False
        elif state(path) != expected:
            return False
    return True
