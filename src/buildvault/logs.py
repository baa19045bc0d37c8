"""Logging: JSON lines on stderr, one per request at debug; a readable start-up banner at info.

With format `json` (the default) every record is one JSON object per line (`ts`, `level`,
`logger`, `msg` and any structured fields: for a request `rpc` (the method), `code` (the
status), `ms` (the duration), `peer`, and where known `instance`, `bytes`), so logs can be
parsed by machines. With format `text` the same record is one line for people:
`<ts> <LEVEL> <logger> <msg> key=value ...`. The banner is the exception to both:
a few plain lines saying what is listening where. Its first line,

    buildvault ready: grpc=127.0.0.1:9092 http=127.0.0.1:8080

is also the readiness signal tests and scripts wait for.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterable
from typing import IO, Any

BANNER_LOGGER = "buildvault.banner"
REQUEST_LOGGER = "buildvault.request"
READY_PREFIX = "buildvault ready:"

LOG_FORMATS = ("text", "json")

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}

request_log = logging.getLogger(REQUEST_LOGGER)
_banner_log = logging.getLogger(BANNER_LOGGER)

# Structured fields of the request being handled (set by the RPC wrapper, filled by handlers).
_fields: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "buildvault_request_fields", default=None
)
# Who the current gRPC call is (set by the auth check before the service runs; never a secret).
_principal: contextvars.ContextVar[str | None] = contextvars.ContextVar("buildvault_principal", default=None)


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": _timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            payload.update(fields)
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, separators=(",", ":"), default=str)


class TextFormatter(logging.Formatter):
    """One readable line per record: time, level, logger, message, then the structured fields."""

    def format(self, record: logging.LogRecord) -> str:
        parts = [_timestamp(record.created), record.levelname, record.name, record.getMessage()]
        fields = getattr(record, "fields", None) or {}
        parts += [f"{key}={_text_value(value)}" for key, value in fields.items()]
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _text_value(value: Any) -> str:
    text = str(value)
    # Quote what would split the line's key=value pairs, so a reader can still cut them apart.
    return json.dumps(text) if not text or any(c.isspace() or c in "\"=" for c in text) else text


def _timestamp(created: float) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
    return f"{seconds}.{int(created % 1 * 1000):03d}Z"


def configure(level: str = "info", stream: IO[str] | None = None, fmt: str = "json") -> None:
    """Install the `fmt` (json or text) handler on the `buildvault` logger tree and the plain banner handler."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {', '.join(LOG_FORMATS)}")
    stream = stream or sys.stderr
    root = logging.getLogger("buildvault")
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root.addHandler(handler)
    root.setLevel(_LEVELS.get(level, logging.INFO))
    root.propagate = False

    for handler in list(_banner_log.handlers):
        _banner_log.removeHandler(handler)
    plain = logging.StreamHandler(stream)
    plain.setFormatter(logging.Formatter("%(message)s"))
    _banner_log.addHandler(plain)
    _banner_log.setLevel(logging.INFO)
    _banner_log.propagate = False


def banner(lines: Iterable[str]) -> None:
    """The readable start-up banner (info level)."""
    _banner_log.info("\n".join(lines))


def requests_enabled() -> bool:
    return request_log.isEnabledFor(logging.DEBUG)


#: What begin_request returns and end_request takes back.
RequestToken = contextvars.Token[dict[str, Any] | None]


def begin_request() -> RequestToken | None:
    """Start collecting fields for this request (only when request logging is on)."""
    if not requests_enabled():
        return None
    return _fields.set({})


def note(**fields: Any) -> None:
    """Attach structured fields to the current request's log line (no-op when logging is off)."""
    current = _fields.get()
    if current is not None:
        current.update(fields)


def set_principal(principal: str) -> None:
    """Name the caller of the current task's request in its log line (one task per gRPC call)."""
    _principal.set(principal)


def end_request(token: RequestToken | None, method: str, code: str, started: float, peer: str | None) -> None:
    """Emit the request's JSON line."""
    if token is None:
        return
    fields = _fields.get() or {}
    _fields.reset(token)
    record = {"rpc": method, "code": code, "ms": round((time.perf_counter() - started) * 1000, 3)}
    if peer:
        record["peer"] = peer
    principal = _principal.get()
    if principal is not None:
        record["principal"] = principal
    record.update(fields)
    request_log.debug("request", extra={"fields": record})
