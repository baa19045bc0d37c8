"""The build pages' views that need no I/O: an invocation, the calls naming an action, a miss
explained and two actions compared, each rendered from what buildvault.history found."""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from urllib.parse import quote

from buildvault.digest import Digest
from buildvault.history.actions import Comparison, Explanation, digest_key
from buildvault.history.store import InvocationDetail, InvocationSummary, Row
from buildvault.server.http import html_page as h

__all__ = ["code_marks", "render_comparison", "render_explanation", "render_invocation", "usage_section"]

e = html.escape
# The misses an invocation page lists before "every miss" (?misses=all).
MISS_PAGE = 1000


# A blob Bazel names in its build events: bytestream://HOST[:PORT]/[INSTANCE/]blobs/HASH/SIZE
_BYTESTREAM_URI = re.compile(r"bytestream://[^\s/]+/(?:[^\s]*/)?blobs/([0-9a-f]{64})/(\d+)")


def linked(detail: str, instance: str) -> str:
    """A build event's detail, escaped, each line's `name: bytestream://…/blobs/H/S` a download."""
    lines = []
    for line in detail.split("\n"):
        name, sep, rest = line.partition(": ")
        match = _BYTESTREAM_URI.fullmatch(rest.strip()) if sep else None
        if match is None:
            lines.append(e(line))
            continue
        url = f"/blob/{match.group(1)}-{match.group(2)}/{quote(name or 'log', safe='')}{h.query(instance=instance)}"
        lines.append(f'{e(name)}: <a class="log" href="{e(url)}">{e(rest.strip())}</a>')
    return "\n".join(lines)


def code_marks(sentence: str) -> str:
    """A finding with its `quoted` names as <code> (escaped first)."""
    pieces = e(sentence).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(pieces))


Event = tuple[float, str, str, str, str]


def usage_section(rows: list[Row], digest: Digest, instance: str) -> str:
    """The invocations that looked this action up, stored or executed it."""
    if not rows:
        return "<h2>Invocations</h2><p>No recorded call names this action.</p>"
    key = digest_key(digest)
    table = []
    for r in rows:
        link = f'<a href="/invocation/{e(quote(r.invocation, safe=""))}"><code>{e(r.invocation)}</code></a>'
        why = ""
        if r.outcome == "miss":
            url = f"/explain/{quote(h.digest_url(key))}{h.query(instance=instance, invocation=r.invocation)}"
            why = f'<a class="why" href="{e(url)}">why did it miss?</a>'
        table.append([link if r.invocation else "–", e(h.when(r.time)), e(r.method), e(r.outcome),
                      f"<code>{e(r.target)}</code>", f"<code>{e(r.mnemonic)}</code>", why])  # fmt: skip
    headers = ("invocation", "time (UTC)", "call", "outcome", "target", "mnemonic", "")
    return "<h2>Invocations</h2>" + h.table(headers, table, "usage")


def render_invocation(
    summary: InvocationSummary, detail: InvocationDetail, events: list[Event], all_misses: bool = False
) -> str:
    i = summary
    instance = i.instance
    info = [
        ("instance", e(instance or "(default)")),
        ("tool", e(f"{i.tool} {i.tool_version}".strip() or "–")),
        ("command", e(" ".join(filter(None, (i.command, i.patterns))) or "–")),
        ("options", f"<code>{e(i.options)}</code>" if i.options else "–"),
        ("started (UTC)", e(h.when(i.bes_started or i.first))),
        ("duration", e(h.seconds(max(0.0, (i.bes_finished or i.last) - (i.bes_started or i.first))))),
        (
            "result",
            e(i.outcome)
            + (
                f" (exit code {i.exit_code}{' ' + e(i.exit_name) if i.exit_name else ''})"
                if i.exit_code is not None
                else ""
            ),
        ),  # fmt: skip
        ("cache hits", f'<span class="hit" id="hits">{i.hits:,}</span>'),
        ("cache misses", f'<span class="miss" id="misses">{i.misses:,}</span>'),
        ("remote executions", f'<span id="executed">{i.executed:,}</span>'),
        ("results uploaded", f"{i.uploads:,}"),
        ("bytes up / down", e(f"{h.size(i.bytes_up)} / {h.size(i.bytes_down)}")),
    ]
    if i.correlated:
        info.append(("correlated invocations", f"<code>{e(i.correlated)}</code>"))
    parts = [h.table(("", ""), info, "summary")]
    counts = ("hit", "miss", "executed", "failed")
    mrows = [[f"<code>{e(m or '(none)')}</code>", *(f"{n:,}" for n in ns)] for m, *ns in detail.by_mnemonic]
    parts.append("<h2>By mnemonic</h2>" + h.table(("mnemonic", *counts), mrows, "mnemonics"))
    trows = [[f"<code>{e(t or '(none)')}</code>", *(f"{n:,}" for n in ns)] for t, *ns in detail.by_target]
    parts.append("<h2>By target (most misses first)</h2>" + h.table(("target", *counts), trows, "targets"))
    srows = [[h.action_link(r.digest, instance), f"<code>{e(r.mnemonic)}</code>", f"<code>{e(r.target)}</code>",
              e(r.method), e(r.outcome), e(h.seconds(r.duration))] for r in detail.slowest]  # fmt: skip
    parts.append("<h2>Slowest calls</h2>" + h.table(("action", "mnemonic", "target", "call", "outcome", "took"), srows))
    if detail.failed:
        frows = [[h.action_link(r.digest, instance), f"<code>{e(r.mnemonic)}</code>", f"<code>{e(r.target)}</code>",
                  e(r.method), e(r.code)] for r in detail.failed]  # fmt: skip
        parts.append("<h2>Failed calls</h2>" + h.table(("action", "mnemonic", "target", "call", "status"), frows))
    if events:
        erows = [
            [e(kind), f"<code>{e(label)}</code>", e(status), f"<pre>{linked(d, instance)}</pre>" if d else ""]
            for _, kind, label, status, d in events
        ]
        parts.append("<h2>Build events</h2>" + h.table(("event", "label", "status", "detail"), erows, "events"))
    # Built straight, one string per miss: an invocation may list thousands (the first MISS_PAGE
    # unless ?misses=all).
    explain_query = e(h.query(instance=instance, invocation=i.id))
    shown = detail.misses if all_misses else detail.misses[:MISS_PAGE]
    lines = []
    for key, mnemonic, target in shown:
        path = h.digest_url(key) if h.PLAIN_DIGEST.fullmatch(key) else quote(h.digest_url(key))
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


def render_explanation(x: Explanation, instance: str) -> str:
    key = digest_key(x.missed.digest)
    parts = [f"<p>Action {h.action_link(key, instance)}"]
    if x.row is not None:
        parts.append(
            f" (target <code>{e(x.row.target or '?')}</code>, mnemonic <code>{e(x.row.mnemonic or '?')}</code>,"
            f' invocation <a href="/invocation/{e(quote(x.row.invocation, safe=""))}">'
            f"<code>{e(x.row.invocation)}</code></a>)"
        )
    parts.append("</p>")
    parts += [f'<p class="note">{e(n)}</p>' for n in x.notes]
    if x.earlier is not None and x.comparison is not None:
        earlier_key = digest_key(x.earlier.digest)
        parts.append(
            f"<p>Compared with the closest earlier action of the same step, found by {e(x.matched_by)}: "
            f"{h.action_link(earlier_key, instance)} in invocation "
            f'<a href="/invocation/{e(quote(x.earlier_invocation, safe=""))}"><code>{e(x.earlier_invocation)}'
            "</code></a>.</p>"
        )
        findings = x.comparison.findings or ["nothing the server can see differs (same action key parts)"]
        parts.append('<h2>What changed</h2><ul class="findings">'
                     + "".join(f"<li>{code_marks(f)}</li>" for f in findings) + "</ul>")  # fmt: skip
        url = f"/compare/{quote(h.digest_url(earlier_key))}/{quote(h.digest_url(key))}{h.query(instance=instance)}"
        parts.append(f'<p><a href="{e(url)}">the full comparison</a></p>')
    return "\n".join(parts)


def render_comparison(c: Comparison, instance: str, shown: Callable[[str, str], str]) -> str:
    """`shown(name, value)` is the environment value as the page may show it (secrets masked)."""
    a_key, b_key = digest_key(c.earlier.digest), digest_key(c.this.digest)
    parts = [f"<p>Earlier: {h.action_link(a_key, instance)} · this: {h.action_link(b_key, instance)}</p>"]
    findings = c.findings or ["nothing differs"]
    parts.append('<h2>Summary</h2><ul class="findings">'
                 + "".join(f"<li>{code_marks(f)}</li>" for f in findings) + "</ul>")  # fmt: skip
    if c.inputs is not None:
        rows = [
            [
                f'<code class="changed">{e(p)}</code>',
                "changed",
                f"<code>{e(x.hash[:12])}</code> → <code>{e(y.hash[:12])}</code>",
            ]
            for p, x, y in c.inputs.changed
        ]
        rows += [
            [f'<code class="added">{e(p)}</code>', "added", f"<code>{e(d.hash[:12])}</code>"] for p, d in c.inputs.added
        ]
        rows += [
            [f'<code class="removed">{e(p)}</code>', "removed", f"<code>{e(d.hash[:12])}</code>"]
            for p, d in c.inputs.removed
        ]
        rows += [[f"<code>{e(p)}</code>", "not uploaded", e(side)] for p, side in c.inputs.unavailable]  # fmt: skip
        parts.append(f"<h2>Inputs</h2><p>{c.inputs.same_files:,} files are the same in both.</p>"
                     + h.table(("path", "change", "digest"), rows, "inputs"))  # fmt: skip
    args_a, args_b = c.earlier.arguments, c.this.arguments
    if c.arguments:
        rows = []
        for _, i1, i2, j1, j2 in c.arguments:
            rows.append([f'<code class="removed">{e(" ".join(args_a[i1:i2]))}</code>',
                         f'<code class="added">{e(" ".join(args_b[j1:j2]))}</code>'])  # fmt: skip
        parts.append("<h2>Arguments</h2>" + h.table(("earlier", "this"), rows, "arguments"))
    env_a, env_b = c.earlier.environment, c.this.environment
    env_rows = [
        [f"<code>{e(n)}</code>", f"<code>{e(shown(n, env_a.get(n, '–')))}</code>",
         f"<code>{e(shown(n, env_b.get(n, '–')))}</code>"]
        for n in sorted(env_a.keys() | env_b.keys()) if env_a.get(n) != env_b.get(n)
    ]  # fmt: skip
    if env_rows:
        parts.append("<h2>Environment</h2>" + h.table(("name", "earlier", "this"), env_rows))
    pa, pb = c.earlier.platform, c.this.platform
    platform_rows = [
        [f"<code>{e(n)}</code>", f"<code>{e(pa.get(n, '–'))}</code>", f"<code>{e(pb.get(n, '–'))}</code>"]
        for n in sorted(pa.keys() | pb.keys())
        if pa.get(n) != pb.get(n)
    ]
    if platform_rows:
        parts.append("<h2>Platform</h2>" + h.table(("property", "earlier", "this"), platform_rows))
    return "\n".join(parts)
