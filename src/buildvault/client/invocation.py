"""Which build a compile or a step belongs to, and the RequestMetadata that says so.

The server's build pages group calls by `tool_invocation_id`. For buildvault-cc and `buildvault
run` the invocation is the build that ran them: `BUILDVAULT_INVOCATION_ID` when set (a CI job can
pass its own id), else the nearest ancestor process that is a build tool (ninja, make, cmake…),
named by its pid and start time, so every compile of one `cmake --build` shares one id and the
next build gets another. The target is the output file, the mnemonic `CppCompile` or the step's
name. Nothing here can fail a compile: what cannot be found is left empty.
"""

from __future__ import annotations

import contextvars
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from buildvault.history.metadata import metadata_header

__all__ = ["BUILD_TOOLS", "current_metadata", "invocation_id", "no_request_metadata", "request_metadata"]

BUILD_TOOLS = frozenset({"ninja", "make", "gmake", "cmake", "ctest", "scons", "meson", "samu"})
_NAMESPACE = uuid.UUID("6f1d2b7e-0c52-4b8e-9d1e-3e7b2a0c5f11")
_MAX_DEPTH = 24
_current: contextvars.ContextVar[tuple[str, bytes] | None] = contextvars.ContextVar(
    "buildvault_request_metadata", default=None
)
_version: list[str] = []


def _tool_version() -> str:
    if not _version:  # looked up once, on first use (importlib.metadata is slow to import)
        try:
            from importlib.metadata import version

            _version.append(version("buildvault"))
        except Exception:  # a bare checkout
            _version.append("dev")
    return _version[0]


def _stat(pid: int) -> tuple[str, int, str] | None:
    """(command name, parent pid, start time in clock ticks) of a process, from /proc."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    name_end = text.rfind(")")
    name = text[text.find("(") + 1 : name_end]
    fields = text[name_end + 2 :].split()
    if len(fields) < 20:
        return None
    return name, int(fields[1]), fields[19]


def invocation_id(env: dict[str, str], pid: int | None) -> str:
    """The build `pid` (the launcher) runs under: BUILDVAULT_INVOCATION_ID, else the nearest build
    tool among its ancestors; "" when neither is known."""
    given = env.get("BUILDVAULT_INVOCATION_ID", "").strip()
    if given:
        return given[:256]
    current = pid
    for _ in range(_MAX_DEPTH):
        if current is None or current <= 1:
            return ""
        stat = _stat(current)
        if stat is None:
            return ""
        name, parent, started = stat
        if name in BUILD_TOOLS and current != pid:
            return str(uuid.uuid5(_NAMESPACE, f"{_boot_id()}:{current}:{started}"))
        current = parent
    return ""


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


@contextmanager
def request_metadata(invocation: str, target: str, mnemonic: str, tool: str = "buildvault-cc") -> Iterator[None]:
    """Calls made inside carry this RequestMetadata (client/remote.py adds it to their metadata)."""
    header = metadata_header(tool=tool, tool_version=_tool_version(), invocation=invocation, target=target[:512],
                             mnemonic=mnemonic)  # fmt: skip
    token = _current.set(header)
    try:
        yield
    finally:
        _current.reset(token)


@contextmanager
def no_request_metadata() -> Iterator[None]:
    """Calls made inside carry no RequestMetadata (bookkeeping entries, not build steps)."""
    token = _current.set(None)
    try:
        yield
    finally:
        _current.reset(token)


def current_metadata() -> tuple[str, bytes] | None:
    """The RequestMetadata header of the calls being made now, if a `request_metadata` is open."""
    return _current.get()
