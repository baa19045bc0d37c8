"""The REAPI `RequestMetadata` a client sends as the binary header
`build.bazel.remote.execution.v2.requestmetadata-bin`: who is calling (tool and version), for which
invocation, action, mnemonic, target and configuration.

Parsing never raises: a header that is not a RequestMetadata message is recorded as `malformed`
and the request goes on as if it had sent none. Every field is cut to `FIELD_LIMIT` characters,
so a client cannot grow the history database with one huge header.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from buildvault.remote_apis import re_pb2

__all__ = ["FIELD_LIMIT", "METADATA_KEY", "Metadata", "metadata_header", "parse_metadata"]

METADATA_KEY = "build.bazel.remote.execution.v2.requestmetadata-bin"
FIELD_LIMIT = 512


@dataclass(frozen=True, slots=True)
class Metadata:
    tool: str = ""
    tool_version: str = ""
    invocation: str = ""
    correlated: str = ""
    action_id: str = ""
    mnemonic: str = ""
    target: str = ""
    configuration: str = ""
    malformed: bool = False


NONE = Metadata()
MALFORMED = Metadata(malformed=True)


def _cut(text: str) -> str:
    return text if len(text) <= FIELD_LIMIT else text[:FIELD_LIMIT]


def parse_metadata(pairs: Iterable[tuple[str, Any]] | None) -> Metadata:
    """The metadata of a call's `invocation_metadata()` pairs (NONE when absent, MALFORMED when bad)."""
    if not pairs:
        return NONE
    for key, value in pairs:
        if key != METADATA_KEY:
            continue
        if not isinstance(value, bytes):
            return MALFORMED
        try:
            message = re_pb2.RequestMetadata.FromString(value)
        except (DecodeError, ValueError, RuntimeError):
            return MALFORMED
        details = message.tool_details
        return Metadata(
            _cut(details.tool_name),
            _cut(details.tool_version),
            _cut(message.tool_invocation_id),
            _cut(message.correlated_invocations_id),
            _cut(message.action_id),
            _cut(message.action_mnemonic),
            _cut(message.target_id),
            _cut(message.configuration_id),
        )
    return NONE


def metadata_header(
    *,
    tool: str,
    tool_version: str = "",
    invocation: str = "",
    correlated: str = "",
    action_id: str = "",
    mnemonic: str = "",
    target: str = "",
    configuration: str = "",
) -> tuple[str, bytes]:
    """The (key, value) pair a client sends (buildvault's own clients use this)."""
    message = re_pb2.RequestMetadata(
        tool_details=re_pb2.ToolDetails(tool_name=tool, tool_version=tool_version),
        action_id=action_id,
        tool_invocation_id=invocation,
        correlated_invocations_id=correlated,
        action_mnemonic=mnemonic,
        target_id=target,
        configuration_id=configuration,
    )
    return METADATA_KEY, message.SerializeToString()
