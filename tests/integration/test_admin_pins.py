"""Pins of every instance reach a running server: at start-up (from its disk), when written
through it, and when set through another server on the same bucket (read from the bucket every
`--pins-refresh` seconds for every instance the server knows)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import s3_server
from polling import wait_for
from reapi_client import CLIENT_OPTIONS, batch_update, digest, make_stubs
from record_damage import record_data
from s3_server import tier_args, wait_drained

from buildvault import pins
from buildvault.digest import Digest
from buildvault.remote_apis import re_pb2
from buildvault.storage.disk.core import AcKeys

# Fixtures bound by assignment: a parameter requesting one is no redefinition to the linter.
aws_env = s3_server.aws_env
s3_endpoint = s3_server.s3_endpoint
bucket = s3_server.bucket


async def _pin(grpc_address: str, instance: str, name: str, label: str) -> None:
    """What `buildvault artifact push --pin` stores: an artifact entry, its Tree, the pin index."""
    content = f"{instance} {name} {label}".encode() * 20
    tree = re_pb2.Tree(root=re_pb2.Directory(files=[re_pb2.FileNode(name="lib.a", digest=digest(content))]))
    tree_data = tree.SerializeToString()
    action_key = digest(f"artifact {instance} {name}".encode())
    key_blob = f"{action_key.hash}/{action_key.size_bytes}".encode()
    index = re_pb2.ActionResult(
        output_directories=[re_pb2.OutputDirectory(path=f"{name}/{label}", tree_digest=digest(tree_data))],
        output_files=[re_pb2.OutputFile(path=f"{name}/{label}.key", digest=digest(key_blob))],
    )
    artifact = re_pb2.ActionResult(
        output_directories=[re_pb2.OutputDirectory(path="out", tree_digest=digest(tree_data))]
    )
    async with grpc.aio.insecure_channel(grpc_address, options=CLIENT_OPTIONS) as channel:
        stubs = make_stubs(channel)
        await batch_update(stubs, [content, tree_data, key_blob, pins.INDEX_ACTION, pins.INDEX_COMMAND_BLOB], instance)
        for key, result in (
            (action_key, artifact),
            (re_pb2.Digest(hash=pins.INDEX_DIGEST.hash, size_bytes=pins.INDEX_DIGEST.size_bytes), index),
        ):
            request = re_pb2.UpdateActionResultRequest(instance_name=instance, action_digest=key, action_result=result)
            await stubs.ac.UpdateActionResult(request)


async def _ask(grpc_address: str, instance: str) -> None:
    """Any action-cache question about `instance` (here a miss)."""
    async with grpc.aio.insecure_channel(grpc_address, options=CLIENT_OPTIONS) as channel:
        request = re_pb2.GetActionResultRequest(instance_name=instance, action_digest=digest(b"nothing"))
        try:
            await make_stubs(channel).ac.GetActionResult(request)
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.NOT_FOUND


def _pins(server: Any) -> set[tuple[str, str, str]]:
    return {(p["namespace"], p["name"], p["label"]) for p in server.status()["pins"]}


def test_pins_of_every_instance_load_at_start_up(buildvault_server_factory: Callable[..., Any]) -> None:
    server = buildvault_server_factory("disk-only")
    for instance in ("", "team-a", "nested/team-b"):
        asyncio.run(_pin(server.grpc_address, instance, "l0", f"golden-{instance.replace('/', '-') or 'default'}"))
    expected = {("ac", "l0", "golden-default"), ("ac/team-a", "l0", "golden-team-a"),
                ("ac/nested/team-b", "l0", "golden-nested-team-b")}  # fmt: skip
    assert _pins(server) == expected  # each learned as it was written
    server.restart()
    assert _pins(server) == expected  # each read from disk before the server said it was ready


def test_pins_set_through_another_server_arrive_from_the_bucket(
    s3_endpoint: str, bucket: str, buildvault_server_factory: Callable[..., Any]
) -> None:
    writer = buildvault_server_factory("writer", extra_args=tier_args(s3_endpoint, bucket))
    reader = buildvault_server_factory("reader", extra_args=tier_args(s3_endpoint, bucket, "--pins-refresh", "0.2"))
    asyncio.run(_pin(writer.grpc_address, "team-a", "l0", "golden"))
    asyncio.run(_pin(writer.grpc_address, "team-z", "l0", "golden"))
    wait_drained(writer.http_address)
    asyncio.run(_ask(reader.grpc_address, "team-a"))  # the reader serves team-a, never team-z
    wait_for(lambda: ("ac/team-a", "l0", "golden") in _pins(reader), 30, "team-a's pin on the reader")
    assert _pins(reader) == {("ac/team-a", "l0", "golden")}
    # Moved through the writer: the reader follows, and keeps the new index on its disk.
    asyncio.run(_pin(writer.grpc_address, "team-a", "l0", "candidate"))
    wait_drained(writer.http_address)
    wait_for(lambda: ("ac/team-a", "l0", "candidate") in _pins(reader), 30, "the moved pin on the reader")
    index_hash = hashlib.sha256(pins.INDEX_ACTION).hexdigest()
    index_key = AcKeys().key("ac/team-a", Digest(index_hash, 0))  # a small entry: a record
    assert record_data(Path(reader.data_dir), index_key) is not None
