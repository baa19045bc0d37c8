"""Everything Execute checks before it queues anything, against the CAS.

`load_action` reads the Action and its Command and walks the input root: any absent blob (the
Action itself, the Command, a Directory, a file) is reported in one `MissingBlobs`, so a client
can upload everything it forgot at once. Unreadable messages are `InvalidRequest`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from google.protobuf.message import DecodeError

from buildvault.actions import MissingBlobs, read_blob
from buildvault.digest import Digest, DigestFunction, InvalidDigest
from buildvault.remote_apis import re_pb2
from buildvault.storage import BlobStore, NotFound

# The largest Action, Command or Directory message read into memory.
MAX_MESSAGE = 16 << 20
# Input trees larger than this many directories are refused rather than walked.
MAX_DIRECTORIES = 200_000


class InvalidRequest(ValueError):
    """An Execute request the server cannot accept (INVALID_ARGUMENT); the message says why."""


@dataclass
class LoadedAction:
    action: re_pb2.Action
    command: re_pb2.Command


def _digest(message: re_pb2.Digest, function: DigestFunction, what: str) -> Digest:
    try:
        return Digest.from_proto(message, function)
    except InvalidDigest as e:
        raise InvalidRequest(f"{what}: {e}") from None


async def _read_message(blobs: BlobStore, digest: Digest, kind: Any, what: str) -> object | None:
    try:
        data = await read_blob(blobs, digest, MAX_MESSAGE)
    except NotFound:
        return None
    except ValueError as e:
        raise InvalidRequest(f"{what} {digest}: {e}") from None
    try:
        return cast(object, kind.FromString(data))
    except DecodeError:
        raise InvalidRequest(f"{what} {digest} is not a {kind.__name__} message") from None


async def missing_inputs(blobs: BlobStore, root: Digest) -> list[Digest]:
    """Every blob of the input tree under `root` that is not stored (Directories and files)."""
    function = root.function
    missing: list[Digest] = []
    files: dict[Digest, None] = {}
    seen: set[Digest] = {root}
    level = [root]
    while level:
        found = await blobs.read_blobs(level)  # the empty Directory too: storage.EmptyBlobStore
        contents: dict[Digest, bytes] = {}
        for digest, data in zip(level, found, strict=True):
            if isinstance(data, NotFound):
                missing.append(digest)
            elif isinstance(data, Exception):
                raise data
            else:
                contents[digest] = data
        following: list[Digest] = []
        for digest, data in contents.items():
            try:
                directory = re_pb2.Directory.FromString(data)
            except DecodeError:
                raise InvalidRequest(f"input directory {digest} is not a Directory message") from None
            for node in directory.files:
                files.setdefault(_digest(node.digest, function, f"input file {node.name!r}"))
            for child in directory.directories:
                child_digest = _digest(child.digest, function, f"input directory {child.name!r}")
                if child_digest not in seen:
                    seen.add(child_digest)
                    following.append(child_digest)
        if len(seen) > MAX_DIRECTORIES:
            raise InvalidRequest(f"the input tree has more than {MAX_DIRECTORIES} directories")
        level = following
    if files:
        missing.extend(await blobs.find_missing(list(files)))
    return missing


async def load_action(blobs: BlobStore, action_digest: Digest) -> LoadedAction:
    """The Action and Command of `action_digest`, with every input present; else MissingBlobs."""
    function = action_digest.function
    action = await _read_message(blobs, action_digest, re_pb2.Action, "action")
    if action is None:
        raise MissingBlobs([action_digest])
    assert isinstance(action, re_pb2.Action)
    if not action.HasField("command_digest"):
        raise InvalidRequest(f"action {action_digest} has no command_digest")
    command_digest = _digest(action.command_digest, function, "command_digest")
    root = _digest(action.input_root_digest, function, "input_root_digest")
    command = await _read_message(blobs, command_digest, re_pb2.Command, "command")
    missing = [] if command is not None else [command_digest]
    missing.extend(await missing_inputs(blobs, root))
    if missing:
        raise MissingBlobs(missing)
    assert isinstance(command, re_pb2.Command)
    if not command.arguments:
        raise InvalidRequest(f"command {command_digest} has no arguments")
    return LoadedAction(action, command)
