"""The frames a server and its local worker processes exchange over the worker's stdin/stdout.

One JSON object per line; protobuf messages travel serialized and base64-encoded. A server sends
`job` and `cancel` frames; a worker answers each job with exactly one `result` frame (unless
it dies, which the server sees as end of file).

    {"type": "job", "id": "...", "instance": "", "action": B64, "command": B64, "timeout": 600.0,
     "queued": 1700000000.123}
    {"type": "cancel", "id": "..."}
    {"type": "result", "id": "...", "result": B64 ActionResult, "status": B64 google.rpc.Status,
     "server_logs": "text"}
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from google.rpc import status_pb2  # type: ignore[import-untyped]

from buildvault.remote_apis import re_pb2


@dataclass
class JobFrame:
    id: str
    instance: str
    action: re_pb2.Action
    command: re_pb2.Command
    timeout: float
    queued: float

    def encode(self) -> bytes:
        return _line(
            type="job",
            id=self.id,
            instance=self.instance,
            action=_b64(self.action.SerializeToString()),
            command=_b64(self.command.SerializeToString()),
            timeout=self.timeout,
            queued=self.queued,
        )


@dataclass
class ResultFrame:
    id: str
    result: re_pb2.ActionResult
    status: status_pb2.Status
    server_logs: str = ""

    def encode(self) -> bytes:
        return _line(
            type="result",
            id=self.id,
            result=_b64(self.result.SerializeToString()),
            status=_b64(self.status.SerializeToString()),
            server_logs=self.server_logs,
        )


@dataclass
class CancelFrame:
    id: str

    def encode(self) -> bytes:
        return _line(type="cancel", id=self.id)


Frame = JobFrame | ResultFrame | CancelFrame


class WireError(ValueError):
    """A line that is not a frame of this protocol."""


def decode(line: bytes) -> Frame:
    """The frame one line carries; WireError when it is not one."""
    try:
        data: dict[str, Any] = json.loads(line)
        kind = data["type"]
        if kind == "job":
            return JobFrame(
                id=str(data["id"]),
                instance=str(data["instance"]),
                action=re_pb2.Action.FromString(_unb64(data["action"])),
                command=re_pb2.Command.FromString(_unb64(data["command"])),
                timeout=float(data["timeout"]),
                queued=float(data["queued"]),
            )
        if kind == "result":
            return ResultFrame(
                id=str(data["id"]),
                result=re_pb2.ActionResult.FromString(_unb64(data["result"])),
                status=status_pb2.Status.FromString(_unb64(data["status"])),
                server_logs=str(data.get("server_logs", "")),
            )
        if kind == "cancel":
            return CancelFrame(id=str(data["id"]))
    except (ValueError, KeyError, TypeError) as e:
        raise WireError(f"bad frame: {e}") from None
    raise WireError(f"unknown frame type {kind!r}")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


def _line(**fields: Any) -> bytes:
    return json.dumps(fields, separators=(",", ":")).encode() + b"\n"
