"""The long-lived local agent behind `buildvault-cc`.

One agent per (remote, instance, writer) configuration and user, started on demand by the
launcher and listening on a unix socket. It keeps the gRPC channel, the file-hash cache
(inode/size/mtime/ctime), compiler identities and direct-mode manifests warm, so that a hit
costs a few stat() calls and three small RPCs instead of a Python+gRPC start-up and a
preprocessor run.

Per compile (see protocol.py for the wire format):
  check:    the line is one cacheable compile (compile_args.py) whose outputs are plain file paths
            (outputs.py); anything else is a BYPASS: the launcher runs it untouched.
  lookup:   hits.py: manifest -> an entry whose inputs hash as recorded and whose include-search
            candidates are as recorded -> GetActionResult -> outputs written => HIT
  miss:     the launcher runs the compiler with every output on a private temp path (and -MD -MF
            tmp when the user asked for no dependency file); the agent reads those bytes, moves them
            into place, and then (in the background; --flush waits) store.py uploads the inputs,
            the Action, the outputs and the manifest entry. Inputs modified during the compile,
            and compiles whose output depends on the time of day or on files the launcher cannot
            see, are not stored (a BYPASS line in the event log says why).
Any remote failure makes the compile local (fail-open) with one warning per outage.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import socket
import socketserver
import struct
import sys
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from buildvault.digest import Digest

from . import protocol
from .compile_args import Bypass, Compile, classify
from .hits import HitFinder, check_time_macros
from .invocation import invocation_id, request_metadata
from .keys import FileHasher, Prepared, Uncacheable, parse_platform, prepare
from .outputs import OutputChanged, discard, move_into_place, private_argv, read_temps, unusable
from .remote import PermissionDenied, Remote, RemoteError
from .roots import Roots, find_cmake_roots, parse_roots
from .store import StoreJob, Storer
from .toolchain import CompilerIdentity

RETRY_SECONDS = float(os.environ.get("BUILDVAULT_RETRY_SECONDS", "10"))
DEBUG = os.environ.get("BUILDVAULT_DEBUG", "") not in ("", "0")
Reply = dict[str, Any]


@dataclass
class _Pending:
    """A miss the launcher is running: where its outputs go, and what is needed to store it."""

    p: Prepared
    temps: dict[str, str]  # final path -> private temp path
    depfile: str  # where the dependency list will be
    created: float
    env: dict[str, str]
    invocation: str = ""  # the build it belongs to (invocation.py)


class Agent:
    def __init__(self, remote_url: str, instance: str, writer: bool, timeout: float, tmpdir: str) -> None:
        self.remote = Remote(remote_url, instance, timeout=timeout, upload_timeout=max(timeout * 4, 20.0))
        self.writer = writer
        self.configured_writer = writer
        self.denied_token = -1  # the token generation a write was refused to
        self.tmpdir = tmpdir
        self.hasher = FileHasher()
        self.compilers = CompilerIdentity()
        self.hits = HitFinder(self.remote, self.hasher)
        self.storer = Storer(self.remote, self.hasher, self.hits, self.compilers)
        self.sync_store = os.environ.get("BUILDVAULT_SYNC_UPLOAD", "") not in ("", "0")
        self.store_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="store")
        self.inflight = 0
        self.pending_warning: str | None = None
        self.pending: dict[str, _Pending] = {}
        self.down_until = 0.0
        self.warned = False
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.last_activity = time.monotonic()
        self._cmake_cache: dict[str, tuple[str | None, int | None, str | None, str | None]] = {}

    # -- health ------------------------------------------------------------------------------
    def _failed(self, error: Exception) -> str | None:
        with self.lock:
            self.down_until = time.monotonic() + RETRY_SECONDS
            if self.warned:
                return None
            self.warned = True
        return f"buildvault-cc: remote cache unavailable ({error}); compiling locally"

    def _denied(self, error: Exception) -> str | None:
        with self.lock:
            was_writer, self.writer = self.writer, False
            self.denied_token = self.remote.tokens.generation
        if not was_writer:
            return None
        return f"buildvault-cc: the remote cache refused an upload ({error}); compiling without uploading"

    def _new_token(self) -> None:
        """The token file changed (a CI token was renewed): read it now, and forget a refusal or an
        outage the old token met, so the next compile uses the cache and uploads again."""
        try:
            self.remote.tokens.metadata()
        except RemoteError:
            return
        with self.lock:
            self.down_until = 0.0
            if self.configured_writer and self.denied_token != self.remote.tokens.generation:
                self.writer = True

    def _ok(self) -> None:
        if self.warned:
            with self.lock:
                self.warned = False

    # -- configuration per request -------------------------------------------------------------
    def roots_for(self, cwd: str, env: dict[str, str]) -> Roots:
        spec = env.get("BUILDVAULT_ROOTS", "").strip()
        if spec:
            return Roots(parse_roots(spec))
        cached = self._cmake_cache.get(cwd)
        if cached is not None and cached[0] and _mtime(cached[0]) == cached[1]:
            source, build = cached[2], cached[3]
        else:
            source, build = find_cmake_roots(cwd)
            cache_file = os.path.join(build, "CMakeCache.txt") if build else None
            self._cmake_cache[cwd] = (cache_file, _mtime(cache_file), source, build)
        roots = []
        if source:
            roots.append(("SRC", source))
        roots.append(("BUILD", build or cwd))
        return Roots(roots)

    def prepare(self, c: Compile, cwd: str, env: dict[str, str]) -> Prepared:
        compiler = self.compilers.resolve(c.argv[0], cwd, env)
        ident = self.compilers.identity(compiler, env)
        spec = parse_platform(env.get("BUILDVAULT_PLATFORM", ""))
        return prepare(c, cwd, env, self.roots_for(cwd, env), ident, spec, compiler)

    # -- the two halves of a compile -------------------------------------------------------------
    def handle_compile(self, req: Reply, lookup_only: bool = False) -> Reply:
        """A hit (outputs restored), a bypass, or a run of the compiler for the launcher; with
        `lookup_only` a miss is {"op": "miss"} and nothing of it is kept."""
        argv, cwd, env = req["argv"], req["cwd"], req["env"]
        extra = tuple(f for f in env.get("BUILDVAULT_SAFE_FLAGS", "").split(",") if f)
        c = classify(argv, env, extra)
        if isinstance(c, Bypass):
            return {"op": "bypass", "reason": c.reason}
        if self.remote.tokens.changed():
            self._new_token()
        if time.monotonic() < self.down_until:
            return {"op": "bypass", "reason": "remote-unavailable"}
        t0 = time.perf_counter()
        try:
            p = self.prepare(c, cwd, env)
            for path, _ in p.outputs:
                reason = unusable(path)
                if reason:
                    return {"op": "bypass", "reason": f"{reason}: {path}"}
            info = self.hasher.info(p.source_abs, p.roots)
            check_time_macros(info.time_macros, info.timestamp_macro, env)
            if info.directives.unseen:
                raise Uncacheable(info.directives.unseen)
            invocation = invocation_id(env, req.get("peer_pid"))
            with request_metadata(invocation, _target(p), "CppCompile"):
                hit = self.hits.lookup(p, env)
        except Uncacheable as e:
            return {"op": "bypass", "reason": f"uncacheable: {e}"}
        except OutputChanged as e:
            return {"op": "bypass", "reason": f"output-changed: {e}"}
        except RemoteError as e:
            return {"op": "bypass", "reason": "remote-error", "warning": self._failed(e)}
        except OSError as e:
            return {"op": "bypass", "reason": f"error: {e}"}
        self._ok()
        if DEBUG:
            print(f"lookup {p.source_abs}: compiler={p.compiler_id[:12]} hit={hit is not None} "
                  f"{time.perf_counter() - t0:.3f}s", file=sys.stderr, flush=True)
        if hit is not None:
            return hit
        if lookup_only:
            return {"op": "miss"}
        token = uuid.uuid4().hex
        exec_argv, temps, depfile = private_argv(c, p.outputs, token, self.tmpdir)
        with self.lock:
            self.pending[token] = _Pending(p, temps, depfile, time.time(), env, invocation)
        return {"op": "run", "argv": exec_argv, "token": token}

    def handle_native(self, req: Reply) -> bytes:
        """A compile from buildvault-cc-native (native_launcher.c): a hit is restored, logged here
        (that launcher writes no event log) and answered in protocol.plain_hit; anything else is
        declined with nothing kept, and the launcher hands the compile to buildvault-cc, which
        asks again and takes the usual path."""
        start = time.monotonic()
        reply = self.handle_compile(req, lookup_only=True)
        if reply.get("op") != "hit":
            return protocol.DECLINED
        warning = (reply.get("warning") or self._take_warning() or "").rstrip("\n")
        _log_hit(req, reply, time.monotonic() - start)
        return protocol.plain_hit(int(reply["exit"]), reply["stdout"], reply["stderr"], warning)

    def handle_step(self, req: Reply) -> Reply:
        """A `buildvault run` step: restored here on a hit, else handed back (run/agent_step.py)."""
        from .run.agent_step import lookup_step  # only agents that serve `buildvault run` load it

        return lookup_step(req, self.remote, self.hasher)

    def handle_done(self, req: Reply) -> Reply:
        with self.lock:
            pending = self.pending.pop(req["token"], None)
        if pending is None:
            return {"status": "MISS", "reason": "unknown-token", "rerun": True}
        own_depfile = pending.depfile not in pending.temps.values()
        try:
            return self._finish(pending, req)
        finally:
            discard(pending.temps)  # whatever was not moved into place
            if own_depfile:
                _unlink(pending.depfile)

    def _finish(self, pending: _Pending, req: Reply) -> Reply:
        p = pending.p
        try:
            written = read_temps(pending.temps) if req["exit"] == 0 and self.writer else {}
            move_into_place(pending.temps)
        except OutputChanged as e:
            # The output path stopped being a plain file path: let the compiler write it itself.
            return {"status": "BYPASS", "reason": f"output-changed: {e}", "rerun": True}
        except OSError as e:
            return {"status": "BYPASS", "reason": f"outputs-unreadable: {e}", "rerun": True}
        if req["exit"] != 0:
            return {"status": "MISS", "reason": "compile-failed"}
        if not self.writer:
            return {"status": "MISS", "reason": "read-only"}
        try:
            if pending.depfile in pending.temps.values():
                final = next(f for f, t in pending.temps.items() if t == pending.depfile)
                dep_bytes = written[final]
            else:
                with open(pending.depfile, "rb") as f:
                    dep_bytes = f.read()
        except OSError as e:
            return {"status": "MISS", "reason": f"not-stored: {e}"}
        job = StoreJob(p, pending.env, dep_bytes.decode("utf-8", "surrogateescape"),
                       [(path, kind, written[path]) for path, kind in p.outputs], req["stdout"], req["stderr"],
                       float(req.get("seconds", 0.0)), float(req.get("started", 0.0)), pending.invocation)
        if self.sync_store:
            return self._store_job(job)
        mkey = self.hits.manifest_key(p).digest
        with self.lock:
            self.inflight += 1
            self.hits.storing[mkey] = self.hits.storing.get(mkey) or threading.Event()
        self.store_pool.submit(self._store_background, job, req, mkey)
        return {"status": "MISS", "reason": "storing", "agent_logs": True, "warning": self._take_warning()}

    def _store_background(self, job: StoreJob, req: Reply, mkey: Digest) -> None:
        try:
            reply = self._store_job(job)
            if reply.get("warning"):
                with self.lock:
                    self.pending_warning = reply["warning"]
            _log_event(job.env, job.p, req, reply)
        except Exception:
            traceback.print_exc()
        finally:
            with self.lock:
                self.inflight -= 1
                event = self.hits.storing.pop(mkey, None)
                self.idle.notify_all()
            if event is not None:
                event.set()

    def _take_warning(self) -> str | None:
        with self.lock:
            warning, self.pending_warning = self.pending_warning, None
        return warning

    def _store_job(self, job: StoreJob) -> Reply:
        try:
            t0 = time.perf_counter()
            with request_metadata(job.invocation, _target(job.p), "CppCompile"):
                stored = self.storer.store(job)
        except Uncacheable as e:
            return {"status": "BYPASS", "reason": f"uncacheable: {e}"}
        except PermissionDenied as e:
            # A read-only credential: keep reading, never try to upload again.
            return {"status": "MISS", "reason": "not-permitted", "warning": self._denied(e)}
        except RemoteError as e:
            return {"status": "MISS", "reason": "upload-failed", "warning": self._failed(e)}
        except OSError as e:
            return {"status": "MISS", "reason": f"not-stored: {e}"}
        self._ok()
        if DEBUG:
            print(f"store {job.p.source_abs}: {time.perf_counter() - t0:.3f}s", file=sys.stderr, flush=True)
        return {"status": "MISS", "reason": "stored-exact" if stored.exact else "stored", "digest": str(stored.digest),
                "outputs": stored.outputs}

    def flush(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        with self.lock:
            while self.inflight and time.monotonic() < deadline:
                self.idle.wait(0.5)


def _target(p: Prepared) -> str:
    """A compile's target in the server's history: its object file, as the key names it."""
    for path, kind in p.outputs:
        if kind == "obj":
            return p.roots.layout(path)
    return p.roots.layout(p.outputs[0][0]) if p.outputs else ""


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _log_event(env: dict[str, str], p: Prepared, req: Reply, reply: Reply) -> None:
    """The event line of a MISS whose upload finished in the background (see launcher._log)."""
    path = env.get("BUILDVAULT_EVENT_LOG")
    if not path:
        return
    event = {
        "status": reply.get("status", "MISS"),
        "reason": reply.get("reason", ""),
        "action": reply.get("digest"),
        "outputs": reply.get("outputs", 0),
        "source": p.compile.source,
        "cwd": p.cwd,
        "compile_seconds": round(float(req.get("seconds", 0.0)), 4),
        "seconds": round(float(req.get("elapsed", 0.0)), 4),
        "exit": req.get("exit", 0),
        "ts": round(time.time(), 3),
    }
    line = json.dumps(event, separators=(",", ":")) + "\n"
    protocol.append_line(path, line)


def _log_hit(req: Reply, reply: Reply, seconds: float) -> None:
    """The event line of a native launcher's hit: launcher._log's fields, timed from the request."""
    path = req["env"].get("BUILDVAULT_EVENT_LOG")
    if not path:
        return
    event = {
        "status": "HIT",
        "reason": "hit",
        "action": reply.get("digest"),
        "outputs": reply.get("outputs", 0),
        "source": protocol.source_of(req["argv"]),
        "cwd": req["cwd"],
        "saved": round(max(0.0, float(reply.get("compile_seconds", 0.0)) - seconds), 4),
        "seconds": round(seconds, 4),
        "exit": reply["exit"],
        "via": "native",
        "ts": round(time.time(), 3),
    }
    protocol.append_line(path, json.dumps(event, separators=(",", ":")) + "\n")


def _alive(socket_path: str) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            s.connect(socket_path)
            protocol.send(s, {"op": "ping"})
            return protocol.recv(s) is not None
    except OSError:
        return False


def _mtime(path: str | None) -> int | None:
    try:
        return os.stat(path).st_mtime_ns if path else None
    except OSError:
        return None


def _peer_pid(sock: socket.socket) -> int | None:
    """The connected launcher's pid (SO_PEERCRED), to find the build it runs under."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return int(struct.unpack("3i", creds)[0])
    except (OSError, AttributeError, struct.error):
        return None


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        agent: Agent = self.server.agent  # type: ignore[attr-defined]
        sock = self.request
        peer = _peer_pid(sock)
        try:
            while True:
                req = protocol.recv(sock)
                if req is None:
                    return
                req["peer_pid"] = peer
                agent.last_activity = time.monotonic()
                op = req.get("op")
                try:
                    if op == "compile":
                        reply = agent.handle_compile(req)
                        if not reply.get("warning"):
                            reply["warning"] = agent._take_warning()  # from a background upload
                    elif op == "native-compile":
                        protocol.send_plain(sock, agent.handle_native(req))
                        agent.last_activity = time.monotonic()
                        continue
                    elif op == "done":
                        reply = agent.handle_done(req)
                    elif op == "step":  # `buildvault run` (run/fast.py)
                        reply = agent.handle_step(req)
                    elif op == "flush":
                        agent.flush()
                        reply = {"op": "flushed"}
                    elif op == "ping":
                        reply = {"op": "pong", "pid": os.getpid()}
                    elif op == "stop":
                        agent.flush()
                        # Give the socket and its lock up now: the next compile starts a new agent
                        # instead of reaching this one while it shuts down.
                        self.server.gave_up = True  # type: ignore[attr-defined]
                        _unlink(self.server.socket_path)  # type: ignore[attr-defined]
                        os.close(self.server.lock_fd)  # type: ignore[attr-defined]
                        protocol.send(sock, {"op": "stopping"})
                        threading.Thread(target=self.server.shutdown, daemon=True).start()
                        return
                    else:
                        reply = {"op": "bypass", "reason": f"unknown-op:{op}"}
                except Exception as e:  # never let a bug break a build: compile locally
                    traceback.print_exc()
                    reply = {"op": "bypass", "status": "MISS", "reason": f"agent-error: {type(e).__name__}: {e}"}
                protocol.send(sock, reply)
                agent.last_activity = time.monotonic()
        except OSError:
            return


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    request_queue_size = 128


def serve(socket_path: str, idle: float) -> int:
    remote = os.environ.get("BUILDVAULT_REMOTE", "")
    instance = os.environ.get("BUILDVAULT_INSTANCE", "")
    writer = os.environ.get("BUILDVAULT_WRITER", "") in ("1", "true", "yes", "on")
    timeout = float(os.environ.get("BUILDVAULT_TIMEOUT", "3"))
    socket_path = os.path.abspath(socket_path)
    os.chdir("/")
    lock_fd = os.open(socket_path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + 5.0
    while True:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError:
            # Another agent owns this socket; if it is alive it answers, if it is exiting we take over.
            if _alive(socket_path) or time.monotonic() > deadline:
                _unlink(socket_path + ".starting")
                return 0
            time.sleep(0.05)
    _unlink(socket_path)
    tmpdir = os.path.join(os.path.dirname(socket_path), "tmp")
    os.makedirs(tmpdir, exist_ok=True)
    agent = Agent(remote, instance, writer, timeout, tmpdir)
    tmp_sock = f"{socket_path}.{os.getpid()}"
    server = _Server(tmp_sock, _Handler)
    server.agent = agent  # type: ignore[attr-defined]
    server.socket_path = socket_path  # type: ignore[attr-defined]
    server.lock_fd = lock_fd  # type: ignore[attr-defined]
    server.gave_up = False  # type: ignore[attr-defined]
    os.chmod(tmp_sock, 0o600)
    os.rename(tmp_sock, socket_path)
    _unlink(socket_path + ".starting")

    def watchdog() -> None:
        while True:
            time.sleep(min(5.0, idle / 4))
            if time.monotonic() - agent.last_activity > idle:
                server.shutdown()
                return
            # Forget tokens of compiles whose launcher died.
            with agent.lock:
                stale = [t for t, v in agent.pending.items() if time.time() - v.created > 3600]
                for t in stale:
                    discard(agent.pending.pop(t).temps)

    threading.Thread(target=watchdog, daemon=True).start()
    print(f"buildvault-cc agent {os.getpid()} listening on {socket_path} (remote {remote}, writer={writer})",
          file=sys.stderr, flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        if not server.gave_up:  # type: ignore[attr-defined]
            _unlink(socket_path)  # (after a stop the path may already be the next agent's)
        server.server_close()
        agent.remote.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="buildvault-cc-agent")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--idle", type=float, default=float(os.environ.get("BUILDVAULT_AGENT_IDLE", "900")))
    args = parser.parse_args(argv)
    return serve(args.socket, args.idle)


if __name__ == "__main__":
    sys.exit(main())
