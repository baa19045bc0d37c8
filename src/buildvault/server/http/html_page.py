"""The HTML kit of the build pages: one page frame, tables, links, and how times, durations and
sizes are written. Every value is escaped by the caller with `e` before it reaches a table."""

from __future__ import annotations

import datetime
import html
import re
from collections.abc import Sequence
from urllib.parse import quote, urlencode

from aiohttp import web

from buildvault.config import format_size

e = html.escape


def when(t: float | None) -> str:
    if t is None:
        return "–"
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


def seconds(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.1f} s"


def size(n: int) -> str:
    return format_size(float(n))


def query(**params: str) -> str:
    kept = {k: v for k, v in params.items() if v}
    return "?" + urlencode(kept) if kept else ""


PLAIN_DIGEST = re.compile(r"[0-9a-f]{1,128}/[0-9]{1,20}")


def digest_url(key: str) -> str:
    """`hash/size` -> `hash-size` (the pages' path form)."""
    return key.replace("/", "-", 1)


def action_link(key: str, instance: str, text: str | None = None) -> str:
    url = f"/action/{quote(digest_url(key))}{query(instance=instance)}"
    return f'<a href="{e(url)}"><code>{e(text or key[:12] + "…/" + key.partition("/")[2])}</code></a>'


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
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


def page(title: str, body: str, status: int = 200) -> web.Response:
    text = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)} · buildvault</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_STYLE}</style></head>
<body><nav><a href="/">status</a><a href="/invocations">invocations</a></nav>
<h1>{e(title)}</h1>
{body}
</body></html>
"""
    return web.Response(text=text, content_type="text/html", status=status)


def error(status: int, message: str) -> web.Response:
    return page(f"{status}", f"<p>{e(message)}</p>", status)
