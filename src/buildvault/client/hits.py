"""The lookup half of a compile: manifest -> an entry that still holds -> ActionResult -> outputs.

A manifest (itself an AC entry under the manifest key: normalized argv + env + platform + the
source's digest) lists include sets earlier real compiles saw. An entry holds when every listed
input hashes as recorded and every recorded include-search candidate (includes.py) is in the
state it was in; its Action is then looked up and its outputs written (outputs.write_output).
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from typing import Any

from buildvault.digest import Digest
from buildvault.remote_apis import re_pb2

from . import includes
from .invocation import no_request_metadata
from .keys import EXACT, ActionKey, FileHasher, Prepared, Uncacheable, action_key
from .outputs import write_output
from .remote import Remote, RemoteError

Entry = dict[str, Any]


def check_time_macros(info_time: bool, info_timestamp: bool, env: dict[str, str]) -> None:
    if info_timestamp:
        raise Uncacheable("__TIMESTAMP__ in an input")
    if info_time and not env.get("SOURCE_DATE_EPOCH"):
        raise Uncacheable("__DATE__/__TIME__ in an input (set SOURCE_DATE_EPOCH to cache it)")


class HitFinder:
    """Manifests (local memory, else the remote) and the hits they lead to."""

    def __init__(self, remote: Remote, hasher: FileHasher) -> None:
        self.remote = remote
        self.hasher = hasher
        self.manifests: dict[Digest, list[Entry]] = {}
        self.key_memo: dict[tuple[object, ...], ActionKey] = {}
        self.storing: dict[Digest, threading.Event] = {}  # manifest keys with an upload in flight
        self.absent = includes.AbsenceCache()

    def manifest_key(self, p: Prepared) -> ActionKey:
        info = self.hasher.info(p.source_abs, p.roots)
        return action_key(p, {p.roots.layout(p.source_abs): (info.digest, info.executable)}, exact=False,
                          manifest=True)

    def lookup(self, p: Prepared, env: dict[str, str]) -> dict[str, Any] | None:
        """The hit reply (outputs already written) or None. Raises OutputChanged, RemoteError."""
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
        with no_request_metadata():  # a manifest is bookkeeping, not a build step
            result = self.remote.get_action_result(mkey.digest, inline_files=["manifest.json"])
        if result is None or not result.output_files:
            return None
        data = self.file_contents([result.output_files[0]])[0]
        try:
            entries = json.loads(data)["entries"]
            assert isinstance(entries, list)
        except (ValueError, KeyError, TypeError, AssertionError):
            return None
        self.manifests[mkey.digest] = entries
        return self._try_entries(p, env, entries, tried, mkey.digest)

    def _try_entries(self, p: Prepared, env: dict[str, str], entries: list[Entry], tried: set[str],
                     mkey_digest: Digest) -> dict[str, Any] | None:
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
            hit = self._materialize(p, key, result, bool(entry["exact"]))
            if hit is not None:
                return hit
        return None

    def _entry_key(self, p: Prepared, env: dict[str, str], entry: Entry, mkey_digest: Digest,
                   fingerprint: str) -> ActionKey | None:
        roots = p.roots
        inputs: dict[str, tuple[Digest, bool]] = {}
        paths = []
        try:
            for layout, hash_, size, _ in entry["inputs"]:
                path = roots.from_layout(layout)
                info = self.hasher.info(path, roots)
                if info.digest.hash != hash_ or info.digest.size_bytes != size:
                    return None
                check_time_macros(info.time_macros, info.timestamp_macro, env)
                inputs[layout] = (info.digest, info.executable)
                paths.append(path)
            probes = {roots.from_layout(layout): state for layout, state in entry["probes"]}
        except (OSError, KeyError, ValueError, TypeError):
            return None
        if not self.absent.holds(probes):
            return None  # a header would now be found elsewhere, or a __has_include answers otherwise
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

    def _materialize(self, p: Prepared, key: ActionKey, result: re_pb2.ActionResult,
                     exact: bool) -> dict[str, Any] | None:
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
        contents = self.file_contents([files[n] for n in names] + streams)
        stdout, stderr = contents[-2], contents[-1]
        token = uuid.uuid4().hex
        for rel, data in zip(names, contents, strict=False):
            path, kind = wanted[rel]
            if kind == "dep":
                data = roots.denormalize_bytes(data)
            write_output(path, data, files[rel].is_executable, token)
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

    def file_contents(self, files: list[re_pb2.OutputFile]) -> list[bytes]:
        """Contents of OutputFile-like messages: inlined bytes (verified) or fetched from CAS."""
        out: list[bytes | None] = []
        fetch = []
        for f in files:
            digest = Digest.from_proto(f.digest) if f.digest.hash else None
            if digest is None:
                out.append(f.contents)  # e.g. stdout_raw without a digest
            elif f.contents or digest.size_bytes == 0:
                if Digest.of(f.contents) != digest:
                    raise RemoteError(f"inlined blob {digest} failed verification")
                out.append(f.contents)
            else:
                out.append(None)
                fetch.append(digest)
        if not fetch:
            return [data or b"" for data in out]
        blobs = self.remote.download(fetch)
        pairs = zip(files, out, strict=True)
        return [blobs[Digest.from_proto(f.digest)] if data is None else data for f, data in pairs]
