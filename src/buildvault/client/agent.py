"""The long-lived local agent behind `buildvault-cc`.

One agent per (remote, instance, writer) configuration and user, started on demand by the
launcher and listening on a unix socket. It keeps the gRPC channel, the file-hash cache
(inode/size/mtime/ctime), compiler identities and direct-mode manifests warm, so that a hit
costs a few stat() calls and three small RPCs instead of a Python+gRPC start-up and a
preprocessor run.

Per compile (see protocol.py for the wire format):
  lookup:   manifest key (normalized argv + env + platform + source digest)
            -> manifest (local, else remote): include lists seen by earlier real compiles
            -> for an entry whose files still hash the same (and whose shadowing candidates are
               still absent): the Action digest -> GetActionResult -> outputs from CAS, verified,
               written atomically  => HIT
  miss:     the launcher runs the real compiler (with -MD -MF tmp added when the user asked for
            no dependency file) and reports back; a writer then uploads input blobs, the
            Directory tree, Command, Action, outputs, UpdateActionResult, and the manifest.
Any remote failure makes the compile local (fail-open) with one warning per outage.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import socket
import socketserver
import sys
import threading
import time
import traceback
import uuid

from buildvault.digest import Digest
from buildvault.remote_apis import re_pb2

from . import protocol
from .compile_args import Bypass, Compile, classify, parse_depfile
from .keys import (
    EXACT,
    ActionKey,
    CompilerIdentity,
    FileHasher,
    Prepared,
    Uncacheable,
    action_key,
    parse_platform,
    prepare,
)
from .remote import Remote, RemoteError, from_proto, to_proto
from .roots import Roots, find_cmake_roots, parse_roots

MANIFEST_ENTRIES = 8
RETRY_SECONDS = float(os.environ.get("BUILDVAULT_RETRY_SECONDS", "10"))
DEBUG = os.environ.get("BUILDVAULT_DEBUG", "") not in ("", "0")


def _now_ts():
    from google.protobuf.timestamp_pb2 import Timestamp

    ts = Timestamp()
    ts.GetCurrentTime()
    return ts


class Agent:
    def __init__(self, remote_url: str, instance: str, writer: bool, timeout: float):
        self.remote = Remote(remote_url, instance, timeout=timeout, upload_timeout=max(timeout * 4, 20.0))
        self.writer = writer
        self.hasher = FileHasher()
        self.compilers = CompilerIdentity()
        self.manifests: dict[Digest, list[dict]] = {}
        self.pending: dict[str, tuple] = {}
        self.down_until = 0.0
        self.warned = False
        self.lock = threading.Lock()
        self.last_activity = time.monotonic()
        self._cmake_cache: dict[str, tuple] = {}

    # -- health ------------------------------------------------------------------------------
    def _failed(self, error: Exception) -> str | None:
        with self.lock:
            self.down_until = time.monotonic() + RETRY_SECONDS
            if self.warned:
                return None
            self.warned = True
        return f"buildvault-cc: remote cache unavailable ({error}); compiling locally"

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
            self._cmake_cache[cwd] = (cache_file, _mtime(cache_file) if cache_file else None, source, build)
        roots = []
        if source:
            roots.append(("SRC", source))
        roots.append(("BUILD", build or cwd))
        return Roots(roots)

    def prepare(self, c: Compile, cwd: str, env: dict[str, str]) -> Prepared:
        compiler = self.compilers.resolve(c.argv[0], cwd, env)
        ident = self.compilers.identity(compiler, env)
        spec = parse_platform(env.get("BUILDVAULT_PLATFORM", ""))
        return prepare(c, cwd, env, self.roots_for(cwd, env), ident, spec)

    # -- the two halves of a compile -------------------------------------------------------------
    def handle_compile(self, req: dict) -> dict:
        argv, cwd, env = req["argv"], req["cwd"], req["env"]
        extra = tuple(f for f in env.get("BUILDVAULT_SAFE_FLAGS", "").split(",") if f)
        c = classify(argv, env, extra)
        if isinstance(c, Bypass):
            return {"op": "bypass", "reason": c.reason}
        if time.monotonic() < self.down_until:
            return {"op": "bypass", "reason": "remote-unavailable"}
        try:
            p = self.prepare(c, cwd, env)
            self._check_time_macros(p, env, self.hasher.info(p.source_abs, p.roots))
            hit = self.lookup(p, env)
        except Uncacheable as e:
            return {"op": "bypass", "reason": f"uncacheable: {e}"}
        except RemoteError as e:
            return {"op": "bypass", "reason": "remote-error", "warning": self._failed(e)}
        except OSError as e:
            return {"op": "bypass", "reason": f"error: {e}"}
        self._ok()
        if DEBUG:
            print(f"lookup {p.source_abs}: compiler={p.compiler_id[:12]} hit={hit is not None}", file=sys.stderr, flush=True)
        if hit is not None:
            return hit
        token = uuid.uuid4().hex
        tmpdep = None
        exec_argv = list(argv)
        if c.depfile is None:
            tmpdep = os.path.join(self.tmpdir, f"{token}.d")
            exec_argv += ["-MD", "-MF", tmpdep]
        with self.lock:
            self.pending[token] = (p, tmpdep, time.time(), env)
        return {"op": "run", "argv": exec_argv, "token": token}

    def handle_done(self, req: dict) -> dict:
        with self.lock:
            entry = self.pending.pop(req["token"], None)
        if entry is None:
            return {"status": "MISS", "reason": "unknown-token"}
        p, tmpdep, started, env = entry
        try:
            if req["exit"] != 0:
                return {"status": "MISS", "reason": "compile-failed"}
            if not self.writer:
                return {"status": "MISS", "reason": "read-only"}
            try:
                digest, n, exact = self.store(p, tmpdep, req["stdout"], req["stderr"],
                                              float(req.get("seconds", 0.0)), env)
            except Uncacheable as e:
                return {"status": "MISS", "reason": f"uncacheable: {e}"}
            except RemoteError as e:
                return {"status": "MISS", "reason": "upload-failed", "warning": self._failed(e)}
            except OSError as e:
                return {"status": "MISS", "reason": f"not-stored: {e}"}
            self._ok()
            return {"status": "MISS", "reason": "stored-exact" if exact else "stored", "digest": str(digest), "outputs": n}
        finally:
            if tmpdep:
                try:
                    os.unlink(tmpdep)
                except OSError:
                    pass

    # -- lookup ----------------------------------------------------------------------------------
    def _check_time_macros(self, p: Prepared, env: dict, info) -> None:
        if info.timestamp_macro:
            raise Uncacheable("__TIMESTAMP__ in an input")
        if info.time_macros and not env.get("SOURCE_DATE_EPOCH"):
            raise Uncacheable("__DATE__/__TIME__ in an input (set SOURCE_DATE_EPOCH to cache it)")

    def manifest_key(self, p: Prepared) -> ActionKey:
        info = self.hasher.info(p.source_abs, p.roots)
        return action_key(p, {p.roots.layout(p.source_abs): (info.digest, info.executable)}, exact=False, manifest=True)

    def lookup(self, p: Prepared, env: dict) -> dict | None:
        mkey = self.manifest_key(p)
        tried: set[str] = set()
        entries = self.manifests.get(mkey.digest)
        if entries:
            hit = self._try_entries(p, env, entries, tried)
            if hit:
                return hit
        result = self.remote.get_action_result(mkey.digest)
        if result is None or not result.output_files:
            return None
        blob = self.remote.download([from_proto(result.output_files[0].digest)])
        try:
            entries = json.loads(next(iter(blob.values())))["entries"]
        except (ValueError, KeyError, TypeError):
            return None
        self.manifests[mkey.digest] = entries
        return self._try_entries(p, env, entries, tried)

    def _try_entries(self, p: Prepared, env: dict, entries: list[dict], tried: set[str]) -> dict | None:
        for entry in entries:
            fingerprint = json.dumps(entry["inputs"])
            if fingerprint in tried:
                continue
            tried.add(fingerprint)
            key = self._entry_key(p, env, entry)
            if key is None:
                continue
            result = self.remote.get_action_result(key.digest)
            if result is None or result.exit_code != 0:
                continue
            hit = self._materialize(p, key, result, entry["exact"])
            if hit is not None:
                return hit
        return None

    def _entry_key(self, p: Prepared, env: dict, entry: dict) -> ActionKey | None:
        roots = p.roots
        inputs: dict[str, tuple[Digest, bool]] = {}
        paths = []
        for layout, hash_, size, exe in entry["inputs"]:
            path = roots.from_layout(layout)
            try:
                info = self.hasher.info(path, roots)
            except (OSError, KeyError):
                return None
            if info.digest.hash != hash_ or info.digest.size_bytes != size:
                return None
            self._check_time_macros(p, env, info)
            inputs[layout] = (info.digest, info.executable)
            paths.append(path)
        for layout in entry.get("absent", ()):
            try:
                if os.path.lexists(roots.from_layout(layout)):
                    return None
            except KeyError:
                return None
        if entry["exact"]:
            inputs = {}
            for path in paths:
                info = self.hasher.info(path, EXACT)
                inputs[EXACT.layout(path)] = (info.digest, info.executable)
        return action_key(p, inputs, exact=entry["exact"])

    def _materialize(self, p: Prepared, key: ActionKey, result: re_pb2.ActionResult, exact: bool) -> dict | None:
        roots = EXACT if exact else p.roots
        wanted = {os.path.relpath(path, p.cwd): (path, kind) for path, kind in p.outputs}
        files = {f.path: f for f in result.output_files}
        if set(files) != set(wanted):
            return None
        digests = [from_proto(f.digest) for f in files.values()]
        stdout = result.stdout_raw
        stderr = result.stderr_raw
        if not stdout and result.stdout_digest.size_bytes:
            digests.append(from_proto(result.stdout_digest))
        if not stderr and result.stderr_digest.size_bytes:
            digests.append(from_proto(result.stderr_digest))
        blobs = self.remote.download(digests)
        if not stdout and result.stdout_digest.size_bytes:
            stdout = blobs[from_proto(result.stdout_digest)]
        if not stderr and result.stderr_digest.size_bytes:
            stderr = blobs[from_proto(result.stderr_digest)]
        for rel, f in files.items():
            path, kind = wanted[rel]
            data = blobs[from_proto(f.digest)]
            if kind == "dep":
                data = roots.denormalize_bytes(data)
            _write_atomic(path, data, f.is_executable)
        meta = result.execution_metadata
        compile_seconds = 0.0
        if meta.HasField("execution_start_timestamp") and meta.HasField("execution_completed_timestamp"):
            compile_seconds = (
                meta.execution_completed_timestamp.ToNanoseconds() - meta.execution_start_timestamp.ToNanoseconds()
            ) / 1e9
        return {
            "op": "hit",
            "exit": result.exit_code,
            "stdout": roots.denormalize_bytes(stdout),
            "stderr": roots.denormalize_bytes(stderr),
            "digest": str(key.digest),
            "outputs": len(files),
            "compile_seconds": compile_seconds,
        }

    # -- store -----------------------------------------------------------------------------------
    def store(self, p: Prepared, tmpdep: str | None, stdout: bytes, stderr: bytes, seconds: float, env: dict):
        c = p.compile
        depfile = tmpdep or next(path for path, kind in p.outputs if kind == "dep")
        with open(depfile, encoding="utf-8", errors="surrogateescape") as f:
            deps = parse_depfile(f.read())
        paths = [p.source_abs]
        for dep in deps:
            path = os.path.normpath(os.path.join(p.cwd, dep))
            if path not in paths:
                paths.append(path)
        outputs = {}
        for path, kind in p.outputs:
            with open(path, "rb") as f:
                outputs[path] = (kind, f.read())
        # Does anything the compile wrote depend on where the checkout is? Then key it byte-exact.
        exact = not p.roots or c.compressed_debug
        sensitive = [s.encode() for s in p.rewritten if len(s) > 1]
        for path, (kind, data) in outputs.items():
            if kind == "obj":
                if p.roots.mentions(data) or any(s in data for s in sensitive):
                    exact = True
            elif any(s in p.roots.normalize_bytes(data) for s in sensitive):
                exact = True
        for stream in (stdout, stderr):
            if any(s in p.roots.normalize_bytes(stream) for s in sensitive):
                exact = True
        roots = EXACT if exact else p.roots
        norm_infos = {}
        inputs: dict[str, tuple[Digest, bool]] = {}
        for path in paths:
            try:
                info = self.hasher.info(path, p.roots)
            except OSError:
                raise Uncacheable(f"input vanished: {path}") from None
            self._check_time_macros(p, env, info)
            norm_infos[path] = info
            if exact:
                info = self.hasher.info(path, EXACT)
            inputs[roots.layout(path)] = (info.digest, info.executable)
        key = action_key(p, inputs, exact=exact)
        blobs: dict[Digest, bytes | tuple] = dict(key.blobs)
        for path in paths:
            layout = roots.layout(path)
            blobs.setdefault(inputs[layout][0], ("file", path))
        out_files = []
        for path, (kind, data) in outputs.items():
            if kind == "dep":
                data = roots.normalize_bytes(data)
            d = Digest.of(data)
            blobs[d] = data
            out_files.append(re_pb2.OutputFile(path=os.path.relpath(path, p.cwd), digest=to_proto(d),
                                               is_executable=False))
        stdout_n, stderr_n = roots.normalize_bytes(stdout), roots.normalize_bytes(stderr)
        stdout_d, stderr_d = Digest.of(stdout_n), Digest.of(stderr_n)
        blobs[stdout_d] = stdout_n
        blobs[stderr_d] = stderr_n
        # Manifest (always keyed normalized): the include list this compile saw.
        mkey = self.manifest_key(p)
        entry = {
            "inputs": [[p.roots.layout(path), norm_infos[path].digest.hash, norm_infos[path].digest.size_bytes,
                        norm_infos[path].executable] for path in paths],
            "absent": self._absent(p, paths),
            "exact": exact,
        }
        old = self.manifests.get(mkey.digest) or []
        entries = [entry] + [e for e in old if e["inputs"] != entry["inputs"]][: MANIFEST_ENTRIES - 1]
        manifest_data = json.dumps({"entries": entries}, separators=(",", ":")).encode()
        manifest_digest = Digest.of(manifest_data)
        blobs[manifest_digest] = manifest_data
        for d, data in mkey.blobs.items():
            blobs.setdefault(d, data)
        missing = self.remote.find_missing(blobs)
        upload = {}
        for d in missing:
            data = blobs[d]
            if isinstance(data, tuple):
                data = self.hasher.content(data[1], roots, d)
            upload[d] = data
        self.remote.upload(upload)
        end = time.time()
        meta = re_pb2.ExecutedActionMetadata(worker=f"buildvault-cc@{socket.gethostname()}")
        meta.execution_start_timestamp.FromNanoseconds(int((end - seconds) * 1e9))
        meta.execution_completed_timestamp.FromNanoseconds(int(end * 1e9))
        result = re_pb2.ActionResult(
            output_files=sorted(out_files, key=lambda f: f.path),
            exit_code=0,
            stdout_digest=to_proto(stdout_d),
            stderr_digest=to_proto(stderr_d),
            execution_metadata=meta,
        )
        self.remote.update_action_result(key.digest, result)
        self.remote.update_action_result(
            mkey.digest,
            re_pb2.ActionResult(output_files=[re_pb2.OutputFile(path="manifest.json", digest=to_proto(manifest_digest))]),
        )
        self.manifests[mkey.digest] = entries
        return key.digest, len(out_files), exact

    @staticmethod
    def _absent(p: Prepared, paths: list[str]) -> list[str]:
        """Files that would shadow a header found later on the include search path: they must stay absent."""
        c = p.compile
        search = [os.path.dirname(p.source_abs)]
        for d in c.include_dirs:
            d = os.path.normpath(os.path.join(p.cwd, d))
            if d not in search:
                search.append(d)
        absent = []
        for path in paths[1:]:
            for index, d in enumerate(search):
                if path.startswith(d + "/"):
                    rel = path[len(d) + 1:]
                    for earlier in search[:index]:
                        candidate = os.path.join(earlier, rel)
                        if not os.path.lexists(candidate):
                            layout = p.roots.layout(candidate)
                            if layout not in absent:
                                absent.append(layout)
                    break
        return absent


def _alive(socket_path: str) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            s.connect(socket_path)
            protocol.send(s, {"op": "ping"})
            return protocol.recv(s) is not None
    except OSError:
        return False


def _mtime(path: str | None):
    try:
        return os.stat(path).st_mtime_ns if path else None
    except OSError:
        return None


def _write_atomic(path: str, data: bytes, executable: bool) -> None:
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.bv{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o777 if executable else 0o666)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
    finally:
        os.close(fd)
    os.replace(tmp, path)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        agent: Agent = self.server.agent  # type: ignore[attr-defined]
        sock = self.request
        try:
            while True:
                req = protocol.recv(sock)
                if req is None:
                    return
                agent.last_activity = time.monotonic()
                op = req.get("op")
                try:
                    if op == "compile":
                        reply = agent.handle_compile(req)
                    elif op == "done":
                        reply = agent.handle_done(req)
                    elif op == "ping":
                        reply = {"op": "pong", "pid": os.getpid()}
                    elif op == "stop":
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
                return 0
            time.sleep(0.05)
    try:
        os.unlink(socket_path)
    except FileNotFoundError:
        pass
    agent = Agent(remote, instance, writer, timeout)
    agent.tmpdir = os.path.join(os.path.dirname(socket_path), "tmp")
    os.makedirs(agent.tmpdir, exist_ok=True)
    tmp_sock = f"{socket_path}.{os.getpid()}"
    server = _Server(tmp_sock, _Handler)
    server.agent = agent  # type: ignore[attr-defined]
    os.chmod(tmp_sock, 0o600)
    os.rename(tmp_sock, socket_path)

    def watchdog() -> None:
        while True:
            time.sleep(min(5.0, idle / 4))
            if time.monotonic() - agent.last_activity > idle:
                server.shutdown()
                return
            # Forget tokens of compiles whose launcher died.
            with agent.lock:
                stale = [t for t, v in agent.pending.items() if time.time() - v[2] > 3600]
                for t in stale:
                    agent.pending.pop(t, None)

    threading.Thread(target=watchdog, daemon=True).start()
    print(f"buildvault-cc agent {os.getpid()} listening on {socket_path} (remote {remote}, writer={writer})",
          file=sys.stderr, flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        try:
            os.unlink(socket_path)
        except OSError:
            pass
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
