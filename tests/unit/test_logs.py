"""JSON-lines logs and the start-up banner."""

from __future__ import annotations

import io
import json
import logging
import time

from buildvault import logs


def test_json_lines_and_banner():
    stream = io.StringIO()
    logs.configure("debug", stream)
    logging.getLogger("buildvault.test").info("hello %s", "world", extra={"fields": {"k": 1}})
    logs.banner([f"{logs.READY_PREFIX} grpc=127.0.0.1:1 http=off", "  details"])
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("buildvault.test").exception("failed")
    first, banner1, banner2, error = stream.getvalue().splitlines()[:4]
    record = json.loads(first)
    assert record["msg"] == "hello world" and record["level"] == "info" and record["k"] == 1 and "ts" in record
    assert banner1.startswith("buildvault ready: grpc=127.0.0.1:1") and banner2 == "  details"
    assert "ValueError: boom" in json.loads(error)["exc"]


def test_request_lines_only_at_debug():
    stream = io.StringIO()
    logs.configure("info", stream)
    token = logs.begin_request()
    assert token is None
    logs.note(ignored=True)
    logs.end_request(token, "Read", "OK", time.perf_counter(), None)
    assert stream.getvalue() == ""

    logs.configure("debug", stream)
    token = logs.begin_request()
    logs.note(digests=3)
    logs.end_request(token, "FindMissingBlobs", "OK", time.perf_counter(), "ipv4:127.0.0.1:5")
    record = json.loads(stream.getvalue())
    assert record["rpc"] == "FindMissingBlobs" and record["digests"] == 3 and record["peer"].startswith("ipv4")
    assert record["logger"] == "buildvault.request" and record["ms"] >= 0
    logs.configure("info")
