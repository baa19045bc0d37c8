"""The audit trail of writes that can poison a cache (`--audit-log FILE`, issue 36).

Every ActionCache update (gRPC UpdateActionResult, HTTP PUT of an action entry: Bazel's results,
ccache's entries, buildvault's pin index and artifact entries) and every Remote Asset push is
one JSON line, appended once the write succeeded; an Execute is one line when it is accepted
(kind `execute`: the server writes its result to the ActionCache for that caller):

    {"time": "2026-12-06T01:02:03.456Z", "ts": 1796...,  "principal": "oidc:host:repo:org/x:ref:...",
     "claims": {"repository": "org/x", "ref": "refs/heads/main", "run_id": "42", ...},
     "kind": "action_result" | "ac_entry" | "pin" | "artifact" | "asset" | "execute",
     "protocol": "grpc" | "http", "instance": "csrc", "digest": "<sha256>/<size>" (HTTP: "<sha256>"),
     "client": "ipv4:10.0.0.7:51234", "method": "UpdateActionResult"}

Content-addressed blobs are not audited: a blob cannot be poisoned, only an entry naming it.
Lines are written by one task per process, off the event loop (a worker thread), each batch one
`write` to a file opened with O_APPEND (so processes sharing the file never interleave lines),
then `fsync`: everything recorded while the previous batch was being written goes in the next.
SIGHUP reopens the file (after log rotation). A failed write is logged; the request it records
has already succeeded.

`buildvault audit ACTION_DIGEST` answers from the file who wrote an entry, when, from which job.
`record_write` is the call for any other front end that writes entries (the Remote Asset service
is audited here already, by its method, in grpc_auth.py).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from buildvault.server.auth.grants import Caller

__all__ = ["IDENTIFYING_CLAIMS", "AuditLog", "add_audit_parser", "audit_command", "grpc_write", "read_entries"]

log = logging.getLogger("buildvault.auth")

# The claims that say which job a token belongs to (GitHub Actions, GitLab CI, Buildkite, others).
IDENTIFYING_CLAIMS = (
    "sub", "jti", "repository", "repository_owner", "ref", "ref_type", "sha", "event_name", "workflow",
    "job_workflow_ref", "run_id", "run_number", "run_attempt", "actor", "environment",
    "project_path", "namespace_path", "ref_protected", "pipeline_source", "pipeline_id", "job_id", "user_login",
    "organization_slug", "pipeline_slug", "build_number", "build_branch", "build_commit",
)  # fmt: skip
_ANONYMOUS = "anonymous"


def _claims(caller: Caller | None) -> dict[str, Any] | None:
    if caller is None or caller.identity is None:
        return None
    claims = caller.identity.claims
    kept: dict[str, Any] = {}
    for name in IDENTIFYING_CLAIMS:
        value = claims.get(name)
        if isinstance(value, str):
            kept[name] = value[:256]
        elif isinstance(value, bool | int):
            kept[name] = value
    return kept


class AuditLog:
    """Appends JSON lines to `path`; `record_write` never blocks and never raises."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pending: list[bytes] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._fd: int | None = None
        self._reopen = False
        self._closing = False
        self.written = 0  # lines on disk (tests wait on it)

    def open(self) -> None:
        """Open (create) the file now (blocking): a path that cannot be written stops the start."""
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)

    def record_write(
        self,
        kind: str,
        caller: Caller | None,
        *,
        protocol: str,
        instance: str,
        digest: str,
        client: str | None,
        method: str,
        **extra: Any,
    ) -> None:
        """One successful write of an entry: `kind` action_result, ac_entry, pin, artifact or asset."""
        now = time.time()
        entry: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat(timespec="milliseconds")[:-6] + "Z",
            "ts": round(now, 3),
            "principal": caller.principal if caller is not None else _ANONYMOUS,
        }
        claims = _claims(caller)
        if claims is not None:
            entry["claims"] = claims
        entry.update(kind=kind, protocol=protocol, instance=instance, digest=digest, client=client, method=method)
        entry.update(extra)
        self._pending.append(json.dumps(entry, separators=(",", ":"), ensure_ascii=True).encode() + b"\n")
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.ensure_future(self._writer())
        assert self._wakeup is not None
        self._wakeup.set()

    def reopen(self) -> None:
        """SIGHUP: the next batch goes to a freshly opened file at `path` (log rotation)."""
        self._reopen = True

    async def _writer(self) -> None:
        assert self._wakeup is not None
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            batch, self._pending = self._pending, []
            if batch:
                await self._write(batch)
            if self._closing and not self._pending:
                return

    async def _write(self, batch: list[bytes]) -> None:
        try:
            await asyncio.to_thread(self._write_blocking, b"".join(batch))
            self.written += len(batch)
        except OSError as e:
            log.error("audit log %s: %d lines not written: %s", self.path, len(batch), e)

    def _write_blocking(self, data: bytes) -> None:
        if self._reopen or self._fd is None:
            self._reopen = False
            old, self._fd = self._fd, None
            if old is not None:
                os.close(old)
            self.open()
        assert self._fd is not None
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        os.fsync(self._fd)

    async def close(self) -> None:
        """Write what is pending, stop the writer, close the file."""
        self._closing = True
        task = self._task
        if task is not None and self._wakeup is not None:
            self._wakeup.set()
            await asyncio.gather(task, return_exceptions=True)
        self._task = None
        batch, self._pending = self._pending, []
        if batch:
            await self._write(batch)
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def _hex(hash_: str) -> str:
    return hash_ if len(hash_) <= 128 and all(c in "0123456789abcdef" for c in hash_) else "invalid"


def grpc_write(audit: AuditLog, method: str, caller: Caller | None, request: Any, peer: str | None) -> None:
    """Record a successful gRPC write: UpdateActionResult, a Remote Asset PushBlob/PushDirectory, or
    an accepted Execute (whose result the server writes)."""
    from buildvault.pins import INDEX_DIGEST

    name = method.rpartition("/")[2]
    instance = str(getattr(request, "instance_name", ""))
    if name == "UpdateActionResult":
        digest = request.action_digest
        result = request.action_result
        if digest.hash == INDEX_DIGEST.hash and digest.size_bytes == INDEX_DIGEST.size_bytes:
            kind = "pin"
        elif (
            len(result.output_directories) == 1
            and result.output_directories[0].path == "artifact"
            and not result.output_files
        ):
            kind = "artifact"
        else:
            kind = "action_result"
        text = f"{_hex(digest.hash)}/{digest.size_bytes}"
        audit.record_write(kind, caller, protocol="grpc", instance=instance, digest=text, client=peer, method=name)
        return
    if name == "Execute":  # accepted: the server writes the result unless the Action forbids it
        digest = request.action_digest
        text = f"{_hex(digest.hash)}/{digest.size_bytes}"
        audit.record_write(
            "execute", caller, protocol="grpc", instance=instance, digest=text, client=peer, method=name,
            skip_cache_lookup=bool(request.skip_cache_lookup),
        )  # fmt: skip
        return
    digest = request.blob_digest if name == "PushBlob" else request.root_directory_digest
    uris = [str(u)[:512] for u in list(request.uris)[:4]]
    text = f"{_hex(digest.hash)}/{digest.size_bytes}"
    audit.record_write(
        "asset", caller, protocol="grpc", instance=instance, digest=text, client=peer, method=name, uris=uris
    )


def http_write(audit: AuditLog, caller: Caller | None, instance: str, hash_: str, client: str | None) -> None:
    """Record a successful HTTP PUT of an action entry (bazel-remote /ac/, ccache's entries)."""
    from buildvault.pins import INDEX_DIGEST

    kind = "pin" if hash_ == INDEX_DIGEST.hash else "ac_entry"
    audit.record_write(kind, caller, protocol="http", instance=instance, digest=hash_, client=client, method="PUT")


# -- reading: `buildvault audit` ---------------------------------------------------------------


def read_entries(path: Path) -> Iterator[dict[str, Any]]:
    """Every well-formed line of the file (a torn last line is skipped)."""
    with path.open("rb") as f:
        for line in f:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict):
                yield entry


def _matches(entry: dict[str, Any], wanted: str) -> bool:
    digest = str(entry.get("digest", ""))
    return digest == wanted or digest.partition("/")[0] == wanted.partition("/")[0]


def add_audit_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    audit = commands.add_parser(
        "audit",
        help="who wrote an action-cache entry, when, from which job",
        description="Search the server's --audit-log for the writes of ACTION_DIGEST (HASH or HASH/SIZE): "
        "time, principal, the token's identifying claims, instance, client address. Exit 3 when none.",
    )
    audit.add_argument("digest", metavar="ACTION_DIGEST", help="the entry's key: HASH or HASH/SIZE")
    audit.add_argument(
        "--audit-log", metavar="FILE", help="the server's audit log (default: its setting, env or --config file)"
    )
    audit.add_argument("--instance", help="only writes to this instance")
    audit.add_argument("--json", action="store_true", help="print the matching lines as they are stored")


def audit_command(args: argparse.Namespace) -> int:
    path = args.audit_log
    if not path:  # the server's own setting: BUILDVAULT_AUDIT_LOG or `audit_log` in the --config file
        from buildvault.config import ConfigError, load_settings

        try:
            path = load_settings().audit_log
        except ConfigError as e:
            print(f"buildvault: {e}", file=sys.stderr)
            return 2
    if not path:
        print("buildvault: no audit log: pass --audit-log FILE (or set BUILDVAULT_AUDIT_LOG)", file=sys.stderr)
        return 2
    wanted = args.digest.strip().lower()
    found = 0
    try:
        for entry in read_entries(Path(path)):
            if not _matches(entry, wanted) or (args.instance is not None and entry.get("instance") != args.instance):
                continue
            found += 1
            if args.json:
                print(json.dumps(entry, separators=(",", ":")))
                continue
            claims = entry.get("claims") or {}
            job = " ".join(f"{k}={v}" for k, v in claims.items() if k != "sub")
            print(
                f"{entry.get('time')} {entry.get('kind')} {entry.get('protocol')} instance={entry.get('instance')!r} "
                f"digest={entry.get('digest')} principal={entry.get('principal')} client={entry.get('client')}"
                + (f" {job}" if job else "")
            )
    except OSError as e:
        print(f"buildvault: audit log {path}: {e.strerror or e}", file=sys.stderr)
        return 1
    if not found:
        print(f"buildvault: no write of {wanted} in {path}", file=sys.stderr)
        return 3
    return 0
