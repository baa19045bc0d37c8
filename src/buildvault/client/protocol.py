"""Launcher <-> agent wire format: 4-byte big-endian length + one marshal'ed dict.

Only builtin modules (marshal, _socket): the launcher starts once per compile and every
import costs milliseconds. Both ends run the same interpreter (the socket name includes
sys.executable), so marshal's version-specific format is fine; the socket lives in a 0700
directory, so only the same user can talk to the agent.

    launcher -> {"op": "compile", "argv", "cwd", "env"}
    agent    -> {"op": "bypass", "reason", "warning"?}            run the line untouched
             |  {"op": "hit", "exit", "stdout", "stderr", ...}     outputs already written
             |  {"op": "run", "argv", "token"}                     run this argv, capture, report:
    launcher -> {"op": "done", "token", "exit", "stdout", "stderr", "seconds", "started", "elapsed"}
    agent    -> {"status": "MISS", "reason", "agent_logs"?, "warning"?}
                (the agent reads the outputs now, uploads in the background, and then writes
                the compile's event-log line itself: "agent_logs")
    buildvault run (run/fast.py -> run/agent_step.py):
    front  -> {"op": "step", "spec": StepSpec fields, "env"}
    agent  -> {"op": "hit", "exit", "stdout", "stderr", "key", "event"}  outputs already restored
           |  {"op": "bypass", "reason": "remote-unavailable", "warning"}  run the command uncached
           |  {"op": "local", "reason"}                                  run the in-process path
    control: {"op": "ping"} -> {"op": "pong", "pid"}; {"op": "flush"} waits for uploads;
             {"op": "stop"} flushes and exits.
    buildvault-cc-native (native_launcher.c), which cannot read marshal:
    native -> {"op": "native-compile", "argv", "cwd", "env"}
    agent  -> plain_hit(...)  outputs already written, the event line written by the agent
           |  DECLINED        nothing done: the native launcher hands the compile to buildvault-cc

Both ends also write the event log (BUILDVAULT_EVENT_LOG), one JSON line per compile:
`append_line`.
"""

from __future__ import annotations

import _socket
import marshal
import os
import sys
import time

TYPE_CHECKING = False  # no `import typing` at run time: the launcher starts once per compile
if TYPE_CHECKING:
    from typing import Any

MAX_MESSAGE = 256 * 1024 * 1024
# The agent's code, relative to this directory: a change to any of these files gives the agent a
# new socket name (launcher.py) and so a new agent; buildvault-cc-native has the list compiled in.
AGENT_MODULES = ("agent.py", "hits.py", "store.py", "keys.py", "includes.py", "outputs.py", "toolchain.py",
                 "preprocessed.py", "compile_args.py", "remote.py", "roots.py",
                 "run/agent_step.py", "run/step.py", "run/key.py", "run/outputs.py", "run/tree.py", "run/spec.py")


def send(sock: _socket.socket, message: dict[str, Any]) -> None:
    data = marshal.dumps(message)
    sock.sendall(len(data).to_bytes(4, "big") + data)


def send_plain(sock: _socket.socket, body: bytes) -> None:
    """A reply to the native launcher: the same length prefix, a body of its own format."""
    sock.sendall(len(body).to_bytes(4, "big") + body)


DECLINED = b"D"


def plain_hit(exit_code: int, stdout: bytes, stderr: bytes, warning: str) -> bytes:
    """b"H", the exit code (4 bytes, signed), then stdout, stderr and a warning line (UTF-8),
    each as a 4-byte length and its bytes; every integer big-endian."""
    parts = [b"H", exit_code.to_bytes(4, "big", signed=True)]
    for field in (stdout, stderr, warning.encode()):
        parts += [len(field).to_bytes(4, "big"), field]
    return b"".join(parts)


def source_of(argv: list[str]) -> str | None:
    """The source file a compile line names, for the event log."""
    for arg in argv[1:]:
        if not arg.startswith("-") and os.path.splitext(arg)[1] in (".c", ".cc", ".cpp", ".cxx", ".C", ".c++", ".S"):
            return arg
    return None


def _recv_exact(sock: _socket.socket, n: int) -> bytes | None:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv(sock: _socket.socket) -> dict[str, Any] | None:
    header = _recv_exact(sock, 4)
    if header is None:
        return None
    n = int.from_bytes(header, "big")
    if n > MAX_MESSAGE:
        raise OSError("message too large")
    body = _recv_exact(sock, n)
    if body is None:
        return None
    try:
        message = marshal.loads(body)
    except (ValueError, EOFError, TypeError):
        raise OSError("malformed message") from None
    if not isinstance(message, dict):
        raise OSError("malformed message")
    return message


def agent_dir() -> str:
    base = os.environ.get("BUILDVAULT_AGENT_DIR")
    if base:
        return base
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "buildvault-cc")
    return f"/tmp/buildvault-cc-{os.getuid()}"


def append_line(path: str, line: str) -> None:
    """Append `line` to the event log at `path` in one write (O_APPEND: the lines of concurrent
    compiles stay whole). A log that cannot be written is left out: it never fails a compile."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass


# A warning of the cache path is printed at most this often across all processes of a build.
WARN_EVERY = 60.0


def warn_once(key: str, message: str) -> None:
    """Print `message` on stderr unless a warning of this `key` was printed in the last WARN_EVERY
    seconds by any process (a marker file in the agent directory): one warning per outage."""
    marker = os.path.join(agent_dir(), f"warned-{key}")
    try:
        if time.time() - os.stat(marker).st_mtime < WARN_EVERY:
            return
    except OSError:
        pass
    try:
        os.makedirs(os.path.dirname(marker), mode=0o700, exist_ok=True)
        with open(marker, "w"):
            pass
    except OSError:
        pass
    sys.stderr.write(message.rstrip("\n") + "\n")
    sys.stderr.flush()
