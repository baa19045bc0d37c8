"""The build pages on the HTTP port: invocations, an invocation, an action, two actions compared,
a miss explained, and downloads of the blobs they show. Server-rendered HTML, no scripts.

    /invocations?instance=&outcome=      recent invocations (ok, failed, running, misses)
    /invocation/<id>                     one invocation: totals, by mnemonic and target, misses
    /action/<sha256>-<size>?instance=&path=   Action, Command, input tree, result, its invocations
    /compare/<a>/<b>?instance=           what differs between two actions
    /explain/<sha256>-<size>?instance=&invocation=   why the action missed
    /blob/<sha256>-<size>/<name>?instance=           a blob's bytes (a file of a tree, an output)

Every page follows the read rule of the instance it shows, as the API would (401 without a
credential, 403 without read on that instance; the invocation list shows only readable
instances). Every value shown is escaped; environment values whose names match the secret
patterns are masked. The data comes from buildvault.history (queries in a thread) and the CAS.
"""

from __future__ import annotations

import asyncio
import html
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from urllib.parse import quote

from aiohttp import web
from google.protobuf.message import DecodeError
from google.protobuf.timestamp_pb2 import Timestamp

from buildvault.config import Settings, parse_list
from buildvault.digest import Digest, InvalidDigest, verify_instance_name
from buildvault.history.actions import (
    ActionView,
    compare_actions,
    digest_key,
    explain_miss,
    is_secret,
    list_directory,
    load_actions,
    parse_digest,
)
from buildvault.history.recorder import Recorder
from buildvault.history.store import HistoryStore, Row
from buildvault.remote_apis import re_pb2
from buildvault.server.auth import Auth
from buildvault.server.auth.grants import Permission
from buildvault.server.auth.http_auth import CHALLENGE, PRINCIPAL
from buildvault.server.auth.policy import Refusal
from buildvault.server.http import html_page as h
from buildvault.server.http.build_render import render_comparison, render_explanation, render_invocation, usage_section
from buildvault.server.http.handlers import REQUEST_KIND
from buildvault.storage import ActionStore, BlobStore, NotFound, ac_namespace

__all__ = ["BuildPages", "DEFAULT_SECRET_PATTERNS"]

DEFAULT_SECRET_PATTERNS = parse_list(Settings.history_secret_patterns)
MASK = "••••••"
# The most bytes of stdout/stderr shown inline on the action page.
INLINE_LIMIT = 64 << 10
e = html.escape


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _Refused(Exception):
    def __init__(self, response: web.Response) -> None:
        self.response = response


@dataclass
class BuildPages:
    """The handlers, over the history store, the CAS, the ActionCache store and access control."""

    history: Recorder | None
    blobs: BlobStore
    actions: ActionStore
    auth: Auth | None = None
    secret_patterns: Sequence[str] = DEFAULT_SECRET_PATTERNS

    def add_routes(self, app: web.Application) -> None:
        for path, handler in (
            ("/invocations", self.invocations),
            ("/invocation/{id}", self.invocation),
            ("/action/{digest}", self.action),
            ("/compare/{a}/{b}", self.compare),
            ("/explain/{digest}", self.explain),
            ("/blob/{digest}/{name}", self.blob),
        ):
            app.router.add_get(path, self._guarded(handler))

    def _guarded(self, handler: Handler) -> Handler:
        async def run(request: web.Request) -> web.StreamResponse:
            request[REQUEST_KIND] = "pages"
            try:
                response: web.StreamResponse = await handler(request)
                return response
            except _Refused as refused:
                return refused.response
            except InvalidDigest as error:
                return h.error(400, str(error))

        return run

    # -- access ----------------------------------------------------------------------------

    def _allows(self, request: web.Request, instance: str) -> bool:
        if self.auth is None or not self.auth.policy.enabled:
            return True
        return self.auth.policy.allows(request.get(PRINCIPAL), Permission.READ, instance)

    def _check(self, request: web.Request, instance: str) -> None:
        """Read on `instance`, answered as the HTTP cache answers: 401 with a challenge, or 403."""
        if self.auth is None or not self.auth.policy.enabled:
            return
        try:
            self.auth.policy.authorize(request.get(PRINCIPAL), Permission.READ, instance)
        except Refusal as refusal:
            self.auth.refused("http", refusal)
            if refusal.unauthenticated:
                raise _Refused(web.Response(status=401, text=str(refusal) + "\n", headers=CHALLENGE)) from None
            raise _Refused(web.Response(status=403, text=str(refusal) + "\n")) from None

    def _instance(self, request: web.Request) -> str:
        instance = verify_instance_name(request.query.get("instance", ""))
        self._check(request, instance)
        return instance

    def _store(self) -> HistoryStore:
        if self.history is None or not self.history.enabled:
            raise _Refused(h.error(404, "the history is off on this server (--history false, or its database failed)"))
        return self.history.store

    # -- /invocations --------------------------------------------------------------------

    async def invocations(self, request: web.Request) -> web.Response:
        store = self._store()
        instance = request.query.get("instance")
        if instance:
            instance = verify_instance_name(instance)
            self._check(request, instance)
        outcome = request.query.get("outcome", "")
        if outcome not in ("", "ok", "failed", "running", "misses"):
            return h.error(400, f"unknown outcome {outcome!r}: want ok, failed, running or misses")
        if self.history is not None:
            await self.history.flush()
        found = await asyncio.to_thread(store.invocations, instance=instance or None, limit=500)
        shown = [i for i in found if self._allows(request, i.instance)]
        if outcome == "misses":
            shown = [i for i in shown if i.misses]
        elif outcome:
            shown = [i for i in shown if i.outcome == outcome]
        rows = [
            [
                f'<a href="/invocation/{e(quote(i.id, safe=""))}"><code>{e(i.id)}</code></a>',
                e(i.instance or "(default)"),
                e(f"{i.tool} {i.tool_version}".strip()),
                e(" ".join(filter(None, (i.command, i.patterns)))),
                e(h.when(i.first)),
                e(h.seconds(max(0.0, (i.bes_finished or i.last) - (i.bes_started or i.first)))),
                f'<span class="{e(i.outcome)}">{e(i.outcome)}</span>'
                + (f" (exit {i.exit_code})" if i.exit_code is not None else ""),
                f"{i.hits:,}",
                f'<span class="miss">{i.misses:,}</span>' if i.misses else "0",
                f"{i.executed:,}",
                e(h.size(i.bytes_up)),
                e(h.size(i.bytes_down)),
            ]
            for i in shown
        ]
        options = "".join(
            f'<option value="{v}"{" selected" if v == outcome else ""}>{v or "any"}</option>'
            for v in ("", "ok", "failed", "running", "misses")
        )
        form = (
            f'<form method="get" action="/invocations"><label>instance <input name="instance" '
            f'value="{e(instance or "")}"></label> <label>outcome <select name="outcome">{options}</select></label> '
            '<button type="submit">filter</button></form>'
        )
        headers = ("invocation", "instance", "tool", "command", "started (UTC)", "duration", "result", "hits",
                   "misses", "executed", "up", "down")  # fmt: skip
        body = form + (h.table(headers, rows, "invocations") if rows else "<p>No invocations recorded.</p>")
        return h.page("Invocations", body)

    # -- /invocation/<id> ----------------------------------------------------------------

    async def invocation(self, request: web.Request) -> web.Response:
        store = self._store()
        invocation_id = request.match_info["id"]
        if len(invocation_id) > 512:
            return h.error(400, "invocation id longer than 512 characters")
        if self.history is not None:
            await self.history.flush()
        summary = await asyncio.to_thread(store.invocation, invocation_id)
        if summary is None:
            return h.error(404, f"no invocation {invocation_id!r} is recorded")
        self._check(request, summary.instance)
        detail, events = await asyncio.gather(
            asyncio.to_thread(store.invocation_detail, invocation_id), asyncio.to_thread(store.events_of, invocation_id)
        )
        all_misses = request.query.get("misses") == "all"
        return h.page(f"Invocation {invocation_id}", render_invocation(summary, detail, events, all_misses))

    # -- /action/<digest> ----------------------------------------------------------------

    async def action(self, request: web.Request) -> web.Response:
        instance = self._instance(request)
        digest = parse_digest(request.match_info["digest"])
        path = request.query.get("path", "").strip("/")
        view = (await load_actions(self.blobs, [digest]))[0]
        result = await self._action_result(instance, digest)
        rows: list[Row] = []
        if self.history is not None and self.history.enabled:
            await self.history.flush()
            rows = await asyncio.to_thread(self.history.store.requests_for, digest_key(digest))
        rows = [r for r in rows if r.instance == instance]
        if view.action is None and result is None and not rows:
            return h.error(404, f"the server knows no action {digest.hash}/{digest.size_bytes} in this instance")
        body = [self._action_section(view, instance)]
        body.append(await self._tree_section(view, instance, path))
        body.append(await self._result_section(result, instance))
        body.append(usage_section(rows, digest, instance))
        return h.page(f"Action {digest.hash[:16]}…", "\n".join(body))

    async def _action_result(self, instance: str, digest: Digest) -> re_pb2.ActionResult | None:
        try:
            data = await self.actions.get(ac_namespace(instance), digest)
        except NotFound:
            return None
        try:
            return re_pb2.ActionResult.FromString(data)
        except DecodeError:
            return None

    def _env_value(self, name: str, value: str) -> str:
        return MASK if is_secret(name, self.secret_patterns) else value

    def _action_section(self, view: ActionView, instance: str) -> str:
        d = view.digest
        if view.action is None:
            return (
                "<h2>Action</h2><p>The client never uploaded this Action message (Bazel with --remote_cache uploads "
                "it with each result it stores; a lookup alone does not).</p>"
            )
        a = view.action
        parts = ["<h2>Action</h2>"]
        info = [
            ("digest", f"<code>{e(d.hash)}/{d.size_bytes}</code>"),
            ("command", f"<code>{e(a.command_digest.hash)}/{a.command_digest.size_bytes}</code>"),
            ("input root", f"<code>{e(a.input_root_digest.hash)}/{a.input_root_digest.size_bytes}</code>"),
            ("timeout", e(f"{a.timeout.ToTimedelta().total_seconds():g} s") if a.HasField("timeout") else "–"),
            ("do_not_cache", "yes" if a.do_not_cache else "no"),
        ]
        parts.append(h.table(("", ""), info))
        c = view.command
        if c is None:
            parts.append("<p>The client never uploaded this action's Command.</p>")
        else:
            parts.append("<h2>Command</h2><h3>Arguments</h3><pre>" + e(" \\\n  ".join(c.arguments)) + "</pre>")
            env_rows = [[f"<code>{e(v.name)}</code>", f"<code>{e(self._env_value(v.name, v.value))}</code>"]
                        for v in c.environment_variables]  # fmt: skip
            parts.append("<h3>Environment</h3>" + (h.table(("name", "value"), env_rows) if env_rows else "<p>none</p>"))
            outputs = [[f"<code>{e(p)}</code>"] for p in view.outputs]
            parts.append("<h3>Output paths</h3>" + h.table(("path",), outputs))
            if c.working_directory:
                parts.append(f"<p>Working directory: <code>{e(c.working_directory)}</code></p>")
        platform = [[f"<code>{e(k)}</code>", f"<code>{e(v)}</code>"] for k, v in sorted(view.platform.items())]
        parts.append("<h3>Platform</h3>" + (h.table(("property", "value"), platform) if platform else "<p>none</p>"))
        return "\n".join(parts)

    async def _tree_section(self, view: ActionView, instance: str, path: str) -> str:
        root = view.input_root
        if root is None:
            return ""
        directory = await list_directory(self.blobs, root, path)
        heading = f"<h2>Input tree{': <code>' + e(path) + '</code>' if path else ''}</h2>"
        if directory is None:
            return heading + (
                "<p>The client did not upload this input tree (Bazel with --remote_cache alone uploads the Action "
                "and Command, not the input Directory messages).</p>"
                if not path
                else "<p>This directory is not in the CAS or the path names no directory.</p>"
            )
        base = f"/action/{quote(h.digest_url(digest_key(view.digest)))}"
        rows = []
        if path:
            parent = path.rpartition("/")[0]
            rows.append([f'<a href="{e(base + h.query(instance=instance, path=parent))}">..</a>', "", ""])
        for d in directory.directories:
            sub = f"{path}/{d.name}" if path else d.name
            rows.append(
                [f'<a href="{e(base + h.query(instance=instance, path=sub))}">{e(d.name)}/</a>', "directory", ""]
            )
        for f in directory.files:
            key = f"{f.digest.hash}-{f.digest.size_bytes}"
            url = f"/blob/{quote(key)}/{quote(f.name, safe='')}{h.query(instance=instance)}"
            rows.append(
                [
                    f'<a href="{e(url)}">{e(f.name)}</a>' + (" (executable)" if f.is_executable else ""),
                    e(h.size(f.digest.size_bytes)),
                    f"<code>{e(f.digest.hash[:16])}…</code>",
                ]
            )
        for s in directory.symlinks:
            rows.append([e(s.name), f"symlink → <code>{e(s.target)}</code>", ""])
        return heading + h.table(("name", "size", "digest"), rows, "tree")

    async def _result_section(self, result: re_pb2.ActionResult | None, instance: str) -> str:
        if result is None:
            return "<h2>Result</h2><p>No ActionResult is stored for this action.</p>"
        parts = [f"<h2>Result</h2><p>Exit code <b>{result.exit_code}</b></p>"]
        rows = []
        for f in result.output_files:
            name = f.path.rpartition("/")[2] or "output"
            blob_key = f"{f.digest.hash}-{f.digest.size_bytes}"
            url = f"/blob/{quote(blob_key)}/{quote(name, safe='')}{h.query(instance=instance)}"
            rows.append([f'<a href="{e(url)}"><code>{e(f.path)}</code></a>', e(h.size(f.digest.size_bytes)), "file"])
        for d in result.output_directories:
            url = f"/blob/{quote(f'{d.tree_digest.hash}-{d.tree_digest.size_bytes}')}/tree{h.query(instance=instance)}"
            rows.append([f'<a href="{e(url)}"><code>{e(d.path)}</code></a>', "", "directory (Tree)"])
        if rows:
            parts.append("<h3>Outputs</h3>" + h.table(("path", "size", "kind"), rows, "outputs"))
        for label, raw, digest in (("stdout", result.stdout_raw, result.stdout_digest),
                                   ("stderr", result.stderr_raw, result.stderr_digest)):  # fmt: skip
            text = raw
            if not text and digest.size_bytes and digest.size_bytes <= INLINE_LIMIT:
                try:
                    found = await self.blobs.read_blobs([parse_digest(f"{digest.hash}-{digest.size_bytes}")])
                except InvalidDigest:
                    found = []
                text = found[0] if found and isinstance(found[0], bytes) else b""
            if text:
                parts.append(f"<h3>{label}</h3><pre>{e(text.decode('utf-8', 'replace'))}</pre>")
        m = result.execution_metadata
        if m.worker or m.HasField("worker_start_timestamp"):

            def ts(t: Timestamp) -> str:
                return h.when(t.seconds + t.nanos / 1e9) if t.seconds else "–"

            info = [
                ("worker", f"<code>{e(m.worker)}</code>"),
                ("queued", e(ts(m.queued_timestamp))),
                ("worker started", e(ts(m.worker_start_timestamp))),
                ("execution started", e(ts(m.execution_start_timestamp))),
                ("execution completed", e(ts(m.execution_completed_timestamp))),
                ("worker completed", e(ts(m.worker_completed_timestamp))),
            ]
            parts.append("<h3>Execution</h3>" + h.table(("", ""), info, "execution"))
        return "\n".join(parts)

    # -- /compare and /explain -----------------------------------------------------------

    async def compare(self, request: web.Request) -> web.Response:
        instance = self._instance(request)
        a, b = parse_digest(request.match_info["a"]), parse_digest(request.match_info["b"])
        earlier, this = await load_actions(self.blobs, [a, b])
        comparison = await compare_actions(self.blobs, earlier, this)
        return h.page("Compare actions", render_comparison(comparison, instance, self._env_value))

    async def explain(self, request: web.Request) -> web.Response:
        instance = self._instance(request)
        digest = parse_digest(request.match_info["digest"])
        invocation = request.query.get("invocation", "")[:512]
        store = self._store()
        if self.history is not None:
            await self.history.flush()
        explanation = await explain_miss(store, self.blobs, instance, digest, invocation)
        return h.page("Why did it miss?", render_explanation(explanation, instance))

    # -- /blob ---------------------------------------------------------------------------

    async def blob(self, request: web.Request) -> web.StreamResponse:
        self._instance(request)  # the read rule of the instance the link came from
        digest = parse_digest(request.match_info["digest"])
        name = request.match_info["name"]
        try:
            chunks = await self.blobs.read(digest)
        except NotFound:
            return h.error(404, f"blob {digest.hash}/{digest.size_bytes} is not in the CAS")
        response = web.StreamResponse()
        response.content_length = digest.size_bytes
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Content-Security-Policy"] = "sandbox"
        first = True
        async for chunk in chunks:
            if first:
                first = False
                text = b"\0" not in chunk[:8192] and _utf8_prefix(chunk[:8192])
                response.content_type = "text/plain" if text else "application/octet-stream"
                if text:
                    response.charset = "utf-8"
                disposition = "inline" if text else "attachment"
                response.headers["Content-Disposition"] = f"{disposition}; filename*=UTF-8''{quote(name, safe='')}"
                await response.prepare(request)
            await response.write(chunk)
        if first:
            response.content_type = "text/plain"
            await response.prepare(request)
        await response.write_eof()
        return response


def _utf8_prefix(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError as error:
        return error.start >= len(data) - 3  # a character cut at the end of the sample
