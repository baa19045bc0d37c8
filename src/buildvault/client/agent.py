"""The long-lived local agent behind `buildvault-cc`.

One agent per (remote, instance, writer) configuration and user, started on demand by the
launcher and listening on a unix socket. It keeps the gRPC channel, the file-hash cache
(inode/size/mtime/ctime), compiler identities and direct-mode manifests warm, so that a hit
costs a few stat() calls and three small RPCs instead of a Python+gRPC start-up and a
preprocessor run.

Per compile (see protocol.py for the wire format):
  lookup:   manifest key (normalized argv + env + platform + source digest)
            -> manifest (local, else remote, itself an AC entry): the include lists earlier real
               compiles saw (from their -MD output), each with the digests of those files, the
               files that must stay ABSENT (they would shadow a header found later on the
               include path) and whether a project file uses __has_include (then a deps-only
               preprocessor run confirms the list)
            -> for an entry that still holds: the Action digest -> GetActionResult (outputs
               inlined) -> verified -> written atomically  => HIT
  miss:     the launcher runs the real compiler (with -MD -MF tmp added when the user asked for
            no dependency file) and reports back; the agent reads the outputs at once, then (in
            the background; --flush waits) a writer uploads the input blobs, Directory tree,
            Command, Action, outputs and stdout/stderr, UpdateActionResult, and the manifest.
            Outputs that contain a root path (debug info, __FILE__, ...) are keyed byte-exact
            (real paths), so they never hit in another checkout; inputs modified during the
            compile are not stored.
Any remote failure makes the compile local (fail-open) with one warning per outage.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import socket
import socketserver
import subprocess
import sys
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor

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
from .remote import PermissionDenied, Remote, RemoteError, from_proto, to_proto
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
        self.key_memo: dict[tuple, ActionKey] = {}
        self.sync_store = os.environ.get("BUILDVAULT_SYNC_UPLOAD", "") not in ("", "0")
        self.store_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="store")
        self.inflight = 0
        self.storing: dict[Digest, threading.Event] = {}
        self.pending_warning: str | None = None
        self.pending: dict[str, tuple] = {}
        self.down_until = 0.0
        self.warned = False
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
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

    def _denied(self, error: Exception) -> str | None:
        with self.lock:
            was_writer, self.writer = self.writer, False
        if not was_writer:
            return None
        return f"buildvault-cc: the remote cache refused an upload ({error}); compiling without uploading"

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
        t0 = time.perf_counter()
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
            print(f"lookup {p.source_abs}: compiler={p.compiler_id[:12]} hit={hit is not None} "
                  f"{time.perf_counter() - t0:.3f}s", file=sys.stderr, flush=True)
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
        p, tmpdep, _, env = entry
        return self._finish(p, tmpdep, env, req)

    def _finish(self, p: Prepared, tmpdep: str | None, env: dict, req: dict) -> dict:
        try:
            if req["exit"] != 0:
                return {"status": "MISS", "reason": "compile-failed"}
            if not self.writer:
                return {"status": "MISS", "reason": "read-only"}
            # Read what the compile wrote now, before the launcher exits and the build moves on.
            try:
                depfile = tmpdep or next(path for path, kind in p.outputs if kind == "dep")
                with open(depfile, encoding="utf-8", errors="surrogateescape") as f:
                    dep_text = f.read()
                outputs = []
                for path, kind in p.outputs:
                    with open(path, "rb") as f:
                        outputs.append((path, kind, f.read()))
            except OSError as e:
                return {"status": "MISS", "reason": f"not-stored: {e}"}
            job = (p, dep_text, outputs, req, env)
            if self.sync_store:
                return self._store_job(job)
            mkey = self.manifest_key(p).digest
            with self.lock:
                self.inflight += 1
                self.storing[mkey] = self.storing.get(mkey) or threading.Event()
            self.store_pool.submit(self._store_background, job, mkey)
            return {"status": "MISS", "reason": "storing", "agent_logs": True, "warning": self._take_warning()}
        finally:
            if tmpdep:
                _unlink(tmpdep)

    def _store_background(self, job, mkey: Digest) -> None:
        try:
            reply = self._store_job(job)
            if reply.get("warning"):
                with self.lock:
                    self.pending_warning = reply["warning"]
            _log_event(job[4], job[0], job[3], reply)
        except Exception:
            traceback.print_exc()
        finally:
            with self.lock:
                self.inflight -= 1
                event = self.storing.pop(mkey, None)
                self.idle.notify_all()
            if event is not None:
                event.set()

    def _take_warning(self) -> str | None:
        with self.lock:
            warning, self.pending_warning = self.pending_warning, None
        return warning

    def _store_job(self, job) -> dict:
        p, dep_text, outputs, req, env = job
        try:
            t0 = time.perf_counter()
            digest, n, exact = self.store(p, dep_text, outputs, req["stdout"], req["stderr"],
                                          float(req.get("seconds", 0.0)), env, float(req.get("started", 0.0)))
        except Uncacheable as e:
            return {"status": "MISS", "reason": f"uncacheable: {e}"}
        except PermissionDenied as e:
            # A read-only credential (issue 11): keep reading, never try to upload again.
            return {"status": "MISS", "reason": "not-permitted", "warning": self._denied(e)}
        except RemoteError as e:
            return {"status": "MISS", "reason": "upload-failed", "warning": self._failed(e)}
        except OSError as e:
            return {"status": "MISS", "reason": f"not-stored: {e}"}
        self._ok()
        if DEBUG:
            print(f"store {p.source_abs}: {time.perf_counter() - t0:.3f}s", file=sys.stderr, flush=True)
        return {"status": "MISS", "reason": "stored-exact" if exact else "stored", "digest": str(digest), "outputs": n}

    def flush(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        with self.lock:
            while self.inflight and time.monotonic() < deadline:
                self.idle.wait(0.5)

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
        storing = self.storing.get(mkey.digest)
        if storing is not None:
            storing.wait(60)
        tried: set[str] = set()
        entries = self.manifests.get(mkey.digest)
        if entries:
            hit = self._try_entries(p, env, entries, tried, mkey.digest)
            if hit:
                return hit
        result = self.remote.get_action_result(mkey.digest, inline_files=["manifest.json"])
        if result is None or not result.output_files:
            return None
        data = self._file_contents([result.output_files[0]])[0]
        try:
            entries = json.loads(data)["entries"]
        except (ValueError, KeyError, TypeError):
            return None
        self.manifests[mkey.digest] = entries
        return self._try_entries(p, env, entries, tried, mkey.digest)

    def _try_entries(self, p: Prepared, env: dict, entries: list[dict], tried: set[str], mkey_digest: Digest) -> dict | None:
        for entry in entries:
            fingerprint = json.dumps(entry["inputs"])
            if fingerprint in tried:
                continue
            tried.add(fingerprint)
            key = self._entry_key(p, env, entry, mkey_digest, fingerprint)
            if key is None:
                continue
            result = self.remote.get_action_result(key.digest, inline_files=key.output_rel)
            if result is None or result.exit_code != 0:
                continue
            hit = self._materialize(p, key, result, entry["exact"])
            if hit is not None:
                return hit
        return None

    def _entry_key(self, p: Prepared, env: dict, entry: dict, mkey_digest: Digest, fingerprint: str) -> ActionKey | None:
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
        if entry.get("probe") and set(self._scan_deps(p, env)) != set(paths):
            # A project file asks __has_include: which files exist decides what is read, so the
            # include list is confirmed by the preprocessor (deps only) before trusting it.
            return None
        if entry["exact"]:
            inputs = {}
            for path in paths:
                info = self.hasher.info(path, EXACT)
                inputs[EXACT.layout(path)] = (info.digest, info.executable)
            return action_key(p, inputs, exact=True)
        # Every listed file hashes as recorded, and the manifest key fixes the command: the
        # Action is a function of (manifest key, entry), so memoize it.
        memo_key = (mkey_digest, fingerprint, tuple(p.platform_spec))
        key = self.key_memo.get(memo_key)
        if key is None:
            key = action_key(p, inputs, exact=False)
            if len(self.key_memo) > 100_000:
                self.key_memo.clear()
            self.key_memo[memo_key] = key
        return key

    def _materialize(self, p: Prepared, key: ActionKey, result: re_pb2.ActionResult, exact: bool) -> dict | None:
        roots = EXACT if exact else p.roots
        wanted = {os.path.relpath(path, p.cwd): (path, kind) for path, kind in p.outputs}
        files = {f.path: f for f in result.output_files}
        if set(files) != set(wanted):
            return None
        streams = [
            re_pb2.OutputFile(digest=result.stdout_digest, contents=result.stdout_raw),
            re_pb2.OutputFile(digest=result.stderr_digest, contents=result.stderr_raw),
        ]
        names = list(files)
        contents = self._file_contents([files[n] for n in names] + streams)
        stdout, stderr = contents[-2], contents[-1]
        for rel, data in zip(names, contents):
            path, kind = wanted[rel]
            f = files[rel]
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

    def _file_contents(self, files: list) -> list[bytes]:
        """Contents of OutputFile-like messages: inlined bytes (verified) or fetched from CAS."""
        out: list[bytes | None] = []
        fetch = []
        for f in files:
            digest = from_proto(f.digest) if f.digest.hash else None
            if digest is None:
                out.append(f.contents)  # e.g. stdout_raw without a digest
            elif f.contents or digest.size_bytes == 0:
                if Digest.of(f.contents) != digest:
                    raise RemoteError(f"inlined blob {digest} failed verification")
                out.append(f.contents)
            else:
                out.append(None)
                fetch.append(digest)
        if fetch:
            blobs = self.remote.download(fetch)
            out = [blobs[from_proto(f.digest)] if data is None else data for f, data in zip(files, out)]
        return out  # type: ignore[return-value]

    # -- store -----------------------------------------------------------------------------------
    def store(self, p: Prepared, dep_text: str, outputs_read: list, stdout: bytes, stderr: bytes, seconds: float,
              env: dict, started: float = 0.0):
        c = p.compile
        deps = parse_depfile(dep_text)
        paths = [p.source_abs]
        for dep in deps:
            path = os.path.normpath(os.path.join(p.cwd, dep))
            if path not in paths:
                paths.append(path)
        outputs = {path: (kind, data) for path, kind, data in outputs_read}
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
            if started and info.mtime > started:
                raise Uncacheable(f"input modified during the compile: {path}")
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
            "probe": any(norm_infos[path].probe for path in paths if p.roots.locate(path) is not None),
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
        manifest_result = re_pb2.ActionResult(
            output_files=[re_pb2.OutputFile(path="manifest.json", digest=to_proto(manifest_digest))]
        )
        self.remote.update_action_results([(key.digest, result), (mkey.digest, manifest_result)])
        self.manifests[mkey.digest] = entries
        return key.digest, len(out_files), exact

    def _scan_deps(self, p: Prepared, env: dict) -> list[str]:
        """The files this compile reads, from a dependency-only preprocessor run (-M)."""
        args: list[str] = []
        skip = False
        for arg in p.compile.argv[1:]:
            if skip:
                skip = False
                continue
            if arg in ("-c", "-MD", "-MP", "-MG"):
                continue
            if arg in ("-o", "-MF", "-MT", "-MQ"):
                skip = True
                continue
            if arg.startswith(("-MF", "-MT", "-MQ")) or (arg.startswith("-o") and len(arg) > 2):
                continue
            args.append(arg)
        tmp = os.path.join(self.tmpdir, f"scan-{uuid.uuid4().hex}.d")
        try:
            done = subprocess.run([p.compile.argv[0], *args, "-M", "-MF", tmp, "-o", os.devnull], cwd=p.cwd,
                                  env=env, capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
            if done.returncode != 0:
                return []
            with open(tmp, encoding="utf-8", errors="surrogateescape") as f:
                deps = parse_depfile(f.read())
        except (OSError, subprocess.TimeoutExpired):
            return []
        finally:
            _unlink(tmp)
        paths = [p.source_abs]
        for dep in deps:
            path = os.path.normpath(os.path.join(p.cwd, dep))
            if path not in paths:
                paths.append(path)
        return paths

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


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _log_event(env: dict, p: Prepared, req: dict, reply: dict) -> None:
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
                        if not reply.get("warning"):
                            reply["warning"] = agent._take_warning()  # from a background upload
                    elif op == "done":
                        reply = agent.handle_done(req)
                    elif op == "flush":
                        agent.flush()
                        reply = {"op": "flushed"}
                    elif op == "ping":
                        reply = {"op": "pong", "pid": os.getpid()}
                    elif op == "stop":
                        agent.flush()
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
    _unlink(socket_path + ".starting")

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
