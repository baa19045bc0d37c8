"""Actions built in memory the way a REAPI client builds them (input tree of Directory messages,
Command, Action), and uploaded with BatchUpdateBlobs: for the history and build page tests."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from buildvault.remote_apis import re_pb2


def digest_of(data: bytes) -> re_pb2.Digest:
    return re_pb2.Digest(hash=hashlib.sha256(data).hexdigest(), size_bytes=len(data))


def key(d: re_pb2.Digest) -> str:
    return f"{d.hash}-{d.size_bytes}"


@dataclass
class Built:
    action: re_pb2.Digest
    blobs: dict[str, bytes] = field(default_factory=dict)  # hash -> bytes (tree, command, action, files)


def tree(files: dict[str, bytes], blobs: dict[str, bytes]) -> re_pb2.Digest:
    """The input root of `files` (path -> contents); every message and file goes into `blobs`."""
    children: dict[str, dict[str, bytes]] = {}
    here: dict[str, bytes] = {}
    for path, data in files.items():
        head, sep, rest = path.partition("/")
        if sep:
            children.setdefault(head, {})[rest] = data
        else:
            here[path] = data
    directory = re_pb2.Directory()
    for name in sorted(here):
        d = digest_of(here[name])
        blobs[d.hash] = here[name]
        directory.files.add(name=name, digest=d)
    for name in sorted(children):
        directory.directories.add(name=name, digest=tree(children[name], blobs))
    data = directory.SerializeToString(deterministic=True)
    d = digest_of(data)
    blobs[d.hash] = data
    return d


def build_action(
    files: dict[str, bytes],
    arguments: list[str],
    outputs: list[str],
    *,
    env: dict[str, str] | None = None,
    platform: dict[str, str] | None = None,
    upload_tree: bool = True,
) -> Built:
    blobs: dict[str, bytes] = {}
    root = tree(files, blobs)
    if not upload_tree:
        blobs = {}
    command = re_pb2.Command(arguments=arguments, output_files=sorted(outputs))
    for name, value in sorted((env or {}).items()):
        command.environment_variables.add(name=name, value=value)
    for name, value in sorted((platform or {}).items()):
        command.platform.properties.add(name=name, value=value)
    command_bytes = command.SerializeToString(deterministic=True)
    command_digest = digest_of(command_bytes)
    blobs[command_digest.hash] = command_bytes
    action = re_pb2.Action(command_digest=command_digest, input_root_digest=root)
    action_bytes = action.SerializeToString(deterministic=True)
    action_digest = digest_of(action_bytes)
    blobs[action_digest.hash] = action_bytes
    return Built(action_digest, blobs)


async def upload(stubs, blobs: dict[str, bytes], instance: str = "", metadata=None) -> None:  # type: ignore[no-untyped-def]
    items = list(blobs.values())
    for start in range(0, len(items), 500):
        request = re_pb2.BatchUpdateBlobsRequest(instance_name=instance)
        for data in items[start : start + 500]:
            request.requests.add(digest=digest_of(data), data=data)
        reply = await stubs.cas.BatchUpdateBlobs(request, metadata=metadata)
        assert all(r.status.code == 0 for r in reply.responses)
