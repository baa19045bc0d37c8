"""What the preprocessed text of a compile says about its output: path- or time-dependent?

Looking for the checkout path in the object misses what the compiler computed from it:
`sizeof(__FILE__)`, `L"" __FILE__`, a hash of `__FILE__`. Looking for `__DATE__`/`__TIME__` in
the sources misses `CAT(__TI, ME__)`. Both are visible in the preprocessed text, where every
macro has been expanded: a root path (or a relative path that leaves the working directory's
root) inside the text means the output depends on where the checkout is; a string shaped like
`__DATE__`, `__TIME__` or `__TIMESTAMP__` means it depends on when it was compiled. Line
markers (`# 1 "/ck/a.cc"`) are the compiler's bookkeeping and are left out. The preprocessor
runs once per stored compile (a miss), never on a hit: a stored entry's inputs fix the text.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from .keys import Prepared, Uncacheable

_LINE_MARKER = re.compile(rb"^#(?: \d+| line \d+)[^\n]*\n?", re.M)
_MONTH = rb"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
_DATE = re.compile(rb'"' + _MONTH + rb' [ 0-3]\d \d{4}"')
_TIME = re.compile(rb'"[0-2]\d:[0-5]\d:[0-6]\d"')
_TIMESTAMP = re.compile(rb'"(?:Sun|Mon|Tue|Wed|Thu|Fri|Sat) ' + _MONTH + rb' [ 0-3]\d [0-2]\d:[0-5]\d:[0-6]\d \d{4}"')
# Builtins the compiler (not the preprocessor) turns into the file's path.
_PATH_BUILTINS = (b"__builtin_FILE", b"__builtin_source_location")
# Options of the compile that a preprocess-only run must not repeat: it writes nothing.
_DROP = frozenset({"-c", "-MD", "-MP"})
_DROP_WITH_VALUE = frozenset({"-o", "-MF", "-MT", "-MQ"})


@dataclass(frozen=True)
class TextFacts:
    path_dependent: bool  # the output may carry the checkout path (or a length/hash of it)
    reason: str  # what was found, for the event log


def preprocess_argv(p: Prepared) -> list[str]:
    argv = [p.compile.argv[0]]
    args = p.compile.argv[1:]
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in _DROP_WITH_VALUE:
            i += 2
            continue
        if arg in _DROP or (arg[:3] in ("-MF", "-MT", "-MQ")) or (arg.startswith("-o") and len(arg) > 2):
            i += 1
            continue
        argv.append(arg)
        i += 1
    return [*argv, "-E", "-o", "-"]


def examine(p: Prepared, env: dict[str, str]) -> TextFacts:
    """Run the preprocessor of this compile and look at its text. Raises Uncacheable when the
    output depends on the time of the compile, or the preprocessor cannot be run."""
    try:
        done = subprocess.run(
            preprocess_argv(p), cwd=p.cwd, env=env, capture_output=True, timeout=300, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Uncacheable(f"preprocessor check failed: {e}") from None
    if done.returncode != 0:
        raise Uncacheable(f"preprocessor check exited {done.returncode}")
    return facts(_LINE_MARKER.sub(b"", done.stdout), p, bool(env.get("SOURCE_DATE_EPOCH")))


def facts(text: bytes, p: Prepared, fixed_epoch: bool) -> TextFacts:
    """The facts of preprocessed `text` (line markers already removed)."""
    if _TIMESTAMP.search(text):
        raise Uncacheable("a __TIMESTAMP__-like string in the preprocessed text")
    if not fixed_epoch and (_DATE.search(text) or _TIME.search(text)):
        raise Uncacheable("a __DATE__/__TIME__-like string in the preprocessed text (set SOURCE_DATE_EPOCH)")
    for builtin in _PATH_BUILTINS:
        if builtin in text:
            return TextFacts(True, builtin.decode())
    if p.roots and p.roots.normalize_bytes(text) != text:
        return TextFacts(True, "root path in the preprocessed text")
    for token in p.rewritten:
        if len(token) > 1 and token.encode() in text:
            return TextFacts(True, "relative path leaving its root in the preprocessed text")
    return TextFacts(False, "")
