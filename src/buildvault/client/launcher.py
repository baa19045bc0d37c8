"""`buildvault-cc`: the compiler launcher. Stdlib-only imports: it runs once per compile.

    buildvault-cc COMPILER ARGS...     compile through the cache (CMake: *_COMPILER_LAUNCHER)
    buildvault-cc --summary LOG...     hits, misses, bypasses and time saved from event logs
    buildvault-cc --stop-agent         stop this configuration's local agent
    buildvault-cc --agent-status       is the agent running? (pid)
    buildvault-cc --flush              wait until the agent's background uploads are done
    buildvault-cc --install-fast [DIR] write DIR/buildvault-cc-fast (default: beside this command)
                                       and print its path: the same launcher started with
                                       `python -IS` (no site, no `import re` from the pip
                                       wrapper): ~10 ms less start-up per compile.
    buildvault-cc --install-native [DIR]
                                       compile DIR/buildvault-cc-native (C, needs cc) and print
                                       its path: a hit without a Python start-up; anything else
                                       it hands to this launcher (native_build.py)

All the work happens in a long-lived local agent (agent.py) reached over a unix socket and
started on demand; this process only forwards the command line, runs the real compiler on a
miss, and replays the result on a hit. Any failure to reach the agent runs the compiler
untouched (fail-open) with one warning.

Environment:
    BUILDVAULT_REMOTE     grpc://host:port or grpcs://host:port of any REAPI v2 cache (unset: run the
                          compiler untouched)
    BUILDVAULT_TOKEN      bearer token sent to the cache (or BUILDVAULT_TOKEN_FILE: a file holding it)
    BUILDVAULT_TLS_CA     PEM CA file that signs a grpcs:// server's certificate (default: system roots)
    BUILDVAULT_INSTANCE   REAPI instance name
    BUILDVAULT_WRITER     1: upload results on a miss (else read-only)
    BUILDVAULT_PLATFORM   e.g. "soc=ascend910b1,cann=8.0.RC3" (a property joins the key of the
                          compiles that mention its value; "name=value!" joins every key)
    BUILDVAULT_ROOTS      declared roots "SRC=/checkout,BUILD=/checkout/build" (default: CMake's
                          source dir and build dir, else the working directory)
    BUILDVAULT_EVENT_LOG  append one JSON line per compile here
    BUILDVAULT_TIMEOUT    seconds per remote call (default 3)
    BUILDVAULT_AGENT_DIR  where agent sockets live (default $XDG_RUNTIME_DIR/buildvault-cc or /tmp/buildvault-cc-UID)
"""

from __future__ import annotations

import _socket  # the C module: `socket` would import enum, selectors, ... (~10 ms per compile)
import os
import sys
import time

from . import protocol

TYPE_CHECKING = False  # no `import typing` at run time
if TYPE_CHECKING:
    from typing import Any

def _fnv1a(data: bytes) -> int:
    h = 0x811C9DC5
    for b in data:
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def _socket_path() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    code = 0
    for module in protocol.AGENT_MODULES:  # new agent code gets a new agent
        try:  # noqa: SIM105 - contextlib would be one more import per compile
            code ^= os.stat(os.path.join(here, module)).st_mtime_ns
        except OSError:
            pass
    config = "\0".join(
        [
            os.environ.get("BUILDVAULT_REMOTE", ""),
            os.environ.get("BUILDVAULT_INSTANCE", ""),
            os.environ.get("BUILDVAULT_WRITER", ""),
            os.environ.get("BUILDVAULT_TIMEOUT", ""),
            # auth (issue 11): another credential or CA is another agent
            os.environ.get("BUILDVAULT_TOKEN", ""),
            os.environ.get("BUILDVAULT_TOKEN_FILE", ""),
            os.environ.get("BUILDVAULT_TLS_CA", ""),
            sys.executable,
            str(code),
        ]
    )
    tag = f"{_fnv1a(config.encode()):08x}"
    return os.path.join(protocol.agent_dir(), f"agent-{tag}.sock")


def _connect(path: str) -> _socket.socket | None:
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        s.connect(path)
        return s
    except OSError:
        s.close()
        return None


def _spawn_agent(path: str) -> None:
    """Start the agent unless another launcher just did (a -j64 build starts 64 launchers at once)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    marker = path + ".starting"
    try:
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        try:
            if time.time() - os.stat(marker).st_mtime < 20:
                return
            os.unlink(marker)
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError:
            return
    except OSError:
        pass
    log = os.path.join(directory, "agent.log")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.setsid()
            os.chdir("/")  # never pin (or depend on) the build directory of the first compile
            if os.fork():
                os._exit(0)
            null = os.open(os.devnull, os.O_RDONLY)
            out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(null, 0)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.closerange(3, 4096)  # never hold the build tool's pipes or jobserver open
            os.execv(sys.executable, [sys.executable, "-m", "buildvault.client.agent", "--socket", path])
        finally:
            os._exit(127)
    os.waitpid(pid, 0)


def _private(directory: str) -> bool:
    """The agent directory must be ours and closed to others (the socket accepts compiles)."""
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        return True  # created 0700 on spawn
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o077


def connect_agent(spawn: bool = True) -> _socket.socket | None:
    path = _socket_path()
    if not _private(os.path.dirname(path)):
        return None
    s = _connect(path)
    if s is not None or not spawn:
        return s
    _spawn_agent(path)
    deadline = time.monotonic() + float(os.environ.get("BUILDVAULT_AGENT_START_TIMEOUT", "10"))
    delay = 0.01
    while time.monotonic() < deadline:
        time.sleep(delay)
        delay = min(delay * 1.5, 0.1)
        s = _connect(path)
        if s is not None:
            return s
    return None


def _warn(message: str) -> None:
    sys.stderr.write(message.rstrip("\n") + "\n")
    sys.stderr.flush()


def run(argv: list[str]) -> int:
    """Run the compiler with our stdio; its exit code (128+N for a signal)."""
    try:
        pid = os.posix_spawnp(argv[0], argv, os.environ)
    except OSError as e:
        _warn(f"buildvault-cc: cannot run {argv[0]}: {e}")
        return 127
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def run_captured(argv: list[str]) -> tuple[int, bytes, bytes, float, float]:
    """Run the compiler with stdout/stderr captured (to replay on later hits) and echoed."""
    directory = protocol.agent_dir()
    fds = []
    for stream in ("out", "err"):
        name = os.path.join(directory, "tmp", f"{os.getpid()}.{stream}")
        os.makedirs(os.path.dirname(name), mode=0o700, exist_ok=True)
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.unlink(name)
        fds.append(fd)
    start = time.monotonic()
    started = time.time()
    try:
        try:
            pid = os.posix_spawnp(
                argv[0], argv, os.environ,
                file_actions=[(os.POSIX_SPAWN_DUP2, fds[0], 1), (os.POSIX_SPAWN_DUP2, fds[1], 2)],
            )
        except OSError as e:
            _warn(f"buildvault-cc: cannot run {argv[0]}: {e}")
            return 127, b"", b"", 0.0, started
        _, status = os.waitpid(pid, 0)
        seconds = time.monotonic() - start
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            code = 128 - code
        captured = []
        for fd in fds:
            os.lseek(fd, 0, os.SEEK_SET)
            chunks = []
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
            captured.append(b"".join(chunks))
    finally:
        for fd in fds:
            os.close(fd)
    _echo(captured[0], captured[1])
    return code, captured[0], captured[1], seconds, started


def _echo(out: bytes, err: bytes) -> None:
    if out:
        sys.stdout.flush()
        os.write(1, out)
    if err:
        sys.stderr.flush()
        os.write(2, err)


def _json(value: object) -> str:
    """Minimal JSON for the event log (json would cost an import of re/enum per compile)."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ",".join(_json(str(k)) + ":" + _json(v) for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_json(v) for v in value) + "]"
    out = ['"']
    for ch in str(value):
        code = ord(ch)
        if ch == '"' or ch == "\\":
            out.append("\\" + ch)
        elif code < 0x20 or 0xD800 <= code <= 0xDFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _log(event: dict[str, Any]) -> None:
    path = os.environ.get("BUILDVAULT_EVENT_LOG")
    if not path:
        return
    event["ts"] = round(time.time(), 3)
    line = _json(event) + "\n"
    protocol.append_line(path, line)


def compile_through_cache(argv: list[str], state: dict[str, bool] | None = None) -> int:
    state = {} if state is None else state
    start = time.monotonic()
    event: dict[str, Any] = {"status": "BYPASS", "reason": "", "action": None, "outputs": 0,
                             "source": protocol.source_of(argv), "cwd": os.getcwd()}

    def finish(code: int) -> int:
        event["seconds"] = round(time.monotonic() - start, 4)
        event["exit"] = code
        _log(event)
        return code

    if not _private(protocol.agent_dir()):
        _warn(f"buildvault-cc: {protocol.agent_dir()} is not a private directory of this user; compiling locally "
              "(set BUILDVAULT_AGENT_DIR)")
        event["reason"] = "agent-dir-not-private"
        state["ran"] = True
        return finish(run(argv))
    sock = connect_agent(spawn=False)
    if sock is None:
        # Start the agent and wait for it: the cache may hold this compile (never compile what
        # the fleet already compiled) -- unless it failed to start a moment ago.
        try:
            marker = os.path.join(protocol.agent_dir(), "warned-agent")
            broken = time.time() - os.stat(marker).st_mtime < protocol.WARN_EVERY
        except OSError:
            broken = False
        sock = None if broken else connect_agent(spawn=True)
    if sock is None:
        protocol.warn_once("agent", "buildvault-cc: local agent unavailable; compiling locally (see agent.log in "
                   f"{protocol.agent_dir()})")
        event["reason"] = "agent-unavailable"
        state["ran"] = True
        return finish(run(argv))
    try:
        try:
            protocol.send(sock, {"op": "compile", "argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)})
            reply = protocol.recv(sock)
        except (OSError, ValueError):
            reply = None
        if reply is None:
            protocol.warn_once("agent", "buildvault-cc: local agent failed; compiling locally")
            event["reason"] = "agent-failed"
            state["ran"] = True
            return finish(run(argv))
        if reply.get("warning"):
            _warn(reply["warning"])
        op = reply.get("op")
        if op == "hit":
            _echo(reply["stdout"], reply["stderr"])
            event.update(status="HIT", reason="hit", action=reply.get("digest"), outputs=reply.get("outputs", 0))
            event["saved"] = round(max(0.0, reply.get("compile_seconds", 0.0) - (time.monotonic() - start)), 4)
            return finish(int(reply["exit"]))
        if op == "run":
            state["ran"] = True
            code, out, err, seconds, started = run_captured(reply["argv"])
            event["status"] = "MISS"
            try:
                protocol.send(sock, {"op": "done", "token": reply["token"], "exit": code, "stdout": out,
                                     "stderr": err, "seconds": seconds, "started": started,
                                     "elapsed": time.monotonic() - start})
                result = protocol.recv(sock) or {"reason": "agent-failed", "rerun": True}
            except (OSError, ValueError):
                result = {"reason": "agent-failed", "rerun": True}
            if result.get("warning"):
                _warn(result["warning"])
            if result.get("rerun"):
                # The outputs went to private temp paths the agent did not move into place: run the
                # compile untouched instead (the output path changed kind, or the agent failed).
                event.update(status="BYPASS", reason=result.get("reason", "agent-failed"))
                return finish(run(argv))
            if result.get("agent_logs"):
                return code  # the agent logs this compile once its upload finishes
            event.update(reason=result.get("reason", ""), action=result.get("digest"), outputs=result.get("outputs", 0))
            event["compile_seconds"] = round(seconds, 4)
            return finish(code)
        event["reason"] = reply.get("reason", "bypass")
    finally:
        sock.close()
    state["ran"] = True
    return finish(run(argv))


def _control(op: str) -> int:
    sock = connect_agent(spawn=False)
    if sock is None:
        print("no agent running")
        return 1 if op == "ping" else 0
    try:
        protocol.send(sock, {"op": op})
        reply = protocol.recv(sock)
    finally:
        sock.close()
    print(_json(reply))
    return 0


def install_fast(directory: str | None) -> int:
    from .fast_script import install

    entry = "from buildvault.client.launcher import main\nsys.exit(main())"
    return install("buildvault-cc-fast", "buildvault-cc --install-fast", entry, directory)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    if args[0] == "--summary":
        from .summary import main as summary_main

        return summary_main(args[1:])
    if args[0] == "--stop-agent":
        return _control("stop")
    if args[0] == "--agent-status":
        return _control("ping")
    if args[0] == "--flush":
        return _control("flush")
    if args[0] == "--install-fast":
        return install_fast(args[1] if len(args) > 1 else None)
    if args[0] == "--install-native":
        from .native_build import install as install_native

        return install_native(args[1] if len(args) > 1 else None)
    if args[0] == "--agent":
        from .agent import main as agent_main

        return agent_main(args[1:])
    if not os.environ.get("BUILDVAULT_REMOTE") or os.environ.get("BUILDVAULT_DISABLE") in ("1", "true"):
        try:
            os.execvp(args[0], args)
        except OSError as e:
            _warn(f"buildvault-cc: cannot run {args[0]}: {e}")
            return 127
    state = {"ran": False}
    try:
        return compile_through_cache(args, state)
    except Exception as e:  # a launcher bug must never break a build
        if state["ran"]:
            raise
        _warn(f"buildvault-cc: internal error ({type(e).__name__}: {e}); compiling locally")
        return run(args)


if __name__ == "__main__":
    sys.exit(main())
