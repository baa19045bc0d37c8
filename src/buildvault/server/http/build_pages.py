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
import datetime
import html
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from urllib.parse import quote, urlencode

from aiohttp import web
from google.protobuf.message import DecodeError
from google.protobuf.timestamp_pb2 import Timestamp

from buildvault.digest import Digest, InvalidDigest, verify_instance_name
from buildvault.history.actions import (
    ActionView,
    Comparison,
    Explanation,
    compare_actions,
    digest_key,
    explain_miss,
    is_secret,
    list_directory,
    load_actions,
    parse_digest,
)
from buildvault.history.recorder import Recorder
from buildvault.history.store import HistoryStore, InvocationDetail, InvocationSummary, Row
from buildvault.remote_apis import re_pb2
from buildvault.server.auth import Auth
from buildvault.server.auth.grants import Permission
from buildvault.server.auth.http_auth import CHALLENGE, PRINCIPAL
from buildvault.server.auth.policy import Refusal
from buildvault.server.http.protocol import REQUEST_KIND
from buildvault.storage import ActionStore, BlobStore, NotFound, ac_namespace

__all__ = ["BuildPages", "DEFAULT_SECRET_PATTERNS"]

DEFAULT_SECRET_PATTERNS = ("*TOKEN*", "*SECRET*", "*PASSWORD*", "*KEY*")
MASK = "••••••"
# The most bytes of stdout/stderr shown inline on the action page.
INLINE_LIMIT = 64 << 10
# The misses an invocation page lists before "every miss" (?misses=all).
MISS_PAGE = 1000
e = html.escape


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _Refused(Exception):
    def __init__(self, response: web.Response) -> None:
        self.response = response


def _when(t: float | None) -> str:
    if t is None:
        return "–"
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _seconds(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.1f} s"


def _bytes(n: int) -> str:
    from buildvault.config import format_size

    return format_size(float(n))


def _q(**params: str) -> str:
    kept = {k: v for k, v in params.items() if v}
    return "?" + urlencode(kept) if kept else ""


_PLAIN_DIGEST = re.compile(r"[0-9a-f]{1,128}/[0-9]{1,20}")


def _digest_url(key: str) -> str:
    """`hash/size` -> `hash-size` (the pages' path form)."""
    return key.replace("/", "-", 1)


def _action_link(key: str, instance: str, text: str | None = None) -> str:
    url = f"/action/{quote(_digest_url(key))}{_q(instance=instance)}"
    return f'<a href="{e(url)}"><code>{e(text or key[:12] + "…/" + key.partition("/")[2])}</code></a>'


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
    """`rows` hold HTML already escaped."""
    head = "".join(f"<th>{e(h)}</th>" for h in headers)
    body = "\n".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>\n{body}\n</tbody></table>'


_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}th,td{padding:.25em .8em;border-bottom:1px solid #ddd;
text-align:left;vertical-align:top}th{font-weight:600;color:#555}td{font-variant-numeric:tabular-nums}
code,pre{font-family:ui-monospace,monospace;font-size:.92em}pre{background:#f6f6f6;padding:.6em;overflow:auto;
max-height:30em}nav a{margin-right:1em}.miss{color:#a40}.hit{color:#070}.failed{color:#b00}
ul.findings li{margin:.3em 0}.added{background:#e6ffe6}.removed{background:#ffe6e6}.changed{background:#fff6d6}
form{margin:1em 0}footer{margin-top:1.5em;color:#777;font-size:.9em}
"""


def _page(title: str, body: str, status: int = 200) -> web.Response:
    text = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)} · buildvault</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_STYLE}</style></head>
<body><nav><a href="/">status</a><a href="/invocations">invocations</a></nav>
<h1>{e(title)}</h1>
{body}
</body></html>
"""
    return web.Response(text=text, content_type="text/html", status=status)


def _error(status: int, message: str) -> web.Response:
    return _page(f"{status}", f"<p>{e(message)}</p>", status)


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
                return _error(400, str(error))

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
            raise _Refused(_error(404, "the history is off on this server (--history false, or its database failed)"))
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
            return _error(400, f"unknown outcome {outcome!r}: want ok, failed, running or misses")
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
                e(_when(i.first)),
                e(_seconds(max(0.0, (i.bes_finished or i.last) - (i.bes_started or i.first)))),
                f'<span class="{e(i.outcome)}">{e(i.outcome)}</span>'
                + (f" (exit {i.exit_code})" if i.exit_code is not None else ""),
                f"{i.hits:,}",
                f'<span class="miss">{i.misses:,}</span>' if i.misses else "0",
                f"{i.executed:,}",
                e(_bytes(i.bytes_up)),
                e(_bytes(i.bytes_down)),
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
        body = form + (_table(headers, rows, "invocations") if rows else "<p>No invocations recorded.</p>")
        return _page("Invocations", body)

    # -- /invocation/<id> ----------------------------------------------------------------

    async def invocation(self, request: web.Request) -> web.Response:
        store = self._store()
        invocation_id = request.match_info["id"]
        if len(invocation_id) > 512:
            return _error(400, "invocation id longer than 512 characters")
        if self.history is not None:
            await self.history.flush()
        summary = await asyncio.to_thread(store.invocation, invocation_id)
        if summary is None:
            return _error(404, f"no invocation {invocation_id!r} is recorded")
        self._check(request, summary.instance)
        detail, events = await asyncio.gather(
            asyncio.to_thread(store.invocation_detail, invocation_id), asyncio.to_thread(store.events_of, invocation_id)
        )
        all_misses = request.query.get("misses") == "all"
        return _page(f"Invocation {invocation_id}", _render_invocation(summary, detail, events, all_misses))

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
            return _error(404, f"the server knows no action {digest.hash}/{digest.size_bytes} in this instance")
        body = [self._action_section(view, instance)]
        body.append(await self._tree_section(view, instance, path))
        body.append(await self._result_section(result, instance))
        body.append(_usage_section(rows, digest, instance))
        return _page(f"Action {digest.hash[:16]}…", "\n".join(body))

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
        parts.append(_table(("", ""), info))
        c = view.command
        if c is None:
            parts.append("<p>The client never uploaded this action's Command.</p>")
        else:
            parts.append("<h2>Command</h2><h3>Arguments</h3><pre>" + e(" \\\n  ".join(c.arguments)) + "</pre>")
            env_rows = [[f"<code>{e(v.name)}</code>", f"<code>{e(self._env_value(v.name, v.value))}</code>"]
                        for v in c.environment_variables]  # fmt: skip
            parts.append("<h3>Environment</h3>" + (_table(("name", "value"), env_rows) if env_rows else "<p>none</p>"))
            outputs = [[f"<code>{e(p)}</code>"] for p in view.outputs]
            parts.append("<h3>Output paths</h3>" + _table(("path",), outputs))
            if c.working_directory:
                parts.append(f"<p>Working directory: <code>{e(c.working_directory)}</code></p>")
        platform = [[f"<code>{e(k)}</code>", f"<code>{e(v)}</code>"] for k, v in sorted(view.platform.items())]
        parts.append("<h3>Platform</h3>" + (_table(("property", "value"), platform) if platform else "<p>none</p>"))
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
        base = f"/action/{quote(_digest_url(digest_key(view.digest)))}"
        rows = []
        if path:
            parent = path.rpartition("/")[0]
            rows.append([f'<a href="{e(base + _q(instance=instance, path=parent))}">..</a>', "", ""])
        for d in directory.directories:
            sub = f"{path}/{d.name}" if path else d.name
            rows.append([f'<a href="{e(base + _q(instance=instance, path=sub))}">{e(d.name)}/</a>', "directory", ""])
        for f in directory.files:
            key = f"{f.digest.hash}-{f.digest.size_bytes}"
            url = f"/blob/{quote(key)}/{quote(f.name, safe='')}{_q(instance=instance)}"
            rows.append([
                f'<a href="{e(url)}">{e(f.name)}</a>' + (" (executable)" if f.is_executable else ""),
                e(_bytes(f.digest.size_bytes)),
                f"<code>{e(f.digest.hash[:16])}…</code>",
            ])
        for s in directory.symlinks:
            rows.append([e(s.name), f"symlink → <code>{e(s.target)}</code>", ""])
        return heading + _table(("name", "size", "digest"), rows, "tree")

    async def _result_section(self, result: re_pb2.ActionResult | None, instance: str) -> str:
        if result is None:
            return "<h2>Result</h2><p>No ActionResult is stored for this action.</p>"
        parts = [f"<h2>Result</h2><p>Exit code <b>{result.exit_code}</b></p>"]
        rows = []
        for f in result.output_files:
            name = f.path.rpartition("/")[2] or "output"
            blob_key = f"{f.digest.hash}-{f.digest.size_bytes}"
            url = f"/blob/{quote(blob_key)}/{quote(name, safe='')}{_q(instance=instance)}"
            rows.append([f'<a href="{e(url)}"><code>{e(f.path)}</code></a>', e(_bytes(f.digest.size_bytes)), "file"])
        for d in result.output_directories:
            url = f"/blob/{quote(f'{d.tree_digest.hash}-{d.tree_digest.size_bytes}')}/tree{_q(instance=instance)}"
            rows.append([f'<a href="{e(url)}"><code>{e(d.path)}</code></a>', "", "directory (Tree)"])
        if rows:
            parts.append("<h3>Outputs</h3>" + _table(("path", "size", "kind"), rows, "outputs"))
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
                return _when(t.seconds + t.nanos / 1e9) if t.seconds else "–"

            info = [
                ("worker", f"<code>{e(m.worker)}</code>"),
                ("queued", e(ts(m.queued_timestamp))),
                ("worker started", e(ts(m.worker_start_timestamp))),
                ("execution started", e(ts(m.execution_start_timestamp))),
                ("execution completed", e(ts(m.execution_completed_timestamp))),
                ("worker completed", e(ts(m.worker_completed_timestamp))),
            ]
            parts.append("<h3>Execution</h3>" + _table(("", ""), info, "execution"))
        return "\n".join(parts)

    # -- /compare and /explain -----------------------------------------------------------

    async def compare(self, request: web.Request) -> web.Response:
        instance = self._instance(request)
        a, b = parse_digest(request.match_info["a"]), parse_digest(request.match_info["b"])
        earlier, this = await load_actions(self.blobs, [a, b])
        comparison = await compare_actions(self.blobs, earlier, this)
        return _page("Compare actions", self._render_comparison(comparison, instance))

    async def explain(self, request: web.Request) -> web.Response:
        instance = self._instance(request)
        digest = parse_digest(request.match_info["digest"])
        invocation = request.query.get("invocation", "")[:512]
        store = self._store()
        if self.history is not None:
            await self.history.flush()
        explanation = await explain_miss(store, self.blobs, instance, digest, invocation)
        return _page("Why did it miss?", self._render_explanation(explanation, instance))

    def _render_explanation(self, x: Explanation, instance: str) -> str:
        key = digest_key(x.missed.digest)
        parts = [f"<p>Action {_action_link(key, instance)}"]
        if x.row is not None:
            parts.append(
                f" (target <code>{e(x.row.target or '?')}</code>, mnemonic <code>{e(x.row.mnemonic or '?')}</code>,"
                f" invocation <a href=\"/invocation/{e(quote(x.row.invocation, safe=''))}\">"
                f"<code>{e(x.row.invocation)}</code></a>)"
            )
        parts.append("</p>")
        parts += [f'<p class="note">{e(n)}</p>' for n in x.notes]
        if x.earlier is not None and x.comparison is not None:
            earlier_key = digest_key(x.earlier.digest)
            parts.append(
                f"<p>Compared with the closest earlier action of the same step, found by {e(x.matched_by)}: "
                f"{_action_link(earlier_key, instance)} in invocation "
                f'<a href="/invocation/{e(quote(x.earlier_invocation, safe=""))}"><code>{e(x.earlier_invocation)}'
                "</code></a>.</p>"
            )
            findings = x.comparison.findings or ["nothing the server can see differs (same action key parts)"]
            parts.append('<h2>What changed</h2><ul class="findings">'
                         + "".join(f"<li>{_code_marks(f)}</li>" for f in findings) + "</ul>")  # fmt: skip
            url = f"/compare/{quote(_digest_url(earlier_key))}/{quote(_digest_url(key))}{_q(instance=instance)}"
            parts.append(f'<p><a href="{e(url)}">the full comparison</a></p>')
        return "\n".join(parts)

    def _render_comparison(self, c: Comparison, instance: str) -> str:
        a_key, b_key = digest_key(c.earlier.digest), digest_key(c.this.digest)
        parts = [f"<p>Earlier: {_action_link(a_key, instance)} · this: {_action_link(b_key, instance)}</p>"]
        findings = c.findings or ["nothing differs"]
        parts.append('<h2>Summary</h2><ul class="findings">'
                     + "".join(f"<li>{_code_marks(f)}</li>" for f in findings) + "</ul>")  # fmt: skip
        if c.inputs is not None:
            rows = [[f'<code class="changed">{e(p)}</code>', "changed",
                     f"<code>{e(x.hash[:12])}</code> → <code>{e(y.hash[:12])}</code>"] for p, x, y in c.inputs.changed]
            rows += [[f'<code class="added">{e(p)}</code>', "added", f"<code>{e(d.hash[:12])}</code>"]
                     for p, d in c.inputs.added]
            rows += [[f'<code class="removed">{e(p)}</code>', "removed", f"<code>{e(d.hash[:12])}</code>"]
                     for p, d in c.inputs.removed]
            rows += [[f"<code>{e(p)}</code>", "not uploaded", e(side)] for p, side in c.inputs.unavailable]  # fmt: skip
            parts.append(f"<h2>Inputs</h2><p>{c.inputs.same_files:,} files are the same in both.</p>"
                         + _table(("path", "change", "digest"), rows, "inputs"))  # fmt: skip
        args_a, args_b = c.earlier.arguments, c.this.arguments
        if c.arguments:
            rows = []
            for _, i1, i2, j1, j2 in c.arguments:
                rows.append([f'<code class="removed">{e(" ".join(args_a[i1:i2]))}</code>',
                             f'<code class="added">{e(" ".join(args_b[j1:j2]))}</code>'])  # fmt: skip
            parts.append("<h2>Arguments</h2>" + _table(("earlier", "this"), rows, "arguments"))
        env_a, env_b = c.earlier.environment, c.this.environment
        env_rows = [
            [f"<code>{e(n)}</code>", f"<code>{e(self._env_value(n, env_a.get(n, '–')))}</code>",
             f"<code>{e(self._env_value(n, env_b.get(n, '–')))}</code>"]
            for n in sorted(env_a.keys() | env_b.keys()) if env_a.get(n) != env_b.get(n)
        ]  # fmt: skip
        if env_rows:
            parts.append("<h2>Environment</h2>" + _table(("name", "earlier", "this"), env_rows))
        pa, pb = c.earlier.platform, c.this.platform
        platform_rows = [
            [f"<code>{e(n)}</code>", f"<code>{e(pa.get(n, '–'))}</code>", f"<code>{e(pb.get(n, '–'))}</code>"]
            for n in sorted(pa.keys() | pb.keys())
            if pa.get(n) != pb.get(n)
        ]
        if platform_rows:
            parts.append("<h2>Platform</h2>" + _table(("property", "earlier", "this"), platform_rows))
        return "\n".join(parts)

    # -- /blob ---------------------------------------------------------------------------

    async def blob(self, request: web.Request) -> web.StreamResponse:
        self._instance(request)  # the read rule of the instance the link came from
        digest = parse_digest(request.match_info["digest"])
        name = request.match_info["name"]
        try:
            chunks = await self.blobs.read(digest)
        except NotFound:
            return _error(404, f"blob {digest.hash}/{digest.size_bytes} is not in the CAS")
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


# A blob Bazel names in its build events: bytestream://HOST[:PORT]/[INSTANCE/]blobs/HASH/SIZE
_BYTESTREAM_URI = re.compile(r"bytestream://[^\s/]+/(?:[^\s]*/)?blobs/([0-9a-f]{64})/(\d+)")


def _linked(detail: str, instance: str) -> str:
    """A build event's detail, escaped, each line's `name: bytestream://…/blobs/H/S` a download."""
    lines = []
    for line in detail.split("\n"):
        name, sep, rest = line.partition(": ")
        match = _BYTESTREAM_URI.fullmatch(rest.strip()) if sep else None
        if match is None:
            lines.append(e(line))
            continue
        url = f"/blob/{match.group(1)}-{match.group(2)}/{quote(name or 'log', safe='')}{_q(instance=instance)}"
        lines.append(f'{e(name)}: <a class="log" href="{e(url)}">{e(rest.strip())}</a>')
    return "\n".join(lines)


def _code_marks(sentence: str) -> str:
    """A finding with its `quoted` names as <code> (escaped first)."""
    pieces = e(sentence).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(pieces))


Event = tuple[float, str, str, str, str]


def _usage_section(rows: list[Row], digest: Digest, instance: str) -> str:
    """The invocations that looked this action up, stored or executed it."""
    if not rows:
        return "<h2>Invocations</h2><p>No recorded call names this action.</p>"
    key = digest_key(digest)
    table = []
    for r in rows:
        link = f'<a href="/invocation/{e(quote(r.invocation, safe=""))}"><code>{e(r.invocation)}</code></a>'
        why = ""
        if r.outcome == "miss":
            url = f"/explain/{quote(_digest_url(key))}{_q(instance=instance, invocation=r.invocation)}"
            why = f'<a class="why" href="{e(url)}">why did it miss?</a>'
        table.append([link if r.invocation else "–", e(_when(r.time)), e(r.method), e(r.outcome),
                      f"<code>{e(r.target)}</code>", f"<code>{e(r.mnemonic)}</code>", why])  # fmt: skip
    headers = ("invocation", "time (UTC)", "call", "outcome", "target", "mnemonic", "")
    return "<h2>Invocations</h2>" + _table(headers, table, "usage")


def _render_invocation(
    summary: InvocationSummary, detail: InvocationDetail, events: list[Event], all_misses: bool = False
) -> str:
    i = summary
    instance = i.instance
    info = [
        ("instance", e(instance or "(default)")),
        ("tool", e(f"{i.tool} {i.tool_version}".strip() or "–")),
        ("command", e(" ".join(filter(None, (i.command, i.patterns))) or "–")),
        ("options", f"<code>{e(i.options)}</code>" if i.options else "–"),
        ("started (UTC)", e(_when(i.bes_started or i.first))),
        ("duration", e(_seconds(max(0.0, (i.bes_finished or i.last) - (i.bes_started or i.first))))),
        ("result", e(i.outcome) + (f" (exit code {i.exit_code}{' ' + e(i.exit_name) if i.exit_name else ''})"
                                   if i.exit_code is not None else "")),  # fmt: skip
        ("cache hits", f'<span class="hit" id="hits">{i.hits:,}</span>'),
        ("cache misses", f'<span class="miss" id="misses">{i.misses:,}</span>'),
        ("remote executions", f'<span id="executed">{i.executed:,}</span>'),
        ("results uploaded", f"{i.uploads:,}"),
        ("bytes up / down", e(f"{_bytes(i.bytes_up)} / {_bytes(i.bytes_down)}")),
    ]
    if i.correlated:
        info.append(("correlated invocations", f"<code>{e(i.correlated)}</code>"))
    parts = [_table(("", ""), info, "summary")]
    counts = ("hit", "miss", "executed", "failed")
    mrows = [[f"<code>{e(m or '(none)')}</code>", *(f"{n:,}" for n in ns)] for m, *ns in detail.by_mnemonic]
    parts.append("<h2>By mnemonic</h2>" + _table(("mnemonic", *counts), mrows, "mnemonics"))
    trows = [[f"<code>{e(t or '(none)')}</code>", *(f"{n:,}" for n in ns)] for t, *ns in detail.by_target]
    parts.append("<h2>By target (most misses first)</h2>" + _table(("target", *counts), trows, "targets"))
    srows = [[_action_link(r.digest, instance), f"<code>{e(r.mnemonic)}</code>", f"<code>{e(r.target)}</code>",
              e(r.method), e(r.outcome), e(_seconds(r.duration))] for r in detail.slowest]  # fmt: skip
    parts.append("<h2>Slowest calls</h2>" + _table(("action", "mnemonic", "target", "call", "outcome", "took"), srows))
    if detail.failed:
        frows = [[_action_link(r.digest, instance), f"<code>{e(r.mnemonic)}</code>", f"<code>{e(r.target)}</code>",
                  e(r.method), e(r.code)] for r in detail.failed]  # fmt: skip
        parts.append("<h2>Failed calls</h2>" + _table(("action", "mnemonic", "target", "call", "status"), frows))
    if events:
        erows = [
            [e(kind), f"<code>{e(label)}</code>", e(status), f"<pre>{_linked(d, instance)}</pre>" if d else ""]
            for _, kind, label, status, d in events
        ]
        parts.append("<h2>Build events</h2>" + _table(("event", "label", "status", "detail"), erows, "events"))
    # Built straight, one string per miss: an invocation may list thousands (the first MISS_PAGE
    # unless ?misses=all).
    explain_query = e(_q(instance=instance, invocation=i.id))
    shown = detail.misses if all_misses else detail.misses[:MISS_PAGE]
    lines = []
    for key, mnemonic, target in shown:
        path = _digest_url(key) if _PLAIN_DIGEST.fullmatch(key) else quote(_digest_url(key))
        lines.append(
            f'<tr><td><a class="why" href="/explain/{path}{explain_query}">{e(key[:12])}…</a></td>'
            f"<td><code>{e(mnemonic)}</code></td><td><code>{e(target)}</code></td></tr>"
        )
    head = "<thead><tr><th>why did it miss?</th><th>mnemonic</th><th>target</th></tr></thead>"
    listing = f'<table class="misses">{head}<tbody>\n' + "\n".join(lines) + "\n</tbody></table>"
    more = ""
    if len(shown) < len(detail.misses):
        url = f"/invocation/{quote(i.id, safe='')}?misses=all"
        more = f'<p>The first {len(shown):,} of {len(detail.misses):,}: <a href="{e(url)}">every miss</a></p>'
    parts.append(f"<h2>Misses ({len(detail.misses):,})</h2>" + (more + listing if lines else "<p>none</p>"))
    return "\n".join(parts)
