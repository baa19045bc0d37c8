"""The store half of a compile: what a real compile read and wrote becomes an Action, its result
and a manifest entry (the include set, the include-search candidates' states, exact or normalized).

The key is normalized (relocatable across checkouts) unless the output may depend on where the
checkout is: debug info, a root path in the object or the streams, or (preprocessed.py) a path
anywhere in the preprocessed text; then it is keyed byte-exact and hits only in this checkout.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass

from buildvault.digest import Digest
from buildvault.remote_apis import re_pb2

from . import includes, preprocessed
from .compile_args import parse_depfile
from .hits import Entry, HitFinder, check_time_macros
from .invocation import current_metadata, no_request_metadata
from .keys import EXACT, FileHasher, FileInfo, Prepared, Uncacheable, action_key
from .remote import Remote
from .toolchain import CompilerIdentity

MANIFEST_ENTRIES = 8


@dataclass
class StoreJob:
    """One successful compile, read right after it finished."""

    p: Prepared
    env: dict[str, str]
    dep_text: str
    outputs: list[tuple[str, str, bytes]]  # (final path, kind, bytes the compiler wrote)
    stdout: bytes
    stderr: bytes
    seconds: float
    started: float  # wall time the compile started (inputs changed after it are not stored)
    invocation: str = ""  # the build it belongs to (invocation.py), for the server's history


@dataclass(frozen=True)
class Stored:
    digest: Digest
    outputs: int
    exact: bool


class Storer:
    def __init__(self, remote: Remote, hasher: FileHasher, hits: HitFinder, compilers: CompilerIdentity) -> None:
        self.remote = remote
        self.hasher = hasher
        self.hits = hits
        self.compilers = compilers

    def store(self, job: StoreJob) -> Stored:
        """Upload everything of `job`; raises Uncacheable (nothing stored), RemoteError, OSError."""
        p, env = job.p, job.env
        c = p.compile
        text = preprocessed.examine(p, env)  # before hashing: an edit after `started` is seen below
        raw = [os.path.join(p.cwd, c.source)]
        paths = [p.source_abs]
        for dep in parse_depfile(job.dep_text):
            path = os.path.normpath(os.path.join(p.cwd, dep))
            if path not in paths:
                paths.append(path)
                raw.append(os.path.join(p.cwd, dep))
        exact = not p.roots or c.compressed_debug or c.debug_info or text.path_dependent
        sensitive = [s.encode() for s in p.rewritten if len(s) > 1]
        for _, kind, data in job.outputs:
            if kind == "obj":
                exact = exact or p.roots.mentions(data) or any(s in data for s in sensitive)
            else:
                exact = exact or any(s in p.roots.normalize_bytes(data) for s in sensitive)
        for stream in (job.stdout, job.stderr):
            exact = exact or any(s in p.roots.normalize_bytes(stream) for s in sensitive)
        infos: dict[str, FileInfo] = {}
        for path in paths:
            try:
                info = self.hasher.info(path, p.roots)
            except OSError:
                raise Uncacheable(f"input vanished: {path}") from None
            check_time_macros(info.time_macros, info.timestamp_macro, env)
            if info.directives.unseen:
                raise Uncacheable(f"{info.directives.unseen}: {path}")
            if job.started and info.mtime > job.started:
                raise Uncacheable(f"input modified during the compile: {path}")
            infos[path] = info
        probes = self._probes(p, env, raw, paths, infos)
        roots = EXACT if exact else p.roots
        inputs: dict[str, tuple[Digest, bool]] = {}
        for path in paths:
            info = self.hasher.info(path, EXACT) if exact else infos[path]
            inputs[roots.layout(path)] = (info.digest, info.executable)
        key = action_key(p, inputs, exact=exact)
        blobs: dict[Digest, bytes | str] = dict(key.blobs)  # str: a file to read when it must go up
        for path in paths:
            blobs.setdefault(inputs[roots.layout(path)][0], path)
        out_files: list[re_pb2.OutputFile] = []
        for path, kind, data in job.outputs:
            if kind == "dep":
                data = roots.normalize_bytes(data)
            d = Digest.of(data)
            blobs[d] = data
            out_files.append(re_pb2.OutputFile(path=os.path.relpath(path, p.cwd), digest=d.to_proto(re_pb2.Digest)))
        stdout_n, stderr_n = roots.normalize_bytes(job.stdout), roots.normalize_bytes(job.stderr)
        stdout_d, stderr_d = Digest.of(stdout_n), Digest.of(stderr_n)
        blobs[stdout_d] = stdout_n
        blobs[stderr_d] = stderr_n
        mkey = self.hits.manifest_key(p)
        entry: Entry = {
            "inputs": [[p.roots.layout(path), infos[path].digest.hash, infos[path].digest.size_bytes,
                        infos[path].executable] for path in paths],
            "probes": sorted([p.roots.layout(path), state] for path, state in probes.items()),
            "exact": exact,
        }
        old = self.hits.manifests.get(mkey.digest) or []
        entries = [entry] + [e for e in old if e["inputs"] != entry["inputs"]][: MANIFEST_ENTRIES - 1]
        manifest_data = json.dumps({"entries": entries}, separators=(",", ":")).encode()
        manifest_digest = Digest.of(manifest_data)
        blobs[manifest_digest] = manifest_data
        for d, data in mkey.blobs.items():
            blobs.setdefault(d, data)
        upload = {}
        for d in self.remote.find_missing(blobs):
            blob = blobs[d]
            upload[d] = self.hasher.content(blob, roots, d) if isinstance(blob, str) else blob
        self.remote.upload(upload)
        end = time.time()
        meta = re_pb2.ExecutedActionMetadata(worker=f"buildvault-cc@{socket.gethostname()}")
        meta.execution_start_timestamp.FromNanoseconds(int((end - job.seconds) * 1e9))
        meta.execution_completed_timestamp.FromNanoseconds(int(end * 1e9))
        out_files.sort(key=lambda f: f.path)
        result = re_pb2.ActionResult(
            output_files=out_files,
            exit_code=0,
            stdout_digest=stdout_d.to_proto(re_pb2.Digest),
            stderr_digest=stderr_d.to_proto(re_pb2.Digest),
            execution_metadata=meta,
        )
        manifest_result = re_pb2.ActionResult(
            output_files=[re_pb2.OutputFile(path="manifest.json", digest=manifest_digest.to_proto(re_pb2.Digest))]
        )
        if current_metadata() is None:
            self.remote.update_action_results([(key.digest, result), (mkey.digest, manifest_result)])
        else:
            # The build's history (the server's pages) sees this compile as Bazel's would be seen:
            # a lookup of the action that missed, then its result; the manifest is bookkeeping.
            self.remote.get_action_result(key.digest)
            self.remote.update_action_result(key.digest, result)
            with no_request_metadata():
                self.remote.update_action_result(mkey.digest, manifest_result)
        self.hits.manifests[mkey.digest] = entries
        return Stored(key.digest, len(out_files), exact)

    def _probes(self, p: Prepared, env: dict[str, str], raw: list[str], paths: list[str],
                infos: dict[str, FileInfo]) -> dict[str, str]:
        """{path: state} of every include-search candidate of this compile (includes.snapshot)."""
        c = p.compile
        system: list[str] = []
        for language in dict.fromkeys((c.language, "c", "c++")):  # g++ compiles a .c file as C++
            system += self.compilers.system_include_dirs(p.compiler_path or c.argv[0], p.compiler_id, c.argv,
                                                         language, env)
        search = includes.search_path(c, p.cwd, env, system)
        files = [(r, infos[path].directives) for r, path in zip(raw, paths, strict=True)]
        return includes.snapshot(c, p.cwd, files, search, set(paths))
