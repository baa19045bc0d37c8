"""Declared roots (source checkout, build directory): the path prefixes that a cache key abstracts.

Inside a key, a root path becomes the placeholder `@NAME_ROOT@` (in argv, environment and the
text of input files), and a file under a root lives in the action's input root at `NAME/rel`;
a file outside every root lives at `_abs/<absolute path>`, hashed byte-exact. Two checkouts of
the same tree at different paths therefore produce the same key. Stdlib only.
"""

from __future__ import annotations

import os
import re

OUTSIDE = "_abs"
# A root matches only where it is a whole path prefix: not preceded or followed by a path character.
_PATH_CHARS = r"A-Za-z0-9_.\-+~@"


def placeholder(name: str) -> str:
    return f"@{name}_ROOT@"


class Roots:
    """An ordered set of named roots. `Roots([])` is the byte-exact (path-dependent) mode."""

    def __init__(self, roots: list[tuple[str, str]]):
        self.named: list[tuple[str, str]] = []  # (name, primary path)
        variants: list[tuple[str, str]] = []  # (path form, name), including realpaths
        seen_names = set()
        for name, path in roots:
            if not path:
                continue
            path = os.path.normpath(os.path.abspath(path))
            if path == "/" or name in seen_names:
                continue
            seen_names.add(name)
            self.named.append((name, path))
            for form in {path, os.path.realpath(path)}:
                variants.append((form, name))
        variants.sort(key=lambda v: len(v[0]), reverse=True)
        self.variants = variants
        self.key = tuple(self.named)
        self._by_name = dict(self.named)
        if variants:
            alternation = "|".join(re.escape(form) for form, _ in variants)
            self._text = re.compile(rf"(?<![{_PATH_CHARS}/])({alternation})(?![{_PATH_CHARS}])")
            self._bytes = re.compile(self._text.pattern.encode())
            self._lookup = {form: name for form, name in variants}
            self._lookup_b = {form.encode(): name for form, name in variants}
        holders = "|".join(re.escape(placeholder(name)) for name, _ in self.named) or r"(?!x)x"
        self._holders = re.compile(holders)
        self._holders_b = re.compile(holders.encode())

    def __bool__(self) -> bool:
        return bool(self.named)

    # -- text ---------------------------------------------------------------------------------
    def normalize(self, text: str) -> str:
        if not self.variants or "/" not in text:
            return text
        return self._text.sub(lambda m: placeholder(self._lookup[m.group(1)]), text)

    def normalize_bytes(self, data: bytes) -> bytes:
        if not self.variants:
            return data
        return self._bytes.sub(lambda m: placeholder(self._lookup_b[m.group(1)]).encode(), data)

    def denormalize(self, text: str) -> str:
        if not self.named or "@" not in text:
            return text
        return self._holders.sub(lambda m: self._by_name[m.group(0)[1:-6]], text)

    def denormalize_bytes(self, data: bytes) -> bytes:
        if not self.named:
            return data
        return self._holders_b.sub(lambda m: self._by_name[m.group(0)[1:-6].decode()].encode(), data)

    def mentions(self, data: bytes) -> bool:
        """Does `data` contain any root path (any form)?"""
        return any(form.encode() in data for form, _ in self.variants)

    # -- paths --------------------------------------------------------------------------------
    def locate(self, path: str) -> tuple[str, str] | None:
        """(name, relative path) of the innermost root holding absolute `path`, or None."""
        for form, name in self.variants:
            if path == form:
                return name, ""
            if path.startswith(form) and path[len(form)] == "/":
                return name, path[len(form) + 1 :]
        return None

    def layout(self, path: str) -> str:
        """Where absolute `path` lives in the action's input root."""
        where = self.locate(path)
        if where is None:
            return f"{OUTSIDE}{path}" if path != "/" else OUTSIDE
        name, rel = where
        return f"{name}/{rel}" if rel else name

    def from_layout(self, layout: str) -> str:
        """The absolute path of a layout path in this checkout."""
        head, _, rel = layout.partition("/")
        if head == OUTSIDE:
            return "/" + rel
        base = self._by_name[head]
        return os.path.join(base, rel) if rel else base

    def path_token(self, path: str) -> str:
        """An absolute path as it appears in a normalized command line."""
        where = self.locate(path)
        if where is None:
            return path
        name, rel = where
        return placeholder(name) + ("/" + rel if rel else "")


def parse_roots(spec: str) -> list[tuple[str, str]]:
    """`BUILDVAULT_ROOTS`: `path` or `NAME=path` entries separated by ':' or ','."""
    out = []
    for i, item in enumerate(p for p in re.split(r"[:,]", spec) if p.strip()):
        item = item.strip()
        name, sep, path = item.partition("=")
        if not sep:
            name, path = f"R{i}", item
        name = re.sub(r"[^A-Za-z0-9_]", "_", name).upper() or f"R{i}"
        out.append((name, path))
    return out


def find_cmake_roots(cwd: str) -> tuple[str | None, str | None]:
    """(source dir, build dir) of the CMake build tree holding `cwd`, from its CMakeCache.txt."""
    d = cwd
    while True:
        cache = os.path.join(d, "CMakeCache.txt")
        if os.path.isfile(cache):
            source = None
            try:
                with open(cache, encoding="utf-8", errors="replace") as f:
                    for line in f:
                        if line.startswith("CMAKE_HOME_DIRECTORY:"):
                            source = line.split("=", 1)[1].strip()
                            break
            except OSError:
                pass
            return source, d
        parent = os.path.dirname(d)
        if parent == d:
            return None, None
        d = parent
